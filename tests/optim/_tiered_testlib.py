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


def small_model(dtype: torch.dtype = torch.bfloat16, experts: int = 3) -> torch.nn.Module:
    """2 blocks, 3 experts of odd width: every population but adapters."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40, d_model=12, n_layers=2, n_heads=2, max_seq_len=16,
        moe=MoEConfig(num_experts=experts, top_k=2, d_ff=10, impl="torch"),
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
        p.grad = g.to(p.device, p.dtype)


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


def grad_for(name: str, shape: torch.Size, step: int) -> torch.Tensor:
    """The gradient of parameter ``name`` (whole shape) at ``step``, the same in any process."""
    gen = torch.Generator().manual_seed(hash_name(name) + 7919 * step)
    return torch.randn(shape, generator=gen)


def hash_name(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name))


def ep_rank_worker(rank: int, world: int, init_method: str, out: str) -> None:
    run_gloo_rank(rank, world, init_method, _ep_body, rank, out)


def _ep_body(rank: int, out: str) -> None:
    """Rank ``rank`` of 2 at parallel.ep=2: 4 experts, 2 a rank; gradients the whole model's
    cut to this rank's experts; the state saved after SAVE_AFTER steps (collective)."""
    from moestack.optim import build_training_optimizer
    from moestack.parallel import build_mesh, expert_blocks, shard_experts

    model = small_model(experts=4)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    mesh = build_mesh(2, rank, 2)
    shard_experts(model, mesh)
    rows = {n: b.lo for b in expert_blocks(model) for n, p in model.named_parameters()
            if p is b.param}  # fmt: skip
    torch.manual_seed(1)
    opt = build_training_optimizer(model, OptimConfig(name="tiered", lr=1e-2), 2, mesh)
    saved = None
    for step in range(STEPS):
        for n, p in model.named_parameters():
            g = grad_for(n, shapes[n], step)
            p.grad = (g[rows[n] : rows[n] + p.shape[0]] if n in rows else g).to(p.dtype)
        opt.step()
        opt.zero_grad()
        if step + 1 == SAVE_AFTER:
            saved = opt.state_dict()
            common, own = opt.sharded_state_dict()  # what a checkpoint writes: no exchange
    torch.save(
        {"weights": weights(model), "rows": rows, "saved": saved, "metrics": opt.metrics(),
         "common": common, "own": own, "rank": rank},
        Path(out) / f"ep_rank{rank}.pt",
    )  # fmt: skip
