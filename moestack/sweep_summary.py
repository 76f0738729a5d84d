"""One table comparing a sweep's jobs: overrides, final losses, perplexity and cache hit
rates side by side, printed at the end of ``moestack-train -m`` and written beside the jobs
(``<sweep dir>/sweep_summary.json``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

from moestack import atomic
from moestack.metrics import jsonable

SUMMARY_FILE = "sweep_summary.json"
_HIT_RATE = "/hit_rate"


class SweepJob(NamedTuple):
    """How one job of a sweep ended."""

    num: int  # hydra's job number
    overrides: list[str]  # the job's own overrides
    out_dir: Path  # its run folder
    error: str | None  # why it failed, None when it finished
    summary: dict[str, Any] | None  # the run summary (summary.json) of a finished job


def rows(jobs: list[SweepJob]) -> list[dict[str, Any]]:
    """One row per job; the overrides column shows what sets the jobs apart (the overrides
    every job shares are left out of it)."""
    shared = set.intersection(*(set(job.overrides) for job in jobs)) if len(jobs) > 1 else set()
    return [job_row(job, [o for o in job.overrides if o not in shared]) for job in jobs]


def job_row(job: SweepJob, overrides: list[str]) -> dict[str, Any]:
    """A job's row: the ``overrides`` shown, its headline numbers, and every policy/capacity
    hit rate of its whole trace replayed (telemetry_summary.json, when telemetry was on)."""
    summary = job.summary or {}
    row: dict[str, Any] = {
        "job": job.num,
        "overrides": " ".join(overrides) or "(none)",
        "status": "finished" if job.error is None else "failed",
        "train loss": summary.get("loss/train"),
        "val loss": summary.get("loss/val"),
        "perplexity": summary.get("eval/perplexity"),
    }
    for key, value in _hit_rates(job.out_dir).items():
        row[key] = value
    return row


def _hit_rates(out_dir: Path) -> dict[str, float]:
    """``lru cap4 hit`` -> value, from the job's telemetry summary (none if absent)."""
    try:
        metrics = json.loads((out_dir / "telemetry_summary.json").read_text())["metrics"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    rates = {}
    for key, value in metrics.items():
        parts = key.split("/")  # telemetry/<policy>/cap<k>/hit_rate (layer keys have 5)
        if len(parts) == 4 and key.endswith(_HIT_RATE) and isinstance(value, (int, float)):
            rates[f"{parts[1]} {parts[2]} hit"] = float(value)
    return rates


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table; numbers with 4 digits, missing values as -."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def write(sweep_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """``<sweep_dir>/sweep_summary.json``: the rows (NaN as "nan"), atomically."""
    path = sweep_dir / SUMMARY_FILE
    plain = [{k: jsonable(v) for k, v in row.items()} for row in rows]
    atomic.write_text(path, json.dumps(plain, indent=2) + "\n")
    return path
