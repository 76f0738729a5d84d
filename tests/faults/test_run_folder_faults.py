"""Fault injection on a run's folder: symlinked run files, folders that cannot hold a run,
two runs into one folder, a full disk, configs that differ or say what they do not mean.
Each case ends as one line naming the folder, file or value; nothing of the run is lost."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.runs import small_config

from moestack import atomic, checkpoint
from moestack.errors import MoestackError
from moestack.locks import LOCK_FILE
from moestack.model import MoETransformer
from moestack.overrides import check_overrides as _check_overrides
from moestack.run_folder import RunFolder, holding_run_dir
from moestack.runs import resolve_checkpoint
from moestack.train import _check_record_dir
from moestack.trainer import train

pytestmark = pytest.mark.faults

TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
    "model.moe.num_experts=4", "model.moe.d_ff=32", "data.seq_len=32", "data.max_bytes=100000",
    "batch_size=2", "steps=2", "eval_every=0", "eval_batches=1", "log_every=1", "ckpt_every=0",
    "telemetry=off", "progress=false", "threads=1", "wandb_mode=disabled",
]  # fmt: skip


def moestack_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestack.train", *TINY, *args],
        capture_output=True, text=True, cwd=cwd, timeout=300,
    )  # fmt: skip


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The refusal's message: exit status 2, no traceback."""
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Error executing job" not in done.stderr
    return done.stderr


# --------------------------------------------------------------------------- run files
def test_a_symlinked_config_yaml_is_replaced_on_resume_not_written_through(tmp_path, fault_report):
    run = tmp_path / "run"
    train(small_config(steps=6, ckpt_every=2), run)
    victim = tmp_path / "elsewhere.yaml"  # a file of someone else's, which the link names
    original = (run / "config.yaml").read_text() + "# not moestack's to rewrite\n"
    victim.write_text(original)
    (run / "config.yaml").unlink()
    (run / "config.yaml").symlink_to(victim)
    train(small_config(steps=6, ckpt_every=2, resume=True), run)
    assert victim.read_text() == original  # the file the link pointed at is untouched
    assert not (run / "config.yaml").is_symlink()
    assert "resume: true" in (run / "config.yaml").read_text()
    fault_report.add("run folder: config.yaml a symbolic link", injected=1, harmless=1)


def test_a_run_file_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch, fault_report):
    path = tmp_path / "summary.json"
    path.write_text('{"old": 1}')

    def fail(fd):
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        atomic.write_text(path, '{"new": 2, "much": "longer than before"}')
    assert path.read_text() == '{"old": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left
    fault_report.add("run folder: I/O error while writing a run file", injected=1, harmless=1)


# --------------------------------------------------------------------------- out_dir itself
def test_an_out_dir_that_is_a_file_or_under_a_file_is_one_line(tmp_path, fault_report):
    (tmp_path / "afile").write_text("not a folder")
    done = moestack_train("out_dir=afile", cwd=tmp_path)
    assert "out_dir=afile is a file" in one_line_error(done)
    done = moestack_train("out_dir=afile/run", cwd=tmp_path)
    assert f"lies under {tmp_path / 'afile'}, which is a file" in one_line_error(done)
    assert (tmp_path / "afile").read_text() == "not a folder"
    fault_report.add("run folder: out_dir a file or under a file", injected=2, refused=2)


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process cannot write to: a read-only tmpfs where mounting is allowed
    (root, as on the CI machine), else a folder without write permission (a non-root user)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_read_only_out_dir_is_one_line_before_anything_is_written(
    read_only_folder, tmp_path, fault_report
):
    done = moestack_train(f"out_dir={read_only_folder / 'run'}", cwd=tmp_path)
    assert f"{read_only_folder} is read-only" in one_line_error(done)
    with pytest.raises(MoestackError, match="is read-only"):
        train(small_config(), read_only_folder)
    fault_report.add("run folder: read-only out_dir", injected=1, refused=1)


