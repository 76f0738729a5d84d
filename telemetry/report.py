"""Offline report of a run: matplotlib PNGs and an HTML page, no wandb needed.

``render_report(run_dir)`` reads what a run leaves (``metrics.jsonl``, ``summary.json``,
``telemetry_summary.json``, ``config.yaml``, ``provenance.json``, the routing trace in
``trace/`` or ``trace_dir=``: a resumed run's parts joined in training order, see
``run_trace``) and writes into ``run_dir/report/``:

- charts from the metrics (``report_plots``): ``loss.png`` (cross-entropy and perplexity),
  ``router_losses.png``, ``routing.png``, ``hit_rate.png`` (a panel per capacity),
  ``layer_hit_rate.png``;
- charts from the trace: ``expert_usage.png`` and ``capacity_sweep.png`` + ``sweep.json``;
- ``index.html``: the summary, hit-rate, setup and trace tables (``report_tables``) and the
  charts.

Every chart over training steps marks each step where the run resumed (a dashed line,
"resumed"); the progress bar's total counts the sweep's jobs from the start.

It works for training runs and for ``moestack telemetry`` runs (whose rows are batches of a
text: their charts run along the tokens routed, not training steps).
"""

from __future__ import annotations

import datetime as dt
import html
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moestack.metrics import read_metrics
from moestack.telemetry import report_plots as plots
from moestack.telemetry import report_tables as tables
from moestack.telemetry.report_plots import usage_heatmap_figure
from moestack.telemetry.run_trace import JOINED, RunTrace, find_parts, load_run_trace
from moestack.telemetry.trace import HEADER_FILE

log = logging.getLogger(__name__)

__all__ = ["render_report", "usage_heatmap_figure", "usage_heatmap_rgb"]

METRIC_CHARTS: tuple[Callable[[list[dict[str, Any]]], plots.Chart | None], ...] = (
    plots.loss_chart,
    plots.router_loss_chart,
    plots.routing_chart,
    plots.hit_rate_chart,
    plots.layer_hit_rate_chart,
)


def usage_heatmap_rgb(usage: np.ndarray) -> np.ndarray:
    """The usage heatmap as an RGB uint8 array (for wandb.Image)."""
    fig = usage_heatmap_figure(usage)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _find_trace(run: Path, trace_dir: str | os.PathLike[str] | None) -> RunTrace | None:
    """The run's whole routing trace: every part of ``trace/`` (or ``trace_dir``) joined in
    training order (``run_trace.load_run_trace``); None when there is none."""
    root = Path(trace_dir) if trace_dir is not None else run / "trace"
    if not (root / HEADER_FILE).is_file() and not find_parts(root):
        return None
    return load_run_trace(root)


def _sweep_jobs(trace: Any, policies: Sequence[str]) -> list[tuple[str, int]]:
    """(policy, capacity) pairs of the capacity sweep: 1..E experts (lru+static from 2)."""
    top = max(trace.num_experts)
    return [(p, c) for p in policies for c in range(1, top + 1) if p != "lru+static" or c >= 2]


def _trace_charts(
    found: RunTrace, out: Path, jobs: list[tuple[str, int]], max_accesses: int, bar: Any
) -> tuple[list[tuple[str, str]], tables.Table]:
    """Expert usage and the capacity sweep of the run's trace (also sweep.json): (images,
    table)."""
    from moestack.telemetry.replay import sweep

    trace = found.trace
    usage = np.zeros((trace.num_layers, max(trace.num_experts)), dtype=np.int64)
    for layer in range(trace.num_layers):
        n = trace.num_experts[layer]
        usage[layer, :n] = np.bincount(trace.accesses(layer), minlength=n)[:n]
    usage_heatmap_figure(usage).savefig(out / "expert_usage.png")
    sweep_rows = []
    for policy, capacity in jobs:
        for stats in sweep(trace, [policy], [capacity], max_accesses=max_accesses):
            row = stats.to_dict()
            keys = ("policy", "capacity", "hit_rate", "misses_per_token", "bytes_loaded")
            sweep_rows.append({k: row[k] for k in keys})
        bar.update(1)
    (out / "sweep.json").write_text(json.dumps(sweep_rows, indent=1))
    images = [
        ("expert_usage.png", "Expert usage per layer (share of each layer's requests)"),
        plots.sweep_chart(sweep_rows, len(found.parts)).save(out),
    ]
    return images, tables.trace_table(found)


