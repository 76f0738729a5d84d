"""Offline report of a run: matplotlib PNGs and a small HTML page, no wandb needed.

``render_report(run_dir)`` reads ``run_dir/metrics.jsonl`` (one JSON object per line, flat
keys, a ``"step"`` key) and, when present, the routing trace in ``run_dir/trace`` (or
``trace_dir=``), and writes into ``run_dir/report/``: ``loss.png``, ``hit_rate.png``,
``layer_hit_rate.png``, ``routing.png`` (from the metrics), ``expert_usage.png`` and
``capacity_sweep.png`` + ``sweep.json`` (from the trace), and ``index.html`` showing them.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moestack.metrics import read_metrics

log = logging.getLogger(__name__)

_HIT = re.compile(r"^telemetry/([^/]+)/cap(\d+)/hit_rate$")
_LAYER_HIT = re.compile(r"^telemetry/layer(\d+)/([^/]+)/cap(\d+)/hit_rate$")
_LOSS = re.compile(r"(loss|perplexity|ppl)", re.I)


def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(float(row.get("step", i)))
            ys.append(float(value))
    return xs, ys


def _line_plot(
    rows: list[dict[str, Any]],
    keys: Sequence[str],
    labels: Sequence[str],
    title: str,
    ylabel: str,
    out: Path,
) -> bool:
    fig = _figure()
    ax = fig.add_subplot()
    drawn = False
    for key, label in zip(keys, labels, strict=True):
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, label=label)
            drawn = True
    if not drawn:
        return False
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    return True


def usage_heatmap_figure(usage: np.ndarray) -> Any:
    """Figure of the expert-usage share per layer (rows: layers, columns: experts)."""
    usage = np.asarray(usage, dtype=np.float64)
    share = usage / np.maximum(usage.sum(axis=1, keepdims=True), 1.0)
    fig = _figure(max(4.0, 0.25 * usage.shape[1] + 2.0), max(2.5, 0.35 * usage.shape[0] + 1.5))
    ax = fig.add_subplot()
    image = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(usage.shape[0]))
    if usage.shape[1] <= 32:
        ax.set_xticks(range(usage.shape[1]))
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("Expert usage (share of the layer's requests)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig


def usage_heatmap_rgb(usage: np.ndarray) -> np.ndarray:
    """The usage heatmap as an RGB uint8 array (for wandb.Image)."""
    fig = usage_heatmap_figure(usage)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _sweep_plot(rows: list[dict[str, Any]], out: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_title("Hit rate vs cache capacity (replayed trace)")
    ax.set_xlabel("capacity (experts per layer)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def _metric_plots(
    rows: list[dict[str, Any]], out: Path
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Plots of the metrics.jsonl rows: (images as (file, caption), table of last values)."""
    images: list[tuple[str, str]] = []
    table: list[tuple[str, str]] = []
    keys = list(dict.fromkeys(k for r in rows for k in r))
    loss_keys = [k for k in keys if _LOSS.search(k) and not k.startswith("telemetry/")][:8]
    if loss_keys and _line_plot(rows, loss_keys, loss_keys, "Loss", "value", out / "loss.png"):
        images.append(("loss.png", "Loss and perplexity"))
    hit_keys = [k for k in keys if _HIT.match(k)]
    if hit_keys and _line_plot(
        rows,
        hit_keys,
        [k.split("/", 1)[1] for k in hit_keys],
        "Hit rate",
        "hit rate",
        out / "hit_rate.png",
    ):
        images.append(("hit_rate.png", "Cache hit rate per policy and capacity"))
    layer_keys = [k for k in keys if _LAYER_HIT.match(k)]
    if layer_keys:
        m = _LAYER_HIT.match(layer_keys[0])
        assert m is not None
        chosen = [k for k in layer_keys if k.endswith(f"/{m.group(2)}/cap{m.group(3)}/hit_rate")]
        labels = [k.split("/")[1] for k in chosen]
        title = f"Per-layer hit rate ({m.group(2)}, capacity {m.group(3)})"
        if _line_plot(rows, chosen, labels, title, "hit rate", out / "layer_hit_rate.png"):
            images.append(("layer_hit_rate.png", title))
    route_keys = [
        k
        for k in ("telemetry/switch_rate", "telemetry/routing_entropy", "telemetry/usage_entropy")
        if k in keys
    ]
    if route_keys and _line_plot(
        rows,
        route_keys,
        [k.split("/")[1] for k in route_keys],
        "Routing locality",
        "value",
        out / "routing.png",
    ):
        images.append(("routing.png", "Switch rate, routing entropy (nats), usage entropy"))
    if rows:
        last = rows[-1]
        for k in [*loss_keys, *hit_keys, *route_keys]:
            if isinstance(last.get(k), (int, float)):
                table.append((k, f"{last[k]:.4g}"))
    return images, table