def test_a_file_the_run_may_not_read_is_named_as_read_not_written(tmp_path, monkeypatch):
    """A permission error while the start reads (here its corpus) is one line that says the
    file could not be opened, not that it could not be written."""

    def denied(cfg):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "corpus.txt"))

    monkeypatch.setattr("moestack.trainer.run_corpus", denied)
    with pytest.raises(MoestackError) as err:
        train(small_config(), tmp_path / "run")
    assert str(err.value) == f"cannot open {tmp_path / 'corpus.txt'}: Permission denied"


def test_an_out_dir_with_a_name_longer_than_the_file_system_allows_is_one_line(
    tmp_path, fault_report
):
    """255 bytes a name on Linux file systems: ``runs/<300 x>/run`` is refused naming that
    name before hydra makes ``runs``; so is such a ``hydra.run.dir``."""
    long_name = "x" * 300
    done = moestack_train(f"out_dir=runs/{long_name}/run", cwd=tmp_path)
    line = one_line_error(done)
    assert (
        f"the folder name {long_name[:16]}" in line and "is 300 bytes, longer than the 255" in line
    )
    assert list(tmp_path.iterdir()) == []  # no runs/ left behind
    with pytest.raises(MoestackError, match=r"hydra.run.dir=.*is 300 bytes, longer than the 255"):
        _check_record_dir(Path(f"logs/{long_name}"), Path("run"), "run")
    fault_report.add("run folder: a name longer than the file system allows", injected=2,
                     refused=2)  # fmt: skip


def test_a_hydra_record_folder_that_is_another_runs_is_refused_and_left_as_it_was(
    tmp_path, fault_report
):
    """``hydra.run.dir`` pointed at another run's folder would overwrite its .hydra/ and add to
    its train.log: refused, that run byte for byte as it was, the new out_dir not made."""
    other = tmp_path / "other"
    train(small_config(steps=2, ckpt_every=0), other)
    (other / "train.log").write_text("the other run's log\n")
    before = {p: p.read_bytes() for p in sorted(other.rglob("*")) if p.is_file()}
    done = moestack_train(f"hydra.run.dir={other}", f"out_dir={tmp_path / 'new'}", cwd=tmp_path)
    line = one_line_error(done)
    assert f"hydra.run.dir={other}: {other} is the folder of another run" in line
    assert {p: p.read_bytes() for p in sorted(other.rglob("*")) if p.is_file()} == before
    assert not (tmp_path / "new").exists()
    fault_report.add("run folder: hydra.run.dir another run's folder", injected=1, refused=1)


def test_a_hydra_record_folder_holding_another_runs_record_is_refused(tmp_path, fault_report):
    """A folder holding only hydra's record of a run whose out_dir lies elsewhere belongs to
    that run: refused for another out_dir, taken for that run's own (its resume)."""
    rec = tmp_path / "rec"
    (rec / ".hydra").mkdir(parents=True)
    (rec / ".hydra/config.yaml").write_text("steps: 2\nout_dir: runs/a\n")
    (rec / ".hydra/hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {tmp_path}\n")
    with pytest.raises(MoestackError, match=f"hydra.run.dir={rec} holds the record of the run "
                       f"in {tmp_path / 'runs/a'}"):  # fmt: skip
        _check_record_dir(rec, tmp_path / "runs/b", str(tmp_path / "runs/b"))
    _check_record_dir(rec, tmp_path / "runs/a", str(tmp_path / "runs/a"))
    fault_report.add("run folder: hydra.run.dir holding another run's record", injected=1,
                     refused=1)  # fmt: skip


