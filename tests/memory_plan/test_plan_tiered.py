"""moestack plan with optim=tiered: each population's line is the bytes the optimizer holds
after a step of the same model (counted from its tensors), and the weights and gradients are
bf16 without a master copy."""

from __future__ import annotations

import torch
from helpers.runs import small_model

from moestack.config import DataConfig, OptimConfig, TrainConfig
from moestack.memory_plan import plan_memory
from moestack.optim import apply_param_dtype, build_optimizer


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
    largest = max(p.numel() for p in model.parameters())
    assert plan.line("optimizer scratch (tiered").bytes == 4 * largest
