"""The cache's device tier on the CPU: an expert is one flat buffer moved by one copy, a hit
copies nothing, and what ``serve`` hands a layer (slot views and an expert -> row table)
equals direct reads of the store, for every policy, with prefetch, and when a call needs
more experts than there are free slots."""

from __future__ import annotations

import random

import pytest
import safetensors
import torch
from helpers.cache import tiny_model

import moestack.cache.device_tier as device_tier
from moestack.cache import ExpertCache, ExpertStore
from moestack.cache.device_tier import ExpertLayout, flat_view


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("tier") / "store"
    return ExpertStore.write(tiny_model(), path, layout="per_layer")


@pytest.fixture(scope="module")
def reference(store):
    """Every expert read straight from the safetensors files (not through the store)."""
    out = {}
    for layer in range(2):
        with safetensors.safe_open(str(store.path / f"layer_{layer:03d}.safetensors"), "pt") as f:
            for e in range(8):
                out[layer, e] = (f.get_tensor(f"e{e:04d}.w1"), f.get_tensor(f"e{e:04d}.w2"))
    return out


@pytest.fixture
def copies(monkeypatch):
    """Counts the cache's host-to-device copies (device_tier.copy_expert)."""
    calls: list[int] = []
    real = device_tier.copy_expert

    def counted(dst, src, *, non_blocking):
        calls.append(src.numel())
        real(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(device_tier, "copy_expert", counted)
    return calls


def _served_equal(served, layer, experts, reference) -> bool:
    """Every requested expert's rows of the served views equal the direct read."""
    for e in set(experts):
        row = int(served.lut_E[e])
        w1, w2 = reference[layer, e]
        if not (
            torch.equal(served.weights["w1"][row], w1)
            and torch.equal(served.weights["w2"][row], w2)
        ):
            return False
    return True


def test_store_load_is_one_buffer(store):
    expert = store.load(1, 3)
    flat = flat_view(expert)
    assert flat is not None and flat.numel() == store.expert_bytes
    assert expert["w1"].untyped_storage().data_ptr() == expert["w2"].untyped_storage().data_ptr()
    layout = ExpertLayout.of_entry(store.entry(1, 3))
    assert layout == ExpertLayout.of(expert)
    back = layout.views(flat)
    assert torch.equal(back["w1"], expert["w1"]) and torch.equal(back["w2"], expert["w2"])
    # tensors that are not one buffer are packed: same values, one buffer
    loose = {k: v.clone() for k, v in expert.items()}
    assert flat_view(loose) is None
    packed = layout.views(layout.flat(loose, pin=False))
    assert torch.equal(packed["w1"], expert["w1"]) and torch.equal(packed["w2"], expert["w2"])


def test_one_copy_per_load_and_one_storage(store, reference, copies):
    cache = ExpertCache(store, 3, "lru")
    requests = [0, 1, 2, 0, 3, 4, 0, 1, 5, 5, 2]
    for e in requests:
        got = cache.get(0, e)
        assert got["w1"].untyped_storage().data_ptr() == got["w2"].untyped_storage().data_ptr()
        assert torch.equal(got["w1"], reference[0, e][0]) and torch.equal(
            got["w2"], reference[0, e][1]
        )
    stats = cache.stats
    # a 3-slot LRU on this sequence, worked by hand: misses 0 1 2 - 3 4 - 1 5 - 2
    assert stats.misses == 8 and stats.loads == 8
    assert len(copies) == 8 and all(n == store.expert_bytes for n in copies)
    assert stats.bytes_to_device == 8 * store.expert_bytes


def test_serve_hits_copy_nothing_and_share_one_buffer(store, reference, copies):
    cache = ExpertCache(store, 4, "lru")
    first = cache.serve(1, [2, 5, 2, 7])
    assert len(copies) == 3
    assert _served_equal(first, 1, [2, 5, 7], reference)
    w1, w2 = first.weights["w1"], first.weights["w2"]
    assert w1.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr()  # the slots
    again = cache.serve(1, [7, 5])  # hits: nothing moves, same buffer, same rows
    assert len(copies) == 3
    assert again.weights["w1"].data_ptr() == w1.data_ptr()
    assert int(again.lut_E[7]) == int(first.lut_E[7]) and int(again.lut_E[5]) == int(first.lut_E[5])
    assert _served_equal(again, 1, [7, 5], reference)


@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "lru+static"])
def test_random_calls_serve_direct_bytes(store, reference, copies, policy):
    """Random calls of every size (more experts than free slots included), gets, and
    prefetches (some wasted): every served expert equals the direct read, and every load
    is one copy."""
    rng = random.Random(11)
    kwargs = {"pinned": [[0, 1], [2, 3]]} if policy == "static" else {"warmup": 10}
    with ExpertCache(store, 2, policy, prefetch=True, prefetch_slots=3, **kwargs) as cache:
        for _ in range(150):
            layer = rng.randrange(2)
            if rng.random() < 0.4:
                cache.prefetch(layer, rng.sample(range(8), rng.randrange(1, 5)))
            experts = [rng.randrange(8) for _ in range(rng.choice([1, 2, 4, 16]))]
            if rng.random() < 0.2:
                got = cache.get(layer, experts[0])
                assert torch.equal(got["w1"], reference[layer, experts[0]][0])
                continue
            served = cache.serve(layer, experts)
            assert _served_equal(served, layer, experts, reference)
        stats = cache.stats
    loaded_here = stats.loads - stats.prefetch_hits  # one copy each; a prefetch: at most one
    assert loaded_here <= len(copies) <= loaded_here + stats.prefetch_issued
    assert stats.bytes_to_device == len(copies) * store.expert_bytes
    assert stats.prefetch_hits > 0 and stats.prefetch_wasted > 0
    for layer in range(2):
        assert len(cache.resident(layer)) <= 2