# --------------------------------------------------------------------------- two runs at once
def test_a_second_run_into_a_folder_in_use_is_refused_and_touches_nothing(tmp_path, fault_report):
    run = tmp_path / "run"
    with holding_run_dir(run):  # another process's run, as far as this one can tell
        (run / "mine.txt").write_text("the first run's file")
        done = moestack_train(f"out_dir={run}", cwd=tmp_path)
        assert "is in use: another process trains into it" in one_line_error(done)
        with pytest.raises(MoestackError, match="is in use"):
            train(small_config(), run)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "mine.txt"]  # no .hydra, log
    train(small_config(steps=2, ckpt_every=0), run)  # once free, the folder takes a run
    fault_report.add("run folder: a second run into a folder in use", injected=1, refused=1)


def test_the_run_folder_is_free_again_after_a_run_is_killed(tmp_path, fault_report):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from moestack.run_folder import holding_run_dir\n"
         "with holding_run_dir(Path(sys.argv[1])):\n"
         "    print('held', flush=True); time.sleep(600)", str(run)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(MoestackError, match="is in use"), RunFolder(run):
            pass
    finally:
        holder.kill()
        holder.wait()
    with RunFolder(run):  # the system dropped the lock with the process
        pass
    fault_report.add("run folder: run killed holding the folder", injected=1, recovered=1)


# --------------------------------------------------------------------------- a full disk
def _fail_after_half(real):
    """``safetensors.torch.save_model`` that writes half the file, then finds the disk full."""

    def save_model(model, filename, *args, **kwargs):
        real(model, filename, *args, **kwargs)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    return save_model


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch, fault_report
):
    run = tmp_path / "run"
    train(small_config(steps=6, ckpt_every=2), run)
    checkpoint._remove(run / "checkpoints/step_000006")  # as if killed before its last save
    monkeypatch.setattr(
        safetensors.torch, "save_model", _fail_after_half(safetensors.torch.save_model)
    )
    with pytest.raises(MoestackError) as err:
        train(small_config(steps=6, ckpt_every=2, resume=True), run)
    message = str(err.value)
    assert "no space left on the device of" in message and str(run / "checkpoints") in message
    assert "MiB" in message and "step_000004" in message and "\n" not in message
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # the partial checkpoint is removed
    checkpoint.verify_checkpoint(run / "checkpoints/step_000004")
    monkeypatch.undo()
    train(small_config(steps=6, ckpt_every=2, resume=True), run)  # space freed: it resumes
    assert checkpoint.latest_checkpoint(run / "checkpoints").name == "step_000006"
    fault_report.add("run folder: full disk while checkpointing", injected=1, refused=1)


