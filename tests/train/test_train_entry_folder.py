"""What moestack-train leaves in its out_dir when a start is refused or stopped: a refused
start leaves nothing new (a run's folder stays byte for byte as the run wrote it: train.log,
provenance.json, .hydra/; a new folder refused for its data is not left behind), and Ctrl-C
ends a run with one line naming the last step logged, the newest checkpoint and the command
that continues it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import TINY_ARGS, run_module

from moestack import checkpoint
from moestack.errors import MoestackError

TINY = [*TINY_ARGS, "telemetry=off", "wandb_mode=disabled"]


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def one_line(done: subprocess.CompletedProcess, status: int) -> str:
    """stderr of a command that ended with ``status`` in one line, no traceback."""
    assert done.returncode == status, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A tiny run of two steps, trained by the command, its checkpoint written at the end."""
    folder = tmp_path_factory.mktemp("finished")
    done = run_module(*TINY, f"out_dir={folder / 'run'}", cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint.latest_checkpoint(folder / "run/checkpoints") is not None
    return folder / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_a_refused_start_leaves_a_finished_run_as_it_was(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = files_of(run)
    done = run_module(*TINY, "model.d_model=64", f"out_dir={run}", cwd=tmp_path)
    assert "already holds checkpoints; pass resume=true" in one_line(done, 2)
    assert files_of(run) == before  # .hydra/config.yaml still says the run's d_model=32


def tree_of(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder``, relative: a file's bytes, None for a folder."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}  # fmt: skip


@pytest.mark.parametrize(
    ("args", "checkpoints", "says"),
    [
        (["model.d_model=64", "resume=true"], True, "changed config (model.d_model 32 -> 64)"),
        (["model.moe.top_k=8", "resume=true"], True, "top_k"),  # refused as hydra's config
        (["resume=true"], False, "holds no checkpoint"),
        (["data=files", "data.paths=[MISSING]"], False, "MISSING does not exist"),
    ],
    ids=["changed-config", "bad-value", "nothing-to-resume", "missing-data"],
)
def test_a_refused_start_leaves_a_runs_folder_as_it_was(finished, tmp_path, args, checkpoints,
                                                        says):  # fmt: skip
    """No line in train.log, no record in provenance.json, .hydra/ and config.yaml as the
    run wrote them: in a finished run, and in one that never checkpointed (a start that is
    not refused starts it over)."""
    run = copy_of(finished, tmp_path)
    if not checkpoints:
        shutil.rmtree(run / "checkpoints")
    before = tree_of(run)
    missing = str(tmp_path / "missing.txt")
    args = [a.replace("MISSING", missing) for a in args]
    done = run_module(*TINY, *args, f"out_dir={run}", cwd=tmp_path)
    assert done.returncode == 2 and says.replace("MISSING", missing) in done.stderr
    assert "Traceback" not in done.stderr
    assert tree_of(run) == before
    starts = json.loads((run / "provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["finished"]


def test_a_new_folder_refused_for_its_data_is_not_left_behind(tmp_path):
    """Nor the folders above it that hydra made (a/b); a folder that was there (kept) stays."""
    missing = tmp_path / "missing.txt"
    args = [*TINY, "data=files", f"data.paths=[{missing}]"]
    (tmp_path / "kept").mkdir()
    done = run_module(*args, f"out_dir={tmp_path / 'kept/a/b/new'}", cwd=tmp_path)
    assert done.returncode == 2 and f"{missing} does not exist" in done.stderr
    assert tree_of(tmp_path / "kept") == {}
    mine = tmp_path / "mine"  # a folder of the user's: only what the start added goes
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    done = run_module(*args, f"out_dir={mine}", cwd=tmp_path)
    assert done.returncode == 2
    assert files_of(mine) == {"notes.txt": b"kept"}
    done = run_module(*args, cwd=tmp_path)  # the dated default folder
    assert done.returncode == 2 and not (tmp_path / "outputs").exists()


def test_a_refused_start_removes_only_the_folders_it_made_and_left_empty(tmp_path):
    """A start into a new ``a/b/run`` refused for its data makes none of ``run``, ``a/b``:
    ``a``, holding a folder another process made there, stays as it was, and so does
    ``tmp_path``."""
    missing = tmp_path / "missing.txt"
    (tmp_path / "a" / "other").mkdir(parents=True)  # another process's
    done = run_module(*TINY, "data=files", f"data.paths=[{missing}]",
                      f"out_dir={tmp_path / 'a/b/run'}", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and f"{missing} does not exist" in done.stderr
    assert tree_of(tmp_path) == {"a": None, "a/other": None}


def test_a_refused_start_removes_no_folder_that_was_there(tmp_path):
    """``out_dir=../new/run`` (hydra names it normalised): ``new`` goes with ``run``. Without
    out_dir, an empty ``outputs/`` that was there stays (the dated folder and its date's
    go); with ``hydra.run.dir=me/x``, ``me`` stays."""
    missing = tmp_path / "missing.txt"
    args = [*TINY, "data=files", f"data.paths=[{missing}]"]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = run_module(*args, "out_dir=../new/run", cwd=cwd)
    assert done.returncode == 2 and f"{missing} does not exist" in done.stderr
    assert tree_of(tmp_path) == {"cwd": None}
    (cwd / "outputs").mkdir()
    done = run_module(*args, cwd=cwd)
    assert done.returncode == 2 and f"{missing} does not exist" in done.stderr
    assert tree_of(tmp_path) == {"cwd": None, "cwd/outputs": None}
    (tmp_path / "me").mkdir()
    done = run_module(*args, f"hydra.run.dir={tmp_path / 'me/x'}", cwd=cwd)
    assert done.returncode == 2 and f"{missing} does not exist" in done.stderr
    assert tree_of(tmp_path) == {"cwd": None, "cwd/outputs": None, "me": None}


def test_a_folder_not_read_before_hydra_is_left_as_hydra_left_it(tmp_path):
    """An interpolated out_dir (resolved by hydra): its folder, holding a record and log, is
    left as it was by a start refused for its data."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)  # hydra's record and log: an older start's
    (run / ".hydra" / "config.yaml").write_text("steps: 2\n")
    (run / "train.log").write_text("a line\n")
    after = tree_of(run)
    missing = tmp_path / "missing.txt"
    env = {**os.environ, "WANDB_MODE": "disabled", "RUN_ROOT": str(tmp_path)}
    done = run_module(*TINY, "data=files", f"data.paths=[{missing}]",
                      "out_dir=${oc.env:RUN_ROOT}/run", cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 2 and f"{missing} does not exist" in done.stderr
    assert tree_of(run) == after


class Terminated(Exception):
    """Raised by the test's SIGTERM handler (the default one ends the process)."""


def test_sigterm_during_a_refused_start_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """torchrun sends SIGTERM to the other ranks once one fails: one that comes while a start
    is being refused (here during its data check) finds the folder as it was, since nothing
    is written before the checks pass."""
    from helpers.runs import small_config

    from moestack import trainer

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("steps: 2\n")
    (run / "train.log").write_text("the run's line\n")
    was = tree_of(run)

    def terminated_midway(cfg):
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's
        raise MoestackError("data/missing.txt does not exist")

    def terminate(signum, frame):
        raise Terminated

    monkeypatch.setattr(trainer, "run_corpus", terminated_midway)
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        with pytest.raises(Terminated):
            trainer.train(small_config(steps=2), run)
        assert signal.getsignal(signal.SIGTERM) is terminate
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert tree_of(run) == was


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` and ``folder`` itself: (mtime in ns, size). A file made and
    removed again changes its folder's mtime, so nothing written goes unseen."""
    seen = {}
    for path in [folder, *folder.rglob("*")]:
        with contextlib.suppress(FileNotFoundError):
            info = path.stat()
            seen[path.relative_to(folder).as_posix()] = (info.st_mtime_ns, info.st_size)
    return seen


def test_a_watched_out_dir_sees_nothing_written_during_a_refused_start(finished, tmp_path):
    """A resume whose checkpoint does not fit its config (refused at the last check, once the
    config, the folder, the data and the model passed theirs), watched every millisecond while
    the command runs: no file or folder in out_dir is made, changed or removed at any time."""
    from moestack.config import to_yaml
    from moestack.runs import load_run_config

    run = copy_of(finished, tmp_path)
    wider = load_run_config(run)
    wider.model = dataclasses.replace(wider.model, d_model=64)
    (run / "config.yaml").write_text(to_yaml(wider))  # the config check cannot tell
    time.sleep(0.01)
    before = snapshot(run)
    command = [sys.executable, "-m", "moestack.train", f"out_dir={run}", "resume=true"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"})  # fmt: skip
    looks = 0
    try:
        while proc.poll() is None:
            assert snapshot(run) == before
            looks += 1
            time.sleep(0.001)
        stderr = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert proc.returncode == 2 and "was trained with model.d_model=32, this model has 64" in stderr
    assert looks > 10 and snapshot(run) == before


# --------------------------------------------------------------------------- Ctrl-C
def interrupt(out: Path, *args: str, at_step: int) -> subprocess.CompletedProcess:
    """Start ``moestack-train ARGS out_dir=OUT`` and send it SIGINT (what Ctrl-C sends) once
    its metrics.jsonl holds step ``at_step``; the finished process."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "moestack.train", *args, f"out_dir={out}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=out.parent)  # fmt: skip
    try:
        while not _logged(out / "metrics.jsonl", at_step):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _logged(metrics: Path, step: int) -> bool:
    try:
        return any(json.loads(line).get("step", 0) >= step for line in metrics.open())
    except (OSError, ValueError):
        return False


LONG = [*TINY, "steps=100000", "log_every=1"]  # never ends by itself


def test_ctrl_c_says_where_the_run_stopped_and_how_to_continue(tmp_path):
    out = tmp_path / "run"
    done = interrupt(out, *LONG, "ckpt_every=2", at_step=3)
    line = one_line(done, 130)
    newest = checkpoint.latest_checkpoint(out / "checkpoints")
    logged = max(json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines())
    assert line.startswith(f"moestack-train: interrupted after step {logged} (the last one logged)")
    assert f"the last checkpoint is {newest}: continue from it with moestack-train " in line
    command = shlex.split(line.split("continue from it with ", 1)[1])
    assert command == ["moestack-train", *LONG, "ckpt_every=2", f"out_dir={out}", "resume=true"]
    starts = json.loads((out / "provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["interrupted"]


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    out = tmp_path / "run"
    done = interrupt(out, *LONG, "ckpt_every=0", at_step=1)
    line = one_line(done, 130)
    assert f"no checkpoint was written in {out}, so there is nothing to resume" in line
    assert "resume=true" not in line and checkpoint.latest_checkpoint(out / "checkpoints") is None


# --------------------------------------------------------------------------- resume
def test_a_resume_typed_as_the_readme_writes_it_takes_the_runs_own_config(finished, tmp_path):
    """The run was started with overrides (a tiny model, two steps, no telemetry): the
    README's ``out_dir=runs/a resume=true`` gives none of them, and the resumed start keeps
    the run's config.yaml (only ``resume`` changes), trains nothing past the run's end."""
    run = copy_of(finished, tmp_path)
    stored = (run / "config.yaml").read_text()
    done = run_module(f"out_dir={run}", "resume=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = stored.replace("resume: false", "resume: true").replace(str(finished), str(run))
    assert (run / "config.yaml").read_text() == expected  # out_dir: where the copy lives
    starts = json.loads((run / "provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["finished", "finished"]
    assert starts[1]["overrides"] == [f"out_dir={run}", "resume=true"]


def test_a_resume_names_only_the_overrides_it_was_given(finished, tmp_path):
    """``model.d_model=64`` changes the run: refused naming that field alone, none of the
    fields the run's own overrides set and the resume did not give."""
    run = copy_of(finished, tmp_path)
    before = tree_of(run)
    done = run_module("model.d_model=64", f"out_dir={run}", "resume=true", cwd=tmp_path)
    line = one_line(done, 2)
    assert "resume=true with a changed config (model.d_model 32 -> 64): a resumed run" in line
    assert tree_of(run) == before


def test_ctrl_c_before_a_resume_began_leaves_the_run_as_it_was(finished, tmp_path):
    """Right after the resume's checks passed, before it writes into the run's folder, and
    again as the process exits: the folder byte for byte as it was, the line naming the run's
    checkpoint and the command that resumes it."""
    from helpers.interrupt import planted

    run = copy_of(finished, tmp_path)
    before = tree_of(run)
    done = planted("checks-passed", f"out_dir={run}", "resume=true", cwd=tmp_path)
    line = one_line(done, 130)
    newest = checkpoint.latest_checkpoint(run / "checkpoints")
    assert line == (
        "moestack-train: interrupted before this start began (the run's folder is as it was); "
        f"the last checkpoint is {newest}: continue from it with moestack-train "
        f"out_dir={run} resume=true"
    )
    assert tree_of(run) == before
