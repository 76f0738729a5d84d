"""The cache policy registry: the one place that names the replacement policies, builds
one by name (pins for the static policies chosen from counts or a warm-up), and sets the
default cache sizes. The expert cache, telemetry's replay and the config checks all use it;
the algorithms themselves are in ``moestack.cache.replacement``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moestack.cache.replacement import (  # noqa: F401  (the algorithms, importable from here)
    BeladyPolicy,
    CachePolicy,
    LFUPolicy,
    LRUPolicy,
    LRUStaticPolicy,
    StaticPolicy,
    next_uses,
    stack_distances,
    top_keys,
)

# The policy registry: every name the cache, telemetry's replay and the configs accept.
POLICIES = ("lru", "lfu", "static", "lru+static", "belady")
# Policies that need the whole request sequence in advance: replay (simulate) only.
OFFLINE_POLICIES = ("belady",)
# Policies a live ExpertCache (and telemetry during training) can run.
ONLINE_POLICIES = tuple(p for p in POLICIES if p not in OFFLINE_POLICIES)


def default_capacity(top_k: int) -> int:
    """The cache size used wherever none is given: 2 x top_k expert slots per layer."""
    return 2 * top_k


def default_capacities(top_k: int) -> tuple[int, int]:
    """The cache sizes telemetry replays when none are given: top_k and 2 x top_k."""
    return (top_k, default_capacity(top_k))


def check_policy(name: str, field: str = "policy", *, online: bool = False) -> str:
    """``name`` if it is a known policy (a live one when ``online``); else a ValueError that
    names ``field``, the value and the choices."""
    choices = ONLINE_POLICIES if online else POLICIES
    if name in choices:
        return name
    extra = (
        f" ({name} is offline-only: use moestack.telemetry.simulate)"
        if name in OFFLINE_POLICIES
        else ""
    )
    raise ValueError(f"{field}={name!r} is unknown; use one of {choices}{extra}")


def make_policy(
    name: str,
    capacity: int,
    *,
    pinned: Sequence[int] | None = None,
    warmup: int = 0,
    num_pinned: int | None = None,
    future: Sequence[int] | np.ndarray | None = None,
) -> CachePolicy:
    """Build a policy by name (one of ``POLICIES``) for one layer's cache."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "lfu":
        return LFUPolicy(capacity)
    if name == "static":
        return StaticPolicy(capacity, pinned, warmup=warmup)
    if name == "lru+static":
        return LRUStaticPolicy(capacity, pinned, num_pinned=num_pinned, warmup=warmup)
    if name == "belady":
        if future is None:
            raise ValueError("policy 'belady' needs future=<the whole request sequence>")
        return BeladyPolicy(capacity, future)
    raise ValueError(f"cache policy {name!r} is unknown; use one of {POLICIES}")


def policy_from_counts(name: str, capacity: int, counts: np.ndarray) -> CachePolicy:
    """An online policy whose pins (static, lru+static) are the most requested keys in
    ``counts`` (requests per key); lru+static pins half its slots, as ``make_policy``."""
    if name == "static":
        return StaticPolicy(capacity, top_keys(counts, capacity))
    if name == "lru+static":
        num_pinned = capacity // 2
        return LRUStaticPolicy(capacity, top_keys(counts, num_pinned), num_pinned=num_pinned)
    return make_policy(check_policy(name, online=True), capacity)
