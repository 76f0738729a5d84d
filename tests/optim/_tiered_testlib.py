"""What tests/optim/test_tiered.py runs in one process and on spawned gloo ranks: a small
moestack model, TieredAdamW over it, and gradients drawn per (step, name) so that every
process sees the same ones."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers.multiprocess import run_gloo_rank

from moestack.config import ModelConfig, MoEConfig, OptimConfig
from moestack.optim import build_optimizer
from moestack.optim.tiered import TieredAdamW

STEPS = 4
SAVE_AFTER = 2  # steps before the state is saved for the resharded resume


def small_model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """2 blocks, 3 experts of odd width: every population but adapters."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40, d_model=12, n_layers=2, n_heads=2, max_seq_len=16,
        moe=MoEConfig(num_experts=3, top_k=2, d_ff=10, impl="torch"),
    )  # fmt: skip
    model = cfg.build()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def tiered(model: torch.nn.Module, **kw: object) -> TieredAdamW:
    cfg = OptimConfig(name="tiered", lr=1e-2, **kw)
    torch.manual_seed(1)  # the rounding seed drawn from the run's generator
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, TieredAdamW)
    return opt


def set_grads(model: torch.nn.Module, step: int) -> None:
    """Gradients drawn from (step, parameter index); the second expert of every layer's
    first expert tensor gets none (an expert with no tokens)."""
    for i, (name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator().manual_seed(1000 * step + i)
        g = torch.randn(p.shape, generator=gen) * (1 + i % 3)
        if name.endswith("moe.w1"):
            g[1] = 0
        p.grad = g.to(p.dtype)


def run_steps(model: torch.nn.Module, opt: TieredAdamW, steps: range) -> None:
    for step in steps:
        set_grads(model, step)
        opt.step()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rank_worker(rank: int, world: int, init_method: str, out: str) -> None:
    run_gloo_rank(rank, world, init_method, _rank_body, rank, out)


def _rank_body(rank: int, out: str) -> None:
    model = small_model()
    opt = tiered(model)
    run_steps(model, opt, range(SAVE_AFTER))
    saved = opt.state_dict()  # collective: every rank gets the whole state
    held = sum(opt.state_bytes().values())
    run_steps(model, opt, range(SAVE_AFTER, STEPS))
    torch.save(
        {"weights": weights(model), "saved": saved, "held": held, "metrics": opt.metrics()},
        Path(out) / f"rank{rank}.pt",
    )
