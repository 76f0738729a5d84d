"""``exchange_metrics``: the interval's ep/* figures from every rank's counters, worked by hand
(the all-gather replaced by the counters of four ranks in two expert-parallel groups)."""

from __future__ import annotations

import pytest
import torch

from moestack.parallel import metrics as ep_metrics
from moestack.parallel.dispatch import ExchangeStats


def group_stats(rows_per_rank: list[list[int]], sent: int, seconds: float) -> ExchangeStats:
    stats = ExchangeStats(rows_sent=sent, rows_received=sent + 1, bytes_moved=8 * sent)
    stats.seconds = seconds
    for rows in rows_per_rank:
        stats.add_layer(rows)
    return stats


def test_load_imbalance_counts_every_group_and_the_rest_by_hand(monkeypatch):
    # ranks 0, 1: group A, two layers seen with rows [3, 1] and [2, 2]: max/mean 1.5 and 1.0
    # ranks 2, 3: group B, two layers with rows [4, 0] and [1, 3]: 2.0 and 1.5
    a = [[3, 1], [2, 2]]
    b = [[4, 0], [1, 3]]
    ranks = [group_stats(a, 10, 0.2), group_stats(a, 12, 0.1), group_stats(b, 4, 0.4),
             group_stats(b, 6, 0.3)]  # fmt: skip
    gathered = [
        torch.tensor(
            [
                s.rows_sent,
                s.rows_received,
                s.bytes_moved,
                s.seconds,
                s.load_imbalance_sum,
                s.layers,
            ],
            dtype=torch.float64,
        )  # fmt: skip
        for s in ranks
    ]

    def all_gather(out, mine):
        assert torch.equal(mine, gathered[0])  # this process is rank 0
        for slot, value in zip(out, gathered, strict=True):
            slot.copy_(value)

    monkeypatch.setattr(ep_metrics.dist, "all_gather", all_gather)
    got = ep_metrics.exchange_metrics(ranks[0], world_size=4, steps=2, elapsed=0.8)
    # mean over every rank's layers: (2 x (1.5 + 1.0) + 2 x (2.0 + 1.5)) / 8 = 1.5
    assert got["ep/load_imbalance"] == pytest.approx(1.5)
    assert got["ep/a2a_share"] == pytest.approx(0.4 / 0.8)
    assert got["ep/bytes_per_step"] == pytest.approx((80 + 96 + 32 + 48) / 4 / 2)
    assert got["ep/rank2/tokens_sent"] == pytest.approx(4 / 2)
    assert got["ep/rank3/tokens_received"] == pytest.approx(7 / 2)
    assert ranks[0].layers == 0 and ranks[0].rows_sent == 0  # reset for the next interval
