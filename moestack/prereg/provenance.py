"""Which lock each run was trained under: ``<run>/prereg_run.json`` and the checks on it.

The runner writes ``prereg_run.json`` into a run's folder when it starts the run and again
when it finishes, with the study hash of the lock it ran under. ``run`` and ``analyze`` accept
a run only when the lock covers that hash (``chain.accepted``: the current lock, or an earlier
one that amendments lead to), so deleting the lock and locking a changed study again does not
make runs of the old study count. A run without the file was trained before run hashes were
recorded: it is accepted only while the lock is legacy (or amended from a legacy one).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.chain import accepted
from moestack.prereg.spec import Prereg

RUN_FILE = "prereg_run.json"
SUMMARY_FILE = "summary.json"


def default_out_dir(spec: Prereg) -> Path:
    return Path("runs") / "prereg" / spec.study


def is_finished(run_dir: Path) -> bool:
    return (run_dir / SUMMARY_FILE).is_file()


def find_run(spec: Prereg, out_dir: Path | str | None = None) -> Path | None:
    """A run folder of the study under ``out_dir`` (default runs/prereg/<study>) that holds
    anything a run leaves (its record, a checkpoint, summary.json), or None."""
    runs = (Path(out_dir) if out_dir else default_out_dir(spec)) / "runs"
    if not runs.is_dir():
        return None
    for run_dir in sorted(runs.iterdir()):
        marks = (run_dir / RUN_FILE, run_dir / SUMMARY_FILE, run_dir / "checkpoints")
        if run_dir.is_dir() and any(mark.exists() for mark in marks):
            return run_dir
    return None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def read_run_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's record, None when it has none; a malformed one is refused."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("study_sha256"), str):
        raise MoestackError(f"{path} is not a valid run record; rerun the run (delete its folder)")
    return record


def write_run_record(run_dir: Path, lock_info: dict[str, Any], status: str) -> Path:
    """Record in ``run_dir`` the study hash of ``lock_info`` (``verify``'s result) the run is
    trained under; ``status`` is ``started`` or ``finished``."""
    run_dir = Path(run_dir)
    old = read_run_record(run_dir) or {}
    same = old.get("study_sha256") == lock_info["study_sha256"]
    record = {
        "study": lock_info["study"],
        "file": lock_info["file"],
        "study_sha256": lock_info["study_sha256"],
        "sha256": lock_info["sha256"],
        "lock_record": lock_info.get("head"),  # the lock record's hash (None: legacy lock)
        "legacy_lock": lock_info["legacy"],
        "status": status,
        "started_at": old.get("started_at", _now()) if same else _now(),
    }
    if status == "finished":
        record["finished_at"] = _now()
    path = run_dir / RUN_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def check_run(run_dir: Path, lock_info: dict[str, Any], *, resume: bool = False) -> dict[str, Any]:
    """The lock record (``n``, ``study_sha256``, ``recorded``) a run was trained under.

    Raises, in one line naming the run folder and both hashes, when the lock does not cover
    the run. ``resume``: the run is unfinished and would continue, which needs the current
    study hash exactly (a run is not continued across a change of the study).
    """
    records = lock_info["history"]
    head, covered = records[-1], accepted(records)
    where, now = lock_info.get("path", lock_info["file"]), records[-1]["study_sha256"]
    amend = f'moestack prereg lock {where} --amend "why"'
    record = read_run_record(run_dir)
    if record is None:
        legacy = next((r for r in covered if r["legacy"]), None)
        if legacy is not None and (head["legacy"] or not resume):
            return {"n": legacy["n"], "study_sha256": legacy["study_sha256"], "recorded": False}
        raise MoestackError(
            f"{run_dir} has no {RUN_FILE}, so the study hash it was trained under is unknown "
            f"(the lock of {where} holds {now[:12]}; only a legacy lock accepts such runs): "
            "rerun it (delete the folder)"
        )
    sha = record["study_sha256"]
    match = next((r for r in covered if r["study_sha256"] == sha), None)
    if resume and sha != now:
        raise MoestackError(
            f"{run_dir} was started under study sha256 {sha[:12]}, the lock of {where} holds "
            f"{now[:12]}: a run does not continue across a change of the study; delete the "
            "folder to rerun it under the current lock"
        )
    if match is not None:
        return {"n": match["n"], "study_sha256": sha, "recorded": True}
    earlier = next((r for r in reversed(records) if r["study_sha256"] == sha), None)
    if earlier is not None:
        raise MoestackError(
            f"{run_dir} was trained under study sha256 {sha[:12]} (lock record #{earlier['n']}), "
            f"which a re-lock without --amend replaced; the lock of {where} holds {now[:12]}: "
            "rerun it (delete the folder), or restore the lock from before that re-lock (git) "
            f"and amend it: {amend}"
        )
    raise MoestackError(
        f"{run_dir} was trained under study sha256 {sha[:12]}, which is not in the lock history "
        f"of {where} (now {now[:12]}): rerun it (delete the folder), or, if the study changed "
        f"on purpose, restore the lock that recorded {sha[:12]} (git) and amend it: {amend}"
    )
