"""A start that ``moestack.trainer.Trainer`` refuses before it begins (a changed config on
resume, a checkpoint of another shape, missing data, nothing to resume) writes nothing: a run's
folder keeps every file, byte for byte, and no provenance record; a folder it would have made is
never made. A start that fails after it began is on record, saying why."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from helpers.runs import small_config

from moestack import trainer
from moestack.config import DataConfig, OptimConfig, to_yaml
from moestack.errors import MoestackError
from moestack.runs import load_run_config
from moestack.trainer import Trainer, train


def tree_of(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder``, relative: a file's bytes, None for a folder."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def run_config(**overrides):
    """A run of 4 steps, checkpointed at 2 and 4."""
    return small_config(**{"steps": 4, "ckpt_every": 2, **overrides})


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run trained through the Python API."""
    folder = tmp_path_factory.mktemp("finished") / "run"
    train(run_config(), folder, launch={"api": "notebook"})
    return folder


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def refused(cfg, run: Path, match: str) -> MoestackError:
    """Start ``cfg`` in ``run``, expect it refused with ``match``; the error."""
    start = Trainer(cfg, run)
    with pytest.raises(MoestackError, match=match) as info:
        start.train()
    assert not start.began  # refused before it began: nothing of it written
    return info.value


def test_a_resume_with_a_changed_config_leaves_the_run_as_it_was(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = tree_of(run)
    cfg = run_config(optim=OptimConfig(lr=1e-3, warmup_steps=5), resume=True)
    refused(cfg, run, r"changed config \(optim.lr 0.003 -> 0.001\)")
    assert tree_of(run) == before
    starts = json.loads((run / "provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["finished"]


def test_a_resume_whose_checkpoint_does_not_fit_leaves_the_run_as_it_was(finished, tmp_path):
    """Refused when the weights load, after the config, data and impl checks passed."""
    run = copy_of(finished, tmp_path)
    wider = dataclasses.replace(run_config(resume=True), out_dir=str(run))
    wider.model = dataclasses.replace(wider.model, d_model=64)
    (run / "config.yaml").write_text(to_yaml(wider))  # the config check cannot tell
    before = tree_of(run)
    refused(wider, run, "was trained with model.d_model=32, this model has 64")
    assert tree_of(run) == before


def test_a_start_refused_for_its_data_leaves_a_run_folder_as_it_was(finished, tmp_path):
    """A folder holding a run that never checkpointed is started over, unless the data is
    refused: then its config, metrics and records stay."""
    run = copy_of(finished, tmp_path)
    shutil.rmtree(run / "checkpoints")
    before = tree_of(run)
    missing = tmp_path / "missing.txt"
    cfg = run_config(data=DataConfig(source="files", paths=[str(missing)], seq_len=32))
    refused(cfg, run, "does not exist")
    assert tree_of(run) == before
    assert load_run_config(run).data.source == "stdlib"


def test_a_resume_with_nothing_to_resume_leaves_the_folder_as_it_was(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    shutil.rmtree(run / "checkpoints")
    before = tree_of(run)
    refused(run_config(resume=True), run, "holds no checkpoint")
    assert tree_of(run) == before


def test_a_refused_start_into_a_new_folder_leaves_no_folder(tmp_path):
    """Nor the folders above it that the start made; those that were there stay."""
    root = tmp_path / "root"
    root.mkdir()
    refused(run_config(resume=True), root / "a" / "b" / "new", "holds no checkpoint")
    assert tree_of(root) == {}
    (root / "a").mkdir()  # a folder of the user's above the new one stays, empty
    refused(run_config(resume=True), root / "a" / "b" / "new", "holds no checkpoint")
    assert tree_of(root) == {"a": None}
    empty = tmp_path / "empty"  # a folder of the user's stays, empty
    empty.mkdir()
    refused(run_config(resume=True), empty, "holds no checkpoint")
    assert tree_of(empty) == {}


def test_a_refused_start_into_a_path_with_dotdot_removes_only_what_it_made(tmp_path, monkeypatch):
    """``a/../b/run`` with ``a`` missing and ``b`` there, empty: ``mkdir(parents=True)`` makes
    ``a`` (on its way through ``a/..``) and ``b/run``; both go, ``b`` stays."""
    root = tmp_path / "root"
    (root / "b").mkdir(parents=True)
    monkeypatch.chdir(root)
    refused(run_config(resume=True), Path("a/../b/run"), "holds no checkpoint")
    assert tree_of(root) == {"b": None}


def test_a_refused_start_keeps_a_folder_it_made_that_now_holds_another(tmp_path, monkeypatch):
    """Another process made a folder beside the new run's (in ``a/``) while the start checked
    its data: the start made none of ``a/b/new``, ``a/b``; ``a`` stays with that folder."""
    root = tmp_path / "root"
    root.mkdir()

    def sibling_then_refused(cfg):
        (root / "a" / "other").mkdir(parents=True)
        raise MoestackError("data/missing.txt does not exist")

    monkeypatch.setattr(trainer, "run_corpus", sibling_then_refused)
    refused(run_config(), root / "a" / "b" / "new", "does not exist")
    assert tree_of(root) == {"a": None, "a/other": None}


def test_a_start_that_fails_after_it_began_is_on_record(tmp_path, monkeypatch):
    def broken(run):
        raise MoestackError("the disk went away")

    monkeypatch.setattr(trainer.Trainer, "train_step", broken)
    start = Trainer(run_config(), tmp_path / "run", launch={"api": "notebook"})
    with pytest.raises(MoestackError, match="disk went away"):
        start.train()
    assert start.began
    (start,) = json.loads((tmp_path / "run" / "provenance.json").read_text())["starts"]
    assert start["api"] == "notebook" and start["status"] == "failed"
    assert start["error"] == "MoestackError: the disk went away"
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_a_folder_another_process_holds_is_not_this_starts_to_undo(finished, tmp_path):
    """Refused because another process trains into the folder (it holds the lock): the start
    did not begin and touched nothing there, none of the other run's log lines and not its
    lock file."""
    import os

    from moestack import locks
    from moestack.locks import LOCK_FILE
    from moestack.run_folder import FolderInUse

    run = copy_of(finished, tmp_path)
    fd = os.open(run / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert locks.lock_exclusive(fd)  # the other process holds the folder
        (run / "train.log").write_text("the other run's line\n")
        after = tree_of(run)
        start = Trainer(run_config(resume=True), run)
        with pytest.raises(FolderInUse, match="is in use"):
            start.train()
        assert not start.began
        assert tree_of(run) == after  # the held lock file and the other run's lines stay
        assert locks.is_held(run / LOCK_FILE)
    finally:
        os.close(fd)


def test_ctrl_c_before_a_new_start_began_leaves_no_folder(tmp_path, monkeypatch):
    """Interrupted while its data loads (before it began): no folder, no lock file left."""

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "run_corpus", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(run_config(), tmp_path / "new")
    assert not (tmp_path / "new").exists()
