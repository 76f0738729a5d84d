"""Metric sinks: metrics.jsonl (the source of truth) mirrored to wandb.

Each record is one JSON object per line with a ``step`` and flat ``area/name`` keys. wandb
runs offline unless the user sets WANDB_MODE; any wandb failure is logged once and then
wandb is switched off, so it never stops training.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from moestack import atomic
from moestack.wandb_run import check_wandb_mode, start_wandb

log = logging.getLogger(__name__)


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file; a line that is not a JSON object (a torn last
    line from a crash) is skipped with a warning naming the file and line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: not JSON, skipped", path, number)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def truncate_after(path: Path, step: int) -> None:
    """Drop records logged after ``step`` (a resumed run rewrites them); atomic rewrite."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def latest_values(path: Path | str, up_to: int) -> dict[str, Any]:
    """The latest value of each key over the records of ``path`` up to step ``up_to`` (what
    a run that logged them holds as its last metrics; "nan"/"inf" strings back as floats);
    {} without the file."""
    if not Path(path).exists():
        return {}
    latest: dict[str, Any] = {}
    for record in read_metrics(path):
        if record.get("step", 0) <= up_to:
            latest.update({k: _number(v) for k, v in record.items() if k != "step"})
    return latest


def _number(value: Any) -> Any:
    """``jsonable``'s inverse for the non-finite floats it writes as strings."""
    return float(value) if value in ("nan", "inf", "-inf") else value


class MetricsWriter:
    """Appends records to ``<run>/metrics.jsonl`` and mirrors them to a wandb run."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool = True,
        wandb_project: str = "",
        wandb_mode: str = "",
        wandb_config: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        check_wandb_mode(wandb_mode)
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.wandb_run = None
        if not enabled:
            return
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        self.file = self.path.open("a")
        self.wandb_run = start_wandb(run_dir, wandb_project, wandb_mode, wandb_config or {})

    def log(
        self, step: int, metrics: dict[str, Any], extra_wandb: dict[str, Any] | None = None
    ) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            try:
                self.wandb_run.log({**metrics, **(extra_wandb or {})}, step=step)
            except Exception as err:
                log.warning("wandb logging failed, switching wandb off: %s", err)
                self.wandb_run = None

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as err:
                log.warning("wandb finish failed: %s", err)


def jsonable(value: Any) -> Any:
    """A number JSON can hold: tensors as Python numbers, NaN/inf as strings ("nan")."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` atomically (temp file, then rename); NaN/inf become strings, so the
    file stays valid JSON."""
    atomic.write_text(path, json.dumps(_plain(data), indent=2))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return jsonable(value)


def human_count(n: int) -> str:
    """A count with three significant digits and a suffix (384, 24.8K, 3.45M, 1.20B): never
    0.00M for a few hundred."""
    rounded = float(f"{n:.3g}")  # 999,999 is 1.00M, not 1000K
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(rounded) >= scale:
            return f"{rounded / scale:#.3g}".rstrip(".") + suffix
    return str(int(n))


def format_summary(summary: dict[str, Any]) -> str:
    """A table of the run's headline numbers, with what each one is where it is not plain."""
    eval_s, train_s = summary.get("perf/eval_s"), summary.get("perf/train_s")
    timing = f"training steps only ({train_s:.0f} s); evaluation {eval_s:.0f} s apart"
    rows = [
        ("train loss", f"{summary['loss/train']:.4f}", "mean of the last log interval"),
        ("val loss", f"{summary['loss/val']:.4f}", "final checkpoint, validation split"),
        ("val perplexity", f"{summary['eval/perplexity']:.3f}", "exp(val loss)"),
        ("tokens/s", f"{summary['perf/tokens_per_s']:.0f}", timing if eval_s is not None else ""),
        ("params (total)", human_count(summary["params/total"]), "the whole model, every expert"),
        ("params (active/token)", human_count(summary["params/active"]), "top_k of the experts"),
        ("skipped steps", str(summary["perf/bad_steps"]), "non-finite loss, update skipped"),
    ]
    rows += [
        (f"layer {key.split('/')[1][5:]} imbalance", f"{value:.2f}", "max/mean tokens per expert")
        for key, value in summary.items()
        if key.endswith("/imbalance")
    ]
    width = max(len(name) for name, _, _ in rows)
    values = max(5, *(len(value) for _, value, _ in rows))
    lines = [
        f"{'metric':<{width}}  {'value':<{values}}  note",
        f"{'-' * width}  {'-' * values}  ----",
    ]
    lines += [f"{name:<{width}}  {value:<{values}}  {note}".rstrip() for name, value, note in rows]
    return "\n".join(lines)
