"""Collectives of OffloadAdamW over the data-parallel ranks, on host (CPU) tensors.

The optimizer state and its collectives live in host memory, so they need a process group
that moves CPU tensors (gloo or MPI); :func:`host_group` provides one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Imported for its import order: before a process group exists (a script that imports
# OffloadAdamW, then calls init_process_group), so no group outlives its teardown.
import moestack.distributed  # noqa: F401

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks."""

    group: Any  # the process group the collectives use (None: the default group)
    distributed: bool  # torch.distributed is initialised with more than one rank
    world_size: int
    rank: int


def join(process_group: Any) -> Ranks:
    """The data-parallel ranks of ``process_group`` (one rank without torch.distributed)."""
    initialised = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size(process_group) if initialised else 1
    rank = dist.get_rank(process_group) if initialised else 0
    distributed = initialised and world_size > 1
    group = host_group(process_group) if distributed else process_group
    return Ranks(group=group, distributed=distributed, world_size=world_size, rank=rank)


def host_group(group: Any) -> Any:
    """A process group that can reduce CPU tensors: the given one, or a gloo twin of it.

    The state and its collectives live in host memory; NCCL moves only CUDA tensors, so with
    an NCCL-only group a gloo group over the same ranks is created (collective: every rank
    builds the optimizer). ``init_process_group("cpu:gloo,cuda:nccl")`` avoids the extra group.
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    log.info("OffloadAdamW: backend %r cannot reduce host tensors; adding a gloo group", backend)
    return dist.new_group(ranks=ranks, backend="gloo")


def any_rank(flags: list[bool], ranks: Ranks) -> list[bool]:
    """Element-wise OR of ``flags`` over the ranks."""
    if not ranks.distributed:
        return list(flags)
    has = torch.tensor(flags, dtype=torch.int32)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=ranks.group)
    return [bool(h) for h in has.tolist()]


def average_grads(comm: Tensor, grad: Tensor, sharded: bool, ranks: Ranks) -> None:
    """Average the packed gradients ``comm`` over the ranks: into ``grad`` (this rank's
    shard) when ``sharded``, else in place (``grad`` is then ``comm``)."""
    if not ranks.distributed:
        return
    if sharded:
        dist.reduce_scatter_tensor(grad, comm, group=ranks.group)
    else:
        dist.all_reduce(comm, group=ranks.group)
    grad.div_(ranks.world_size)


def gather_shards(own: Tensor, out: Tensor | None, stride: int, ranks: Ranks) -> Tensor:
    """Every rank's part of a per-shard buffer into ``out`` (``[num_shards * stride]``; a new
    tensor when None)."""
    if out is None:
        out = own.new_empty(ranks.world_size * stride)
    if own.numel() < stride:
        own = torch.cat([own, own.new_zeros(stride - own.numel())])
    dist.all_gather_into_tensor(out, own.contiguous(), group=ranks.group)
    return out


def sum_over_ranks(t: Tensor, ranks: Ranks) -> None:
    """All-reduce ``t`` in place (sum)."""
    dist.all_reduce(t, group=ranks.group)
