"""Cache policies against plain reference implementations written here, access by access."""

from __future__ import annotations

import functools
from collections import OrderedDict

import numpy as np
import pytest

from moestack.cache.policies import (
    BeladyPolicy,
    LFUPolicy,
    LRUPolicy,
    LRUStaticPolicy,
    StaticPolicy,
    make_policy,
    stack_distances,
)


def random_trace(seed: int, n: int = 600, keys: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(keys, 0.5))
    return rng.choice(keys, size=n, p=p).astype(np.int64)


class RefLRU:
    def __init__(self, cap: int) -> None:
        self.cap, self.d = cap, OrderedDict()

    def access(self, k: int) -> tuple[bool, int | None]:
        if k in self.d:
            self.d.move_to_end(k)
            return True, None
        ev = None
        if len(self.d) == self.cap:
            ev = next(iter(self.d))
            del self.d[ev]
        self.d[k] = 1
        return False, ev


class RefLFU:
    """Counts for every key ever seen; evict min (count, last use) among resident keys."""

    def __init__(self, cap: int) -> None:
        self.cap, self.count, self.last, self.res, self.t = cap, {}, {}, set(), 0

    def access(self, k: int) -> tuple[bool, int | None]:
        self.t += 1
        self.count[k] = self.count.get(k, 0) + 1
        if k in self.res:
            self.last[k] = self.t
            return True, None
        ev = None
        if len(self.res) == self.cap:
            ev = min(self.res, key=lambda r: (self.count[r], self.last[r]))
            self.res.remove(ev)
        self.res.add(k)
        self.last[k] = self.t
        return False, ev


class RefPinnedLRU:
    """num_pinned slots pinned (top counts of the warm-up, ties to smaller key) + LRU rest."""

    def __init__(self, cap: int, num_pinned: int, warmup: int, pinned=None) -> None:
        self.lru = RefLRU(cap - num_pinned) if cap > num_pinned else None
        self.num_pinned, self.warmup, self.seen, self.counts = num_pinned, warmup, 0, {}
        self.pinned = set(pinned) if pinned is not None else None
        self.loaded: set[int] = set()

    def _pin(self) -> None:
        order = sorted(self.counts, key=lambda k: (-self.counts[k], k))
        self.pinned = set(order[: self.num_pinned])
        if self.lru is not None:
            for k in list(self.lru.d):
                if k in self.pinned:
                    del self.lru.d[k]
                    self.loaded.add(k)

    def access(self, k: int) -> bool:
        if self.pinned is None:
            hit = self.lru.access(k)[0] if self.lru is not None else False
            self.counts[k] = self.counts.get(k, 0) + 1
            self.seen += 1
            if self.seen >= self.warmup:
                self._pin()
            return hit
        if k in self.pinned:
            hit = k in self.loaded
            self.loaded.add(k)
            return hit
        return self.lru.access(k)[0] if self.lru is not None else False


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap", [1, 2, 3, 5])
def test_lru_matches_reference(seed: int, cap: int) -> None:
    keys = random_trace(seed)
    ref, pol = RefLRU(cap), LRUPolicy(cap)
    for k in keys.tolist():
        assert pol.access(k) == ref.access(k)
        assert pol.resident() == sorted(ref.d)
    # vectorised path, in uneven pieces, from a fresh policy
    ref, pol = RefLRU(cap), LRUPolicy(cap)
    expected = np.array([ref.access(k)[0] for k in keys.tolist()])
    got = np.concatenate([pol.access_many(p) for p in np.split(keys, [5, 77, 300, 301])])
    np.testing.assert_array_equal(got, expected)
    assert pol.recency() == list(ref.d)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap", [1, 3, 5])
def test_lfu_matches_reference(seed: int, cap: int) -> None:
    keys = random_trace(seed + 10, n=2000)
    ref, pol = RefLFU(cap), LFUPolicy(cap)
    for k in keys.tolist():
        assert pol.access(k) == ref.access(k)
    assert pol.resident() == sorted(ref.res)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap", [1, 2, 4])
