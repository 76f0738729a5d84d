"""A save that fails for a full disk says what the run can continue from: the newest
checkpoint and resume=true, or, before the first one, that there is none to resume from
(never "the last checkpoint, none, is kept")."""

from __future__ import annotations

import errno

import pytest
import torch
from helpers.runs import small_model

from moestack import MoETransformer, checkpoint
from moestack.errors import MoestackError


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_before_the_first_checkpoint_offers_no_resume(tmp_path, monkeypatch):
    cfg = small_model()
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(MoestackError) as err:
        checkpoint.save_checkpoint(tmp_path, 2, MoETransformer(cfg), cfg, {})
    message = str(err.value)
    assert "no space left" in message and "none to resume from" in message
    assert "none," not in message and "resume=true" not in message and "\n" not in message


def test_a_full_disk_later_names_the_checkpoint_to_resume_from(tmp_path, monkeypatch):
    cfg = small_model()
    first = checkpoint.save_checkpoint(tmp_path, 2, MoETransformer(cfg), cfg, {})
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(MoestackError) as err:
        checkpoint.save_checkpoint(tmp_path, 4, MoETransformer(cfg), cfg, {})
    assert f"the last checkpoint, {first}, is kept: resume=true continues from it" in str(err.value)
    assert checkpoint.list_checkpoints(tmp_path) == [first]


def test_kept_note_reads_the_newest_complete_checkpoint(tmp_path):
    assert checkpoint.kept_note(tmp_path / "missing") == (
        "no checkpoint was written before it, so there is none to resume from"
    )
    cfg = small_model()
    checkpoint.save_checkpoint(tmp_path, 2, MoETransformer(cfg), cfg, {}, keep_last=3)
    newest = checkpoint.save_checkpoint(tmp_path, 6, MoETransformer(cfg), cfg, {}, keep_last=3)
    (tmp_path / "step_000008").mkdir()  # a save that never finished: no meta.json
    assert str(newest) in checkpoint.kept_note(tmp_path)
