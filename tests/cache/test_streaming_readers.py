"""A transformers run trained with its frozen experts streamed from disk (offload_experts=disk)
read back as the resident run (offload_experts=off) is: `moestack export` (merged, and
--adapter) writes the same tensors, bit for bit (float32 on the CPU, where the training is
bitwise the resident run's: tests/cache/test_streaming.py), the experts read from the run's
store; `eval --offload` serves them from that store (no second copy) with the resident run's
loss; a store gone or altered is refused in one line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import hf_config, tiny_hf_model_dir  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from moestack import cli  # noqa: E402
from moestack.cache.expert_cache import CacheConfig  # noqa: E402
from moestack.lora import LoRAConfig  # noqa: E402
from moestack.trainer import train  # noqa: E402

# lora: adapters on the experts (served with them by eval --offload); routers+lora: on the
# attention projections (the experts served bare, as any offloaded evaluation serves them)
TARGETS = {"lora": "experts", "routers+lora": "attention"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(trainable, offload_experts) -> a 5-step run of the tiny Qwen3-MoE folder."""
    tmp = tmp_path_factory.mktemp("streamed_export")
    source = tiny_hf_model_dir(tmp, "qwen3_moe")
    out = {}
    for trainable, targets in TARGETS.items():
        for mode in ("off", "disk"):
            run = tmp / f"{trainable}-{mode}"
            cfg = hf_config(source, tmp, trainable=trainable, steps=5, ckpt_every=5,
                            lora=LoRAConfig(rank=2, targets=targets), offload_experts=mode,
                            cache=CacheConfig(capacity=2), out_dir=str(run))  # fmt: skip
            train(cfg, run)
            out[trainable, mode] = run
    return out


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by name."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def export(capsys, run: Path, out: Path, *options: str) -> dict:
    cli.main(["export", str(run), str(out), *options])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("trainable", list(TARGETS))
@pytest.mark.parametrize("adapter", [False, True])
def test_export_is_the_resident_runs(runs, tmp_path, capsys, trainable: str, adapter: bool):
    """The same files and the same float32 tensors, bit for bit; merged, the experts the
    adapters trained on moved away from the source folder's (the store's experts did go in)."""
    options = ["--adapter"] if adapter else []
    resident = export(capsys, runs[trainable, "off"], tmp_path / "resident", *options)
    streamed = export(capsys, runs[trainable, "disk"], tmp_path / "streamed", *options)
    assert streamed["files"] == resident["files"]
    want, got = tensors(tmp_path / "resident"), tensors(tmp_path / "streamed")
    assert want.keys() == got.keys() and want
    assert all(t.dtype == torch.float32 for t in got.values())
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    experts = [n for n in got if "experts" in n]
    if adapter:  # the adapters (and the routers trained beside them), no expert weight
        assert any("lora" in n for n in got) and not any(n.endswith("_proj") for n in got)
        assert bool(experts) == (TARGETS[trainable] == "experts")
        return
    source = tensors(Path(json.loads((tmp_path / "streamed/moestack_export.json").read_text())
                          ["source_dir"]))  # fmt: skip
    assert experts and all(n in source for n in experts)
    moved = [n for n in experts if not torch.equal(got[n], source[n])]
    assert bool(moved) == (TARGETS[trainable] == "experts")  # merged: W + alpha / r * A @ B


def files_of(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def eval_json(capsys, *argv: str) -> dict:
    cli.main(["eval", *argv])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("trainable", list(TARGETS))
def test_offloaded_eval_serves_the_runs_own_store(runs, capsys, trainable: str):
    """The resident run's validation loss, exactly; the experts read from the run's store on
    disk, nothing written into the run folder (its store stays as it was)."""
    streamed = runs[trainable, "disk"]
    want = eval_json(capsys, str(runs[trainable, "off"]))["loss/val"]
    before = files_of(streamed)
    got = eval_json(capsys, str(streamed), "--offload", "--capacity", "2")
    assert files_of(streamed) == before
    assert got["loss/val"] == want
    assert got["cache/loads"] > 0 and got["cache/bytes_read"] > 0
    index = json.loads((streamed / "experts/index.json").read_text())
    assert got["memory/experts_bytes"] == sum(f["size"] - f["data_start"] for f in index["files"])


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_store_gone_or_altered_is_refused_naming_it(runs, tmp_path, capsys):
    """Gone: eval, eval --offload and export name the folder. Altered (a byte flipped in
    every expert file of layer 0, sizes and headers kept): the checksums refuse it at its
    first load, naming the store, and no export is left behind."""
    run = tmp_path / "run"
    shutil.copytree(runs["lora", "disk"], run)
    store = run / "experts"
    shutil.move(store, tmp_path / "aside")
    for argv in (["eval", str(run)], ["eval", str(run), "--offload"],
                 ["export", str(run), str(tmp_path / "out")]):  # fmt: skip
        err = one_line_error(capsys, argv)
        assert f"from {store}, which is gone" in err, err
    shutil.move(tmp_path / "aside", store)
    index = json.loads((store / "index.json").read_text())
    assert sum(e["file"].startswith("layer_000/") for e in index["files"]) == 6  # per expert
    for entry in index["files"]:
        if entry["file"].startswith("layer_000/"):
            path = store / entry["file"]
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
    for argv in (["eval", str(run), "--offload"], ["export", str(run), str(tmp_path / "out")]):
        err = one_line_error(capsys, argv)
        assert f"the expert store {store}, which fails its checks" in err, err
        assert "put back the store the run trained with" in err
    assert not (tmp_path / "out").exists()


def test_another_store_and_steering_of_adapted_experts_are_refused(runs, tmp_path, capsys):
    """eval --offload serves a streamed run from its own store only; the routing steering
    does not reach layers whose experts carry adapters (lora.targets=experts)."""
    run = runs["lora", "disk"]
    err = one_line_error(capsys, ["eval", str(run), "--offload", "--store-dir", str(tmp_path)])
    assert f"its own expert store {run / 'experts'}, which --offload serves" in err, err
    err = one_line_error(capsys, ["eval", str(run), "--offload", "--cache-aware-bias", "1"])
    assert "--cache-aware-bias and --reroute-tau do not steer such layers" in err, err
    assert list(tmp_path.iterdir()) == []
