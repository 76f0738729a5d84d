"""The resumable runner: plan the arm x seed grid and train every unfinished run."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moestack import locks
from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.prereg.compose import compose_config
from moestack.prereg.locking import check_code, verify
from moestack.prereg.provenance import (
    SUMMARY_FILE,
    check_run,
    default_out_dir,
    is_finished,
    write_run_record,
)
from moestack.prereg.signals import sigterm_as_interrupt
from moestack.prereg.sources import RUNNING_CODE, this_code
from moestack.prereg.spec import Prereg, RunSpec, load

log = logging.getLogger(__name__)

__all__ = [
    "CLAIM_FILE", "SUMMARY_FILE", "check_runs", "claim", "claimed", "default_out_dir",
    "is_finished", "plan", "release", "run",
]  # fmt: skip

CLAIM_FILE = "claim.json"  # in a run's folder; locked (flock) while a runner trains it


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
    """moestack.trainer.train, imported late: torch loads only when a run trains. The
    trainer's own log (its closing summary holds the run's val loss and perplexity) is kept
    to warnings: a study shows no run's results before it is complete (summary.json and
    metrics.jsonl still record them)."""
    from moestack.trainer import train

    trainer_log = logging.getLogger("moestack.trainer")
    level = trainer_log.level
    trainer_log.setLevel(logging.WARNING)
    try:
        return train(cfg, out_dir)
    finally:
        trainer_log.setLevel(level)


def run(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    train_fn: Callable[[TrainConfig, Path], dict[str, Any]] | None = None,
    progress: bool = True,
    amend: str | None = None,
) -> list[Path]:
    """Train every run of the locked study that has not finished; returns all run dirs.

    A run with ``summary.json`` is skipped; one with a checkpoint resumes from it
    (``resume=true``, same out_dir). Runs are claimed one at a time (``claim``), so several
    invocations over the same folder (one per core or machine) share the grid. Each run
    records the study hash it is trained under and, once finished, its identity (arm, seed,
    the final checkpoint's weights sha256: ``prereg_run.json``); a finished run the lock
    does not cover, or an interrupted one started under another study hash, is refused before
    anything trains.
    Nothing trains with moestack sources other than the lock's (``locking.check_code``)
    unless ``amend`` says why the change leaves the answer alone (it becomes an amendment).
    ``train_fn`` replaces ``moestack.trainer.train``. SIGTERM stops it as Ctrl-C does
    (``signals.sigterm_as_interrupt``): the run in training is recorded as interrupted and
    resumes later from its last checkpoint.
    """
    with sigterm_as_interrupt():
        return _run(path, out_dir, train_fn, progress, amend)


def _run(
    path: Path | str,
    out_dir: Path | str | None,
    train_fn: Callable[[TrainConfig, Path], dict[str, Any]] | None,
    progress: bool,
    amend: str | None,
) -> list[Path]:
    """:func:`run`'s body."""
    info = check_code(path, verify(path), amend, out_dir)
    # the code just checked against the lock, which this process runs: each run's record
    # names it (later edits of the checkout's files do not change what is imported)
    info = {**info, RUNNING_CODE: this_code()}
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
    try:
        held = [item for item in todo if not _claimed_and_trained(item, info, train_fn, bar)]
        # a second pass: a run skipped in the instant `prereg status` looked at its claim
        held = [item for item in held if not _claimed_and_trained(item, info, train_fn, bar)]
    finally:
        if bar is not None:
            bar.close()
    held = [item for item in held if not is_finished(item.run_dir)]  # others finished them
    if held:
        names = [item.name for item in held]
        log.warning("%d runs are being trained by other runners: %s", len(names), names)
    return [r.run_dir for r in runs]


def claim(run_dir: Path) -> int | None:
    """Take the run for this process: an exclusive ``flock`` on ``claim.json`` (which names
    the host and pid), held until :func:`release`; None when another runner holds it. So
    several ``prereg run`` invocations over the same folder share the grid.

    The operating system drops the lock when the last descriptor of it closes: when the
    runner ends, however it ends, unless a child it forked without exec still runs (on a
    network file system, as far as it supports ``flock``). A claim.json deleted while held
    is noticed (the lock is on the old file) and claimed anew."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CLAIM_FILE
    for _ in range(3):
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            held = locks.lock_exclusive(fd)
        except BaseException:
            os.close(fd)
            raise
        if not held:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # deleted under us: again
                release(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
        except BaseException:
            release(fd)
            raise
        return fd
    return None


def release(fd: int) -> None:
    """Give a run claimed with :func:`claim` back (its claim.json stays, unlocked)."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def claimed(run_dir: Path) -> bool:
    """Whether a runner holds the run now (:func:`moestack.locks.is_held`: a runner that
    tries to claim the run in that instant waits a moment, or takes it on its second pass,
    :func:`run`)."""
    return locks.is_held(Path(run_dir) / CLAIM_FILE)


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
    fd = claim(item.run_dir)
    if fd is None:
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
        release(fd)
    return True


def _train_one(
    item: RunSpec,
    resume: bool,
    info: dict[str, Any],
    train_fn: Callable[[TrainConfig, Path], dict[str, Any]],
    bar: Any,
) -> None:
    """Train (or resume) one run, recording the study hash before and, with the run's
    identity (arm, seed, final checkpoint), after."""
    overrides = [*item.overrides, f"out_dir={item.run_dir}", f"resume={str(resume).lower()}"]
    cfg = compose_config(overrides)
    item.run_dir.mkdir(parents=True, exist_ok=True)
    (item.run_dir / "prereg_overrides.json").write_text(json.dumps(overrides, indent=2))
    write_run_record(item.run_dir, info, "started", item)
    log.info("%s: %s %s", item.name, "resuming" if resume else "training", item.run_dir)
    if bar is not None:
        bar.set_postfix_str(item.name)
    train_fn(cfg, item.run_dir)
    if not is_finished(item.run_dir):
        raise MoestackError(f"{item.name}: training ended without {SUMMARY_FILE}")
    write_run_record(item.run_dir, info, "finished", item)  # its identity: arm, seed, weights
    if bar is not None:
        bar.update(1)