def _find_trace(run: Path, trace_dir: str | os.PathLike[str] | None) -> Path | None:
    """The trace directory of a run (resumed runs: trace/<part>/, the last); None if none."""
    from moestack.telemetry.trace import HEADER_FILE

    trace_path = Path(trace_dir) if trace_dir is not None else run / "trace"
    if not (trace_path / HEADER_FILE).is_file():
        parts = sorted(p.parent for p in trace_path.glob(f"*/{HEADER_FILE}"))
        while len(parts) > 1 and _holds_no_tokens(parts[-1]):
            log.warning("%s holds no tokens (stopped before its first flush); skipped", parts[-1])
            parts.pop()
        trace_path = parts[-1] if parts else trace_path
    return trace_path if (trace_path / HEADER_FILE).is_file() else None


def _holds_no_tokens(trace_path: Path) -> bool:
    """Whether a trace part's header says it holds no tokens (a bad header: False, so that
    loading it reports what is wrong)."""
    from moestack.telemetry.trace import HEADER_FILE

    try:
        header = json.loads((trace_path / HEADER_FILE).read_text())
        return isinstance(header, dict) and header.get("num_tokens") == 0
    except (OSError, ValueError):
        return False


def _trace_plots(
    trace_path: Path, out: Path, policies: Sequence[str], max_accesses: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Expert usage and the capacity sweep of a trace (also sweep.json): (images, table)."""
    from moestack.telemetry.replay import sweep
    from moestack.telemetry.trace import RoutingTrace

    trace = RoutingTrace.load(trace_path)
    usage = np.zeros((trace.num_layers, max(trace.num_experts)), dtype=np.int64)
    for layer in range(trace.num_layers):
        req = trace.accesses(layer)
        usage[layer, : trace.num_experts[layer]] = np.bincount(
            req, minlength=trace.num_experts[layer]
        )[: trace.num_experts[layer]]
    usage_heatmap_figure(usage).savefig(out / "expert_usage.png")
    results = sweep(trace, policies, max_accesses=max_accesses)
    sweep_rows = [
        {
            k: r.to_dict()[k]
            for k in ("policy", "capacity", "hit_rate", "misses_per_token", "bytes_loaded")
        }
        for r in results
    ]
    (out / "sweep.json").write_text(json.dumps(sweep_rows, indent=1))
    _sweep_plot(sweep_rows, out / "capacity_sweep.png")
    images = [
        ("expert_usage.png", "Expert usage (layers x experts)"),
        ("capacity_sweep.png", "Hit rate vs capacity, every policy (trace replay)"),
    ]
    return images, [("trace tokens", str(trace.num_tokens))]


def _index_page(run: Path, images: list[tuple[str, str]], table: list[tuple[str, str]]) -> str:
    """index.html: the table, the images and run_dir/summary.json when there is one."""
    summary_path = run / "summary.json"
    summary_html = ""
    if summary_path.is_file():
        summary_html = (
            f"<h2>summary.json</h2><pre>{html.escape(summary_path.read_text()[:20000])}</pre>"
        )
    body = "".join(
        f'<figure><img src="{name}" alt="{html.escape(cap)}"><figcaption>{html.escape(cap)}'
        "</figcaption></figure>"
        for name, cap in images
    )
    rows_html = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in table
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>moestack report: {html.escape(run.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:960px;margin:auto}"
        "img{max-width:100%}td{padding:2px 12px}</style></head><body>"
        f"<h1>moestack report: {html.escape(str(run))}</h1>"
        f"<table>{rows_html}</table>{body}{summary_html}</body></html>"
    )


def render_report(
    run_dir: str | os.PathLike[str],
    *,
    out_dir: str | os.PathLike[str] | None = None,
    trace_dir: str | os.PathLike[str] | None = None,
    policies: Sequence[str] = ("lru", "lfu", "static", "lru+static", "belady"),
    max_accesses: int = 200_000,
) -> Path:
    """Render PNGs and index.html for ``run_dir``; returns the path of index.html.

    ``max_accesses`` caps the requests per layer replayed for the capacity sweep.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run_dir={str(run)!r} is not a directory")
    out = Path(out_dir) if out_dir is not None else run / "report"
    out.mkdir(parents=True, exist_ok=True)

    metrics_path = run / "metrics.jsonl"
    rows = read_metrics(metrics_path) if metrics_path.is_file() else []
    if not rows:
        log.warning("%s: no metrics.jsonl rows; the report has only trace plots", run)
    images, table = _metric_plots(rows, out)
    trace_path = _find_trace(run, trace_dir)
    if trace_path is not None:
        trace_images, trace_table = _trace_plots(trace_path, out, policies, max_accesses)
        images += trace_images
        table += trace_table

    index = out / "index.html"
    index.write_text(_index_page(run, images, table), encoding="utf-8")
    log.info("report written to %s", index)
    return index
