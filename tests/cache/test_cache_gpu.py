"""The expert cache on a CUDA device (skipped without one): served logits bitwise the
resident model's, LRU hits and misses equal to a plain OrderedDict replay, no host
synchronisation in a layer call, and slots evicted and refilled while a lagging compute
stream still reads them."""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict

import pytest
import torch
from helpers.cache import batches, tiny_cfg

from moestack import MoETransformer
from moestack.cache import ExpertCache, ExpertStore, offloaded
from moestack.evaluation import evaluate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def model(impl: str = "torch", dtype: torch.dtype = torch.float32) -> MoETransformer:
    """tests/helpers/cache.tiny_model with the expert implementation and dtype chosen."""
    cfg = tiny_cfg()
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl=impl))
    torch.manual_seed(0)
    m = MoETransformer(cfg)
    with torch.no_grad():
        for moe in m.moe_layers:
            moe.router.weight.mul_(40.0)
    return m.eval().to(dtype)


@pytest.mark.parametrize(
    ("impl", "dtype"),
    [("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.bfloat16)],
)
@pytest.mark.parametrize(("policy", "prefetch"), [("lru", False), ("lru", True), ("static", True)])
def test_served_logits_equal_the_resident_model(tmp_path, impl, dtype, policy, prefetch):
    tokens = batches(n=1, batch=2)[0][0].to(CUDA)
    with torch.no_grad():
        resident = model(impl, dtype).to(CUDA)
        want_batch = resident(tokens).logits
        want_steps = [resident(tokens[:1, i : i + 1]).logits for i in range(6)]
    store = ExpertStore.write(model(impl, dtype), tmp_path / "store")
    served = model(impl, dtype).to(CUDA)
    pinned = [[0, 1], [2, 3]] if policy == "static" else None
    with (
        ExpertCache(store, 2, policy, device=CUDA, prefetch=prefetch, pinned=pinned) as cache,
        offloaded(served, cache),
        torch.no_grad(),
    ):
        for i, want in enumerate(want_steps):  # one token a call: its experts in slots
            assert torch.equal(served(tokens[:1, i : i + 1]).logits, want), i
        assert torch.equal(served(tokens).logits, want_batch)  # more experts than slots


def test_lru_hits_equal_an_ordered_dict_replay(tmp_path):
    ref = model().to(CUDA)
    data = [(x.to(CUDA), y.to(CUDA)) for x, y in batches()]
    chosen: list[list[int]] = [[], []]
    hooks = [
        moe.router.register_forward_hook(
            lambda mod, args, out, i=i: chosen[i].extend(out.experts.reshape(-1).tolist())
        )
        for i, moe in enumerate(ref.moe_layers)
    ]
    evaluate(ref, data, CUDA)
    for h in hooks:
        h.remove()
    store = ExpertStore.write(model(), tmp_path / "store")
    served = model().to(CUDA)
    with ExpertCache(store, 3, "lru", device=CUDA, record=True, host_capacity=4) as cache:
        with offloaded(served, cache):
            evaluate(served, data, CUDA)
        for layer in range(2):
            lru: OrderedDict[int, None] = OrderedDict()
            expected = []
            for e in chosen[layer]:
                hit = e in lru
                lru[e] = None
                lru.move_to_end(e)
                if len(lru) > 3:
                    lru.popitem(last=False)
                expected.append((e, hit))
            assert cache.access_log(layer) == expected
        stats = cache.stats
    assert stats.misses == sum(not h for layer in range(2) for _, h in cache.access_log(layer))
    assert stats.bytes_to_device == stats.loads * store.expert_bytes


def test_a_layer_call_does_not_synchronise_the_host(tmp_path):
    store = ExpertStore.write(model(), tmp_path / "store")
    with ExpertCache(store, 2, "lru", device=CUDA, host_capacity=8, prefetch=True) as cache:
        for e in range(8):  # fill the host tier and the slot buffer first
            cache.get(0, e)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
        try:
            for requests in ([0, 1], [1, 0], [5, 6], [6, 7, 7], [2, 3]):
                cache.serve(0, requests)  # hits, misses from pinned host memory
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert cache.stats.misses > 0


@pytest.mark.parametrize("prefetch", [False, True])
def test_slots_refilled_while_a_lagging_stream_reads_them(tmp_path, prefetch):
    """Each call's rows are read on a compute stream held back by a sleep kernel while the
    next calls evict and refill slots: every read still sees its own expert's bytes."""
    store = ExpertStore.write(model(), tmp_path / "store")
    expected = {
        (layer, e): torch.cat([t.reshape(-1) for t in store.load(layer, e).values()]).sum()
        for layer in range(2)
        for e in range(8)
    }
    rng = random.Random(3)
    sums, wanted = [], []
    with ExpertCache(store, 2, "lru", device=CUDA, prefetch=prefetch, host_capacity=8) as cache:
        for _ in range(300):
            layer = rng.randrange(2)
            if prefetch and rng.random() < 0.5:
                cache.prefetch(layer, rng.sample(range(8), 2))
            requests = [rng.randrange(8) for _ in range(rng.choice([1, 2, 3, 12]))]
            torch.cuda._sleep(200_000)  # the compute stream lags the host
            served = cache.serve(layer, requests)
            idx = torch.tensor(requests).pin_memory().to(CUDA, non_blocking=True)
            rows = served.lut_E[idx]
            w1 = served.weights["w1"][rows].flatten(1).sum(1)
            w2 = served.weights["w2"][rows].flatten(1).sum(1)
            sums.append(w1 + w2)
            wanted += [expected[layer, e] for e in requests]
    got = torch.cat(sums).cpu()
    assert torch.allclose(got, torch.stack(wanted), rtol=1e-5, atol=1e-5)
