"""Which lock each run was trained under and which run a folder holds: ``prereg_run.json``.

The runner writes ``prereg_run.json`` into a run's folder when it starts the run and again
when it finishes, with the study hash of the lock it ran under. ``run`` and ``analyze`` accept
a run only when the lock covers that hash (``chain.accepted``: the current lock, or an earlier
one that amendments lead to), so deleting the lock and locking a changed study again does not
make runs of the old study count. A run without the file was trained before run hashes were
recorded: the lock accepts it only while it is legacy (or amended from a legacy one), and
``analyze`` and ``evaluate`` still refuse it for want of an identity (below).

The record written when a run finishes is also the run's **identity**: the study hash, the
arm, the seed, and the name, step and weights sha256 of its final checkpoint (from the
checkpoint's verified meta.json), sealed with a digest of its own fields (``records``).
``check_identity`` ties a finished folder to the run the grid registered there and to the
weights it finished with, so a record or a checkpoint copied from another run is refused.

A **kept** run (``kept``: restored on another machine from the records kept in the
repository) has no checkpoint; its final checkpoint's meta.json is kept beside the records
(``KEPT_META``, its own digest checked), and the identity is checked against that.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.chain import accepted
from moestack.prereg.records import is_sealed, write_sealed
from moestack.prereg.sources import RUNNING_CODE, TRAINED_BY, trained_by
from moestack.prereg.spec import Prereg, RunSpec

RUN_FILE = "prereg_run.json"
SUMMARY_FILE = "summary.json"
RUN_SEAL = "record_sha256"  # the run record's digest of its other fields
# What a finished run's record names: the run, and the final checkpoint it finished with.
IDENTITY = ("run", "arm", "seed", "study_sha256", "checkpoint", "step", "model_sha256")
# A kept run's final checkpoint: {"checkpoint": its folder's name, "meta": its meta.json}.
KEPT_META = "kept_checkpoint_meta.json"


def default_out_dir(spec: Prereg) -> Path:
    return Path("runs") / "prereg" / spec.study


def is_finished(run_dir: Path) -> bool:
    return (run_dir / SUMMARY_FILE).is_file()


def is_kept(run_dir: Path) -> bool:
    """A run restored from its kept records (``kept.restore``): its final checkpoint's
    meta.json is kept, and it has no checkpoints of its own."""
    run_dir = Path(run_dir)
    return (run_dir / KEPT_META).is_file() and not (run_dir / "checkpoints").exists()


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


def write_run_record(
    run_dir: Path, lock_info: dict[str, Any], status: str, run: RunSpec | None = None
) -> Path:
    """Record in ``run_dir`` the study hash of ``lock_info`` (``verify``'s result) the run is
    trained under; ``status`` is ``started`` or ``finished``. ``run`` (the grid's point)
    names its arm and seed; a finished record needs it and adds the final checkpoint's
    name, step and weights sha256, which the checkpoint's files are verified against first.
    ``trained_by`` names the code (code hash, git commit) of every start that wrote the
    record under this study hash: the runner's, checked against the lock when it started
    (``lock_info``'s ``running_code``), else ``sources.this_code()``. The record is sealed
    (``record_sha256``) and written atomically."""
    run_dir = Path(run_dir)
    if status == "finished" and run is None:
        raise ValueError("a finished run record needs the run (its arm and seed)")
    old = read_run_record(run_dir) or {}
    same = old.get("study_sha256") == lock_info["study_sha256"]
    record: dict[str, Any] = {
        "study": lock_info["study"],
        "file": lock_info["file"],
        "study_sha256": lock_info["study_sha256"],
        "sha256": lock_info["sha256"],
        "lock_record": lock_info.get("head"),  # the lock record's hash (None: legacy lock)
        "legacy_lock": lock_info["legacy"],
        "status": status,
        "started_at": old.get("started_at", _now()) if same else _now(),
        TRAINED_BY: trained_by(old if same else None, lock_info.get(RUNNING_CODE)),
    }
    if run is not None:
        record.update(run=run.name, arm=run.arm, seed=run.seed)
    if status == "finished":
        ckpt, step, sha = final_checkpoint(run_dir, verify=True)
        record.update(checkpoint=ckpt.name, step=step, model_sha256=sha, finished_at=_now())
    path = run_dir / RUN_FILE
    write_sealed(path, record, RUN_SEAL)
    return path


def final_checkpoint(run_dir: Path, *, verify: bool = False) -> tuple[Path, int, str]:
    """The run's newest checkpoint (``runs.resolve_checkpoint``), its step and the sha256 of
    its weights as its meta.json records them (meta.json checked: structure, its own digest,
    the file sizes). ``verify`` hashes the weights file against meta.json first (when the
    record is written: then the recorded sha256 is the weights' own; later checks read it
    from meta.json, and loading the weights hashes them again)."""
    from moestack import checkpoint
    from moestack.runs import resolve_checkpoint

    ckpt = resolve_checkpoint(run_dir)
    meta = checkpoint.read_meta(ckpt)
    if verify:
        checkpoint.verify_file(ckpt, checkpoint.MODEL_FILE, meta)
    sha = meta.get("sha256", {}).get(checkpoint.MODEL_FILE)
    if sha is None:
        raise MoestackError(
            f"{ckpt}: its {checkpoint.META_FILE} records no sha256 of {checkpoint.MODEL_FILE} "
            "(a checkpoint older than the digests), so the run's weights cannot be identified; "
            "retrain the run (delete its folder)"
        )
    return ckpt, int(meta["step"]), sha


def kept_checkpoint(run_dir: Path) -> tuple[str, int, str]:
    """A kept run's final checkpoint: its name, step and weights sha256, from its kept
    meta.json (structure and digest checked: ``checkpoint.check_meta``)."""
    from moestack import checkpoint

    path = Path(run_dir) / KEPT_META
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = None
    if not isinstance(kept, dict) or not isinstance(kept.get("checkpoint"), str):
        raise MoestackError(
            f"{path} is not a kept checkpoint record ({{'checkpoint': name, 'meta': meta.json}}); "
            "restore the run's kept records again"
        )
    meta = checkpoint.check_meta(kept.get("meta"), path)
    sha = meta.get("sha256", {}).get(checkpoint.MODEL_FILE)
    if not isinstance(sha, str):
        raise MoestackError(f"{path}: its meta records no sha256 of {checkpoint.MODEL_FILE}")
    return kept["checkpoint"], int(meta["step"]), sha


def final_weights(run_dir: Path) -> tuple[str, int, str]:
    """The name, step and weights sha256 of the run's final checkpoint: its own
    (``final_checkpoint``), or a kept run's (``kept_checkpoint``)."""
    if is_kept(run_dir):
        return kept_checkpoint(run_dir)
    ckpt, step, sha = final_checkpoint(run_dir)
    return ckpt.name, step, sha


def _retrain(run_dir: Path) -> str:
    return f"retrain it: delete {run_dir} and run `moestack prereg run` on the study again"


def check_identity(item: RunSpec, study: str) -> dict[str, Any]:
    """The identity record of the finished run ``item``, after checking that it is this
    run's (study ``study``, its arm and seed, sealed) and that the final checkpoint holds the
    weights it recorded. Raises, in one line naming the run folder and what differs."""
    run_dir = item.run_dir
    path = run_dir / RUN_FILE
    record = read_run_record(run_dir)
    if record is None:
        raise MoestackError(
            f"{run_dir} has no {RUN_FILE}, so nothing ties its checkpoint to run {item.name}; "
            + _retrain(run_dir)
        )
    missing = [key for key in IDENTITY if key not in record]
    if record.get("status") != "finished" or missing:
        raise MoestackError(
            f"{path} records no identity of the run (no {', '.join(missing) or 'finished'} "
            "record): it finished before moestack recorded a run's arm, seed and final "
            f"checkpoint (or the runner stopped before writing it), so its checkpoint cannot "
            f"be tied to run {item.name}; " + _retrain(run_dir)
        )
    if not is_sealed(record, RUN_SEAL):
        raise MoestackError(
            f"{path} was edited after the runner wrote it ({RUN_SEAL} does not match its "
            f"fields); restore it, or {_retrain(run_dir)}"
        )
    mine = {"study": study, "run": item.name, "arm": item.arm, "seed": item.seed}
    differs = [f"{k} {record.get(k)!r} (here {v!r})" for k, v in mine.items() if record.get(k) != v]
    if differs:
        raise MoestackError(
            f"{path} is the identity of another run ({', '.join(differs)}): a record copied "
            f"from another run's folder; restore this run's own, or {_retrain(run_dir)}"
        )
    name, step, sha = final_weights(run_dir)
    if (name, step, sha) != (record["checkpoint"], record["step"], record["model_sha256"]):
        where = run_dir / KEPT_META if is_kept(run_dir) else run_dir / "checkpoints" / name
        raise MoestackError(
            f"{where}: the final checkpoint of {item.name} holds weights sha256 {sha[:12]} "
            f"(step {step}), not the {record['model_sha256'][:12]} ({record['checkpoint']}) "
            f"the run finished with ({RUN_FILE}): the checkpoint was replaced, copied from "
            f"another run?; restore it, or {_retrain(run_dir)}"
        )
    return record


def check_identities(runs: list[RunSpec], study: str) -> dict[str, dict[str, Any]]:
    """The identity of every finished run of ``runs`` (``check_identity``), no two of them
    holding the same weights (``check_distinct_weights``); raises at the first that fails."""
    found = {r.name: check_identity(r, study) for r in runs if is_finished(r.run_dir)}
    check_distinct_weights(runs, found)
    return found


def check_distinct_weights(runs: list[RunSpec], identities: dict[str, dict[str, Any]]) -> None:
    """Refuse two finished runs of different overrides (arm or seed) whose final weights are
    the same file: one folder's checkpoint and record were copied from the other."""
    seen: dict[str, RunSpec] = {}
    for item in runs:
        if item.name not in identities:
            continue
        sha = identities[item.name]["model_sha256"]
        other = seen.setdefault(sha, item)
        if other is not item and other.overrides != item.overrides:
            raise MoestackError(
                f"{item.run_dir} and {other.run_dir} hold the same final weights (sha256 "
                f"{sha[:12]}) though they train different runs: one folder's checkpoint was "
                f"copied from the other; {_retrain(item.run_dir)}"
            )


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
