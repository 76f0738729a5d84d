"""Expert parallelism applied to a model: shard its experts, average and clip its gradients,
and (``whole_experts``) see its weights whole, gathered over the EP group.

Checkpoints never depend on the layout, yet nothing is gathered for one: each rank writes the
experts it holds and their optimizer state into files of its own, which meta.json describes
by rows (``moestack.checkpoint_parts``), so a run saved at any ``(dp, ep)`` resumes at any
other.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from moestack.parallel.dispatch import ExchangeStats, ExpertParallelExperts, ExpertShard
from moestack.parallel.mesh import ExpertParallelMesh, build_mesh, check_layout

log = logging.getLogger(__name__)


def expert_parallel(
    model: nn.Module, world_size: int, rank: int, ep: int
) -> tuple[ExpertParallelMesh | None, ExchangeStats | None]:
    """With ``ep > 1``: the mesh (collective), and ``model``'s experts cut to this rank's;
    with ``ep == 1``: ``(None, None)`` and the model as it is."""
    if ep == 1:
        return None, None
    mesh = build_mesh(world_size, rank, ep)
    stats = shard_experts(model, mesh)
    log.info(
        "expert parallel: %d data-parallel group(s) x %d EP ranks; this rank: dp %d, ep %d",
        mesh.dp, mesh.ep, mesh.dp_rank, mesh.ep_rank,
    )  # fmt: skip
    return mesh, stats


def shard_experts(model: nn.Module, mesh: ExpertParallelMesh) -> ExchangeStats:
    """Keep only this rank's experts in every MoE layer of ``model`` (``model.moe_layers``),
    in place; returns the exchange counters the layers share.

    Each ``w1``/``w2`` (and each LoRA adapter stacked on them) becomes a new parameter
    holding rows ``[lo, hi)`` of the whole one (same name; of a meta tensor, memory for those
    rows alone, not yet drawn: ``MoETransformer.init_experts``). Expert gradients
    are scaled by ``1 / ep`` as they arrive, so that averaging them over the expert
    data-parallel group (``dp`` ranks) gives the mean over all ``dp x ep`` ranks' tokens, as
    a single process over the global batch would compute. Each layer then runs its experts
    through ``ExpertParallelExperts`` (``MoE.set_experts``).
    """
    stats = ExchangeStats()
    for moe in model.moe_layers:
        num_experts = moe.w1.shape[0]
        check_layout(mesh.world_size, mesh.ep, num_experts)
        lo, hi = mesh.expert_range(num_experts)
        for name in moe.expert_tensor_names():  # w1, w2 and any adapters stacked on them
            whole = getattr(moe, name)
            rows = whole.detach()[lo:hi]
            # experts built on meta: memory for this rank's rows only, drawn by the model
            # (MoETransformer.init_experts), or read from a checkpoint
            held = torch.empty(rows.shape, dtype=rows.dtype) if rows.is_meta else rows.clone()
            part = nn.Parameter(held, requires_grad=whole.requires_grad)
            if part.requires_grad and mesh.ep > 1:
                part.register_hook(lambda g, ep=mesh.ep: g / ep)
            setattr(moe, name, part)
        moe.expert_offset = lo  # the rows' global expert ids start here (layout-free init)
        shard = ExpertShard(mesh=mesh, num_experts=num_experts, stats=stats)
        moe.set_experts(ExpertParallelExperts(shard))
    return stats


def _shard_of(moe: nn.Module) -> ExpertShard | None:
    """The EP shard an MoE layer runs its experts on (None: not expert-parallel)."""
    backend = moe.experts_backend
    return backend.shard if isinstance(backend, ExpertParallelExperts) else None


class ExpertBlock(NamedTuple):
    """One sharded expert tensor of a model and where its rows sit among all experts."""

    param: nn.Parameter  # this rank's rows: experts [lo, hi)
    mesh: ExpertParallelMesh
    lo: int
    hi: int


def expert_blocks(model: nn.Module) -> list[ExpertBlock]:
    """Every sharded ``w1``/``w2`` (and adapter) of ``model``'s MoE layers, in layer order:
    the one walk over them that gradients, checkpoints and the optimizer pair share."""
    blocks = []
    for moe in model.moe_layers:
        shard = _shard_of(moe)
        if shard is not None:
            lo, hi = shard.mesh.expert_range(shard.num_experts)
            blocks += [
                ExpertBlock(getattr(moe, n), shard.mesh, lo, hi) for n in moe.expert_tensor_names()
            ]
    return blocks


def expert_params(model: nn.Module) -> set[int]:
    """``id`` of every sharded expert parameter of ``model``."""
    return {id(b.param) for b in expert_blocks(model)}


def _mesh_of(model: nn.Module) -> ExpertParallelMesh:
    return next(shard.mesh for shard in map(_shard_of, model.moe_layers) if shard is not None)


@torch.no_grad()
def average_gradients(model: nn.Module) -> None:
    """Average gradients over the ranks that share each parameter (torch AdamW's optimizer
    under EP calls it; the OffloadAdamW pair reduces its own): replicated parameters over
    all ranks, experts over their expert data-parallel group. A parameter that got no
    gradient on a rank (an expert that received no tokens) takes part with zeros."""
    mesh = _mesh_of(model)
    experts = expert_params(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    replicated = [p.grad for p in params if id(p) not in experts]
    sharded = [p.grad for p in params if id(p) in experts]
    _all_reduce_mean(replicated, None, mesh.world_size)
    if mesh.dp > 1:
        _all_reduce_mean(sharded, mesh.expert_dp_group, mesh.dp)


def _all_reduce_mean(grads: list[torch.Tensor], group: Any, size: int) -> None:
    """Sum ``grads`` over ``group`` in one flat buffer and divide by ``size``."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip to the global 2-norm over every parameter, each expert counted once (after
    ``average_gradients``); returns the norm before clipping (torch's formula)."""
    mesh = _mesh_of(model)
    experts = expert_params(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    rep = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in experts]
    own = [p.grad for p in model.parameters() if p.grad is not None and id(p) in experts]
    sq = torch.stack([_sum_of_squares(rep), _sum_of_squares(own)])  # one host sync
    total = float(global_grad_norm(sq, mesh))
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return total


def global_grad_norm(squares: torch.Tensor, mesh: ExpertParallelMesh) -> torch.Tensor:
    """The global gradient 2-norm from this rank's squared norms ``squares = [replicated,
    experts]`` (float64): the replicated parameters' are equal on every rank, so counted
    once; the experts' are summed over the EP group, whose ranks hold different experts
    (collective over the EP group; ``squares[1]`` is summed in place)."""
    dist.all_reduce(squares[1:], group=mesh.ep_group)
    return squares.sum().sqrt()


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` in float64 on the host (0 for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([g.detach().double().square().sum() for g in grads]).sum().cpu()


@contextlib.contextmanager
def whole_experts(model: nn.Module) -> Iterator[None]:
    """Inside, every sharded ``w1``/``w2`` holds all experts (gathered over the EP group:
    collective), so ``model.state_dict()`` is the layout-free model; restored on exit."""
    saved = []
    for block in expert_blocks(model):
        saved.append((block.param, block.param.data))
        block.param.data = gather_rows(block.param.data, block.mesh)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def gather_rows(local: torch.Tensor, mesh: ExpertParallelMesh) -> torch.Tensor:
    """The EP group's row blocks of a tensor, concatenated in rank order (collective)."""
    parts = [torch.empty_like(local) for _ in range(mesh.ep)]
    dist.all_gather(parts, local.contiguous(), group=mesh.ep_group)
    return torch.cat(parts)
