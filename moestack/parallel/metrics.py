"""Expert parallelism's training metrics, from the exchange counters of every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moestack.parallel.dispatch import ExchangeStats


def exchange_metrics(
    stats: ExchangeStats, world_size: int, steps: int, elapsed: float
) -> dict[str, float]:
    """The interval's ``ep/*`` metrics (collective: every rank calls it), then ``stats`` reset.

    ``ep/rank{r}/tokens_sent`` and ``.../tokens_received``: (token, slot) rows per step rank
    r sent to / received from other ranks (forward); ``ep/bytes_per_step``: bytes a rank sent
    to others per step, forward and backward, mean over ranks; ``ep/a2a_share``: the largest
    share of the interval any rank spent inside all-to-alls (wall time: exact on gloo, which
    blocks; on NCCL the time to enqueue); ``ep/load_imbalance``: mean over layers, steps and
    every rank of max / mean rows per EP rank of its group (the straggler's excess; every
    expert-parallel group counted alike, not the logging rank's alone).
    """
    steps = max(steps, 1)
    mine = torch.tensor(
        [
            *(stats.rows_sent, stats.rows_received, stats.bytes_moved, stats.seconds),
            *(stats.load_imbalance_sum, stats.layers),
        ],
        dtype=torch.float64,
    )
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    metrics = {
        "ep/a2a_share": max(float(t[3]) for t in every) / max(elapsed, 1e-9),
        "ep/load_imbalance": sum(float(t[4]) for t in every)
        / max(sum(float(t[5]) for t in every), 1.0),
        "ep/bytes_per_step": sum(float(t[2]) for t in every) / len(every) / steps,
    }
    for rank, t in enumerate(every):
        metrics[f"ep/rank{rank}/tokens_sent"] = float(t[0]) / steps
        metrics[f"ep/rank{rank}/tokens_received"] = float(t[1]) / steps
    stats.reset()
    return metrics
