"""The one policy registry: names, checks, default sizes and pins chosen from counts."""

import numpy as np
import pytest

from moestack.cache.policies import (
    ONLINE_POLICIES,
    POLICIES,
    check_policy,
    default_capacities,
    default_capacity,
    policy_from_counts,
)
from moestack.config import CacheConfig, ModelConfig, MoEConfig, TelemetryConfig, TrainConfig


def test_default_sizes_follow_top_k_everywhere():
    for top_k in (1, 2, 3, 8):
        assert default_capacity(top_k) == 2 * top_k
        assert default_capacities(top_k) == (top_k, 2 * top_k)
        moe = MoEConfig(num_experts=16, top_k=top_k)
        cfg = TrainConfig(model=ModelConfig(moe=moe))
        assert cfg.cache.capacity == 2 * top_k
        assert cfg.telemetry.capacities == [top_k, 2 * top_k]
    # A byte budget stands in for the slot count; both at once is refused.
    assert TrainConfig(cache=CacheConfig(capacity_bytes=4096)).cache.capacity == 0
    with pytest.raises(ValueError, match="cache.capacity=4 and cache.capacity_bytes=9"):
        CacheConfig(capacity=4, capacity_bytes=9)


def test_names_are_checked_against_the_registry_naming_the_field():
    assert set(ONLINE_POLICIES) == set(POLICIES) - {"belady"}
    for name in POLICIES:
        assert check_policy(name) == name
    with pytest.raises(ValueError, match=r"telemetry.policies='fifo' is unknown"):
        TelemetryConfig(policies=["lru", "fifo"])
    with pytest.raises(ValueError, match=r"cache.policy='mru' is unknown"):
        CacheConfig(policy="mru")
    with pytest.raises(ValueError, match="belady is offline-only"):
        check_policy("belady", "policy", online=True)


def brute_force_top(counts: np.ndarray, n: int) -> list[int]:
    """Most requested keys first, ties to the smaller key, keys never requested left out."""
    ranked = sorted((-int(c), k) for k, c in enumerate(counts) if c > 0)
    return [k for _, k in ranked[:n]]


@pytest.mark.parametrize("seed", range(5))
def test_pins_chosen_from_counts_are_the_most_requested(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, size=int(rng.integers(3, 12)))  # ties and zeros included
    for capacity in (1, 2, 5):
        static = policy_from_counts("static", capacity, counts)
        assert static.pinned == sorted(brute_force_top(counts, capacity))
        mixed = policy_from_counts("lru+static", capacity, counts)
        assert mixed.num_pinned == capacity // 2
        assert mixed.pinned == sorted(brute_force_top(counts, capacity // 2))
    assert policy_from_counts("lru", 3, counts).resident() == []
    with pytest.raises(ValueError, match="offline-only"):
        policy_from_counts("belady", 3, counts)
