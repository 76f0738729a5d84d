"""Fault injection: Ctrl-C (SIGINT) at chosen moments of ``moestack-train``: while it imports
(from inside a finalizer, where Python drops the KeyboardInterrupt), right after hydra made
the run folder and again as the process exits, and twice after some steps of a run whose
hydra record lives apart from its out_dir. Every one ends with one line on stderr, exit status
130, and nothing left that was not there or is needed to resume; the line's command resumes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers.cli import TINY_ARGS, run_module
from helpers.interrupt import after_step, planted

from moestack import checkpoint

pytestmark = pytest.mark.faults

TINY = [*TINY_ARGS, "telemetry=off", "wandb_mode=disabled"]


def tree_of(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder``, relative: a file's bytes, None for a folder."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def the_line(done) -> str:
    """stderr of an interrupted command: exit status 130, one line, no traceback."""
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def test_ctrl_c_while_the_command_imports_is_neither_lost_nor_a_traceback(tmp_path, fault_report):
    """Raised inside a finalizer, Python would print the KeyboardInterrupt, drop it and train
    on: held, it stops the command before anything is made."""
    (tmp_path / "kept").mkdir()
    done = planted("import-finalizer", *TINY, "out_dir=kept/a/run", cwd=tmp_path)
    line = the_line(done)
    assert line == "moestack-train: interrupted before the run began; nothing was written"
    assert tree_of(tmp_path) == {"kept": None}
    fault_report.add("Ctrl-C: during the imports, inside a finalizer", injected=1, refused=1)


def test_ctrl_c_as_torch_imports_is_one_line(tmp_path, fault_report):
    """torch is imported after main() took Ctrl-C over (the package's names load lazily): a
    Ctrl-C then is held and stops the command before anything is made, in one line."""
    (tmp_path / "kept").mkdir()
    done = planted("torch-import", *TINY, "out_dir=kept/a/run", cwd=tmp_path)
    assert done.returncode == 130, done.stderr[-2000:]
    assert the_line(done) == "moestack-train: interrupted before the run began; nothing was written"
    assert tree_of(tmp_path) == {"kept": None}
    fault_report.add("Ctrl-C: as torch imports", injected=1, refused=1)


def test_ctrl_c_right_before_the_start_writes_and_again_at_exit_leaves_nothing(
    tmp_path, fault_report
):
    """Every check passed, the start about to make kept/a/b/run (hydra's record and log, the
    run's files): none of it is made (kept, there before, stays as it was); the second
    Ctrl-C, as the process exits, is ignored."""
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept/mine.txt").write_text("the user's")
    before = tree_of(tmp_path)
    done = planted("checks-passed", *TINY, "out_dir=kept/a/b/run", cwd=tmp_path)
    line = the_line(done)
    assert line == "moestack-train: interrupted before the run began; nothing was written"
    assert tree_of(tmp_path) == before
    fault_report.add("Ctrl-C: right before the start writes, again at exit", injected=2,
                     refused=2)  # fmt: skip


@pytest.mark.parametrize(
    "there,out_dir,removed,case",
    [  # the start made kept/a/run and kept/a above it: both go
        ("kept/mine.txt", "kept/a/run", "kept/a", "right after the run folder is made"),
        # out_dir was there with a file of the user's: that stays, the start's records go
        ("kept/run/notes.txt", "kept/run", "what it added to kept/run",
         "right after the start, into a folder that was there"),
    ],
)  # fmt: skip
def test_ctrl_c_before_a_step_leaves_only_what_was_there(
    tmp_path, fault_report, there, out_dir, removed, case
):
    """Ctrl-C right after the start made (or took) its run folder, before a step: what the
    start made or added holds only its own records, so it goes again; what was there stays
    as it was, and the line says what was removed."""
    (tmp_path / there).parent.mkdir(parents=True)
    (tmp_path / there).write_text("the user's")
    before = tree_of(tmp_path)
    done = planted("folder-made", *TINY, f"out_dir={out_dir}", cwd=tmp_path)
    line = the_line(done)
    assert tree_of(tmp_path) == before
    assert line == (
        "moestack-train: interrupted before it logged a step; nothing was kept "
        f"(removed: {removed})"
    )
    fault_report.add(f"Ctrl-C: {case}", injected=1, refused=1)


def test_ctrl_c_twice_after_steps_names_out_dirs_checkpoint_and_its_command_resumes(
    tmp_path, fault_report
):
    """hydra's record in rec/, the run in run/: the line names run/'s newest checkpoint (not
    rec/'s none) and a command that resumes; a second Ctrl-C 50 ms after the first changes
    nothing. The command printed is run as printed and finishes the run."""
    args = [*TINY, "steps=30", "ckpt_every=2", "keep_last=2", "hydra.run.dir=rec",
            "out_dir=run"]  # fmt: skip
    done = after_step(tmp_path / "run", *args, at_step=3, cwd=tmp_path, again_after_s=0.05)
    line = the_line(done)
    newest = checkpoint.latest_checkpoint(tmp_path / "run/checkpoints")
    assert newest is not None and not (tmp_path / "rec/checkpoints").exists()
    logged = max(json.loads(r)["step"] for r in (tmp_path / "run/metrics.jsonl").open())
    assert logged < 30
    assert line.startswith(f"moestack-train: interrupted after step {logged} (the last one")
    assert f"the last checkpoint is run/checkpoints/{newest.name}: " in line  # out_dir as typed
    words = shlex.split(line.split("continue from it with ", 1)[1])
    assert words[0] == "moestack-train" and "resume=true" in words
    starts = json.loads((tmp_path / "run/provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["interrupted"]
    resumed = run_module(*words[1:], cwd=tmp_path)  # rec/ holds this run's own record
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "run/summary.json").read_text())["out_dir"].endswith("run")
    starts = json.loads((tmp_path / "run/provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["interrupted", "finished"]
    fault_report.add("Ctrl-C: twice after steps, hydra record apart", injected=2, recovered=2)
