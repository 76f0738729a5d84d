"""Fault injection on the rank files of an expert-parallel checkpoint (moestack.checkpoint_parts):
two ranks' files swapped and meta.json re-signed over them (sizes, sha256 and its own digest
recomputed, so every digest verifies). Each rank file records which rank wrote it, its kind
and the experts it holds; a file whose record is not what meta.json's ``parts`` say of its
name is refused in one line naming the file, both records and the fix, instead of resuming
with rank 1's experts in rank 0's rows. Ranks are simulated in one process, as
tests/train/test_rank_files.py does: the files are written directly, nothing is trained."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import safetensors
import torch

from moestack import checkpoint, checkpoint_format, checkpoint_parts
from moestack.errors import MoestackError
from moestack.model import ModelConfig
from moestack.moe import MoEConfig
from moestack.optim import expert_state
from moestack.parallel import ExpertParallelMesh, shard_experts

pytestmark = pytest.mark.faults

CFG = ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, moe=MoEConfig(4, 2, 12))
STEP = 7


def write(root: Path, ep: int = 2) -> Path:
    """A checkpoint of ``ep`` ranks' models (seeded), each rank's experts and an optimizer
    part and shard part of its own, written as the trainer writes them."""
    folder = checkpoint.new_folder(root, STEP)
    parts = []
    for r in range(ep):
        model = CFG.build(seed=3)
        mesh = ExpertParallelMesh(world_size=ep, ep=ep, ep_rank=r, dp_rank=0, ep_group=None,
                                  expert_dp_group=None)  # fmt: skip
        shard_experts(model, mesh)
        optim = [expert_state.offload_part({}), expert_state.shard_part({})]
        parts += checkpoint_parts.write_rank_files(folder, r, model, True, optim)
    return checkpoint.save_checkpoint(
        root, STEP, CFG.build(seed=3), CFG, {"x": 1}, folder=folder, parts=parts
    )


def swap_and_resign(path: Path, suffix: str) -> tuple[Path, Path]:
    """Swap rank 0's and rank 1's ``suffix`` files, then record the swapped files' sizes and
    digests in meta.json and recompute its own digest: the checkpoint verifies."""
    a, b = path / f"rank00000.{suffix}", path / f"rank00001.{suffix}"
    a.rename(path / "swap")
    b.rename(a)
    (path / "swap").rename(b)
    meta = json.loads((path / checkpoint.META_FILE).read_text())
    for file in (a, b):
        meta["sizes"][file.name] = file.stat().st_size
        meta["sha256"][file.name] = hashlib.sha256(file.read_bytes()).hexdigest()
    meta[checkpoint.SELF_DIGEST] = checkpoint_format.meta_digest(meta)
    (path / checkpoint.META_FILE).write_text(json.dumps(meta, indent=2))
    return a, b


def test_each_rank_file_records_its_rank_kind_and_rows(tmp_path):
    path = write(tmp_path / "ckpt")
    meta = checkpoint.verify_checkpoint(path)
    for r, rows in ((0, "0,2"), (1, "2,4")):
        with safetensors.safe_open(path / f"rank{r:05d}.experts.safetensors", "pt") as f:
            assert f.metadata() == {"rank": str(r), "kind": "experts", "rows": rows}
        optim = torch.load(path / f"rank{r:05d}.optim.pt", weights_only=True)
        assert optim[checkpoint_parts.RECORD] == {"rank": r, "kind": "optimizer",
                                                  "rows": [2 * r, 2 * r + 2]}  # fmt: skip
        shard = torch.load(path / f"rank{r:05d}.shard.pt", weights_only=True)
        assert shard[checkpoint_parts.RECORD] == {"rank": r, "kind": "optimizer_shard",
                                                  "rows": [r, r + 1]}  # fmt: skip
    for name, record in meta["parts"].items():  # each agrees with meta.json
        checkpoint_parts.check_rank_file(path / name, record)


@pytest.mark.parametrize("suffix", ["experts.safetensors", "optim.pt", "shard.pt"])
def test_a_swapped_rank_file_fails_its_check(tmp_path, fault_report, suffix):
    path = write(tmp_path / "ckpt")
    a, b = swap_and_resign(path, suffix)
    meta = checkpoint.read_meta(path)
    for name in meta["sha256"]:  # every digest verifies: the re-signed meta.json is consistent
        assert checkpoint.sha256_file(path / name) == meta["sha256"][name]
    with pytest.raises(MoestackError, match="swapped"):  # the whole check refuses it
        checkpoint.verify_checkpoint(path)
    with pytest.raises(MoestackError) as err:
        checkpoint_parts.check_rank_file(a, meta["parts"][a.name])
    line = str(err.value)
    assert "\n" not in line and str(a) in line and "rank 1" in line and "rank 0" in line
    assert "swapped" in line and "use another checkpoint" in line
    with pytest.raises(MoestackError, match="rank 1's"):
        checkpoint_parts.check_rank_file(b, meta["parts"][b.name])
    fault_report.add("rank files: swapped between ranks, meta.json re-signed", injected=1,
                     refused=1)  # fmt: skip


def test_an_older_rank_file_without_its_record_still_loads(tmp_path):
    """A rank file written before the records (an experts file with its rows only, a part
    without the record) is checked as far as it says: rows, else nothing."""
    path = write(tmp_path / "ckpt")
    file = path / "rank00001.experts.safetensors"
    with safetensors.safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    checkpoint_parts.write_safetensors(file, tensors, {"rows": "2,4"})
    checkpoint_parts.check_rank_file(file, {"kind": "experts", "rows": [2, 4]})
    with pytest.raises(MoestackError, match="experts 2..3"):
        checkpoint_parts.check_rank_file(file, {"kind": "experts", "rows": [0, 2]})
    optim = path / "rank00000.optim.pt"
    torch.save(expert_state.offload_part({}), optim)
    checkpoint_parts.check_rank_file(optim, {"kind": "optimizer", "rows": [0, 2]})


def test_a_resume_from_swapped_rank_files_is_refused(tmp_path, fault_report):
    """What a resume reads (``load_model_weights``, the checkpoint chosen by
    ``newest_verified``): refused, not rank 1's experts in rank 0's rows."""
    root = tmp_path / "ckpt"
    path = write(root)
    a, _ = swap_and_resign(path, "experts.safetensors")
    with pytest.raises(MoestackError, match="swapped") as err:
        checkpoint.load_model_weights(path, CFG.build(seed=0), CFG)
    assert str(a) in str(err.value)
    assert checkpoint.newest_verified(root) is None  # resume=true takes no such checkpoint
    fault_report.add("rank files: swapped, resumed from", injected=1, refused=1)