def test_prefetched_expert_is_served_from_its_slot(store, reference, copies):
    with ExpertCache(store, 2, "lru", prefetch=True) as cache:
        assert cache.prefetch(0, [6]) == 1
        cache._layers[0].staged[6].future.result()
        assert len(copies) == 1
        served = cache.serve(0, [6])
        assert len(copies) == 1  # no second copy: the staged slot became the resident one
        assert _served_equal(served, 0, [6], reference)
        stats = cache.stats
        assert (stats.misses, stats.loads, stats.prefetch_hits) == (1, 1, 1)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_offloaded_logits_bitwise_with_each_impl(tmp_path, impl):
    """The layer computes on the strided slot views (every slot's w1 at one stride) through
    either expert implementation (Triton in the interpreter here) and matches the in-memory
    model bit for bit, with every slot in use (capacity 2 of 8, a 16-token batch)."""
    import dataclasses

    from helpers.cache import batches, tiny_cfg

    from moestack import MoETransformer
    from moestack.cache import offloaded

    def model() -> MoETransformer:
        cfg = tiny_cfg()
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl=impl))
        torch.manual_seed(0)
        m = MoETransformer(cfg)
        with torch.no_grad():
            for moe in m.moe_layers:
                moe.router.weight.mul_(40.0)
        return m.eval()

    tokens = batches(n=1, batch=1)[0][0]
    with torch.no_grad():
        ref = model()
        want = ref(tokens).logits
        decode = ref(tokens[:, :1]).logits
    store = ExpertStore.write(model(), tmp_path / "store")
    served = model()
    with ExpertCache(store, 2, "lru") as cache, offloaded(served, cache), torch.no_grad():
        assert torch.equal(served(tokens).logits, want)  # more experts than slots: a buffer
        assert torch.equal(served(tokens[:, :1]).logits, decode)  # one token: the slots


def test_a_failed_load_leaks_no_slot_and_counts_its_requests(store):
    """A read that fails (a transient OSError) is raised to the caller; the call's slots go
    back or to the experts loaded, so later calls of every layer still find room, the
    requests are counted, and a retry serves the expert (from the store, as read directly)."""
    cache = ExpertCache(store, 2, "lru")
    real, failures = store.load, {"left": 0}

    def flaky(*args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError("transient read error")
        return real(*args, **kwargs)

    store.load = flaky
    try:
        requests = 0
        for i in range(5):
            failures["left"] = 1
            pair = [2 * i % 8, (2 * i + 1) % 8]
            with pytest.raises(OSError, match="transient"):
                cache.serve(0, pair)
            requests += 2
            assert cache.stats.hits + cache.stats.misses == requests
            assert cache._slots.held == len(cache._layers[0].slot_of)  # nothing leaked
        served = cache.serve(1, [0, 1])  # the other layer still finds free slots
        served_again = cache.serve(0, [0, 1])  # the failed experts load on retry
    finally:
        store.load = real
    assert torch.equal(served.weights["w1"][int(served.lut_E[1])], store.load(1, 1)["w1"])
    assert torch.equal(
        served_again.weights["w2"][int(served_again.lut_E[1])], store.load(0, 1)["w2"]
    )
