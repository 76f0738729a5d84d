"""Where a study stands: how many runs are finished, running, interrupted or waiting, per
arm, the time the rest should take, and how many finished runs are evaluated already. No
metric of any run is shown: a study is analysed once, when every registered run is done
(looking at interim numbers is optional stopping).
"""

from __future__ import annotations

import datetime as dt
import statistics
from pathlib import Path
from typing import Any

from moestack import checkpoint
from moestack.errors import MoestackError
from moestack.prereg.analysis import analysis_key, cached_evaluation
from moestack.prereg.provenance import IDENTITY, read_run_record
from moestack.prereg.runner import claimed, default_out_dir, is_finished, plan
from moestack.prereg.spec import load

STATES = ("finished", "running", "interrupted", "waiting")


def _state(run_dir: Path) -> str:
    if is_finished(run_dir):
        return "finished"
    if claimed(run_dir):
        return "running"
    if checkpoint.latest_checkpoint(run_dir / "checkpoints") is not None:
        return "interrupted"
    return "waiting"


def _wall_s(run_dir: Path) -> float | None:
    """Start to finish of a finished run, from its run record (None if unknown; a resumed
    run's includes the time it stood still, so the estimate errs long)."""
    try:
        record = read_run_record(run_dir) or {}
        start = dt.datetime.fromisoformat(record["started_at"])
        end = dt.datetime.fromisoformat(record["finished_at"])
    except (KeyError, TypeError, ValueError, MoestackError):  # no, or a malformed, record
        return None
    return (end - start).total_seconds()


def _cached(run_dir: Path, key: str) -> dict[str, Any] | None:
    """The run's cached evaluation; None also when it does not check (no identity record, an
    edited file): counted as not evaluated here, ``evaluate`` and ``analyze`` name why."""
    try:
        record = read_run_record(run_dir)
        if record is None or any(k not in record for k in IDENTITY):
            return None
        return cached_evaluation(run_dir, key, record)
    except MoestackError:
        return None


def status(path: Path | str, out_dir: Path | str | None = None) -> dict[str, Any]:
    """Counts of runs by state, per arm and in all, and the median wall time of a finished
    run with the time the rest should take at the present number of runners."""
    spec = load(path)
    runs = plan(spec, out_dir)
    arms: dict[str, dict[str, int]] = {arm: dict.fromkeys(STATES, 0) for arm in spec.arms}
    total = dict.fromkeys(STATES, 0)
    walls = []
    key, evaluated, eval_cpu = analysis_key(spec), 0, []
    for item in runs:
        state = _state(item.run_dir)
        arms[item.arm][state] += 1
        total[state] += 1
        if state != "finished":
            continue
        if (wall := _wall_s(item.run_dir)) is not None:
            walls.append(wall)
        # its evaluation exists (``prereg evaluate``); none is shown
        cached = _cached(item.run_dir, key)
        evaluated += cached is not None
        if cached is not None and isinstance(cached.get("eval_cpu_s"), (int, float)):
            eval_cpu.append(float(cached["eval_cpu_s"]))
    median = statistics.median(walls) if walls else None
    left = total["running"] + total["interrupted"] + total["waiting"]
    runners = max(total["running"], 1)
    eta = None if median is None else left * median / runners
    return {
        "study": spec.study,
        "folder": str(Path(out_dir) if out_dir else default_out_dir(spec)),  # the runs read
        "runs": len(runs),
        "arms": arms,
        "total": total,
        "median_run_s": median,
        "runners": total["running"],
        "eta_s": eta,
        "evaluated": evaluated,
        # core-seconds the evaluations left should take (None: none timed yet)
        "eval_left_cpu_s": (len(runs) - evaluated) * statistics.median(eval_cpu)
        if eval_cpu
        else None,
    }


def render(result: dict[str, Any]) -> str:
    """The status as a table, one line per arm."""
    lines = [f"study {result['study']}: {result['total']['finished']} of {result['runs']} runs "
             f"finished in {result['folder']} (no results are shown before the study is "
             "complete)"]  # fmt: skip
    lines.append(f"  {'arm':<16}" + "".join(f"{s:>12}" for s in STATES))
    for arm, counts in [*result["arms"].items(), ("all", result["total"])]:
        lines.append(f"  {arm:<16}" + "".join(f"{counts[s]:>12}" for s in STATES))
    if result["median_run_s"] is not None:
        eta_h = result["eta_s"] / 3600
        lines.append(
            f"  a run takes {result['median_run_s']:.0f} s (median); the rest about "
            f"{eta_h:.1f} h with {max(result['runners'], 1)} runner(s)"
        )
    line = (
        f"  evaluated ahead of the analysis: {result['evaluated']} of "
        f"{result['total']['finished']} finished runs (`moestack prereg evaluate`)"
    )
    if result.get("eval_left_cpu_s") is not None:
        line += f"; the other evaluations about {result['eval_left_cpu_s'] / 60:.0f} core-minutes"
    lines.append(line)
    return "\n".join(lines)
