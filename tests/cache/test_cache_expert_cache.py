"""ExpertCache: policy behaviour against hand-written references and the simulator, prefetch
accounting, argument errors, and a multi-threaded stress test against direct reads."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict

import numpy as np
import pytest
import safetensors
import torch
from helpers.cache import tiny_model

from moestack.cache import ExpertCache, ExpertStore
from moestack.telemetry import RoutingTrace, simulate


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "store"
    return ExpertStore.write(tiny_model(), path, layout="per_layer")


def _skewed(n: int, num_experts: int = 8, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_experts + 1) ** 1.2
    return rng.choice(num_experts, size=n, p=p / p.sum()).tolist()


def test_argument_errors(store):
    with pytest.raises(ValueError, match=r"capacity=1 is smaller than top_k=2"):
        ExpertCache(store, 1)
    with pytest.raises(ValueError, match=r"capacity_bytes=7000 \(1 experts"):
        ExpertCache(store, capacity_bytes=7000)
    assert ExpertCache(store, capacity_bytes=3 * store.expert_bytes + 5).capacity == 3
    with pytest.raises(ValueError, match="belady is offline-only"):
        ExpertCache(store, 2, "belady")
    with pytest.raises(ValueError, match="policy='fifo' is unknown"):
        ExpertCache(store, 2, "fifo")
    cache = ExpertCache(store, 2)
    with pytest.raises(ValueError, match="layer=5 out of range"):
        cache.get(5, 0)
    with pytest.raises(ValueError, match="expert=9 out of range"):
        cache.get(0, 9)


def test_lru_matches_ordered_dict_reference(store):
    requests = _skewed(400)
    cache = ExpertCache(store, 3, "lru", record=True)
    ref: OrderedDict[int, None] = OrderedDict()
    expected = []
    for e in requests:
        hit = e in ref
        if hit:
            ref.move_to_end(e)
        else:
            ref[e] = None
            if len(ref) > 3:
                ref.popitem(last=False)
        expected.append((e, hit))
        got = cache.get(1, e)
        assert torch.equal(got["w1"], store.load(1, e)["w1"])
        assert cache.resident(1) == sorted(ref)
    assert cache.access_log(1) == expected
    stats = cache.stats
    assert stats.hits == sum(h for _, h in expected)
    assert stats.misses == stats.loads == len(requests) - stats.hits
    assert stats.bytes_read == stats.loads * store.expert_bytes
    assert stats.stall_s > 0


def test_static_matches_hand_reference(store):
    requests = _skewed(200, seed=3)
    cache = ExpertCache(store, 2, "static", pinned=[[0, 1], [0, 1]], record=True)
    seen: set[int] = set()
    for e in requests:
        cache.get(0, e)
    expected = []
    for e in requests:
        expected.append((e, e in (0, 1) and e in seen))
        if e in (0, 1):
            seen.add(e)
    assert cache.access_log(0) == expected
    assert cache.resident(0) == sorted(seen)


@pytest.mark.parametrize(
    ("policy", "kwargs"),
    [
        ("lru", {}),
        ("lfu", {}),
        ("static", {"warmup": 40}),
        ("lru+static", {"warmup": 40}),
        ("static", {"pinned": [[1, 2, 5], [0, 3, 4]]}),
    ],
)
def test_token_order_replay_equals_simulate(store, policy, kwargs):
    """Requests issued token by token, slot by slot (the cache's own order) give the
    simulator's per-layer hits on the same trace."""
    n, k = 150, 2
    rng = np.random.default_rng(7)
    trace = RoutingTrace(["l0", "l1"], [k, k], [8, 8])
    layers = []
    for layer in range(2):
        first = np.array(_skewed(n, seed=layer))
        second = (first + 1 + rng.integers(0, 7, size=n)) % 8
        layers.append(np.stack([first, second], axis=1))
    trace.append(np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int32), layers)
    warmup = kwargs.get("warmup", 0)
    pinned = kwargs.get("pinned")
    sim = simulate(trace, policy, 3, warmup=warmup, static_experts=pinned, reuse=False)
    cache = ExpertCache(store, 3, policy, pinned=pinned, warmup=warmup, record=True)
    for t in range(n):
        for layer in range(2):
            for slot in range(k):
                cache.get(layer, int(layers[layer][t, slot]))
    for layer in range(2):
        counted = cache.access_log(layer)[warmup:]
        assert sum(h for _, h in counted) == sim.layers[layer].hits
        assert len(counted) - sum(h for _, h in counted) == sim.layers[layer].misses


def test_get_many_dedupes_reads_not_policy(store):
    requests = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    cache = ExpertCache(store, 2, "lru", record=True)
    out = cache.get_many(0, requests)
    assert sorted(out) == [0, 1, 2]
    stats = cache.stats
    assert (stats.hits, stats.misses) == (0, 9)  # LRU with 2 slots on a cycle of 3
    assert stats.loads == 3 and stats.bytes_read == 3 * store.expert_bytes
    assert len(cache.resident(0)) == 2


def test_prefetch_keeps_policy_stats(store):
    requests = _skewed(300, seed=5)
    plain = ExpertCache(store, 2, "lru", record=True)
    with ExpertCache(store, 2, "lru", prefetch=True, record=True) as pre:
        for i, e in enumerate(requests):
            plain.get(0, e)
            if i + 1 < len(requests):
                pre.get(0, e)
                pre.prefetch(0, [requests[i + 1]])  # a perfect predictor
            else:
                pre.get(0, e)
        assert pre.access_log(0) == plain.access_log(0)
        s, p = plain.stats, pre.stats
        assert (s.hits, s.misses) == (p.hits, p.misses)
        assert p.prefetch_hits == p.misses - 1  # every miss but the first was prefetched
        assert p.prefetch_wasted == 0
        assert p.prefetch_issued == p.prefetch_hits
        pre.prefetch(1, [3, 4])
        pre.get_many(1, [3])  # 4 was staged but not requested: wasted
        assert pre.stats.prefetch_wasted == 1


def test_stress_threads_serve_direct_bytes(store):
    """Prefetcher on, four threads of random gets and prefetches: every result equals a
    direct safetensors read, and the counters add up."""
    reference = {}
    for layer in range(2):
        with safetensors.safe_open(str(store.path / f"layer_{layer:03d}.safetensors"), "pt") as f:
            for e in range(8):
                reference[layer, e] = (f.get_tensor(f"e{e:04d}.w1"), f.get_tensor(f"e{e:04d}.w2"))
    errors: list[str] = []
    per_thread = 250
    with ExpertCache(store, 2, "lru", prefetch=True, prefetch_workers=3) as cache:

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(per_thread):
                layer = rng.randrange(2)
                if rng.random() < 0.3:
                    cache.prefetch(layer, rng.sample(range(8), 3))
                e = rng.randrange(8)
                if rng.random() < 0.5:
                    got = cache.get(layer, e)
                else:
                    got = cache.get_many(layer, [e, rng.randrange(8), e])[e]
                w1, w2 = reference[layer, e]
                if not (torch.equal(got["w1"], w1) and torch.equal(got["w2"], w2)):
                    errors.append(f"layer {layer} expert {e}")

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = cache.stats
    assert errors == []
    assert stats.requests > 4 * per_thread
    assert stats.prefetch_issued > 0
    assert stats.prefetch_hits + stats.prefetch_wasted <= stats.prefetch_issued
    for layer in range(2):
        assert len(cache.resident(layer)) <= 2
