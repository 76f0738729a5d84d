"""LRU's stack distances on many distinct keys (a 128-expert layer) against their definition,
and the vectorised LRU replay against a plain OrderedDict walk, access by access."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from moestack.cache import replacement
from moestack.cache.policies import LRUPolicy, stack_distances


def skewed_trace(seed: int, n: int, keys: int) -> np.ndarray:
    """``n`` requests over ``keys`` keys, a few used often and many rarely (long windows)."""
    rng = np.random.default_rng(seed)
    return rng.choice(keys, size=n, p=rng.dirichlet(np.full(keys, 0.3))).astype(np.int64)


def reference_distances(keys: list[int], before: list[int]) -> list[int]:
    """The definition: distinct other keys since the key's previous request (``before``: the
    keys requested earlier, oldest first), -1 for a first request."""
    seq = before + keys
    out = []
    for i in range(len(before), len(seq)):
        prev = [j for j in range(i) if seq[j] == seq[i]]
        out.append(len(set(seq[prev[-1] + 1 : i]) - {seq[i]}) if prev else -1)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_keys", [65, 128, 300])
def test_stack_distances_many_keys(seed: int, num_keys: int) -> None:
    keys = skewed_trace(seed, 700, num_keys)
    before = [int(k) for k in np.random.default_rng(seed + 9).permutation(num_keys)[:40]]
    last = np.full(num_keys, -1, dtype=np.int64)
    last[before] = np.arange(len(before)) * 3  # ticks before the chunk, oldest first
    dist, state = stack_distances(keys, last, 1000)
    assert dist.tolist() == reference_distances(keys.tolist(), before)
    expected = last.copy()
    for i, k in enumerate(keys.tolist()):
        expected[k] = 1000 + i
    np.testing.assert_array_equal(state, expected)


def test_stack_distances_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """An input longer than one sparse table is taken in pieces with the same result."""
    keys = skewed_trace(7, 3000, 128)
    whole, state = stack_distances(keys, np.full(0, -1, dtype=np.int64), 0)
    monkeypatch.setattr(replacement, "_TABLE_WORDS", 64 * 40)  # pieces of 4096 requests
    long_keys = np.concatenate([keys, keys[::-1], keys])
    pieces, piece_state = stack_distances(long_keys, np.full(0, -1, dtype=np.int64), 0)
    monkeypatch.undo()
    ref, ref_state = stack_distances(long_keys, np.full(0, -1, dtype=np.int64), 0)
    np.testing.assert_array_equal(pieces, ref)
    np.testing.assert_array_equal(piece_state, ref_state)
    np.testing.assert_array_equal(pieces[: keys.size], whole)
    assert reference_distances(keys[:400].tolist(), []) == whole[:400].tolist()


@pytest.mark.parametrize("cap", [1, 8, 16, 100])
def test_lru_many_keys_matches_dict_walk(cap: int) -> None:
    keys = skewed_trace(cap, 4000, 128)
    ref: OrderedDict[int, None] = OrderedDict()
    expected = []
    for k in keys.tolist():
        hit = k in ref
        expected.append(hit)
        if hit:
            ref.move_to_end(k)
        else:
            if len(ref) == cap:
                ref.popitem(last=False)
            ref[k] = None
    pol = LRUPolicy(cap)
    got = np.concatenate([pol.access_many(p) for p in np.split(keys, [300, 301, 2000, 2900])])
    np.testing.assert_array_equal(got, np.array(expected))
    assert pol.recency() == list(ref)


def test_lru_replays_a_128_expert_layer_vectorised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer of 128 experts no longer walks its requests one by one in Python (the walk
    cost 1 s of the 3.07M-request trace's replay)."""

    def walk(self: LRUPolicy, key: int) -> tuple[bool, int | None]:
        raise AssertionError("access_many walked the requests one at a time")

    keys = skewed_trace(3, 5000, 128)
    expected = LRUPolicy(8).access_many(keys[:200])  # below _VECTOR_MIN: the walk
    monkeypatch.setattr(LRUPolicy, "access", walk)
    hits = LRUPolicy(8).access_many(keys)
    np.testing.assert_array_equal(hits[:200], expected)


@pytest.mark.parametrize("cap", [1, 8, 100])
def test_lfu_lazy_heap_matches_its_definition(cap: int) -> None:
    """LFU's hits leave their heap entry stale (a lower bound); the victims, chosen with the
    entries renewed, are still the resident key of fewest requests, then least recent,
    whether the requests come one by one or in pieces."""
    from moestack.cache.policies import LFUPolicy

    keys = skewed_trace(cap + 1, 3000, 128)
    counts: dict[int, int] = {}
    last: dict[int, int] = {}
    resident: set[int] = set()
    pol = LFUPolicy(cap)
    pieces = np.split(keys, [400, 401, 1700])
    for n, piece in enumerate(pieces):
        got = pol.access_many(piece) if n % 2 else None
        for i, k in enumerate(piece.tolist()):
            t = len(last) and max(last.values()) + 1
            counts[k] = counts.get(k, 0) + 1
            hit, evicted = k in resident, None
            if not hit and len(resident) == cap:
                evicted = min(resident, key=lambda r: (counts[r], last[r]))
                resident.remove(evicted)
            resident.add(k)
            last[k] = t
            if got is None:
                assert pol.access(k) == (hit, evicted)
            else:
                assert bool(got[i]) == hit
        assert pol.resident() == sorted(resident)
