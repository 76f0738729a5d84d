"""Checkpoints written in rank files (expert parallelism, moestack.checkpoint_parts), in one
process: ranks simulated by cutting a whole model's experts as ``parallel.shard_experts``
does. Read back whole or at another layout they give the whole model's tensors bitwise;
meta.json naming a file outside the checkpoint, or rows that make no sense, is refused."""

from __future__ import annotations

import json
import threading

import pytest
import safetensors
import safetensors.torch
import torch

from moestack import checkpoint, checkpoint_format, checkpoint_parts
from moestack.errors import MoestackError
from moestack.model import ModelConfig
from moestack.moe import MoEConfig
from moestack.parallel import ExpertParallelMesh, shard_experts

CFG = ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, moe=MoEConfig(4, 2, 12))


def ranks_of(ep: int) -> list[torch.nn.Module]:
    """The ``ep`` ranks of one EP group, each a model holding its block of the experts."""
    models = []
    for r in range(ep):
        model = CFG.build(seed=3)
        mesh = ExpertParallelMesh(world_size=ep, ep=ep, ep_rank=r, dp_rank=0, ep_group=None,
                                  expert_dp_group=None)  # fmt: skip
        shard_experts(model, mesh)
        models.append(model)
    return models


def write(root, ep: int, step: int = 7) -> tuple:
    """A checkpoint of the ep ranks' models written as the trainer writes one."""
    folder = checkpoint.new_folder(root, step)
    models = ranks_of(ep)
    parts = [
        part
        for r, model in enumerate(models)
        for part in checkpoint_parts.write_rank_files(folder, r, model, True, [])
    ]
    path = checkpoint.save_checkpoint(
        root, step, models[0], CFG, {"x": 1}, folder=folder, parts=parts
    )
    return path, models


def test_rank_files_read_back_whole_and_at_another_layout(tmp_path) -> None:
    whole = CFG.build(seed=3)
    path, _ = write(tmp_path / "ckpt", ep=2)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["meta.json", "model.safetensors", "rank00000.experts.safetensors",
                     "rank00001.experts.safetensors", "train_state.pt"]  # fmt: skip
    want = whole.state_dict()
    got = checkpoint.read_weights(path)
    tied = CFG.tie_embeddings  # a tied lm_head is stored once, under the embedding's name
    assert got.keys() == ({k for k in want if k != "lm_head.weight"} if tied else want.keys())
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    one = CFG.build(seed=99)  # other weights: everything must be read
    checkpoint.load_model_weights(path, one, CFG)
    for name, tensor in one.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    for r, rank in enumerate(ranks_of(4)):  # ep=4 reads a quarter of a file's rows
        for p in rank.parameters():
            p.data.normal_()
        checkpoint.load_model_weights(path, rank, CFG)
        for name, tensor in rank.state_dict().items():
            rows = slice(r, r + 1) if ".moe.w" in name else slice(None)
            assert torch.equal(tensor, want[name][rows]), (r, name)
    layers = list(checkpoint.iter_expert_layers(path))
    assert [tuple(w.shape) for w in layers[0]] == [tuple(whole.layers[0].moe.w1.shape),
                                                   tuple(whole.layers[0].moe.w2.shape)]  # fmt: skip
    assert torch.equal(layers[1][0], want["layers.1.moe.w1"])


def test_a_missing_rank_file_is_named(tmp_path) -> None:
    path, _ = write(tmp_path / "ckpt", ep=2)
    meta = json.loads((path / "meta.json").read_text())
    for table in ("sizes", "sha256", "parts"):
        meta[table].pop("rank00001.experts.safetensors")
    meta[checkpoint.SELF_DIGEST] = checkpoint_format.meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        MoestackError, match=r"no rank file holds the experts state of experts 2..3"
    ):
        checkpoint.load_model_weights(path, CFG.build(seed=0), CFG)


@pytest.mark.parametrize(
    ("name", "record", "why"),
    [
        ("../model.safetensors", {"kind": "experts", "rows": [0, 2]}, "not a rank file"),
        ("rank00000.experts.safetensors", {"kind": "optimizer", "rows": [0, 2]}, "does not match"),
        ("rank00000.experts.safetensors", {"kind": "experts", "rows": [2, 2]}, "0 <= lo < hi"),
        ("rank00000.optim.pt", {"kind": "weights", "rows": [0, 2]}, "no kind"),
    ],
)
def test_malformed_parts_are_refused_naming_the_field(tmp_path, name, record, why) -> None:
    path, _ = write(tmp_path / "ckpt", ep=2)
    meta = json.loads((path / "meta.json").read_text())
    meta["parts"][name] = record
    meta[checkpoint.SELF_DIGEST] = checkpoint_format.meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(MoestackError, match=rf"meta.json: parts .*{why}.*corrupt"):
        checkpoint.read_meta(path)