def test_static_matches_reference(seed: int, cap: int) -> None:
    keys = random_trace(seed + 20)
    ref, pol = RefPinnedLRU(cap, cap, warmup=50), StaticPolicy(cap, warmup=50)
    for k in keys.tolist():
        assert pol.access(k)[0] == ref.access(k)
        assert not pol.contains(k) or k in ref.pinned
    ref, pol = RefPinnedLRU(cap, cap, warmup=50), StaticPolicy(cap, warmup=50)
    expected = np.array([ref.access(k) for k in keys.tolist()])
    got = np.concatenate([pol.access_many(p) for p in np.split(keys, [10, 49, 51, 400])])
    np.testing.assert_array_equal(got, expected)
    assert pol.pinned == sorted(ref.pinned)


def test_static_given_pins_and_repin() -> None:
    pol = StaticPolicy(2, [3, 5])
    assert [pol.access(k) for k in (3, 3, 1, 5, 5)] == [
        (False, None),
        (True, None),
        (False, None),
        (False, None),
        (True, None),
    ]
    assert not pol.contains(1) and pol.resident() == [3, 5]
    assert pol.pin([5, 1]) == [3]
    assert pol.resident() == [5]
    with pytest.raises(ValueError, match="num_pinned"):
        pol.pin([1, 2, 3])
    with pytest.raises(ValueError, match="warmup"):
        StaticPolicy(2)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap,num_pinned", [(2, 1), (4, 2), (5, 3)])
def test_lru_static_matches_reference(seed: int, cap: int, num_pinned: int) -> None:
    keys = random_trace(seed + 30)
    ref = RefPinnedLRU(cap, num_pinned, warmup=40)
    pol = LRUStaticPolicy(cap, num_pinned=num_pinned, warmup=40)
    for k in keys.tolist():
        hit, evicted = pol.access(k)
        assert hit == ref.access(k)
        assert evicted is None or not pol.contains(evicted)
        assert len(pol) <= cap
    ref = RefPinnedLRU(cap, num_pinned, warmup=40)
    pol = LRUStaticPolicy(cap, num_pinned=num_pinned, warmup=40)
    expected = np.array([ref.access(k) for k in keys.tolist()])
    got = np.concatenate([pol.access_many(p) for p in np.split(keys, [7, 39, 41, 200])])
    np.testing.assert_array_equal(got, expected)


def brute_force_min_misses(keys: tuple[int, ...], cap: int) -> int:
    """Exhaustive search over every admission / eviction choice (bypass allowed)."""

    @functools.cache
    def best(t: int, cache: frozenset[int]) -> int:
        if t == len(keys):
            return 0
        k = keys[t]
        if k in cache:
            return best(t + 1, cache)
        options = [best(t + 1, cache)]  # serve without caching
        if len(cache) < cap:
            options.append(best(t + 1, cache | {k}))
        else:
            options += [best(t + 1, (cache - {v}) | {k}) for v in cache]
        return 1 + min(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 5, size=13)
    cap = int(rng.integers(1, 4))
    pol = BeladyPolicy(cap, keys)
    misses = int((~pol.access_many(keys)).sum())
    assert misses == brute_force_min_misses(tuple(keys.tolist()), cap)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cap", [1, 2, 4, 6])
def test_belady_never_beaten(seed: int, cap: int) -> None:
    keys = random_trace(seed + 40, n=1500)
    best = int((~BeladyPolicy(cap, keys).access_many(keys)).sum())
    others = [LRUPolicy(cap), LFUPolicy(cap), StaticPolicy(cap, warmup=100)]
    if cap >= 2:
        others.append(LRUStaticPolicy(cap, warmup=100))
    for pol in others:
        assert best <= int((~pol.access_many(keys)).sum()), pol.name


def test_belady_checks_the_future() -> None:
    pol = BeladyPolicy(2, [1, 2, 3])
    pol.access(1)
    with pytest.raises(ValueError, match="future"):
        pol.access(3)


def test_stack_distances_definition() -> None:
    keys = random_trace(50, n=300)
    dist, _ = stack_distances(keys, np.full(0, -1, dtype=np.int64), 0)
    for i, k in enumerate(keys.tolist()):
        prev = [j for j in range(i) if keys[j] == k]
        if not prev:
            assert dist[i] == -1
        else:
            assert dist[i] == len(set(keys[prev[-1] + 1 : i].tolist()) - {k})


def test_bad_names_and_capacities() -> None:
    with pytest.raises(ValueError, match="unknown"):
        make_policy("fifo", 2)
    with pytest.raises(ValueError, match="capacity"):
        LRUPolicy(0)
    with pytest.raises(ValueError, match="future"):
        make_policy("belady", 2)