def test_a_full_disk_seen_only_as_a_library_error_is_one_line(tmp_path, monkeypatch, fault_report):
    """torch.save reports a full disk as a RuntimeError without errno: the free space says."""
    run = tmp_path / "run"

    def save(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed")

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(MoestackError, match=r"no space left .* 0\.0 MiB free"):
        train(small_config(steps=2, ckpt_every=0), run)
    fault_report.add("run folder: full disk said only by a library", injected=1, refused=1)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (skipped where mounting is not allowed): a disk that really fills."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_disk_that_really_fills_mid_run_is_one_line(small_tmpfs, tmp_path, fault_report):
    run = small_tmpfs / "run"
    filler = small_tmpfs / "filler"
    real_save = checkpoint.save_checkpoint

    def save_on_a_full_disk(*args, **kwargs):  # the disk fills up just before the save
        free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
        filler.write_bytes(b"x" * max(0, free - 4096))
        return real_save(*args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(checkpoint, "save_checkpoint", save_on_a_full_disk)
    try:
        with pytest.raises(MoestackError, match="no space left on the device of"):
            train(small_config(steps=2, ckpt_every=0), run)
    finally:
        mp.undo()
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    fault_report.add("run folder: disk really full mid-run", injected=1, refused=1)


def test_a_disk_too_full_for_the_runs_record_keeps_the_error_that_ended_the_run(
    small_tmpfs, caplog, fault_report
):
    """The disk fills up to its last byte before a checkpoint: the save's one line ends the
    run, and provenance.json, which cannot be written either, is named in a warning."""
    run = small_tmpfs / "run"
    filler = small_tmpfs / "filler"
    real_save = checkpoint.save_checkpoint

    def save_on_a_full_disk(*args, **kwargs):
        with contextlib.suppress(OSError), filler.open("wb") as f:  # till the disk refuses
            while True:
                f.write(b"x" * 4096)
                f.flush()
        return real_save(*args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(checkpoint, "save_checkpoint", save_on_a_full_disk)
    try:
        with (
            caplog.at_level("WARNING", logger="moestack.provenance"),
            pytest.raises(MoestackError, match="no space left on the device of"),
        ):
            train(small_config(steps=2, ckpt_every=0), run)
    finally:
        mp.undo()
    assert f"{run / 'provenance.json'}: this start's end (failed) is not recorded" in caplog.text
    starts = json.loads((run / "provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["running"]  # as a kill leaves it
    fault_report.add("run folder: disk too full for the run's record", injected=1, refused=1)


# --------------------------------------------------------------------------- what a run says
def test_an_incomplete_newest_checkpoint_is_named_when_an_older_one_is_used(
    tmp_path, caplog, fault_report
):
    run = tmp_path / "run"
    train(small_config(steps=4, ckpt_every=2, keep_last=3), run)
    (run / "checkpoints/step_000004" / checkpoint.META_FILE).unlink()
    with caplog.at_level("WARNING", logger="moestack.runs"):
        assert resolve_checkpoint(run).name == "step_000002"
    assert "step_000004" in caplog.text and "incomplete" in caplog.text
    fault_report.add("run folder: newest checkpoint incomplete", injected=1, recovered=1)


def test_a_non_finite_final_validation_loss_fails_the_run(tmp_path, monkeypatch, fault_report):
    from moestack import trainer

    real = trainer.evaluate

    def nan_at_the_end(model, batches, device):
        out = real(model, batches, device)
        return {**out, "loss/val": float("nan"), "eval/perplexity": float("nan")}

    monkeypatch.setattr(trainer, "evaluate", nan_at_the_end)
    with pytest.raises(MoestackError, match="final validation loss is nan"):
        train(small_config(steps=2, ckpt_every=0), tmp_path / "run")
    assert json.loads((tmp_path / "run/summary.json").read_text())["loss/val"] == "nan"
    fault_report.add("run folder: NaN final validation loss", injected=1, refused=1)


@pytest.mark.parametrize("override", ["compile=2", "compile=0", "progress=yes", "compile=1"])
def test_a_true_false_field_takes_only_true_or_false(override, fault_report):
    key, _, value = override.partition("=")
    with pytest.raises(MoestackError, match=f"{key} is true or false, not '{value}'"):
        _check_overrides([override])
    _check_overrides([f"{key}=true", f"{key}=False", "steps=2", "model.moe.top_k=2"])
    fault_report.add("run config: true/false field given another value", injected=1, refused=1)


def test_the_parameter_count_is_the_whole_models_on_a_rank_that_holds_half_the_experts():
    cfg = small_config().model
    whole = MoETransformer(cfg)
    expected = {"total": sum(p.numel() for p in whole.parameters())}
    d, f, e, k = cfg.d_model, cfg.moe.d_ff, cfg.moe.num_experts, cfg.moe.top_k
    per_expert = d * 2 * f + f * d  # w1 [D, 2F] + w2 [F, D], worked by hand
    expected["active"] = expected["total"] - cfg.n_layers * (e - k) * per_expert
    assert whole.num_params() == expected
    shard = MoETransformer(cfg)
    for moe in shard.moe_layers:  # what an ep=2 rank keeps: experts [0, E/2)
        moe.w1 = torch.nn.Parameter(moe.w1.detach()[: e // 2].clone())
        moe.w2 = torch.nn.Parameter(moe.w2.detach()[: e // 2].clone())
    assert sum(p.numel() for p in shard.parameters()) < expected["total"]
    assert shard.num_params() == expected