def test_streamed_safetensors_read_back_with_the_safetensors_library(tmp_path) -> None:
    """The rank files' writer (streamed, one tensor at a time) writes what safetensors reads:
    every dtype a checkpoint holds, odd shapes, a scalar, an empty tensor, a non-contiguous
    view, and the metadata."""
    gen = torch.Generator().manual_seed(5)
    tensors = {
        "b.f32": torch.randn(3, 5, generator=gen),
        "a.bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c.f16": torch.randn(2, 3, 1, generator=gen).to(torch.float16),
        "d.i64": torch.randint(-9, 9, (4,), generator=gen),
        "e.bool": torch.rand(5, generator=gen) > 0.5,
        "f.scalar": torch.tensor(2.5, dtype=torch.float64),
        "g.empty": torch.empty(0, 3),
        "h.view": torch.randn(4, 6, generator=gen).t(),
    }
    checkpoint_parts.write_safetensors(tmp_path / "x.safetensors", tensors, {"rows": "0,2"})
    back = safetensors.torch.load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safetensors.safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert f.metadata() == {"rows": "0,2"}


def test_versions_one_process_checkpoints_stay_readable_by_older_moestack(tmp_path) -> None:
    """A checkpoint without rank files is written as version 2 (what moestack read before
    them) and read back; with rank files it is version 3, and parts in a version 2 meta.json
    are refused."""
    plain = checkpoint.save_checkpoint(tmp_path / "plain", 3, CFG.build(seed=1), CFG, {"x": 1})
    assert json.loads((plain / "meta.json").read_text())["version"] == 2
    checkpoint.load_model_weights(plain, CFG.build(seed=2), CFG)
    path, _ = write(tmp_path / "ranks", ep=2)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["version"] == 3
    meta["version"] = 2
    meta[checkpoint.SELF_DIGEST] = checkpoint_format.meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(MoestackError, match="version 2 meta.json"):
        checkpoint.read_meta(path)


class _Exchange:
    """``gather`` for ranks simulated by threads: every rank's value, in rank order."""

    def __init__(self, world: int) -> None:
        self.values: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def gather(self, rank: int, value):
        self.values[rank] = value
        self.barrier.wait()
        out = list(self.values)
        self.barrier.wait()
        return out


def _newest_by_ranks(root, world: int) -> list:
    exchange, found = _Exchange(world), [None] * world

    def rank(r: int) -> None:
        gather = lambda value: exchange.gather(r, value)  # noqa: E731
        found[r] = checkpoint.newest_verified(root, r, world, gather=gather)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return found


def test_ranks_verify_each_file_once_and_agree(tmp_path, monkeypatch, caplog) -> None:
    """Two ranks split a checkpoint's files (each hashed once, by one rank, the bytes
    balanced); a flipped byte in a file the other rank verified makes both fall back to the
    older checkpoint, and the warning names the file on every rank."""
    root = tmp_path / "ckpt"
    old, _ = write(root, ep=2, step=5)
    new, _ = write(root, ep=2, step=7)
    meta = checkpoint.read_meta(new)
    hashed: list[tuple[str, str]] = []
    real = checkpoint.sha256_file

    def counted(path):
        hashed.append((threading.current_thread().name, str(path)))
        return real(path)

    monkeypatch.setattr(checkpoint_format, "sha256_file", counted)  # verify_file hashes there
    assert _newest_by_ranks(root, 2) == [new, new]
    files = sorted(meta["sizes"])
    assert sorted(p.rsplit("/", 1)[1] for _, p in hashed) == files  # each once
    shares = [checkpoint.verification_share(meta, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == files
    for r in range(2):
        assert {p.rsplit("/", 1)[1] for t, p in hashed if t == f"rank{r}"} == set(shares[r])
    load = [sum(meta["sizes"][n] for n in share) for share in shares]
    assert max(load) <= sum(load) - min(meta["sizes"].values())  # neither rank hashes all

    victim = new / shares[1][0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    hashed.clear()
    with caplog.at_level("WARNING", logger="moestack.checkpoint"):
        assert _newest_by_ranks(root, 2) == [old, old]
    warnings = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(warnings) == 2 and all(str(victim) in w for w in warnings)
