"""No host-device synchronisation on the MoE hot path (CUDA only; skipped on the CPU).

A sync stalls the host until the GPU drains its queue, so the next kernels cannot be queued
behind the running ones. torch reports each synchronising call it makes while
``torch.cuda.set_sync_debug_mode("warn")`` is on; these tests count them (file and line of
each) around the router, the Triton experts, the torch path and a whole MoE layer's training
step, and the first test checks that the counting sees a known sync (``torch.bincount``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from moestack.config import MoEConfig, RouterConfig
from moestack.kernels import tuning
from moestack.moe import MoE, moe_experts_torch
from moestack.router import Router, tokens_per_expert

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
E, K, T, D, F = 16, 4, 512, 128, 256


def syncs(fn: Callable[[], object]) -> list[str]:
    """The synchronising CUDA calls ``fn`` makes, as "file:line" of the Python caller."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def routed(seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(T, E, device="cuda", generator=g).topk(K, dim=-1).indices


def test_the_sync_counter_sees_a_sync():
    assert syncs(lambda: torch.bincount(routed().reshape(-1), minlength=E))


def test_tokens_per_expert_does_not_sync():
    experts = routed()
    assert syncs(lambda: tokens_per_expert(experts, E)) == []
    want = torch.bincount(experts.reshape(-1), minlength=E)
    assert torch.equal(tokens_per_expert(experts, E), want)


def test_router_forward_metrics_and_bias_update_do_not_sync():
    router = Router(D, E, K, RouterConfig(bias_update_rate=1e-3)).cuda().train()
    x = torch.randn(T, D, device="cuda")

    def step():
        routing = router(x)
        Router.metrics(routing, E)
        router.update_bias()

    step()  # warm-up: first-call allocations
    assert syncs(step) == []


def _expert_weights(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x = torch.randn(T, D, device="cuda", dtype=dtype, requires_grad=True)
    w1 = (torch.randn(E, D, 2 * F, device="cuda") / D**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, F, D, device="cuda") / F**0.5).to(dtype).requires_grad_()
    weights = torch.rand(T, K, device="cuda", requires_grad=True)
    return x, w1, w2, weights


def test_triton_experts_do_not_sync(monkeypatch):
    pytest.importorskip("triton")
    from moestack.kernels import moe_experts

    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")  # timing candidates synchronises
    x, w1, w2, weights = _expert_weights(torch.bfloat16)
    experts = routed()

    def step():
        moe_experts(x, w1, w2, experts, weights).sum().backward()

    step()  # compiles the kernels
    assert syncs(step) == []


# The backward's newer paths, each forced (none runs by default without a measurement): the
# persistent GEMM (its tile table built on the device), torch._grouped_mm's weight gradients,
# the SwiGLU backward fused into G's GEMM; with the launcher each one calls.
NEW_PATHS = {
    "persistent": ("mm", tuning.PERSISTENT_CANDIDATES[0], "persistent_mm"),
    "torch-dW": ("wgrad", tuning.TORCH_WGRAD, "grouped_wgrad_torch"),
    "fused-dSwiGLU": ("mm_dswiglu", tuning.CANDIDATES["mm_dswiglu"][0], "mm_dswiglu_fused"),
}


@pytest.mark.parametrize("path", NEW_PATHS)
def test_triton_experts_do_not_sync_on_the_new_paths(path, monkeypatch):
    pytest.importorskip("triton")
    from moestack.kernels import _launch, moe_experts

    kind, cfg, launcher = NEW_PATHS[path]
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")  # timing candidates synchronises
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", "/nonexistent.json")  # the others: defaults
    tuning.clear_cache()
    calls = []
    real = getattr(_launch, launcher)
    monkeypatch.setattr(_launch, launcher, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    x, w1, w2, weights = _expert_weights(torch.bfloat16)
    experts = routed()

    def step():
        moe_experts(x, w1, w2, experts, weights).sum().backward()

    try:
        with tuning.forced_config(kind, cfg):
            step()  # compiles the kernels
            assert calls, f"{launcher} never ran: the {path} path was not taken"
            assert syncs(step) == []
    finally:
        tuning.clear_cache()


def test_torch_experts_do_not_sync():
    x, w1, w2, weights = _expert_weights(torch.bfloat16)
    experts = routed()

    def step():
        moe_experts_torch(x, w1, w2, experts, weights).sum().backward()

    step()
    assert syncs(step) == []


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_moe_layer_training_step_does_not_sync(impl, monkeypatch):
    if impl == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    layer = MoE(D, MoEConfig(num_experts=E, top_k=K, d_ff=F, impl=impl), RouterConfig())
    layer = layer.cuda().train()
    x = torch.randn(4, T // 4, D, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        (y.float().square().mean() + layer.aux_loss).backward()

    step()
    assert syncs(step) == []
