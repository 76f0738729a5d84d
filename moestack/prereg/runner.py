"""The resumable runner: plan the arm x seed grid and train every unfinished run."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.prereg.compose import compose_config
from moestack.prereg.locking import verify
from moestack.prereg.provenance import (
    SUMMARY_FILE,
    check_run,
    default_out_dir,
    is_finished,
    write_run_record,
)
from moestack.prereg.spec import Prereg, RunSpec, load

log = logging.getLogger(__name__)

__all__ = [
    "CLAIM_FILE", "SUMMARY_FILE", "check_runs", "claim", "claimed", "default_out_dir",
    "is_finished", "plan", "run",
]  # fmt: skip

CLAIM_FILE = "claim.json"  # in a run's folder while a runner trains it
_UNREADABLE_CLAIM_S = 60.0  # an unreadable claim older than this is a dead runner's


def plan(spec: Prereg, out_dir: Path | str | None = None) -> list[RunSpec]:
    """Every run of the grid, seed by seed (each seed's arms in file order), so that a study
    cut short still holds complete seeds: paired comparisons need every arm of a seed."""
    root = Path(out_dir) if out_dir else default_out_dir(spec)
    return [
        RunSpec(arm, seed, root / "runs" / f"{arm}-s{seed}", tuple(spec.overrides(arm, seed)))
        for seed in spec.seeds
        for arm in spec.arms
    ]


def check_runs(runs: list[RunSpec], lock_info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The lock record each finished run was trained under (``provenance.check_run``); raises
    at the first run the lock does not cover."""
    return {r.name: check_run(r.run_dir, lock_info) for r in runs if is_finished(r.run_dir)}


def _train(cfg: TrainConfig, out_dir: Path) -> dict[str, Any]:
    """moestack.trainer.train, imported late: torch loads only when a run trains."""
    from moestack.trainer import train

    return train(cfg, out_dir)


def run(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    train_fn: Callable[[TrainConfig, Path], dict[str, Any]] | None = None,
    progress: bool = True,
) -> list[Path]:
    """Train every run of the locked study that has not finished; returns all run dirs.

    A run with ``summary.json`` is skipped; one with a checkpoint resumes from it
    (``resume=true``, same out_dir). Runs are claimed one at a time (``claim``), so several
    invocations over the same folder (one per core or machine) share the grid. Each run
    records the study hash it is trained under (``prereg_run.json``); a finished run the lock
    does not cover, or an interrupted one started under another study hash, is refused before
    anything trains.
    ``train_fn`` replaces ``moestack.trainer.train``.
    """
    info = verify(path)
    spec = load(path)
    runs = plan(spec, out_dir)
    train_fn = train_fn or _train
    check_runs(runs, info)
    todo = [r for r in runs if not is_finished(r.run_dir)]
    for item in todo:
        if _interrupted(item):
            check_run(item.run_dir, info, resume=True)
    log.info(
        "study %s: %d runs, %d finished, %d to train", spec.study, len(runs), len(runs) - len(todo),
        len(todo),
    )  # fmt: skip
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc=spec.study, unit="run")
    elsewhere = []
    try:
        for item in todo:
            if not _claimed_and_trained(item, info, train_fn, bar):
                elsewhere.append(item.name)
    finally:
        if bar is not None:
            bar.close()
    if elsewhere:
        log.info("%d runs were being trained by other runners: %s", len(elsewhere), elsewhere)
    return [r.run_dir for r in runs]


def claim(run_dir: Path) -> bool:
    """Take the run for this process: create ``claim.json`` (host, pid) only if no live runner
    holds it, so several ``prereg run`` invocations over the same folder share the grid.

    A claim left by a dead process of this host is taken over; one from another host is
    respected (remove its claim.json by hand if that runner is gone)."""
    target = run_dir / CLAIM_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    mine = {"host": socket.gethostname(), "pid": os.getpid()}
    for _ in range(2):
        try:
            fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if not _stale(target, mine["host"]):
                return False
            log.info("%s: taking over the claim of a runner that is gone", run_dir.name)
            target.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return True
    return False


def claimed(run_dir: Path) -> bool:
    """Whether a live runner holds the run (a claim that is not a dead runner's)."""
    target = Path(run_dir) / CLAIM_FILE
    return target.exists() and not _stale(target, socket.gethostname())


def _stale(target: Path, host: str) -> bool:
    """True when the claim's runner was a process of this host that no longer exists, or the
    claim has stayed unreadable for a minute (its runner died while writing it)."""
    try:
        holder = json.loads(target.read_text())
        pid = int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        try:  # being written right now, or left half-written: wait a minute before taking it
            return time.time() - target.stat().st_mtime > _UNREADABLE_CLAIM_S
        except OSError:
            return False
    if holder.get("host") != host:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _interrupted(item: RunSpec) -> bool:
    from moestack import checkpoint

    return checkpoint.latest_checkpoint(item.run_dir / "checkpoints") is not None


def _claimed_and_trained(
    item: RunSpec,
    info: dict[str, Any],
    train_fn: Callable[[TrainConfig, Path], dict[str, Any]],
    bar: Any,
) -> bool:
    """Train the run if no other runner holds or finished it; False when another runner has it."""
    if not claim(item.run_dir):
        return False
    try:
        if is_finished(item.run_dir):  # finished by another runner since the plan was made
            if bar is not None:
                bar.update(1)
            return True
        resume = _interrupted(item)
        if resume:
            check_run(item.run_dir, info, resume=True)
        _train_one(item, resume, info, train_fn, bar)
    finally:
        (item.run_dir / CLAIM_FILE).unlink(missing_ok=True)
    return True


def _train_one(
    item: RunSpec,
    resume: bool,
    info: dict[str, Any],
    train_fn: Callable[[TrainConfig, Path], dict[str, Any]],
    bar: Any,
) -> None:
    """Train (or resume) one run, recording the study hash before and after."""
    overrides = [*item.overrides, f"out_dir={item.run_dir}", f"resume={str(resume).lower()}"]
    cfg = compose_config(overrides)
    item.run_dir.mkdir(parents=True, exist_ok=True)
    (item.run_dir / "prereg_overrides.json").write_text(json.dumps(overrides, indent=2))
    write_run_record(item.run_dir, info, "started")
    log.info("%s: %s %s", item.name, "resuming" if resume else "training", item.run_dir)
    if bar is not None:
        bar.set_postfix_str(item.name)
    train_fn(cfg, item.run_dir)
    if not is_finished(item.run_dir):
        raise MoestackError(f"{item.name}: training ended without {SUMMARY_FILE}")
    write_run_record(item.run_dir, info, "finished")
    if bar is not None:
        bar.update(1)
