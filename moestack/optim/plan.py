"""The sharding plan of OffloadAdamW: which slices of which parameters each rank owns.

Pure bookkeeping over shapes and indices; no tensor is allocated or moved here. What the
optimizer's placement rules read of a parameter is a :class:`ParamSpec` (shape, device type,
dtype), so that a memory plan can ask them about parameters it never allocates
(:func:`moestack.optim.offload_plan.plan_offload`); torch AdamW's state is planned here too
(:func:`adamw_state_bytes`).

Every parameter is cut into *units*: one per expert for stacked expert tensors ``[E, ...]``
(marked by name pattern or ``expert_params``), and one per tensor (or a few row blocks of a
large tensor, when sharding) otherwise. The units, ordered by param group, then parameter,
then row, are cut into ``N`` contiguous shards of nearly equal size at unit boundaries, so a
shard holds whole experts. Consecutive units of one parameter in one shard merge into a
*segment*, the piece that is packed to the host and copied back in one go.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DEFAULT_EXPERT_PATTERN = r"(^|\.)w[12]$"


@dataclass(frozen=True)
class ParamSpec:
    """What the optimizers' placement rules read of one parameter: its shape, device type,
    dtype and whether it is contiguous. :meth:`of` describes a tensor; a memory plan
    describes the parameters a run will have (built on the meta device, or not at all)."""

    shape: tuple[int, ...]
    device: str  # device type: "cpu", "cuda", ...
    dtype: torch.dtype
    contiguous: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, p: Tensor) -> ParamSpec:
        """The spec of tensor ``p``."""
        return cls(tuple(p.shape), p.device.type, p.dtype, p.is_contiguous())


def adamw_state_bytes(specs: Sequence[ParamSpec]) -> dict[str, int]:
    """Bytes of torch AdamW's state over ``specs`` (its trained parameters), by role: the
    moments ``exp_avg`` and ``exp_avg_sq`` in each parameter's dtype, and a float32 ``step``
    scalar per tensor."""
    moment = sum(s.numel * s.dtype.itemsize for s in specs)
    return {"exp_avg": moment, "exp_avg_sq": moment, "step": 4 * len(specs)}


@dataclass
class Unit:
    """A row block of one parameter: the smallest piece the optimizer places and skips."""

    pidx: int  # index into the optimizer's flat parameter list
    group: int  # param group index
    row0: int  # first row (dim 0) of the block
    rows: int  # number of rows
    start: int  # element offset in the flattened parameter
    numel: int
    expert: bool  # the block is exactly one expert of a stacked expert tensor
    shard: int = 0  # owning shard (rank when sharded, else 0)
    off: int = 0  # element offset inside the owning shard's flat buffers


@dataclass
class Segment:
    """Contiguous run of units of one parameter in one shard: the unit of packing/copy-back."""

    pidx: int
    start: int  # element offset in the flattened parameter
    numel: int
    shard: int
    off: int  # element offset inside the shard


@dataclass
class ShardPlan:
    """Where every element of every parameter lives in the flat per-shard host buffers."""

    units: list[Unit]
    segments: list[Segment]
    segs_of: list[list[Segment]]  # per parameter, its segments
    shard_sizes: list[int]  # elements per shard
    stride: int  # the largest shard: the per-rank slot in gathered/communication buffers
    total: int  # elements over all parameters
    num_shards: int
    my_shard: int
    my_units: list[int]  # indices into ``units`` of the units this rank owns

    @property
    def own_size(self) -> int:
        """Elements of the shard this rank owns."""
        return self.shard_sizes[self.my_shard]

    @property
    def host_size(self) -> int:
        """Length of this rank's state buffers (moments, master weights)."""
        return self.own_size if self.num_shards > 1 else self.total

    def comm_offset(self, shard: int, off: int) -> int:
        """Offset of shard-local element ``off`` in a buffer holding every shard's slot."""
        return shard * self.stride + off if self.num_shards > 1 else off

    def unit_ids(self, pidx: int) -> list[int]:
        """Indices of all units (every shard's) of parameter ``pidx``, in row order."""
        return [k for k, u in enumerate(self.units) if u.pidx == pidx]


def expert_flags(
    params: Sequence[Tensor],
    names: Sequence[str],
    expert_params: Iterable[Tensor] | None,
    expert_pattern: str | None,
) -> list[bool]:
    """Which parameters are stacked experts ``[E, ...]``, split along dim 0 into units."""
    expert_ids = {id(t) for t in (expert_params or [])}
    rx = re.compile(expert_pattern) if expert_pattern else None
    return [
        p.ndim >= 2 and (id(p) in expert_ids or bool(rx and rx.search(n)))
        for p, n in zip(params, names, strict=True)
    ]


