"""attach(): recorded experts equal each model's own top-k, computed independently here."""

from __future__ import annotations

import math
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.telemetry import small_moestack
from torch import nn

from moestack.telemetry import attach, tiny_model

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def hook_count(model: nn.Module) -> int:
    total = 0
    for m in model.modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
        ):
            total += len(getattr(m, attr, {}))
    return total


def capture_inputs(modules: list[nn.Module]) -> tuple[list[list[torch.Tensor]], list]:
    """Record every input of each module with the test's own pre-hooks."""
    seen: list[list[torch.Tensor]] = [[] for _ in modules]
    handles = [
        m.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0].detach().clone()))
        for i, m in enumerate(modules)
    ]
    return seen, handles


def ref_moestack_topk(x: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(torch.softmax(x.float() @ weight.float().T, -1), k, dim=-1).indices


def test_moestack_model_experts_ids_and_hooks() -> None:
    model = small_moestack()
    routers = [m.router for m in model.moe_layers]
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(tokens).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks_before = hook_count(model)
    seen, handles = capture_inputs(routers)
    tel = attach(model)
    assert hook_count(model) > hooks_before + len(handles)
    with torch.no_grad():
        hooked = model(tokens).logits
        model(tokens[:2, :8])
    tel.detach()
    for h in handles:
        h.remove()
    assert hook_count(model) == hooks_before
    assert torch.equal(plain, hooked)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    trace = tel.trace
    for layer, router in enumerate(routers):
        expected = torch.cat([ref_moestack_topk(x, router.weight, 2) for x in seen[layer]])
        np.testing.assert_array_equal(trace.experts(layer), expected.numpy())
    seq = np.concatenate([np.repeat([0, 1, 2], 16), np.repeat([3, 4], 8)])
    pos = np.concatenate([np.tile(np.arange(16), 3), np.tile(np.arange(8), 2)])
    np.testing.assert_array_equal(trace.sequence_ids(), seq)
    np.testing.assert_array_equal(trace.position_ids(), pos)
    with torch.no_grad():
        model(tokens)  # detached: nothing more recorded
    assert tel.trace.num_tokens == 64


def set_router_weights(model: nn.Module, routers: list[nn.Module]) -> None:
    g = torch.Generator().manual_seed(3)
    for r in routers:
        with torch.no_grad():
            r.weight.copy_(torch.randn(r.weight.shape, generator=g))
            if hasattr(r, "e_score_correction_bias"):
                r.e_score_correction_bias.copy_(0.3 * torch.randn(r.weight.shape[0], generator=g))


def reference_topk(family: str, router: nn.Module, h: torch.Tensor, cfg) -> torch.Tensor:
    """The family's routing rule, rewritten from the model papers / configs."""
    h = h.reshape(-1, router.weight.shape[1])
    k = cfg.num_experts_per_tok
    if family == "gpt_oss":
        return torch.topk(F.linear(h, router.weight, router.bias), k, dim=-1).indices
    if family == "deepseek_v3":
        scores = torch.sigmoid(F.linear(h.float(), router.weight.float()))
        choice = scores + router.e_score_correction_bias
        n_group, per = cfg.n_group, router.weight.shape[0] // cfg.n_group
        group_best = choice.view(-1, n_group, per).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_best, dtype=torch.bool)
        keep.scatter_(1, group_best.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        return torch.topk(choice, k, dim=-1).indices
    probs = torch.softmax(F.linear(h, router.weight).float(), dim=-1)
    return torch.topk(probs, k, dim=-1).indices


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_families(family: str) -> None:
    model = tiny_model(family).eval()
    routers = [
        m
        for n, m in model.named_modules()
        if n.endswith((".gate", ".router")) and hasattr(m, "top_k")
    ]
    assert routers, f"test could not find {family} routers"
    set_router_weights(model, routers)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    hooks_before = hook_count(model)
    seen, handles = capture_inputs(routers)
    with attach(model) as tel:
        assert [s.module for s in tel.routers] == routers
        with torch.no_grad():
            hooked = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    assert hook_count(model) == hooks_before
    assert torch.equal(plain, hooked)
    for layer, router in enumerate(routers):
        expected = reference_topk(family, router, seen[layer][0], model.config).numpy()
        got = tel.trace.experts(layer)
        if family == "deepseek_v3":  # its router's top-k is unsorted: compare the sets
            got, expected = np.sort(got, axis=1), np.sort(expected, axis=1)
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(tel.trace.position_ids(), np.tile(np.arange(12), 2))


class FakeSparseMoeBlock(nn.Module):
    """transformers v4 style: a plain `gate` Linear; top-k happens in the block."""

    def __init__(self, d: int, e: int, k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.proj = nn.Linear(d, d)
        self.k = k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.gate(h.reshape(-1, h.shape[-1]))
        w, idx = torch.topk(torch.softmax(logits, -1), self.k, -1)
        return h + self.proj(h) * w.sum(-1).reshape(*h.shape[:-1], 1) + idx.sum() * 0


class MoEGate(nn.Module):
    """DeepSeek remote-code style: the gate returns (indices, weights, aux)."""

    def __init__(self, d: int, e: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(e, d))
        self.top_k = k

    def forward(self, h: torch.Tensor):
        scores = torch.softmax(F.linear(h.reshape(-1, h.shape[-1]), self.weight), -1)
        w, idx = torch.topk(scores, self.top_k, -1)
        return idx, w, None


class DeepseekV3MoE(nn.Module):
    def __init__(self, d: int, e: int, k: int) -> None:
        super().__init__()
        self.gate = MoEGate(d, e, k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        idx, w, _ = self.gate(h)
        return h * w.sum(-1).reshape(*h.shape[:-1], 1)


class FakeLM(nn.Module):
    def __init__(self, block: type, d: int = 16, e: int = 6, k: int = 2) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_experts_per_tok=k, num_local_experts=e)
        self.embed = nn.Embedding(50, d)
        self.layers = nn.ModuleList(block(d, e, k) for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h


def test_v4_gate_linear_convention() -> None:
    torch.manual_seed(0)
    model = FakeLM(FakeSparseMoeBlock)
    gates = [b.gate for b in model.layers]
    seen, handles = capture_inputs(gates)
    ids = torch.randint(0, 50, (2, 5))
    with attach(model) as tel, torch.no_grad():
        model(input_ids=ids)
    for layer, gate in enumerate(gates):
        assert tel.routers[layer].kind == "v4_gate" and tel.routers[layer].top_k == 2
        expected = torch.topk(torch.softmax(gate(seen[layer][0]), -1), 2, -1).indices
        np.testing.assert_array_equal(tel.trace.experts(layer), expected.numpy())


def test_gate_module_returning_indices() -> None:
    torch.manual_seed(0)
    model = FakeLM(DeepseekV3MoE)
    outputs: list[torch.Tensor] = []
    handle = model.layers[1].gate.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    with attach(model) as tel, torch.no_grad():
        model(torch.randint(0, 50, (3, 4)))
    handle.remove()
    assert [s.kind for s in tel.routers] == ["gate_module", "gate_module"]
    np.testing.assert_array_equal(tel.trace.experts(1), outputs[0].numpy())


def test_unknown_model_and_explicit_routers() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"TopKRouter.*routers=\["):
        attach(model)
    with pytest.raises(ValueError, match="not a module name"):
        attach(model, routers=["nope"], top_k=2)
    x = torch.randn(3, 4)
    with attach(model, routers=["0"], top_k=2) as tel, torch.no_grad():
        model(x)
    expected = torch.topk(torch.softmax(model[0](x), -1), 2, -1).indices
    np.testing.assert_array_equal(tel.trace.experts(0), expected.numpy())


def test_padding_is_not_replayed() -> None:
    model = tiny_model("mixtral").eval()
    ids = torch.randint(0, 256, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    with attach(model) as tel, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    pos = tel.trace.position_ids()
    assert (pos == -1).sum() == 2 and pos[6] == -1 and pos[7] == -1
    assert tel.trace.accesses(0).size == 10 * 2


def ref_lru_hits(keys: list[int], cache: OrderedDict, cap: int) -> int:
    hits = 0
    for k in keys:
        if k in cache:
            cache.move_to_end(k)
            hits += 1
        else:
            if len(cache) == cap:
                cache.popitem(last=False)
            cache[k] = 1
    return hits


def test_interval_metrics_match_references() -> None:
    model = small_moestack()
    routers = [m.router for m in model.moe_layers]
    seen, handles = capture_inputs(routers)
    g = torch.Generator().manual_seed(5)
    tel = attach(model, policies=("lru", "static"), capacities=(2, 3))
    caches = {(layer, cap): OrderedDict() for layer in range(2) for cap in (2, 3)}
    prev_counts = None
    loaded_sets: dict[tuple[int, int], set[int]] = {}
    for interval, calls in enumerate((2, 1)):
        start = len(seen[0])
        with torch.no_grad():
            for _ in range(calls):
                model(torch.randint(0, 256, (2, 16), generator=g))
        metrics = tel.interval_metrics()
        expected = [
            torch.cat([ref_moestack_topk(x, routers[layer].weight, 2) for x in seen[layer][start:]])
            for layer in range(2)
        ]
        counts = []
        for layer in range(2):
            keys = expected[layer].reshape(-1).tolist()
            counts.append(np.bincount(keys, minlength=8))
            for cap in (2, 3):
                hits = ref_lru_hits(keys, caches[(layer, cap)], cap)
                got = metrics[f"telemetry/layer{layer}/lru/cap{cap}/hit_rate"]
                assert math.isclose(got, hits / len(keys))
                # static: pins = most used experts of the previous interval; the first interval
                # chose its pins from its own requests, so it only warms the cache (not scored)
                src = counts[layer] if interval == 0 else prev_counts[layer]
                pins = sorted(range(8), key=lambda e, s=src: (-s[e], e))[:cap]
                loaded = loaded_sets.get((layer, cap), set()) & set(pins)
                s_hits = 0
                for k in keys:
                    if k in pins:
                        s_hits += k in loaded
                        loaded.add(k)
                loaded_sets[(layer, cap)] = loaded
                key = f"telemetry/layer{layer}/static/cap{cap}/hit_rate"
                if interval == 0:
                    assert key not in metrics
                else:
                    assert math.isclose(metrics[key], s_hits / len(keys))
        prev_counts = counts
        # switch rate of layer 0: consecutive tokens of each sequence
        rows = expected[0].reshape(-1, 16, 2).tolist()
        share = [
            1 - len(set(a) & set(b)) / 2
            for seq in rows
            for a, b in zip(seq[:-1], seq[1:], strict=True)
        ]
        assert math.isclose(metrics["telemetry/layer0/switch_rate"], sum(share) / len(share))
        assert metrics["telemetry/tokens"] == 32 * calls
    assert tel.interval_metrics() == {}
    tel.detach()
    for h in handles:
        h.remove()


def test_paused_and_summary_and_charts() -> None:
    model = small_moestack()
    tel = attach(model, max_memory_tokens=0)
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 8)))
        with tel.paused():
            model(torch.randint(0, 256, (2, 8)))
    summary = tel.summary()
    assert summary["tokens"] == 16 and summary["trace_tokens"] == 0
    assert sum(summary["expert_usage"][0]) == 32
    curves = tel.capacity_curves()
    assert curves["lru"][-1] >= curves["lru"][0] and len(curves["capacity"]) == 8
    charts = tel.wandb_charts()
    assert {"telemetry/charts/hit_rate_vs_capacity", "telemetry/charts/expert_usage"} <= set(charts)
    tel.close()
