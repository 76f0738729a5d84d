"""The bytes optim=tiered keeps and allocates, counted from shapes alone (meta tensors will
do): each population's state, a step's scratch, the rows of ``moestack plan``, and the ZeRO
split of the state over ranks that :class:`moestack.optim.tiered.TieredAdamW` makes and the
plan repeats (tests/memory_plan/test_plan_tiered.py checks them against what the optimizer
holds and allocates)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from moestack.kernels import host_tiered
from moestack.populations import POPULATIONS, ParamInfo


def planned_state_bytes(
    named: Iterable[tuple[str, Tensor]],
    info: dict[str, ParamInfo],
    policy: Callable[[str], Any],
    master: str,
    param_dtype: torch.dtype,
) -> dict[str, int]:
    """The bytes of state :class:`TieredAdamW` keeps per population for the trainable
    ``(name, tensor)`` pairs once every one has stepped, from their shapes alone (meta
    tensors will do): what ``state_bytes`` counts, summed over the ranks."""
    out = dict.fromkeys(POPULATIONS, 0)
    for name, p in named:
        out[info[name].population] += tensor_state_bytes(
            p.shape, policy(info[name].population), master, param_dtype
        )
    return out


def plan_rows(
    named: list[tuple[str, Tensor]],
    info: dict[str, ParamInfo],
    cfg: Any,
    param_dtype: torch.dtype,
    ranks: int,
    offload: bool = False,
    on_cpu: bool | None = None,
) -> list[tuple[str, str, int, str]]:
    """The memory plan's rows ``(where, what, bytes, formula)`` for the trained ``named``
    tensors under ``cfg`` (OptimConfig): each population's state on the most loaded of
    ``ranks`` (the optimizer's own split, :func:`assign_by_size`), on the device or, with
    ``offload`` (``optim.offload=cpu`` off the CPU), on the host beside the device's copy of
    the one tensor being stepped; then what a step allocates (``on_cpu``: the plan's device
    is the CPU, whatever device ``named`` is on: meta tensors)."""
    sizes = {n: sum(planned_state_bytes([(n, p)], info, cfg.policy, cfg.master, param_dtype)
                    .values()) for n, p in named}  # fmt: skip
    owner = assign_by_size(sizes, ranks)
    load = [sum(size for n, size in sizes.items() if owner[n] == r) for r in range(ranks)]
    heaviest = load.index(max(load)) if load else 0
    shared = f"; the most loaded of {ranks} ranks (whole tensors)" if ranks > 1 else ""
    rows = []
    for population in POPULATIONS:
        size = sum(sizes[n] for n, _ in named
                   if info[n].population == population and owner[n] == heaviest)  # fmt: skip
        rule = cfg.policy(population)
        formula = (f"momentum {rule.momentum}, second moment {rule.second_moment} (1-D: full), "
                   f"master {cfg.master}{shared}")  # fmt: skip
        if size:
            rows.append(("host" if offload else "device", f"optimizer state (tiered, {population})",
                         size, formula))  # fmt: skip
    if offload:
        rows.append(("device", "optimizer state in flight (tiered, optim.offload=cpu)",
                     max(sizes.values(), default=0), "the state of the tensor that keeps most, "
                     "copied to the device for its update and back"))  # fmt: skip
    step = planned_step_bytes(named, info, cfg.policy, cfg.master, param_dtype, on_cpu)
    rows.append(("device", "optimizer scratch (tiered, during a step)", step,
                 "the torch ops' temporaries of the tensor that needs most: its update, fp32 "
                 "copies and rounding noise (freed when the step ends; none of torch's where "
                 "the C++ kernel steps CPU tensors: its buffers are its own)"))  # fmt: skip
    return rows


def planned_step_bytes(
    named: Iterable[tuple[str, Tensor]],
    info: dict[str, ParamInfo],
    policy: Callable[[str], Any],
    master: str,
    param_dtype: torch.dtype,
    on_cpu: bool | None = None,
) -> int:
    """The most bytes :class:`TieredAdamW` allocates during a step, freed by its end (the
    tensors on the CPU: ``on_cpu``, else where each of ``named`` is): none for
    a CPU tensor the C++ kernel steps (its buffers are its own, not torch's: a unit's update
    and a matrix's column sums for each thread, kept between steps); for one the
    torch ops step (:func:`moestack.kernels.host_tiered.step_torch`), the largest of its
    stages: the fp32 gradient (narrower ones), the update and its squares (10 bytes an
    element; 4 more with a bf16 momentum), and without a master the new weights, the fp32
    copy of narrower ones and the rounding noise in int64 (16 bytes an element and 8 an
    element of one unit); plus the row and column vectors of a factored estimate."""
    named = list(named)
    cpu = {n: p.device.type == "cpu" if on_cpu is None else on_cpu for n, p in named}
    host = any(cpu.values()) and host_tiered.kernel_or_none()
    extra = vectors = 0
    for name, p in named:
        numel, rule = math.prod(p.shape), policy(info[name].population)
        stacked = info[name].stacked and len(p.shape) >= 1
        unit = numel // p.shape[0] if stacked and p.shape[0] else numel
        factored = rule.second_moment == "factored" and len(p.shape) >= 2
        if host and cpu[name] and _host_layout(p.shape, stacked, factored):
            continue  # the C++ kernel: no tensor allocated
        narrow = 4 * numel if param_dtype != torch.float32 else 0
        core = narrow + 10 * numel + (4 * numel if rule.momentum == "bfloat16" else 0)
        write = 4 * numel
        if master == "none":
            write += narrow + 16 * numel + 8 * unit
        extra = max(extra, core, write)
        if factored:
            vectors = max(
                vectors, 16 * (math.prod(p.shape[:-1]) + math.prod(p.shape[:-2]) * p.shape[-1])
            )
    return extra + vectors


def _host_layout(shape: torch.Size, stacked: bool, factored: bool) -> bool:
    """Whether the C++ kernel takes a tensor of ``shape`` (a unit is whole matrices)."""
    units = shape[0] if stacked else 1
    lead = math.prod(shape[:-2]) if factored else units
    return math.prod(shape) > 0 and lead % max(units, 1) == 0


def tensor_state_bytes(shape: torch.Size, rule: Any, master: str, param_dtype: torch.dtype) -> int:
    numel = math.prod(shape)
    size = 0 if rule.momentum == "none" else numel * getattr(torch, rule.momentum).itemsize
    if rule.second_moment == "factored" and len(shape) >= 2:
        lead = math.prod(shape[:-2])
        size += 4 * lead * (shape[-2] + shape[-1])
    else:
        size += 4 * numel
    if master == "float32" and param_dtype != torch.float32:
        size += 4 * numel
    return size


def assign_by_size(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Each name's rank: the largest first (ties by name), each to the least loaded rank
    (ties to the lowest): the ZeRO split of tiered's state, which the plan repeats."""
    load = [0] * world
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += sizes[name]
    return owner
