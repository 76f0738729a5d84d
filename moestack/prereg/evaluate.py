"""Evaluating a study's finished runs ahead of its analysis, showing nothing.

A run's evaluation (perplexity and cache hit rates of its final checkpoint on the
pre-registered validation batches) depends on that run alone, so it may be computed as soon
as the run finishes, while the others still train: ``moestack prereg evaluate FILE`` fills
each finished run's cached evaluation (``prereg_eval.json``, keyed by the analysis settings)
and prints counts only. ``prereg analyze`` reuses the cache once every run is done. Both
check each finished run's identity (``provenance.check_identity``) and each cached
evaluation (``analysis.cached_evaluation``) first. No metric is read back or shown here: an
interim look at results would be optional stopping.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any, NamedTuple

from moestack.errors import MoestackError
from moestack.prereg.analysis import analysis_key, cached_evaluation, evaluate_shard, metric_names
from moestack.prereg.locking import verify
from moestack.prereg.provenance import check_identities
from moestack.prereg.runner import check_runs, default_out_dir, is_finished, plan
from moestack.prereg.sources import check_study_code
from moestack.prereg.spec import Prereg, RunSpec, load

log = logging.getLogger(__name__)


class CheckedStudy(NamedTuple):
    """A locked study whose finished runs the lock covers and whose folders hold the runs
    registered there (what ``evaluate`` and ``analyze`` start from)."""

    lock: dict[str, Any]  # ``verify``'s record
    spec: Prereg
    root: Path  # the study folder
    grid: list[RunSpec]  # every registered run
    trained: dict[str, dict[str, Any]]  # finished run -> the lock record it was trained under
    identities: dict[str, dict[str, Any]]  # finished run -> its checked identity record
    code: dict[str, Any]  # the code that trained the finished runs (``sources``)


def checked_study(path: Path | str, out_dir: Path | str | None, jobs: int) -> CheckedStudy:
    """Verify the lock, that it covers every finished run, and each finished run's identity
    (its arm, seed and the weights its final checkpoint holds: ``provenance.check_identity``)
    and the code that trained it (the lock's, where its record names it:
    ``sources.check_run_code``); refused otherwise. ``jobs`` must be 1 or more."""
    if jobs < 1:
        raise MoestackError(f"--jobs {jobs}: give 1 or more processes")
    lock = verify(path)
    spec = load(path)
    root = Path(out_dir) if out_dir else default_out_dir(spec)
    grid = plan(spec, root)
    trained = check_runs(grid, lock)
    identities = check_identities(grid, spec.study)
    code = check_study_code(grid, identities, lock)
    return CheckedStudy(lock, spec, root, grid, trained, identities, code)


def evaluate_in_parallel(path: Path | str, root: Path, jobs: int) -> list[str]:
    """Evaluate the finished, not yet evaluated runs in ``jobs`` processes (fresh
    interpreters: each loads the corpus once), each on every ``jobs``-th run, with
    ``cores // jobs`` threads. Returns the names of the runs evaluated."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(jobs) as pool:
        args = [(str(path), str(root), i, jobs, threads) for i in range(jobs)]
        done = [name for names in pool.starmap(evaluate_shard, args) for name in names]
    log.info("evaluated %d runs in %d processes", len(done), jobs)
    return done


def evaluate_finished(
    path: Path | str, out_dir: Path | str | None = None, *, jobs: int = 1
) -> dict[str, Any]:
    """Check the lock, the study every finished run was trained under and its identity, then
    evaluate the finished runs that have no cached evaluation yet (``jobs`` processes), each
    cached evaluation checked on the way (``cached_evaluation``). Returns counts:
    registered, finished, evaluated now, evaluated in all."""
    _, spec, root, grid, _, _, _ = checked_study(path, out_dir, jobs)
    if jobs > 1:
        now = evaluate_in_parallel(path, root, jobs)
    else:
        now = evaluate_shard(str(path), str(root), 0, 1)
    key = analysis_key(spec)
    finished = [r for r in grid if is_finished(r.run_dir)]
    identities = check_identities(finished, spec.study)  # with the runs finished meanwhile
    names = metric_names(spec.analysis)
    evaluated = [cached_evaluation(r.run_dir, key, identities[r.name], names) for r in finished]
    return {
        "study": spec.study,
        "registered": len(grid),
        "finished": len(finished),
        "evaluated_now": len(now),
        "evaluated": sum(e is not None for e in evaluated),
    }


def render(result: dict[str, Any]) -> str:
    """One line of counts (no metric)."""
    return (
        f"study {result['study']}: evaluated {result['evaluated_now']} run(s) now; "
        f"{result['evaluated']} of {result['finished']} finished runs evaluated "
        f"({result['registered']} registered). No results are shown before the study is "
        "complete: `moestack prereg analyze` reports them then."
    )
