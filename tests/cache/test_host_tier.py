"""The host tier filled ahead: every expert read once, served bit for bit as the safetensors
files hold it, to several caches at once with no further disk read; refused where it would
not fit in the host memory available."""

from __future__ import annotations

import math

import pytest
import safetensors
import torch
from helpers.cache import tiny_model

import moestack.cache.host_tier as host_tier
from moestack.cache import ExpertCache, ExpertStore
from moestack.cache.cache_state import host_tier_of
from moestack.cache.host_tier import HostTier, available_host_bytes, store_bytes
from moestack.errors import MoestackError


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("host") / "store"
    return ExpertStore.write(tiny_model(), path, layout="per_layer")


def _direct(store: ExpertStore, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert read straight from its safetensors file (not through the store)."""
    with safetensors.safe_open(str(store.path / f"layer_{layer:03d}.safetensors"), "pt") as f:
        return f.get_tensor(f"e{e:04d}.w1"), f.get_tensor(f"e{e:04d}.w2")


def test_every_expert_is_held_as_the_files_hold_it(store):
    tier = HostTier.read(store, pin=False, workers=3, progress=False)
    assert tier.nbytes == sum(
        w.nbytes for layer in range(2) for e in range(8) for w in _direct(store, layer, e)
    )
    for layer in range(store.num_layers):
        for e in range(store.num_experts):
            w1, w2 = _direct(store, layer, e)
            held = tier.load(layer, e)
            assert torch.equal(held["w1"], w1) and torch.equal(held["w2"], w2)
            assert (
                held["w1"].untyped_storage().data_ptr() == held["w2"].untyped_storage().data_ptr()
            )
    assert tier.loads == store.num_layers * store.num_experts
    assert tier.num_experts == store.num_experts  # the rest is the store's


def test_caches_over_it_read_nothing_more_from_disk(store, monkeypatch):
    tier = HostTier.read(store, pin=False, progress=False)
    reads = []
    real = ExpertStore.load
    monkeypatch.setattr(
        ExpertStore, "load", lambda self, *a, **k: reads.append(a) or real(self, *a, **k)
    )
    requests = [3, 1, 3, 7, 0, 1, 5, 3, 6, 2]  # a seeded-looking mix with repeats
    for capacity in (2, 4):
        with ExpertCache(tier, capacity, "lru") as cache:
            for e in requests:
                got = cache.get(1, e)
                w1, w2 = _direct(store, 1, e)
                assert torch.equal(got["w1"], w1) and torch.equal(got["w2"], w2)
            assert cache.stats.misses == _lru_misses(requests, capacity)
            assert cache.stats.bytes_read == 0  # and counted so
    assert reads == []  # every miss served from host memory


def _lru_misses(requests: list[int], capacity: int) -> int:
    """Misses of a plain LRU list over ``requests``."""
    held: list[int] = []
    misses = 0
    for e in requests:
        if e in held:
            held.remove(e)
        else:
            misses += 1
            if len(held) == capacity:
                held.pop(0)
        held.append(e)
    return misses


def test_a_tier_larger_than_the_free_memory_is_refused_in_one_line(store, monkeypatch):
    monkeypatch.setattr(host_tier, "available_host_bytes", lambda: 1000)
    with pytest.raises(MoestackError, match=r"take 0\.0 GiB, more than 90% of the 0\.0 GiB") as err:
        HostTier.read(store, pin=False, progress=False)
    assert "\n" not in str(err.value) and str(store.path) in str(err.value)


def test_an_expert_outside_the_store_is_named(store):
    tier = HostTier.read(store, pin=False, progress=False)
    with pytest.raises(MoestackError, match=r"expert 8 of layer 0 is not in the host tier"):
        tier.load(0, 8)


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12345 kB\n")
    assert available_host_bytes(meminfo) == 12345 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_host_bytes(meminfo) is None
    assert available_host_bytes(tmp_path / "absent") is None


def test_pinned_experts_are_counted_as_the_pinned_allocator_takes_them(store):
    """torch's page-locked allocator rounds each block up to a power of two: the check counts
    what it will take (worked here from the experts' sizes)."""
    sizes = [store.entry(layer, e).nbytes for layer in range(2) for e in range(8)]
    rounded = [2 ** math.ceil(math.log2(n)) for n in sizes]
    assert store_bytes(store) == sum(sizes)
    assert store_bytes(store, pinned=True) == sum(rounded) > sum(sizes)


def test_a_tier_filled_on_misses_keeps_each_layers_most_recent_experts(store, monkeypatch):
    """``capacity`` experts per layer, least recently used evicted: which fetches it held
    and which it read from disk are a plain LRU list's, worked per layer here."""
    reads = []
    real = ExpertStore.load
    monkeypatch.setattr(
        ExpertStore, "load", lambda self, *a, **k: reads.append(a) or real(self, *a, **k)
    )
    tier = HostTier(store, capacity=2)
    requests = [(0, 3), (1, 3), (0, 1), (0, 3), (0, 5), (0, 1), (1, 3), (1, 0), (0, 3)]
    held = {0: [], 1: []}  # oldest first
    for layer, e in requests:
        got, hit, nbytes = tier.fetch(layer, e)
        w1, w2 = _direct(store, layer, e)
        assert torch.equal(got["w1"], w1) and torch.equal(got["w2"], w2)
        assert hit == (e in held[layer])
        assert nbytes == (0 if hit else store.expert_bytes)
        if hit:
            held[layer].remove(e)
        elif len(held[layer]) == 2:
            held[layer].pop(0)
        held[layer].append(e)
    # worked by hand: layer 0 goes 3, 1, 3 (hit), 5 (evicts 1), 1 (evicts 3), 3 (evicts 5);
    # layer 1 goes 3, 3 (hit), 0: the fourth and seventh requests hit, the rest read the disk
    assert reads == [r for i, r in enumerate(requests) if i not in (3, 6)]
    assert tier.nbytes == sum(store.entry(layer, e).nbytes for layer in held for e in held[layer])
    assert tier.loads == len(requests)


def test_a_cache_over_a_tier_read_ahead_takes_no_tier_of_its_own(store):
    tier = HostTier.read(store, pin=False, progress=False)
    with ExpertCache(tier, 2, "lru") as cache:
        assert cache.host is tier and cache.store is store
    with ExpertCache(store, 2, "lru", host_capacity=4) as cache:
        assert cache.host is None  # on a CPU device the device tier is host memory


def test_the_tiers_a_cache_reads_through(store):
    """On a CUDA device the cache's own tier holds ``host_capacity`` experts per layer; a
    tier read ahead is taken as it is, and a second tier on top of it refused in one line."""
    tier = HostTier.read(store, pin=False, progress=False)
    assert host_tier_of(tier, 0, on_gpu=True) == (store, tier)
    with pytest.raises(
        ValueError, match=r"^host_capacity=4 with a HostTier .*: give host_capacity=0$"
    ):
        host_tier_of(tier, 4, on_gpu=True)
    got, own = host_tier_of(store, 4, on_gpu=True)
    assert got is store and own is not None and (own.capacity, own.pin) == (4, True)
    assert host_tier_of(store, 4, on_gpu=False) == (store, None)
