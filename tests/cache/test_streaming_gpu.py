"""Training with frozen experts streamed through the expert cache on a CUDA device
(scripts/gpu_check.sh, kernel_tests phase): the experts in pinned host memory or on disk, the
cache's slots on the GPU, copies on the cache's own streams, the backward getting the experts
again. The CPU twin, bitwise, is tests/cache/test_streaming.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cache import tiny_cfg
from helpers.streaming import STEPS, build, run_cfg, train, trained

from moestack.cache.streaming import attach_streaming, stream_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize(("mode", "prefetch"), [("host", True), ("disk", False)])
def test_streamed_training_on_cuda_equals_the_resident_run(tmp_path: Path, mode, prefetch):
    check_equal_to_resident(tmp_path, mode, prefetch, CUDA)


def check_equal_to_resident(tmp_path: Path, mode: str, prefetch: bool, device: torch.device):
    """20 steps of LoRA (dropout 0.1: the backward's recomputation must draw the forward's
    mask again, from the device's generator) with capacity 6 of 8 experts a layer: the
    resident run's losses within 1e-6 relative and its adapters within fp32 rounding. Not
    bitwise: a grouped GEMM over the cache's slots is not the one over all the experts, and
    the GPU's kernels may split the sums differently for other group counts."""
    cfg = run_cfg("lora", mode, prefetch=prefetch, capacity=6)
    resident = build(cfg).to(device)
    want = train(resident, cfg, STEPS)
    streamed = build(cfg).to(device)
    state = attach_streaming(streamed, cfg, tmp_path)
    assert all(m.w1.is_meta and m.w2.is_meta for m in streamed.moe_layers)
    if device.type == "cuda" and mode == "host":  # asynchronous copies need page-locked memory
        expert, _, _ = state.cache.host.fetch(0, 0)
        assert all(t.is_pinned() for t in expert.values())
    got = train(streamed, cfg, STEPS)
    assert got == pytest.approx(want, rel=1e-6)
    for name, tensor in trained(resident).items():
        torch.testing.assert_close(trained(streamed)[name], tensor, rtol=1e-5, atol=1e-6)
    assert state.metrics(STEPS)["cache/loads"] > 0
    state.close()


def test_the_experts_never_all_on_the_device(tmp_path: Path):
    """4 layers of 32 experts, 2 cache slots a layer. After attach the device holds the
    resident model's bytes less its experts (the slots come with the first step); over two
    training steps its peak is the resident run's less every expert, plus at most the plan's
    slot buffer and working set (a layer's experts in use, their copy in expert order and
    their cast), which together are 0.7x the experts: never all of them on the device."""
    shape = dict(num_experts=32, d_model=64, n_layers=4)
    cfg = run_cfg("lora", "host", capacity=2, model=tiny_cfg(**shape))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # the peaks below are these runs' own
    base = torch.cuda.memory_allocated()
    resident = build(cfg, **shape).to(CUDA)
    held_resident = torch.cuda.memory_allocated() - base
    experts = sum(m.w1.nbytes + m.w2.nbytes for m in resident.moe_layers)
    want = train(resident, cfg, steps=2)
    peak_resident = torch.cuda.max_memory_allocated() - base
    del resident
    streamed = build(cfg, **shape).to(CUDA)
    state = attach_streaming(streamed, cfg, tmp_path)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base <= held_resident - experts + 64 * 1024
    torch.cuda.reset_peak_memory_stats()
    assert train(streamed, cfg, steps=2) == pytest.approx(want, rel=1e-6)
    peak = torch.cuda.max_memory_allocated() - base
    plan = stream_plan(cfg, state.store.expert_bytes, tokens=2 * 16, cuda=True)
    assert plan.slots + plan.working_set < 0.75 * experts
    assert peak <= peak_resident - experts + plan.slots + plan.working_set + 64 * 1024
    state.close()
