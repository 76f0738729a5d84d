"""A checkpoint's folder and files get the modes the umask gives the run's other files
(``mkdir`` and ``open``): readable by the group and others under a umask of 022, as the run
folder is, not its owner's alone (a temporary folder is made 0700, safetensors writes 0600)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.runs import small_model

from moestack import MoETransformer, checkpoint


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask, folder_mode, file_mode", [(0o022, 0o755, 0o644),
                                                         (0o027, 0o750, 0o640)])  # fmt: skip
def test_a_checkpoint_follows_the_umask_like_the_run_folder(tmp_path, mask, folder_mode, file_mode):
    cfg = small_model()
    with umask(mask):
        run = tmp_path / "run"
        run.mkdir()  # the run folder and a run file, as the umask makes them
        (run / "metrics.jsonl").write_text("{}\n")
        torch.manual_seed(0)
        saved = checkpoint.save_checkpoint(run / "checkpoints", 4, MoETransformer(cfg), cfg, {})
    assert (mode(run), mode(run / "metrics.jsonl")) == (folder_mode, file_mode)
    assert mode(saved) == folder_mode
    files = sorted(saved.iterdir())
    assert [p.name for p in files] == sorted(
        [checkpoint.MODEL_FILE, checkpoint.STATE_FILE, checkpoint.META_FILE]
    )
    assert {p.name: mode(p) for p in files} == {p.name: file_mode for p in files}
    checkpoint.verify_checkpoint(saved)  # the files read back as written
