"""Charts of a live replay: hit rate vs cache capacity, per-layer hit rate, expert usage.

``capacity_curves(live)`` gives the whole run's hit rate at every capacity 1..E from the
accumulated sums: LRU exactly (from the reuse-distance histogram) and a 'static-oracle'
(the run's most used experts pinned, compulsory misses ignored). ``wandb_charts(live)``
wraps those curves, the per-interval hit rate of each layer and the expert-usage heatmap
in wandb objects for a dashboard (wandb is imported only there).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moestack.telemetry.live import LiveReplay


def capacity_curves(live: LiveReplay) -> dict[str, list[float]]:
    """Hit rate vs capacity 1..E over the run: LRU (exact, from stack distances) and
    'static-oracle' (the run's most used experts pinned, compulsory misses ignored)."""
    width = max(s.num_experts for s in live.routers)
    lru_hits = np.zeros(width)
    static_hits = np.zeros(width)
    total = 0
    for a in live.total:
        if a.reuse is None or a.counts is None:
            continue
        cum = np.cumsum(a.reuse[:-1])
        lru_hits[: cum.size] += cum
        lru_hits[cum.size :] += cum[-1] if cum.size else 0
        top = np.cumsum(np.sort(a.counts)[::-1])
        static_hits[: top.size] += top
        static_hits[top.size :] += top[-1] if top.size else 0
        total += a.requests
    scale = 1.0 / total if total else 0.0
    return {
        "capacity": list(range(1, width + 1)),
        "lru": (lru_hits * scale).tolist(),
        "static-oracle": (static_hits * scale).tolist(),
    }


def wandb_charts(live: LiveReplay) -> dict[str, Any]:
    """wandb objects for a dashboard; pass to ``wandb.log`` (imports wandb lazily)."""
    import wandb

    from moestack.telemetry.report import usage_heatmap_rgb

    curves = capacity_curves(live)
    charts: dict[str, Any] = {
        "telemetry/charts/hit_rate_vs_capacity": wandb.plot.line_series(
            xs=curves["capacity"],
            ys=[curves["lru"], curves["static-oracle"]],
            keys=["lru", "static-oracle"],
            title="Hit rate vs cache capacity (experts per layer)",
            xname="capacity",
        )
    }
    if live.history:
        layers = len(live.routers)
        steps = [h[0] for h in live.history]
        ys = [[h[1][i] for h in live.history] for i in range(layers)]
        name, cap = live.policies[0], live.capacities[0]
        charts["telemetry/charts/layer_hit_rate"] = wandb.plot.line_series(
            xs=steps,
            ys=ys,
            keys=[f"layer{i}" for i in range(layers)],
            title=f"Per-layer hit rate ({name}, capacity {cap})",
            xname="step",
        )
    charts["telemetry/charts/expert_usage"] = wandb.Image(
        usage_heatmap_rgb(live.usage()), caption="expert usage share (layers x experts)"
    )
    return charts
