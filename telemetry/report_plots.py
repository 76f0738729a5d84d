"""The charts of ``moestack report``: one question per chart, axes named for what they count.

Each ``*_chart`` takes the metrics.jsonl rows (or a trace's numbers) and returns a ``Chart``
(file name, caption, figure; ``Chart.save`` writes the PNG), or None when the run has nothing
to draw. Quantities of different units
never share an axis: cross-entropy and perplexity are separate panels, router losses have
their own figure, and hit rates get one panel per cache capacity. Layers are summarised as
their mean with a min-max band once there are too many for one line each.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

Rows = list[dict[str, Any]]


class Chart(NamedTuple):
    """A drawn chart: the PNG file it is saved as, its caption, the matplotlib Figure, and
    the steps where it marks that the run resumed."""

    name: str
    caption: str
    figure: Any
    resumed: tuple[int, ...] = ()

    def save(self, out: Path) -> tuple[str, str]:
        self.figure.savefig(out / self.name)
        return self.name, self.caption


HIT = re.compile(r"^telemetry/([^/]+)/cap(\d+)/hit_rate$")
LAYER_HIT = re.compile(r"^telemetry/layer(\d+)/([^/]+)/cap(\d+)/hit_rate$")
MAX_LINES = 8  # layers drawn one line each; more become a mean and a min-max band
POLICY_ORDER = ("lru", "lfu", "static", "lru+static", "belady")  # and their colours, everywhere


def policy_color(policy: str) -> str:
    """The colour of a cache policy, the same in every chart."""
    known = POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER)
    return f"C{known % 10}"


def panels(count: int, width: float = 4.0, height: float = 3.4) -> tuple[Any, list[Any]]:
    """A figure of ``count`` panels: one row up to three, else two rows."""
    cols = count if count <= 3 else math.ceil(count / 2)
    rows = 1 if count <= 3 else 2
    fig = figure(width * cols + 1.0, height * rows + 0.2)
    axes = list(np.atleast_1d(fig.subplots(rows, cols)).ravel())
    for extra in axes[count:]:
        extra.set_visible(False)
    return fig, axes[:count]


def figure(width: float = 7.0, height: float = 4.0) -> Any:
    """A matplotlib Figure on the Agg canvas (no display needed), laid out to fit."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


RESUMED = "resumed"  # the label of a resume mark


def mark_resumes(chart: Chart, steps: Sequence[int]) -> Chart:
    """``chart`` with a dashed vertical line labelled "resumed" at each step where the run
    resumed, on every panel; returns it with ``resumed`` set to the steps drawn."""
    if not steps:
        return chart
    for ax in chart.figure.axes:
        if not ax.get_visible():
            continue
        for step in steps:
            ax.axvline(step, color="0.35", linestyle="--", linewidth=1.0, zorder=0.5)
            ax.text(
                step, 0.98, f" {RESUMED}", transform=ax.get_xaxis_transform(), rotation=90,
                va="top", ha="left", fontsize=7, color="0.35",
            )  # fmt: skip
    return chart._replace(resumed=tuple(int(s) for s in steps))


def x_axis(rows: Rows) -> tuple[str, str]:
    """The key the charts run along and its label: training steps, or the tokens a
    telemetry run has routed (its rows are batches, not steps)."""
    if any("tokens_seen" in row for row in rows):
        return "tokens_seen", "tokens routed"
    return "step", "training step"


