"""The report's figures: hit rate against perplexity (``plot_scatter``), hit rate against
cache capacity (``plot_capacity``) and misses per token against the serving batch
(``plot_batches``), one colour per arm, drawn with matplotlib's Agg canvas (no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestack.prereg.spec import Prereg


def _arm_colors(arms: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {arm: cmap(i % 10) for i, arm in enumerate(arms)}


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _finish_panel(ax: Any, first: bool, xlabel: str, ylabel: str, title: str) -> None:
    """Label one panel; the first of a figure carries the legend (one colour per arm)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if first:
        ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    return path


def _spread_bars(
    mean: Sequence[float], low: Sequence[float], high: Sequence[float]
) -> list[list[float]]:
    """matplotlib's asymmetric ``yerr`` for a min..max bar about each mean, clamped at 0: the
    mean of equal values can round past them (0.1 x 3 / 3)."""
    below = [max(0.0, m - lo) for m, lo in zip(mean, low, strict=True)]
    above = [max(0.0, hi - m) for m, hi in zip(mean, high, strict=True)]
    return [below, above]


def plot_scatter(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Hit rate (each policy) vs validation perplexity: one point per run, one colour per arm."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        return None
    cap = a.scatter_capacity or a.capacities[min(1, len(a.capacities) - 1)]
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(a.policies), 3.8)
    for i, policy in enumerate(a.policies):
        ax = fig.add_subplot(1, len(a.policies), i + 1)
        for arm in spec.arms:
            pts = [r for r in done if r["arm"] == arm]
            if pts:
                ax.scatter(
                    [r["metrics"]["perplexity"] for r in pts],
                    [r["metrics"][f"{policy}/cap{cap}/hit_rate"] for r in pts],
                    color=colors[arm],
                    label=arm,
                    s=36,
                )
        base = [r["metrics"]["perplexity"] for r in done if r["arm"] == spec.baseline]
        if base:
            budget = sum(base) / len(base) * 1.01
            ax.axvline(budget, color="grey", ls="--", lw=1, label="baseline +1% ppl")
        title = f"{policy} cache, {cap} slots/layer"
        _finish_panel(
            ax, i == 0, "validation perplexity", f"{policy} hit rate, capacity {cap}", title
        )
    return _save(fig, out / "hit_rate_vs_perplexity.png")


def plot_capacity(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Hit rate vs capacity per policy: the mean over seeds of each arm, a bar for min..max."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        return None
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(a.policies), 3.8)
    for i, policy in enumerate(a.policies):
        ax = fig.add_subplot(1, len(a.policies), i + 1)
        for arm in spec.arms:
            pts = [r for r in done if r["arm"] == arm]
            if not pts:
                continue
            ys = [[r["metrics"][f"{policy}/cap{c}/hit_rate"] for r in pts] for c in a.capacities]
            mean = [sum(y) / len(y) for y in ys]
            yerr = _spread_bars(mean, [min(y) for y in ys], [max(y) for y in ys])
            ax.errorbar(
                a.capacities, mean, yerr=yerr, color=colors[arm], marker="o", capsize=3, label=arm
            )
        ax.set_xticks(list(a.capacities))
        _finish_panel(ax, i == 0, "cache capacity (experts per layer)", "hit rate", policy)
    return _save(fig, out / "hit_rate_vs_capacity.png")


def batch_curves(
    spec: Prereg, records: Sequence[dict[str, Any]], policy: str = "lru"
) -> dict[int, dict[str, dict[str, list[float]]]]:
    """Misses per token against the serving batch (``analysis.serve_batches``), per capacity
    and arm: {capacity: {arm: {"batch", "mean", "min", "max"}}} over the arm's finished seeds.
    Batch 1 is the one-stream replay (``<policy>/cap<c>/misses_per_token``)."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    batches = sorted(set(a.serve_batches) | {1})

    def metric(cap: int, batch: int) -> str:
        at = f"{policy}/cap{cap}" + (f"/b{batch}" if batch > 1 else "")
        return f"{at}/misses_per_token"

    curves: dict[int, dict[str, dict[str, list[float]]]] = {}
    for cap in a.capacities:
        for arm in spec.arms:
            runs = [r["metrics"] for r in done if r["arm"] == arm]
            runs = [m for m in runs if all(metric(cap, b) in m for b in batches)]
            if not runs:
                continue
            values = [[m[metric(cap, b)] for m in runs] for b in batches]
            curves.setdefault(cap, {})[arm] = {
                "batch": [float(b) for b in batches],
                "mean": [sum(v) / len(v) for v in values],
                "min": [min(v) for v in values],
                "max": [max(v) for v in values],
            }
    return curves


def plot_batches(
    spec: Prereg, records: Sequence[dict[str, Any]], out: Path, policy: str = "lru"
) -> Path | None:
    """Misses per token against the serving batch, a panel per capacity: whether an arm's
    gain at one stream survives batched serving (a batch loads the union of its sequences'
    experts). None when the study replays one stream only or has no finished run."""
    if len(set(spec.analysis.serve_batches) | {1}) < 2 or policy not in spec.analysis.policies:
        return None
    curves = batch_curves(spec, records, policy)
    if not curves:
        return None
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(curves), 3.8)
    for i, (cap, arms) in enumerate(curves.items()):
        ax = fig.add_subplot(1, len(curves), i + 1)
        for arm, c in arms.items():
            yerr = _spread_bars(c["mean"], c["min"], c["max"])
            ax.errorbar(
                c["batch"],
                c["mean"],
                yerr=yerr,
                color=colors[arm],
                marker="o",
                capsize=3,
                label=arm,
            )
        batches = next(iter(arms.values()))["batch"]
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(int(b)) for b in batches])
        title = f"{policy} cache, {cap} slots/layer"
        xlabel = "sequences served together (batch)"
        _finish_panel(ax, i == 0, xlabel, f"{policy} misses per token", title)
    return _save(fig, out / "misses_vs_batch.png")


def plot_all(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> list[str]:
    """Draw every figure of the report into ``out``; the file names of those drawn."""
    drawn = (
        plot_scatter(spec, records, out),
        plot_capacity(spec, records, out),
        plot_batches(spec, records, out),
    )
    return [p.name for p in drawn if p is not None]