def build_plan(
    shapes: Sequence[tuple[int, ...]],
    group_of: Sequence[int],
    is_expert: Sequence[bool],
    num_shards: int,
    my_shard: int,
) -> ShardPlan:
    """Cut parameters of ``shapes`` into units, and the units into contiguous, balanced shards."""
    total = sum(math.prod(s) for s in shapes)
    # Large non-expert tensors are cut into row blocks when sharding, for balance.
    max_block = max(1, total // (8 * num_shards)) if num_shards > 1 else total + 1
    units = _cut_units(shapes, group_of, is_expert, max_block)
    sizes = _assign_shards(units, total, num_shards)
    segments = _merge_segments(units)
    segs_of: list[list[Segment]] = [[] for _ in shapes]
    for s in segments:
        segs_of[s.pidx].append(s)
    return ShardPlan(
        units=units,
        segments=segments,
        segs_of=segs_of,
        shard_sizes=sizes,
        stride=max(sizes) if sizes else 0,
        total=total,
        num_shards=num_shards,
        my_shard=my_shard,
        my_units=[k for k, u in enumerate(units) if u.shard == my_shard],
    )


def _cut_units(
    shapes: Sequence[tuple[int, ...]],
    group_of: Sequence[int],
    is_expert: Sequence[bool],
    max_block: int,
) -> list[Unit]:
    """Units in placement order (group, then parameter, then row); shards not yet assigned."""
    units: list[Unit] = []
    for i in sorted(range(len(shapes)), key=lambda i: (group_of[i], i)):
        shape = shapes[i]
        ndim, numel = len(shape), math.prod(shape)
        rows = shape[0] if ndim >= 1 else 1
        per_row = numel // rows if rows else 0
        if is_expert[i]:
            step = 1
        elif ndim >= 1 and numel > max_block and per_row > 0:
            step = max(1, max_block // per_row)
        else:
            step = rows
        for r0 in range(0, max(rows, 1), max(step, 1)):
            r = min(step, rows - r0) if rows else 0
            units.append(
                Unit(
                    pidx=i,
                    group=group_of[i],
                    row0=r0,
                    rows=r,
                    start=r0 * per_row,
                    numel=r * per_row if ndim >= 1 else numel,
                    expert=is_expert[i],
                )
            )
    return units


def _assign_shards(units: list[Unit], total: int, num_shards: int) -> list[int]:
    """Set each unit's shard and offset: a contiguous cut at the unit boundary nearest to
    each ``k * total / num_shards``. Returns the size of every shard."""
    bounds = [0]
    for u in units:
        bounds.append(bounds[-1] + u.numel)
    cuts = [0]
    j = 0
    for k in range(1, num_shards):
        target = k * total / num_shards
        while j + 1 < len(bounds) and abs(bounds[j + 1] - target) <= abs(bounds[j] - target):
            j += 1
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(units))
    sizes = []
    for s in range(num_shards):
        off = 0
        for u in units[cuts[s] : cuts[s + 1]]:
            u.shard, u.off = s, off
            off += u.numel
        sizes.append(off)
    return sizes


def _merge_segments(units: list[Unit]) -> list[Segment]:
    """Merge consecutive units of one parameter in one shard into segments."""
    segs: list[Segment] = []
    for u in units:
        last = segs[-1] if segs else None
        if (
            last is not None
            and last.pidx == u.pidx
            and last.shard == u.shard
            and last.start + last.numel == u.start
        ):
            last.numel += u.numel
        else:
            segs.append(Segment(u.pidx, u.start, u.numel, u.shard, u.off))
    return segs


def contiguous_runs(
    units: Iterable[Unit], in_place: bool, steps: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """Merge consecutive units into runs ``(pidx, x_start, off, numel)`` the step can take
    in one slice: contiguous in the weights (the parameter itself when ``in_place``, else
    the shard buffer) and in the shard buffers, with equal step counts."""
    runs: list[list[int]] = []
    for u in units:
        x_start = u.start if in_place else u.off
        if runs:
            r = runs[-1]
            same_base = r[0] == u.pidx if in_place else True
            if (
                same_base
                and steps[r[0]] == steps[u.pidx]
                and r[1] + r[3] == x_start
                and r[2] + r[3] == u.off
            ):
                r[3] += u.numel
                continue
        runs.append([u.pidx, x_start, u.off, u.numel])
    return [(pidx, x0, off, n) for pidx, x0, off, n in runs]


def param_ranges(units: Iterable[Unit]) -> dict[int, list[tuple[int, int]]]:
    """``(start, numel)`` of each unit in its flattened parameter, by parameter index."""
    out: dict[int, list[tuple[int, int]]] = {}
    for u in units:
        out.setdefault(u.pidx, []).append((u.start, u.numel))
    return out


Span = tuple[int, int, int, int]  # (pidx, x_start, off, numel), see contiguous_runs


def group_spans(
    plan: ShardPlan,
    gi: int,
    idle: set[int],
    active: Sequence[bool],
    steps: Sequence[int],
    per_param: bool,
    cache: dict[Any, list[Span]],
) -> list[Span]:
    """The slices of param group ``gi`` to step: this rank's units that are active and not
    idle, merged when contiguous (within one parameter when ``per_param``).

    Kept in ``cache`` while the idle and active sets stay and all step counts are equal (they
    then split nothing), so that a step over many experts does not redo the merge in Python.
    """
    key = None
    if min(steps, default=0) == max(steps, default=0):
        key = (gi, per_param, tuple(sorted(idle)), tuple(active))
        if key in cache:
            return cache[key]
    if len(cache) > 64:  # idle sets keep changing: start over
        cache.clear()
    units = [plan.units[k] for k in plan.my_units if k not in idle]
    todo = [u for u in units if u.group == gi and active[u.pidx]]
    spans = contiguous_runs(todo, per_param, steps)
    if key is not None:
        cache[key] = spans
    return spans
