"""What an OffloadAdamW decides and allocates, from its settings and its parameters' specs
alone: the shards, in place or not, the fused step's mode, the pipeline, where the
collectives run, and every host and device buffer by role. OffloadAdamW builds itself from
this plan, and ``moestack plan`` counts the same plan without building an optimizer
(:mod:`moestack.memory_plan`), so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moestack.optim import buckets, device_comm, fused, switches, transfer
from moestack.optim.plan import ParamSpec, ShardPlan, build_plan


@dataclass(frozen=True)
class OffloadPlan:
    """What one OffloadAdamW decides and allocates, known from its settings and its
    parameters' specs alone: OffloadAdamW builds itself from it, ``moestack plan`` counts
    it (moestack.memory_plan)."""

    shards: ShardPlan  # which units this rank owns, where they sit in its buffers
    in_place: bool  # the parameters are stepped themselves: no master copy
    mode: str | None  # the fused step's (moestack.optim.fused); None: reference path
    split: bool  # the master weights are the bf16 weights plus int16 remainders
    staging_dtype: torch.dtype | None  # of the staged fused step's weight buffer
    host: transfer.Sizes  # this rank's host buffers: role -> (elements, dtype)
    device_scratch: dict[str, int]  # device type -> elements of its fp32 dtype scratch
    pipelined: bool = False  # the step runs bucket by bucket (moestack.optim.buckets)
    grad_dtype: torch.dtype = torch.float32  # of the host gradient buffer
    device_reduce: bool = False  # collectives on the devices (moestack.optim.device_comm)
    device_comm: int = 0  # elements of the device buffers of those collectives (grad_dtype)


def plan_offload(
    specs: Sequence[ParamSpec],
    group_of: Sequence[int],
    is_expert: Sequence[bool],
    *,
    world_size: int = 1,
    rank: int | None = 0,
    shard: bool = True,
    fused_step: str = "auto",
    moment_dtype: torch.dtype = torch.float32,
    in_place: bool | None = None,
    update_delay: int = 0,
    pipeline: bool | str = "auto",
    overlap: bool = True,
    skip_idle_experts: bool = False,
    reduce_on_device: bool | str = "auto",
    backend: str | None = None,
    native: Callable[[], bool] = fused.native_loads,
) -> OffloadPlan:
    """The plan of an OffloadAdamW over parameters ``specs`` (param group and expert flag of
    each) on ``rank`` of a process group of ``world_size`` ranks (1: not distributed;
    ``rank=None``: the rank holding the largest shard). Arguments as OffloadAdamW's;
    ``native`` says whether the native kernel loads, asked only where a split master
    depends on it (a memory plan assumes it does). A delayed update (``update_delay``) keeps
    a master copy and two packed gradient buffers (the next step's land beside the ones the
    update reads); the pipeline: :func:`_pipelines`; the device collectives (``backend``:
    the process group's): :func:`_reduces_on_device`."""
    distributed = world_size > 1
    pipelined = _pipelines(specs, pipeline, overlap, distributed, fused_step, in_place,
                           skip_idle_experts)  # fmt: skip
    num_shards = world_size if (distributed and shard) else 1
    shards = _shard_plan(specs, group_of, is_expert, num_shards, rank)
    # a delayed or pipelined update copies weights back: the parameters stay as they are
    never = update_delay or pipelined
    steps_in_place = transfer.choose_in_place(False if never else in_place, specs, distributed)
    device_reduce = _reduces_on_device(
        specs, reduce_on_device, num_shards, fused_step, backend, skip_idle_experts
    )
    mode = _fused_mode(specs, fused_step, pipelined, steps_in_place, update_delay, distributed,
                       num_shards)  # fmt: skip
    split = mode is not None and fused.wants_split_master(fused_step, mode, specs) and native()
    staging = _staging_dtype(specs, mode, device_reduce)
    # gradients packed into host buffers, weights copied back: all but the direct fused step
    # (it reads p.grad and writes p.data itself) and the in-place one
    pack = not steps_in_place and mode != fused.DIRECT
    grad_dtype = _grad_dtype(specs, pipelined, device_reduce)
    host = transfer.host_buffer_sizes(
        *(shards, moment_dtype, steps_in_place, pack, staging),
        master_dtype=torch.int16 if split else torch.float32,
        spare_grad=bool(update_delay),
        grad_dtype=grad_dtype,
        comm_on_host=not device_reduce,
    )
    scratch = transfer.device_scratch_sizes(specs, copies=pack, host_dtype=grad_dtype)
    comm = device_comm.buffer_elements(shards) if device_reduce else 0
    return OffloadPlan(
        *(shards, steps_in_place, mode, split, staging, host, scratch),
        *(pipelined, grad_dtype, device_reduce, comm),
    )


def _pipelines(
    specs: Sequence[ParamSpec],
    requested: bool | str,
    overlap: bool,
    distributed: bool,
    fused_step: str,
    in_place: bool | None,
    skip_idle_experts: bool,
) -> bool:
    """Whether the step runs bucket by bucket (``pipeline``,
    :func:`moestack.optim.switches.decide`): where ``buckets.refusal`` allows it and, on
    "auto", every parameter is on a GPU and ``overlap`` is on. It runs the fused step's
    staged mode, its gradients crossing in their own dtype when all are bf16."""
    why_not = buckets.refusal(
        specs,
        distributed=distributed,
        skip_idle_experts=skip_idle_experts,
        fused_step=fused_step,
        in_place=in_place,
    )
    return switches.decide(
        "pipeline", requested, why_not, pays=overlap and buckets.on_devices(specs)
    )


def _staging_dtype(
    specs: Sequence[ParamSpec], mode: str | None, device_reduce: bool
) -> torch.dtype | None:
    """The dtype of the staged weight buffer: the fused mode's, bf16 where the device
    collectives send a bf16 shard's new weights back; None without a fused step."""
    staging = None if mode is None else fused.staging_dtype_of(mode, specs)
    if device_reduce and specs[0].dtype == torch.bfloat16:
        staging = torch.bfloat16  # the shard's new weights cross back as bf16
    return staging


def _reduces_on_device(
    specs: Sequence[ParamSpec],
    requested: bool | str,
    num_shards: int,
    fused_step: str,
    backend: str | None,
    skip_idle_experts: bool,
) -> bool:
    """Whether the ranks reduce their gradients on the devices (``reduce_on_device``): where
    ``device_comm.refusal`` allows it and, on "auto", every parameter is on a GPU. Then
    only this rank's gradient shard is on the host, in the gradients' dtype, and bf16
    weights are staged back."""
    why_not = device_comm.refusal(
        specs,
        num_shards=num_shards,
        fused_step=fused_step,
        backend=backend,
        skip_idle_experts=skip_idle_experts,
    )
    return switches.decide("reduce_on_device", requested, why_not, pays=buckets.on_devices(specs))


def _grad_dtype(specs: Sequence[ParamSpec], pipelined: bool, device_reduce: bool) -> torch.dtype:
    """The host gradients' dtype: the parameters' where they cross as they are (a pipelined
    step's bf16, the device collectives' shard), else fp32."""
    if pipelined:
        return buckets.grad_buffer_dtype(specs)
    return specs[0].dtype if device_reduce else torch.float32


def _shard_plan(
    specs: Sequence[ParamSpec],
    group_of: Sequence[int],
    is_expert: Sequence[bool],
    num_shards: int,
    rank: int | None,
) -> ShardPlan:
    """The shards of ``num_shards``, seen from ``rank`` (None: the first of the largest)."""
    shapes = [s.shape for s in specs]
    mine = 0 if num_shards == 1 else rank
    shards = build_plan(shapes, group_of, is_expert, num_shards, mine or 0)
    if mine is None:
        mine = max(range(num_shards), key=lambda k: (shards.shard_sizes[k], -k))
        shards = build_plan(shapes, group_of, is_expert, num_shards, mine)
    return shards


def _fused_mode(
    specs: Sequence[ParamSpec],
    fused_step: str,
    pipelined: bool,
    steps_in_place: bool,
    update_delay: int,
    distributed: bool,
    num_shards: int,
) -> str | None:
    """The fused step's mode (:mod:`moestack.optim.fused`; None: the reference path or the
    in-place step): staged when pipelined, never direct under a delayed update (the
    parameters stay as they are meanwhile)."""
    if pipelined:
        return fused.STAGED
    if fused_step == "off" or steps_in_place:
        return None
    mode = fused.choose_mode(specs, distributed, num_shards)
    return fused.MASTER if update_delay and mode == fused.DIRECT else mode