def series(rows: Rows, key: str, x_key: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the rows holding a finite number under ``key``."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
            xs.append(float(row.get(x_key, i)))
            ys.append(float(value))
    return np.asarray(xs), np.asarray(ys)


def _finish(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _lines(ax: Any, rows: Rows, keys: dict[str, str], x_key: str) -> bool:
    """One line per key (label: its value); sparse series (evaluations) get markers."""
    drawn = False
    for key, label in keys.items():
        xs, ys = series(rows, key, x_key)
        if xs.size:
            marker = "o" if xs.size <= 12 else None
            ax.plot(xs, ys, label=label, marker=marker, markersize=4)
            drawn = True
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def _layer_band(ax: Any, rows: Rows, pattern: re.Pattern[str], x_key: str, label: str) -> bool:
    """Per-layer series of ``pattern``: a line each, or mean and min-max band past MAX_LINES."""
    keys = sorted({k for r in rows for k in r if pattern.match(k)}, key=_layer_index)
    if not keys:
        return False
    if len(keys) <= MAX_LINES:
        return _lines(ax, rows, {k: f"layer {_layer_index(k)}" for k in keys}, x_key)
    xs = sorted({x for k in keys for x in series(rows, k, x_key)[0]})
    table = np.full((len(keys), len(xs)), np.nan)
    for i, key in enumerate(keys):
        for x, y in zip(*series(rows, key, x_key), strict=True):
            table[i, xs.index(x)] = y
    ax.fill_between(xs, np.nanmin(table, 0), np.nanmax(table, 0), alpha=0.25, label="min-max")
    ax.plot(xs, np.nanmean(table, 0), label=f"{label}, mean of {len(keys)} layers")
    ax.legend(fontsize=8)
    return True


def _layer_index(key: str) -> int:
    match = re.search(r"layer(\d+)", key)
    return int(match.group(1)) if match else -1


def loss_chart(rows: Rows) -> Chart | None:
    """loss.png: cross-entropy and perplexity, train and validation, side by side."""
    x_key, x_label = x_axis(rows)
    fig = figure(10.0, 3.8)
    left, right = fig.subplots(1, 2)
    losses = {"loss/train": "train", "loss/val": "validation", "loss": "text"}
    ppl = {"eval/train_perplexity": "train", "eval/perplexity": "validation", "perplexity": "text"}
    if not _lines(left, rows, losses, x_key):
        return None
    _finish(left, "Cross-entropy", x_label, "nats per token")
    if _lines(right, rows, ppl, x_key):
        right.set_yscale("log")
        _plain_log_ticks(right)
        _finish(right, "Perplexity (log scale)", x_label, "perplexity")
    else:
        right.set_visible(False)
    return Chart("loss.png", "Cross-entropy and perplexity (validation: at each evaluation)", fig)


def _plain_log_ticks(ax: Any) -> None:
    """Log-axis ticks as plain numbers (12, 20, 50), not powers of ten."""
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)


def router_loss_chart(rows: Rows) -> Chart | None:
    """router_losses.png: the weighted total added to the loss, z-loss, load balance."""
    x_key, x_label = x_axis(rows)
    wanted = [
        ("Router losses, weighted (added to the loss)", None, {"loss/aux": "weighted sum"}),
        ("Router z-loss (unweighted)", re.compile(r"^router/layer\d+/z_loss$"), None),
        ("Load-balance loss (unweighted)", re.compile(r"^router/layer\d+/load_balance$"), None),
    ]
    present = [p for p in wanted if _has(rows, p[1], p[2])]
    if not present:
        return None
    fig, axes = panels(len(present))
    for ax, (title, pattern, keys) in zip(axes, present, strict=True):
        if pattern is None:
            _lines(ax, rows, keys or {}, x_key)
        else:
            _layer_band(ax, rows, pattern, x_key, "loss")
        _finish(ax, title, x_label, "loss")
    return Chart(
        "router_losses.png",
        "Router losses: their weighted sum, z-loss and load balance per layer",
        fig,
    )


def _has(rows: Rows, pattern: re.Pattern[str] | None, keys: dict[str, str] | None) -> bool:
    if pattern is not None:
        return any(pattern.match(k) for r in rows for k in r)
    return any(k in r for r in rows for k in keys or {})


def routing_chart(rows: Rows) -> Chart | None:
    """routing.png: switch rate, the two entropies (nats, 0..1), router imbalance."""
    x_key, x_label = x_axis(rows)
    wanted = [
        ("Expert switch rate", {"telemetry/switch_rate": "switch rate"}, "share of experts"),
        ("Routing entropy", {"telemetry/routing_entropy": "per token"}, "nats"),
        (
            "Expert load balance",
            {"telemetry/usage_entropy": "usage entropy / log E"},
            "1 = balanced",
        ),
    ]
    present = [p for p in wanted if _has(rows, None, p[1])]
    imbalance = re.compile(r"^router/layer\d+/imbalance$")
    if not present and not _has(rows, imbalance, None):
        return None
    fig, axes = panels(len(present) + _has(rows, imbalance, None))
    for ax, (title, keys, unit) in zip(axes, present, strict=False):
        _lines(ax, rows, keys, x_key)
        _finish(ax, title, x_label, unit)
    if _has(rows, imbalance, None):
        _layer_band(axes[-1], rows, imbalance, x_key, "imbalance")
        _finish(axes[-1], "Router imbalance", x_label, "max / mean tokens per expert")
    return Chart("routing.png", "Routing locality: expert switches, entropies and imbalance", fig)


def hit_rate_chart(rows: Rows) -> Chart | None:
    """hit_rate.png: one panel per cache capacity, a line per policy."""
    x_key, x_label = x_axis(rows)
    found = list(
        dict.fromkeys((m[1], int(m[2]), k) for r in rows for k in r if (m := HIT.match(k)))
    )
    capacities = sorted({cap for _, cap, _ in found})
    if not capacities:
        return None
    fig = figure(3.8 * len(capacities) + 1.6, 3.8)
    axes = np.atleast_1d(fig.subplots(1, len(capacities), sharey=True))
    for ax, cap in zip(axes, capacities, strict=True):
        for policy, c, key in found:
            if c == cap:
                xs, ys = series(rows, key, x_key)
                ax.plot(xs, ys, label=policy, color=policy_color(policy))
        _finish(ax, f"{cap} experts per layer", x_label, "hit rate" if ax is axes[0] else "")
        ax.set_ylim(0, 1)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8, title="policy")
    caption = "Cache hit rate during the run, per capacity (each interval replayed)"
    return Chart("hit_rate.png", caption, fig)