def _page(run: Path, images: list[tuple[str, str]], parts: list[tables.Table]) -> str:
    """index.html: the tables first (what the run achieved, on what), then the charts."""
    from moestack import __version__

    figures = "".join(
        f'<figure><img src="{html.escape(name)}" alt="{html.escape(cap)}">'
        f"<figcaption>{html.escape(cap)}</figcaption></figure>"
        for name, cap in images
    )
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;"
        "color:#222}h1{font-size:1.5em;margin-bottom:0}.path{color:#666;margin-top:4px}"
        ".tables{display:flex;flex-wrap:wrap;gap:8px 32px;align-items:flex-start}"
        "table{border-collapse:collapse;font-size:.92em}th,td{padding:3px 10px;text-align:left;"
        "border-bottom:1px solid #ddd;white-space:pre-line}td[data-value]{text-align:right;"
        "font-variant-numeric:tabular-nums}th{background:#f3f3f3}.note{color:#777;font-size:.8em;"
        "margin:4px 0}figure{margin:24px 0}img{max-width:100%;border:1px solid #eee}"
        "figcaption{color:#555;font-size:.9em}"
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>moestack report: {html.escape(run.name)}</title><style>{style}</style></head>"
        f"<body><h1>moestack report: {html.escape(run.name)}</h1>"
        f"<p class='path'>{html.escape(str(run.resolve()))} &middot; written {when} by "
        f"moestack {html.escape(__version__)}</p>"
        f"<div class='tables'>{''.join(tables.table_html(t) for t in parts)}</div>"
        f"<section><h2>Charts</h2>{figures or '<p>No metrics or trace to chart.</p>'}</section>"
        "</body></html>"
    )


def _tables(run: Path) -> list[tables.Table]:
    """Summary, hit rates and setup tables of the run's files (those it has)."""
    summary = tables.read_json(run / "summary.json")
    telemetry = tables.read_json(run / "telemetry_summary.json")
    live = telemetry.get("metrics")
    source = "telemetry_summary.json" if isinstance(live, dict) else "summary.json"
    trace_parts = telemetry.get("parts") if isinstance(live, dict) else None
    if isinstance(trace_parts, list) and len(trace_parts) > 1:
        source += f", the run's {len(trace_parts)} trace {JOINED}"
    metrics = live if isinstance(live, dict) else summary.get("metrics")
    found = [
        tables.summary_table(summary),
        tables.hit_rate_table(metrics, source) if isinstance(metrics, dict) else None,
        tables.setup_table(run),
    ]
    return [t for t in found if t is not None]


def render_report(
    run_dir: str | os.PathLike[str],
    *,
    out_dir: str | os.PathLike[str] | None = None,
    trace_dir: str | os.PathLike[str] | None = None,
    policies: Sequence[str] = ("lru", "lfu", "static", "lru+static", "belady"),
    max_accesses: int = 200_000,
    progress: bool = False,
) -> Path:
    """Render PNGs and index.html for ``run_dir``; returns the path of index.html.

    ``max_accesses`` caps the requests per layer replayed for the capacity sweep;
    ``progress`` shows a progress bar (the sweep is the slow part).
    """
    from tqdm.auto import tqdm

    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run_dir={str(run)!r} is not a directory")
    out = Path(out_dir) if out_dir is not None else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = run / "metrics.jsonl"
    rows = read_metrics(metrics_path) if metrics_path.is_file() else []
    if not rows:
        log.warning("%s: no metrics.jsonl rows; the report has only trace charts", run)
    found = _find_trace(run, trace_dir)
    jobs = _sweep_jobs(found.trace, policies) if found is not None else []
    resumed = found.resume_steps if found is not None else []
    images: list[tuple[str, str]] = []
    parts = _tables(run)
    total = len(METRIC_CHARTS) + len(jobs)  # the sweep's jobs counted before the bar starts
    with tqdm(total=total, desc="report", unit="step", disable=not progress) as bar:
        for chart in METRIC_CHARTS:
            drawn = chart(rows) if rows else None
            if drawn is not None:
                if plots.x_axis(rows)[0] == "step":  # training steps: where the run resumed
                    drawn = plots.mark_resumes(drawn, resumed)
                images.append(drawn.save(out))
            bar.update(1)
        if found is not None:
            trace_images, trace_table = _trace_charts(found, out, jobs, max_accesses, bar)
            images += trace_images
            parts.append(trace_table)
    index = out / "index.html"
    index.write_text(_page(run, images, parts), encoding="utf-8")
    log.debug("report written to %s", index)  # the caller says where (moestack report prints it)
    return index
