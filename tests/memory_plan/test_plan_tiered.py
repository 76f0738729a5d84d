"""moestack plan with optim=tiered: each population's line is the bytes the optimizer holds
after a step of the same model (counted from its tensors), and the weights and gradients are
bf16 without a master copy."""

from __future__ import annotations

import pytest
import torch
from helpers.alloc import PeakAllocated
from helpers.runs import small_model

from moestack.config import DataConfig, OptimConfig, TrainConfig
from moestack.memory_plan import plan_memory
from moestack.optim import apply_param_dtype, build_optimizer
from moestack.optim.tiered import TieredAdamW
from moestack.optim.tiered_bytes import planned_step_bytes
from moestack.populations import classify


def test_tiered_lines_are_the_bytes_held() -> None:
    cfg = TrainConfig(
        model=small_model(), optim=OptimConfig(name="tiered"), data=DataConfig(seq_len=32)
    )
    plan = plan_memory(cfg)
    torch.manual_seed(0)
    model = cfg.model.build()
    assert apply_param_dtype(model, cfg.optim, torch.device("cpu")) == torch.bfloat16
    opt = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for population, held in opt.state_bytes().items():
        if held:
            assert plan.line(f"optimizer state (tiered, {population})").bytes == held
    params = sum(p.numel() for p in model.parameters())
    assert plan.line("gradients").bytes == 2 * params
    named = list(model.named_parameters())  # CPU tensors: the C++ kernel allocates no tensor
    step = planned_step_bytes(named, classify(model), cfg.optim.policy, "none", torch.bfloat16)
    assert plan.line("optimizer scratch (tiered, during a step)").bytes == step


def test_update_in_backward_plans_one_modules_gradients() -> None:
    """small_model (width 32, 2 layers, 4 experts of width 32, vocabulary 256 tied): a MoE
    layer's w1 [4, 32, 64] and w2 [4, 32, 32], and the tied embedding [256, 32], in bf16."""
    optim = OptimConfig(name="tiered", grad_clip=0.0, update_in_backward=True)
    plan = plan_memory(TrainConfig(model=small_model(), optim=optim, data=DataConfig(seq_len=32)))
    assert plan.line("gradients").bytes == 2 * (4 * 32 * 64 + 4 * 32 * 32 + 256 * 32)
    assert "update_in_backward" in plan.line("gradients").formula
    compiled = TrainConfig(model=small_model(), optim=optim, data=DataConfig(seq_len=32),
                           compile=True)  # fmt: skip
    block = 32 + 96 * 32 + 32 * 32 + 32 + 4 * 32 * 64 + 4 * 32 * 32 + 4 * 32  # a whole layer
    assert plan_memory(compiled).line("gradients").bytes == 2 * (block + 256 * 32)
    with pytest.raises(ValueError, match="this run has 2 ranks"):
        plan_memory(
            TrainConfig(model=small_model(), optim=optim, data=DataConfig(seq_len=32)), ranks=2
        )


@pytest.mark.parametrize("master", ["none", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_allocates_no_more_than_planned(master: str, dtype: torch.dtype) -> None:
    """What one step allocates at its peak (counted from every operator's outputs) is within
    the plan's line, and most of it: bf16 or fp32 weights, with and without a master."""
    torch.manual_seed(0)
    cfg = OptimConfig(name="tiered", master=master)
    model = TrainConfig(model=small_model(), data=DataConfig(seq_len=32)).model.build()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    opt = build_optimizer(model, cfg)
    for step in range(2):  # the first step makes the state, the second is measured
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        with PeakAllocated() as measured:
            opt.step()
    named = list(model.named_parameters())
    planned = planned_step_bytes(named, classify(model), cfg.policy, master, dtype)
    assert 0.6 * planned <= measured.peak <= planned, (measured.peak, planned)


def test_on_two_ranks_the_lines_are_the_most_loaded_ranks_state(monkeypatch) -> None:
    """The plan at 2 ranks sums to the state of the rank that holds most, as the optimizer
    splits it (each rank built as rank r of 2 and stepped once)."""
    cfg = TrainConfig(
        model=small_model(), optim=OptimConfig(name="tiered"), data=DataConfig(seq_len=32)
    )
    plan = plan_memory(cfg, ranks=2)
    planned = sum(ln.bytes for ln in plan.lines if ln.what.startswith("optimizer state (tiered"))
    held = []
    for rank in range(2):
        monkeypatch.setattr(TieredAdamW, "_ranks", lambda self, r=rank: (r, 2))
        monkeypatch.setattr(TieredAdamW, "_share_weights", lambda self: None)
        monkeypatch.setattr(TieredAdamW, "_reduce_stats", lambda self: None)
        model = cfg.model.build()
        apply_param_dtype(model, cfg.optim, torch.device("cpu"))
        opt = build_optimizer(model, cfg.optim)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        held.append(sum(opt.state_bytes().values()))
    assert planned == max(held) and min(held) > 0
