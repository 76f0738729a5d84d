"""A save that replaces a checkpoint of the same step, killed half-way: the next start
still finds a complete checkpoint of that step (keep_last=1: it may be the only one)."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.runs import small_model

from moestack import MoETransformer, checkpoint

pytestmark = pytest.mark.faults

STEP = 8


def saved(root, seed: int) -> dict[str, torch.Tensor]:
    """Save a seeded small model as checkpoint STEP under ``root`` (keep_last=1); its weights."""
    torch.manual_seed(seed)
    cfg = small_model()
    model = MoETransformer(cfg)
    checkpoint.save_checkpoint(root, STEP, model, cfg, {"seed": torch.tensor(seed)}, keep_last=1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def weights_at_start(root) -> dict[str, torch.Tensor]:
    """What the next start finds: leftovers cleaned, the newest verified checkpoint read."""
    checkpoint.clean_partial(root)
    newest = checkpoint.newest_verified(root)
    assert newest is not None and newest.name == f"step_{STEP:06d}", sorted(root.iterdir())
    assert [p.name for p in root.iterdir()] == [newest.name]
    return checkpoint.read_weights(newest)


def same(read: dict[str, torch.Tensor], model: dict[str, torch.Tensor]) -> bool:
    """The weights read equal the model's (a tied weight is stored once, under one name)."""
    assert set(read) <= set(model) and len(read) >= len(model) - 1
    return all(torch.equal(read[k], model[k]) for k in read)


def test_a_kill_while_the_replaced_copy_is_deleted_keeps_a_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    saved(root, seed=0)
    real_rmtree = shutil.rmtree

    def killed_in_trash(path, *args, **kwargs):  # the kill comes while the old copy goes
        if path.name.startswith(checkpoint.TRASH_PREFIX) and path.exists():
            raise KeyboardInterrupt("simulated kill")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_in_trash)
    with pytest.raises(KeyboardInterrupt):
        saved(root, seed=1)
    monkeypatch.undo()
    torch.manual_seed(1)
    new = MoETransformer(small_model()).state_dict()
    assert same(weights_at_start(root), new)  # the new copy took the old one's place


def test_a_kill_between_setting_aside_and_renaming_restores_the_old_copy(tmp_path):
    """As kill -9 leaves it: the old copy renamed to .trash-step_N, the new one still in its
    temporary folder. The old copy is renamed back; the temporary folder removed."""
    root = tmp_path / "checkpoints"
    old = saved(root, seed=0)
    final = root / f"step_{STEP:06d}"
    final.rename(root / f"{checkpoint.TRASH_PREFIX}{final.name}")
    (checkpoint.new_folder(root, STEP) / checkpoint.MODEL_FILE).write_bytes(b"half")
    assert same(weights_at_start(root), old)


def test_a_save_that_fails_before_its_rename_puts_the_old_copy_back(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    old = saved(root, seed=0)
    real_rename = checkpoint.os.rename

    def failing(src, dst):
        if str(src).rsplit("/", 1)[-1].startswith(f".{checkpoint.PREFIX}"):
            raise OSError("simulated failure")
        return real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", failing)
    with pytest.raises(OSError, match="simulated"):
        saved(root, seed=1)
    monkeypatch.undo()
    assert same(weights_at_start(root), old)
