"""Offloaded evaluation and generation: bitwise the in-memory model's results, and the
simulator's hit rate on the trace telemetry records from the same run."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from helpers.cache import batches, tiny_model

from moestack.cache import (
    ExpertCache,
    ExpertStore,
    evaluate_offloaded,
    generate_offloaded,
    offloaded,
    restore_experts,
)
from moestack.config import CacheConfig
from moestack.errors import MoestackError
from moestack.evaluation import evaluate
from moestack.telemetry import attach, simulate

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model()
    data = batches()
    reference = evaluate(model, data, CPU)
    with torch.no_grad():
        logits = model(data[0][0]).logits
    store = ExpertStore.write(model, tmp_path_factory.mktemp("offload") / "store")
    return store, data, reference, logits


@pytest.mark.parametrize(
    ("policy", "capacity", "prefetch", "kwargs"),
    [
        ("lru", 2, False, {}),
        ("lru", 3, True, {}),
        ("lfu", 4, False, {}),
        ("static", 3, True, {"pinned": [[0, 2, 5], [1, 3, 7]]}),
        ("lru+static", 4, False, {"pinned": [[0, 1], [2, 3]]}),
    ],
)
def test_perplexity_exact_and_hit_rate_equals_simulate(setup, policy, capacity, prefetch, kwargs):
    store, data, reference, _ = setup
    model = tiny_model()  # fresh weights, same values; released by evaluate_offloaded
    with attach(model, policies=("lru",), capacities=(2,), entropy=False) as tel:
        cache_cfg = CacheConfig(policy=policy, capacity=capacity, prefetch=prefetch)
        result = evaluate_offloaded(model, store, data, CPU, cache_cfg, **kwargs)
        trace = tel.trace
    assert result["loss/val"] == reference["loss/val"]  # exact, not approximate
    assert result["eval/perplexity"] == reference["eval/perplexity"]
    for moe in model.moe_layers:  # the in-memory expert weights were really gone
        assert moe.w1.device.type == "meta" and moe.w2.device.type == "meta"
        assert "experts" not in moe.__dict__  # patch removed on exit
    sim = simulate(
        trace, policy, capacity, warmup=0, static_experts=kwargs.get("pinned"), reuse=False
    )
    assert result["cache/hits"] == sim.hits
    assert result["cache/misses"] == sim.misses
    assert result["cache/hit_rate"] == pytest.approx(sim.hit_rate, abs=0)
    if prefetch:
        assert result["cache/prefetch_issued"] > 0


def test_logits_bitwise_and_restore(setup):
    store, data, _, logits = setup
    model = tiny_model()
    cache = ExpertCache(store, 2, "lru")

    with offloaded(model, cache), torch.no_grad():
        got = model(data[0][0]).logits
    assert torch.equal(got, logits)
    # meta weights can't be used
    with pytest.raises((NotImplementedError, RuntimeError)), torch.no_grad():
        model(data[0][0])
    restore_experts(model, store, CPU)
    with torch.no_grad():
        assert torch.equal(model(data[0][0]).logits, logits)


def test_hit_sequence_matches_ordered_dict_lru(setup):
    """The cache's (expert, hit) log equals a hand-written LRU fed with the routers' choices
    in token order (recorded independently with a forward hook on the in-memory model)."""
    store, data, _, _ = setup
    ref_model = tiny_model()
    chosen: list[list[int]] = [[], []]
    hooks = [
        moe.router.register_forward_hook(
            lambda mod, args, out, i=i: chosen[i].extend(out.experts.reshape(-1).tolist())
        )
        for i, moe in enumerate(ref_model.moe_layers)
    ]
    evaluate(ref_model, data, CPU)
    for h in hooks:
        h.remove()
    cache = ExpertCache(store, 3, "lru", record=True)
    evaluate_offloaded(tiny_model(), cache, data, CPU)
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


def test_generate_matches_in_memory(setup):
    store, _, _, _ = setup
    ref = tiny_model()
    prompt = [5, 17, 99, 3]
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(6):
            nxt = ref(tokens).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
    out = generate_offloaded(
        tiny_model(), store, prompt, 6, CPU, CacheConfig(capacity=2, prefetch=True)
    )
    assert out["tokens"] == tokens[0, len(prompt) :].tolist()
    assert out["cache/requests"] > 0


def test_cache_aware_bias_raises_hit_rate(setup):
    store, data, reference, _ = setup
    lru2 = CacheConfig(policy="lru", capacity=2)
    base = evaluate_offloaded(tiny_model(), store, data, CPU, lru2)
    biased = evaluate_offloaded(tiny_model(), store, data, CPU, lru2, cache_aware_bias=0.3)
    assert biased["cache/hit_rate"] > base["cache/hit_rate"] + 0.05
    assert biased["loss/val"] != reference["loss/val"]  # routing really changed
    with pytest.raises(ValueError, match="cache_aware_bias=-1"):
        evaluate_offloaded(tiny_model(), store, data, CPU, cache_aware_bias=-1)


def test_store_from_other_model_is_refused(setup):
    store, data, _, _ = setup
    other = tiny_model(num_experts=4)
    with pytest.raises(MoestackError, match="num_experts=8, this model has 4"):
        evaluate_offloaded(other, store, data, CPU)


def test_under_autocast_only_the_used_experts_are_cast(setup, monkeypatch):
    """bf16 autocast over fp32 experts: the logits are the in-memory model's under the same
    autocast, and each layer call hands the expert computation only its own experts (casting
    the whole slot pool would convert every resident expert of every layer, every call)."""
    import moestack.cache.offload as offload

    store, data, _, _ = setup
    tokens = data[0][0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = tiny_model()(tokens).logits
    widths = []
    real = offload.run_experts

    def spy(x_TD, w1, w2, experts_TK, weights_TK, impl):
        widths.append((w1.shape[0], torch.unique(experts_TK).numel()))
        return real(x_TD, w1, w2, experts_TK, weights_TK, impl)

    monkeypatch.setattr(offload, "run_experts", spy)
    model = tiny_model()
    cache = ExpertCache(store, 3, "lru")
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with cache, offloaded(model, cache), torch.no_grad(), bf16:
        got = model(tokens).logits
    assert torch.equal(got, want)
    assert widths and all(rows == used for rows, used in widths)