def layer_hit_rate_chart(rows: Rows) -> Chart | None:
    """layer_hit_rate.png: per-layer hit rate of the first policy at its largest capacity."""
    x_key, x_label = x_axis(rows)
    found = {(m.group(2), int(m.group(3))) for r in rows for k in r if (m := LAYER_HIT.match(k))}
    if not found:
        return None
    first = next(m.group(2) for r in rows for k in r if (m := LAYER_HIT.match(k)))
    cap = max(c for p, c in found if p == first)
    pattern = re.compile(rf"^telemetry/layer\d+/{re.escape(first)}/cap{cap}/hit_rate$")
    fig = figure()
    ax = fig.add_subplot()
    _layer_band(ax, rows, pattern, x_key, "hit rate")
    _finish(ax, f"Hit rate per layer ({first}, {cap} experts per layer)", x_label, "hit rate")
    ax.set_ylim(0, 1)
    return Chart("layer_hit_rate.png", f"Hit rate per layer ({first}, capacity {cap})", fig)


def usage_heatmap_figure(usage: np.ndarray) -> Any:
    """Figure of the expert-usage share per layer (rows: layers, columns: experts)."""
    usage = np.asarray(usage, dtype=np.float64)
    share = usage / np.maximum(usage.sum(axis=1, keepdims=True), 1.0)
    width = max(6.0, 0.3 * usage.shape[1] + 3.0)
    fig = figure(width, max(3.0, 0.35 * usage.shape[0] + 1.8))
    ax = fig.add_subplot()
    image = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(usage.shape[0]))
    if usage.shape[1] <= 32:
        ax.set_xticks(range(usage.shape[1]))
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("Expert usage per layer", fontsize=10)
    fig.colorbar(image, ax=ax, label="share of the layer's requests")
    return fig


def sweep_chart(rows: Sequence[dict[str, Any]], parts: int = 1) -> Chart:
    """capacity_sweep.png: hit rate against cache size for every policy (whole trace; a
    resumed run's ``parts`` joined in training order)."""
    fig = figure()
    ax = fig.add_subplot()
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == name)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=name, color=policy_color(name))
    _finish(
        ax, "Hit rate vs cache size (the whole trace replayed)", "experts per layer", "hit rate"
    )
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, title="policy")
    caption = "Hit rate vs cache size, every policy (trace replay after warm-up)"
    if parts > 1:
        caption += f"; the run's {parts} trace parts joined in training order"
    return Chart("capacity_sweep.png", caption, fig)
