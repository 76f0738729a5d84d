"""OffloadAdamW: AdamW whose state lives in host memory, sharded over data-parallel ranks.

Why: Adam's fp32 master weights and two moments cost 12 bytes per parameter, three times the
bf16 weights and gradients a device needs for training. This optimizer keeps them in host
memory (pinned when CUDA is present) and, under ``torch.distributed``, splits them over the
ranks (ZeRO-1), so the device holds only the model weights and their gradients.

Layout. Every parameter is cut into *units*: one per expert for stacked expert tensors
``[E, ...]`` (marked by name pattern or ``expert_params``), and one per tensor (or a few row
blocks of a large tensor, when sharding) otherwise. The units, ordered by param group, then
parameter, then row, are cut into ``N`` contiguous shards of nearly equal size at unit
boundaries, so a shard holds whole experts. Each rank keeps flat fp32 buffers for the master
weights and moments of its shard only. One step:

1. Gradients are packed into a flat host buffer (on CUDA the copies start inside backward,
   from post-accumulate-grad hooks on a side stream), reduced over the ranks and averaged
   (``reduce_scatter_tensor`` when sharded, ``all_reduce`` otherwise; both work on gloo).
2. The rank steps its shard with torch's fused CPU AdamW kernel (``torch._fused_adamw_``),
   in a few large contiguous slices.
3. The updated master weights are all-gathered and copied back into the parameters (on CUDA
   on a side stream; the compute stream waits on an event, the host does not).

With gradient accumulation, run every micro-batch but the last inside ``opt.no_sync()`` (as
with DDP; moestack.train does): the gradients then cross to the host once per step.

On CUDA, 16-bit parameters and gradients change dtype on the device, through one fp32
scratch of at most 64 MiB: the host only runs the AdamW step. Training keeps bf16 weights on
the device with this optimizer (``optim.param_dtype``), 4 bytes per parameter with gradients.

On a CPU-only machine without ``torch.distributed`` and with fp32 parameters, host and
device are the same memory, so the optimizer steps the parameters in place and keeps no
separate master copy (``in_place`` is then True); otherwise a separate fp32 master copy is
kept. The master copy is initialised from the parameters at their first step (or by
``load_state_dict``), so weights loaded into the model after the optimizer was built count.

Checkpoints are keyed by parameter name; stacked expert tensors are stored per expert
(``"layers.0.moe.w1/expert3"``), so a state saved with N ranks loads with M ranks.
``state_dict()`` is collective: every rank must call it, and every rank returns the same
full state (save it from rank 0). ``load_state_dict`` takes that full dict on every rank and
keeps the rank's own part. The dict holds only tensors, numbers, strings, lists and dicts,
so ``torch.load(path, weights_only=True)`` reads it.

Gradient clipping must go through :meth:`OffloadAdamW.clip_grad_norm_`, which measures the
norm of the reduced (averaged) gradients across all shards; ``torch.nn.utils.clip_grad_norm_``
would see only the local, unreduced ``.grad`` and, on CUDA, run after the gradients were
already copied to the host. Do not wrap the model in DDP: this optimizer reduces the
gradients itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)

FORMAT = "moestack.optim.OffloadAdamW"
FORMAT_VERSION = 1
DEFAULT_EXPERT_PATTERN = r"(^|\.)w[12]$"
_BF16_CHUNK = 1 << 21  # elements per fp32 scratch slice when moments are stored in bf16
# Elements per device-side dtype conversion between 16-bit device tensors and the fp32 host
# buffers: the device holds one fp32 scratch of at most this size (64 MiB).
_XFER_CHUNK = 1 << 24


@dataclass
class _Unit:
    """A row block of one parameter: the smallest piece the optimizer places and skips."""

    pidx: int  # index into OffloadAdamW._params
    group: int  # param group index
    row0: int  # first row (dim 0) of the block
    rows: int  # number of rows
    start: int  # element offset in the flattened parameter
    numel: int
    expert: bool  # the block is exactly one expert of a stacked expert tensor
    shard: int = 0  # owning shard (rank when sharded, else 0)
    off: int = 0  # element offset inside the owning shard's flat buffers


@dataclass
class _Segment:
    """Contiguous run of units of one parameter in one shard: the unit of packing/copy-back."""

    pidx: int
    start: int  # element offset in the flattened parameter
    numel: int
    shard: int
    off: int  # element offset inside the shard


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with host-resident, sharded state.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or param-group
            dicts of either. Names key the checkpoint; without them the keys are ``param<i>``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; groups may override them.
        offload: where the state lives; only ``"cpu"`` (host memory) is supported.
        shard: split the state over the ranks of ``process_group`` (ZeRO-1) when
            ``torch.distributed`` is initialised. Gradients are averaged over the ranks either
            way; do not wrap the model in DDP.
        overlap: on CUDA, copy gradients to the host during backward and weights back on a
            side stream. No effect on CPU.
        skip_idle_experts: an expert whose reduced gradient is exactly zero gets no update
            this step (no moment decay, no weight decay, no host step, no copy back). Not
            exact: dense AdamW keeps moving an idle expert with its decaying momentum and
            weight decay. Measured (scripts/bench_optim.py, expert idle every other step, 200
            steps): the idle expert's total update differs from dense AdamW's by ~11% (relative
            L2); busy experts and other tensors are unaffected (1e-8). Steps are still counted,
            so bias correction follows the global step. On CUDA the gradient copy to the host
            still happens (it starts in backward, before idleness is known); in sharded runs
            the collectives still carry the expert.
        moment_dtype: ``torch.float32`` or ``torch.bfloat16`` for the host moments.
        expert_params: tensors to treat as stacked experts ``[E, ...]`` (split along dim 0).
        expert_pattern: regex on parameter names marking stacked experts (default matches
            names ending in ``.w1``/``.w2``); ``None`` turns name matching off.
        process_group: the data-parallel group (default: the default group).
        in_place: step fp32 CPU parameters in place, without a master copy. ``None`` (default)
            does so when it is possible (no distributed run, all parameters fp32, contiguous,
            on the CPU); ``False`` forces the separate master copy.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        offload: str = "cpu",
        shard: bool = True,
        overlap: bool = True,
        skip_idle_experts: bool = False,
        moment_dtype: torch.dtype | str = torch.float32,
        expert_params: Iterable[Tensor] | None = None,
        expert_pattern: str | None = DEFAULT_EXPERT_PATTERN,
        process_group: Any = None,
        in_place: bool | None = None,
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay, where="")
        if str(offload) != "cpu":
            raise ValueError(
                f"offload={offload!r} is not supported: the optimizer state lives in host memory; "
                "use offload='cpu'"
            )
        self.moment_dtype = _parse_moment_dtype(moment_dtype)
        self._built = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.shard_state = bool(shard)
        self.overlap = bool(overlap)
        self.skip_idle_experts = bool(skip_idle_experts)
        self._pg = process_group
        self._dist = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self._dist else 1
        self.rank = dist.get_rank(process_group) if self._dist else 0
        self._dist = self._dist and self.world_size > 1
        if self._dist:
            self._pg = _host_group(process_group)
        self.num_shards = self.world_size if (self._dist and self.shard_state) else 1
        self.my_shard = self.rank if self.num_shards > 1 else 0

        self._params: list[Tensor] = []
        self._names: list[str] = []
        self._group_of: list[int] = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for j, p in enumerate(group["params"]):
                self._params.append(p)
                self._names.append(names[j] if names else f"param{len(self._names)}")
                self._group_of.append(gi)
        if len(set(self._names)) != len(self._names):
            raise ValueError("parameter names must be unique; pass model.named_parameters()")
        self._index = {id(p): i for i, p in enumerate(self._params)}
        expert_ids = {id(t) for t in (expert_params or [])}
        rx = re.compile(expert_pattern) if expert_pattern else None
        self._is_expert = [
            p.ndim >= 2 and (id(p) in expert_ids or bool(rx and rx.search(n)))
            for p, n in zip(self._params, self._names, strict=True)
        ]
        devices = {p.device.type for p in self._params}
        self._cuda = "cuda" in devices
        can_in_place = (
            not self._dist
            and devices <= {"cpu"}
            and all(p.dtype == torch.float32 and p.is_contiguous() for p in self._params)
        )
        if in_place and not can_in_place:
            raise ValueError(
                "in_place=True needs fp32, contiguous CPU parameters and no distributed run; "
                "use in_place=None to let the optimizer decide"
            )
        self.in_place = can_in_place if in_place is None else (in_place and can_in_place)
        self._steps = [0] * len(self._params)
        self._step_t = [torch.zeros((), dtype=torch.float32) for _ in self._params]
        self._build_layout()
        self._alloc()
        self._grads_ready = False
        self._moment_scratch: Tensor | None = None  # fp32 slices of bf16 moments
        self._idle: set[int] = set()  # indices (into self._units) of owned units skipped now
        self._active = [False] * len(self._params)
        self._hooks: list[Any] = []
        self._hooked = [False] * len(self._params)
        cuda_devs = [p.device for p in self._params if p.is_cuda]
        self._side = (
            torch.cuda.Stream(device=cuda_devs[0]) if (cuda_devs and self.overlap) else None
        )
        self._xfer_scratch: dict[torch.device, Tensor] = {}  # see _to_host / _to_device
        self._defer_copies = False  # inside no_sync(): hooks start no copies
        if self._side is not None and not self.in_place:
            # The hooks hold the optimizer weakly: a hook registry lives in C++, out of reach
            # of Python's garbage collector, so a strong reference would keep a dropped
            # optimizer (and its device scratch) alive as long as the parameters.
            hook = _weak_grad_hook(self)
            for p in self._params:
                if p.requires_grad:  # torch refuses hooks on frozen tensors
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        self._built = True
        log.info(
            "OffloadAdamW: %d tensors, %d elements, %d shard(s), this rank holds %d "
            "(in_place=%s, moments %s)",
            len(self._params),
            self._total,
            self.num_shards,
            self._shard_sizes[self.my_shard],
            self.in_place,
            self.moment_dtype,
        )

    # ----------------------------------------------------------------- construction helpers

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a group's hyper-parameters; groups cannot be added after construction."""
        if getattr(self, "_built", False):
            raise NotImplementedError(
                "OffloadAdamW lays out its host state at construction; build a new optimizer "
                "with all param groups instead of calling add_param_group later"
            )
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in param_group:
                merged = {**self.defaults, **param_group}
                _check_hparams(
                    merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], "group "
                )
                break
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if not p.is_floating_point():
                raise ValueError(f"parameter of dtype {p.dtype} cannot be optimised by AdamW")

    def _build_layout(self) -> None:
        """Cut parameters into units, and the units into contiguous, balanced shards."""
        total = sum(p.numel() for p in self._params)
        self._total = total
        n = self.num_shards
        # Large non-expert tensors are cut into row blocks when sharding, for balance.
        max_block = max(1, total // (8 * n)) if n > 1 else total + 1
        units: list[_Unit] = []
        order = sorted(range(len(self._params)), key=lambda i: (self._group_of[i], i))
        for i in order:
            p = self._params[i]
            rows = p.shape[0] if p.ndim >= 1 else 1
            per_row = p.numel() // rows if rows else 0
            if self._is_expert[i]:
                step = 1
            elif p.ndim >= 1 and p.numel() > max_block and per_row > 0:
                step = max(1, max_block // per_row)
            else:
                step = rows
            for r0 in range(0, max(rows, 1), max(step, 1)):
                r = min(step, rows - r0) if rows else 0
                units.append(
                    _Unit(
                        pidx=i,
                        group=self._group_of[i],
                        row0=r0,
                        rows=r,
                        start=r0 * per_row,
                        numel=r * per_row if p.ndim >= 1 else p.numel(),
                        expert=self._is_expert[i],
                    )
                )
        # Contiguous cut at the unit boundary nearest to each k * total / n.
        bounds = [0]
        for u in units:
            bounds.append(bounds[-1] + u.numel)
        cuts = [0]
        j = 0
        for k in range(1, n):
            target = k * total / n
            while j + 1 < len(bounds) and abs(bounds[j + 1] - target) <= abs(bounds[j] - target):
                j += 1
            cuts.append(max(j, cuts[-1]))
        cuts.append(len(units))
        sizes = []
        for s in range(n):
            off = 0
            for u in units[cuts[s] : cuts[s + 1]]:
                u.shard, u.off = s, off
                off += u.numel
            sizes.append(off)
        self._units = units
        self._shard_sizes = sizes
        self._S = max(sizes) if sizes else 0
        # Segments: merge consecutive units of one parameter in one shard.
        segs: list[_Segment] = []
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
                segs.append(_Segment(u.pidx, u.start, u.numel, u.shard, u.off))
        self._segments = segs
        self._segs_of: list[list[_Segment]] = [[] for _ in self._params]
        for s in segs:
            self._segs_of[s.pidx].append(s)
        self._my_units = [k for k, u in enumerate(units) if u.shard == self.my_shard]

    def _alloc(self) -> None:
        """Allocate the host buffers: moments (and master, grads, comm unless in place)."""
        pin = torch.cuda.is_available() and self._cuda
        size = self._shard_sizes[self.my_shard] if self.num_shards > 1 else self._total

        def host(n: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self._exp_avg = host(size, self.moment_dtype)
        self._exp_avg_sq = host(size, self.moment_dtype)
        if self.in_place:
            self._master = self._grad = self._comm = None
            return
        self._master = host(size)
        if self.num_shards > 1:
            self._comm = host(self.num_shards * self._S)
            self._grad = host(self._S)
        else:
            self._comm = host(self._total)
            self._grad = self._comm

    def host_buffers(self) -> dict[str, Tensor]:
        """Every host tensor this optimizer owns, by role (for memory accounting)."""
        out = {"exp_avg": self._exp_avg, "exp_avg_sq": self._exp_avg_sq}
        if self._master is not None:
            out["master"] = self._master
        if self._comm is not None:
            out["grad_comm"] = self._comm
            if self._grad is not self._comm:
                out["grad_shard"] = self._grad
        if self._moment_scratch is not None:
            out["bf16_moment_scratch"] = self._moment_scratch
        return out

    def device_buffers(self) -> dict[str, Tensor]:
        """Every device tensor this optimizer owns (the dtype-change scratch, once used)."""
        return {f"xfer_scratch/{dev}": buf for dev, buf in self._xfer_scratch.items()}

    # ----------------------------------------------------------------------- gradients

    def _grad_hook(self, p: Tensor) -> None:
        """Post-accumulate-grad hook (CUDA): start this gradient's copy to the host."""
        i = self._index[id(p)]
        if self._defer_copies:  # inside no_sync(): a later backward copies the sum
            self._hooked[i] = False
            return
        assert self._side is not None and self._comm is not None
        grad = p.grad
        if grad is None:
            return
        self._side.wait_stream(torch.cuda.current_stream(p.device))
        with torch.cuda.stream(self._side):
            flat = grad.view(-1)
            for s in self._segs_of[i]:
                base = s.shard * self._S + s.off if self.num_shards > 1 else s.off
                self._to_host(
                    self._comm[base : base + s.numel],
                    flat[s.start : s.start + s.numel],
                    non_blocking=True,
                )
            grad.record_stream(self._side)
        self._hooked[i] = True
        self._grads_ready = False

    def _sync_grads(self) -> None:
        """Make the averaged gradients of this rank's shard ready on the host."""
        if self._grads_ready:
            return
        has = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32)
        if self._dist:
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self._pg)
        self._active = [bool(h) for h in has.tolist()]
        if not self.in_place:
            assert self._comm is not None and self._grad is not None
            if self._side is not None:
                self._side.synchronize()
            for i, p in enumerate(self._params):
                if self._hooked[i] and p.grad is not None:
                    continue
                flat = p.grad.view(-1) if p.grad is not None else None
                for s in self._segs_of[i]:
                    base = s.shard * self._S + s.off if self.num_shards > 1 else s.off
                    dst = self._comm[base : base + s.numel]
                    if flat is None:
                        dst.zero_()
                    else:
                        self._to_host(dst, flat[s.start : s.start + s.numel], non_blocking=False)
            self._hooked = [False] * len(self._params)
            if self._dist:
                if self.num_shards > 1:
                    dist.reduce_scatter_tensor(self._grad, self._comm, group=self._pg)
                else:
                    dist.all_reduce(self._comm, group=self._pg)
                self._grad.div_(self.world_size)
        self._idle = set()
        if self.skip_idle_experts:
            for k in self._my_units:
                u = self._units[k]
                if u.expert and self._active[u.pidx] and _all_zero(self._unit_grad(u)):
                    self._idle.add(k)
        self._grads_ready = True

    def _unit_grad(self, u: _Unit) -> Tensor:
        if self.in_place:
            g = self._params[u.pidx].grad
            assert g is not None
            return g.view(-1)[u.start : u.start + u.numel]
        assert self._grad is not None
        return self._grad[u.off : u.off + u.numel]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradients to a global 2-norm of ``max_norm``; return the norm.

        Call this instead of ``torch.nn.utils.clip_grad_norm_``: the norm is taken after the
        cross-rank reduction, over every shard, and the host copy the step consumes is scaled
        (when state is offloaded, the device ``.grad`` is left as it is). Same formula as
        torch: ``coef = min(1, max_norm / (norm + 1e-6))``.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported; OffloadAdamW clips 2-norms")
        self._sync_grads()
        if self.in_place:
            grads = [p.grad for p in self._params if p.grad is not None]
            if not grads:
                return torch.zeros(())
            norms = torch._foreach_norm(grads, 2.0)
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        else:
            assert self._grad is not None
            own = self._grad[: self._shard_sizes[self.my_shard]]
            local = own.square().sum() if own.numel() else torch.zeros(())
            if self._dist and self.num_shards > 1:
                dist.all_reduce(local, group=self._pg)
            total = local.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self.in_place:
            torch._foreach_mul_(grads, coef)
        else:
            assert self._grad is not None
            self._grad.mul_(coef)
        return total

    # ------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step on this rank's shard, then the updated weights back to the params."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_grads()
        first = [i for i, a in enumerate(self._active) if a and self._steps[i] == 0]
        if first and not self.in_place:
            self._init_master(first)
        for i, a in enumerate(self._active):
            if a:
                self._steps[i] += 1
                self._step_t[i].fill_(float(self._steps[i]))
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)
        self._return_weights()
        self._grads_ready = False
        return loss

    def _init_master(self, pidxs: list[int]) -> None:
        """Copy the current parameters into the master buffer (first step / load)."""
        assert self._master is not None
        want = set(pidxs)
        for k in self._my_units:
            u = self._units[k]
            if u.pidx in want:
                src = self._params[u.pidx].detach().reshape(-1)[u.start : u.start + u.numel]
                self._master[u.off : u.off + u.numel].copy_(src)

    def _runs(self, gi: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]:
        """(param, grad, exp_avg, exp_avg_sq, step) slices for group gi, merged when contiguous."""
        runs: list[list[Any]] = []  # [pidx, x_start, off, numel]
        for k in self._my_units:
            u = self._units[k]
            if u.group != gi or not self._active[u.pidx] or k in self._idle:
                continue
            x_start = u.start if self.in_place else u.off
            if runs:
                r = runs[-1]
                same_base = r[0] == u.pidx if self.in_place else True
                if (
                    same_base
                    and self._steps[r[0]] == self._steps[u.pidx]
                    and r[1] + r[3] == x_start
                    and r[2] + r[3] == u.off
                ):
                    r[3] += u.numel
                    continue
            runs.append([u.pidx, x_start, u.off, u.numel])
        out = []
        for pidx, x0, off, n in runs:
            if self.in_place:
                p = self._params[pidx]
                assert p.grad is not None
                x = p.data.view(-1)[x0 : x0 + n]
                g = p.grad.view(-1)[x0 : x0 + n]
            else:
                assert self._master is not None and self._grad is not None
                x = self._master[off : off + n]
                g = self._grad[off : off + n]
            m = self._exp_avg[off : off + n]
            v = self._exp_avg_sq[off : off + n]
            out.append((x, g, m, v, self._step_t[pidx]))
        return out

    def _step_group(self, gi: int, group: dict[str, Any]) -> None:
        runs = self._runs(gi)
        if not runs:
            return
        kw = {
            "lr": float(group["lr"]),
            "beta1": float(group["betas"][0]),
            "beta2": float(group["betas"][1]),
            "weight_decay": float(group["weight_decay"]),
            "eps": float(group["eps"]),
        }
        if self.moment_dtype == torch.float32:
            xs, gs, ms, vs, ss = (list(t) for t in zip(*runs, strict=True))
            _adamw(xs, gs, ms, vs, ss, **kw)
            return
        longest = max(x.numel() for x, *_ in runs)
        scratch = self._moment_scratch
        if scratch is None or scratch.shape[1] < min(longest, _BF16_CHUNK):
            scratch = self._moment_scratch = torch.empty(2, min(longest, _BF16_CHUNK))
        for x, g, m, v, s in runs:  # bf16 moments: fp32 scratch slice by slice
            for a in range(0, x.numel(), _BF16_CHUNK):
                b = min(a + _BF16_CHUNK, x.numel())
                m32 = scratch[0, : b - a].copy_(m[a:b])
                v32 = scratch[1, : b - a].copy_(v[a:b])
                _adamw([x[a:b]], [g[a:b]], [m32], [v32], [s], **kw)
                m[a:b].copy_(m32)
                v[a:b].copy_(v32)

    def _return_weights(self) -> None:
        """Copy the updated master weights (all shards) back into the parameters."""
        if self.in_place:
            return
        assert self._master is not None and self._comm is not None
        if self.num_shards > 1:
            own = self._master
            if own.numel() < self._S:
                own = torch.cat([own, own.new_zeros(self._S - own.numel())])
            dist.all_gather_into_tensor(self._comm, own, group=self._pg)
            src, stride = self._comm, self._S
        else:
            src, stride = self._master, 0
        idle_segs = self._idle_param_ranges() if self._idle and self.num_shards == 1 else None
        if self._side is not None:  # the compute stream may still read the old weights
            self._side.wait_stream(torch.cuda.current_stream(self._side.device))
        ctx = torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()
        with ctx:
            for s in self._segments:
                if not self._active[s.pidx]:
                    continue
                p = self._params[s.pidx]
                flat = p.data.view(-1)
                base = s.shard * stride + s.off
                if idle_segs is not None and idle_segs.get(s.pidx):
                    self._copy_skipping(flat, src, s, base, idle_segs[s.pidx])
                    continue
                self._to_device(
                    flat[s.start : s.start + s.numel],
                    src[base : base + s.numel],
                    non_blocking=self._side is not None,
                )
        if self._side is not None:
            event = torch.cuda.Event()
            event.record(self._side)
            # The compute stream waits, the host does not: the next step synchronises the side
            # stream before it touches the host buffers again.
            torch.cuda.current_stream(self._side.device).wait_event(event)

    def _idle_param_ranges(self) -> dict[int, list[tuple[int, int]]]:
        out: dict[int, list[tuple[int, int]]] = {}
        for k in self._idle:
            u = self._units[k]
            out.setdefault(u.pidx, []).append((u.start, u.numel))
        return out

    def _copy_skipping(
        self, flat: Tensor, src: Tensor, s: _Segment, base: int, idle: list[tuple[int, int]]
    ) -> None:
        """Copy a segment back unit by unit, leaving out skipped (idle) experts."""
        skip = {start for start, _ in idle}
        for k in self._my_units:
            u = self._units[k]
            if u.pidx != s.pidx or u.start in skip:
                continue
            if s.start <= u.start < s.start + s.numel:
                a = base + (u.start - s.start)
                self._to_device(
                    flat[u.start : u.start + u.numel],
                    src[a : a + u.numel],
                    non_blocking=self._side is not None,
                )

    # ------------------------------------------------------------------- host <-> device

    def _xfer_buffer(self, device: torch.device) -> Tensor:
        """The fp32 device scratch through which 16-bit tensors change dtype on the device."""
        buf = self._xfer_scratch.get(device)
        if buf is None:
            largest = max(p.numel() for p in self._params if p.device == device)
            buf = torch.empty(min(largest, _XFER_CHUNK), dtype=torch.float32, device=device)
            self._xfer_scratch[device] = buf
        return buf

    def _to_host(self, dst: Tensor, src: Tensor, non_blocking: bool) -> None:
        """fp32 host ``dst`` <- ``src``; a 16-bit CUDA ``src`` is widened on the device.

        Why: torch widens a cross-device copy into a temporary as large as ``src``; the
        chunked scratch bounds that device memory. Every use of the scratch is on one
        stream (the side stream, or the current one without overlap), so reuse is ordered.
        """
        if not _cast_on_device(src, dst):
            dst.copy_(src, non_blocking=non_blocking)
            return
        scratch = self._xfer_buffer(src.device)
        for a in range(0, src.numel(), scratch.numel()):
            b = min(a + scratch.numel(), src.numel())
            tmp = scratch[: b - a]
            tmp.copy_(src[a:b])
            dst[a:b].copy_(tmp, non_blocking=non_blocking)

    def _to_device(self, dst: Tensor, src: Tensor, non_blocking: bool) -> None:
        """16-bit or fp32 ``dst`` <- fp32 host ``src``; narrowing runs on the device.

        Why: torch narrows a host-to-device copy on the host into a pageable temporary,
        which costs a host pass and turns the copy synchronous; here the fp32 words cross
        PCIe from the (pinned) buffer and a device kernel narrows them.
        """
        if not _cast_on_device(dst, src):
            dst.copy_(src, non_blocking=non_blocking)
            return
        scratch = self._xfer_buffer(dst.device)
        for a in range(0, src.numel(), scratch.numel()):
            b = min(a + scratch.numel(), src.numel())
            tmp = scratch[: b - a]
            tmp.copy_(src[a:b], non_blocking=non_blocking)
            dst[a:b].copy_(tmp)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no copies to the host (as ``DDP.no_sync``).

        For gradient accumulation: wrap every micro-batch but the last, so the gradients
        cross to the host once per step, summed, instead of once per micro-batch.
        """
        previous, self._defer_copies = self._defer_copies, True
        try:
            yield
        finally:
            self._defer_copies = previous

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (before handing them to another
        optimizer); later steps copy gradients synchronously."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._hooked = [False] * len(self._params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch: clear ``.grad``; also forget host gradients not yet consumed."""
        super().zero_grad(set_to_none=set_to_none)
        self._grads_ready = False
        self._hooked = [False] * len(self._params)

    # ------------------------------------------------------------------------ checkpoint

    def _entries(self, i: int) -> list[tuple[str, list[int]]]:
        """Checkpoint keys of parameter i and the indices of the units each one covers."""
        name = self._names[i]
        ks = [k for k, u in enumerate(self._units) if u.pidx == i]
        if self._is_expert[i]:
            return [(f"{name}/expert{self._units[k].row0}", [k]) for k in ks]
        return [(name, ks)]

    def _gathered(self, buf: Tensor | None) -> Tensor | None:
        """The full [num_shards * S] buffer of a per-shard buffer (collective when sharded)."""
        if buf is None:
            return None
        if self.num_shards == 1:
            return buf
        own = buf
        if own.numel() < self._S:
            own = torch.cat([own, own.new_zeros(self._S - own.numel())])
        out = own.new_empty(self.num_shards * self._S)
        dist.all_gather_into_tensor(out, own.contiguous(), group=self._pg)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Full, name-keyed state (collective when sharded: call it on every rank).

        Format: ``{"format", "version", "param_groups": [{hyper-params..., "params": [names]}],
        "state": {key: {"step": int, "exp_avg", "exp_avg_sq"[, "master"]}}}`` where key is
        the parameter name, or ``name/expert<e>`` for stacked expert tensors. ``master`` is
        stored only for parameters whose dtype is not fp32.
        """
        if self._side is not None:
            self._side.synchronize()
        m = self._gathered(self._exp_avg)
        v = self._gathered(self._exp_avg_sq)
        x = self._gathered(self._master)
        assert m is not None and v is not None
        stride = self._S if self.num_shards > 1 else 0
        state: dict[str, Any] = {}
        for i, p in enumerate(self._params):
            if self._steps[i] == 0:
                continue
            for key, ks in self._entries(i):
                units = [self._units[k] for k in ks]
                shape = list(p.shape[1:]) if self._is_expert[i] else list(p.shape)
                rows = [(u.shard * stride + u.off, u.numel) for u in units]

                def take(buf: Tensor, rows: list[Any] = rows, shape: list[int] = shape) -> Tensor:
                    return torch.cat([buf[a : a + n] for a, n in rows]).clone().view(shape)

                entry: dict[str, Any] = {
                    "step": self._steps[i],
                    "exp_avg": take(m),
                    "exp_avg_sq": take(v),
                }
                if p.dtype != torch.float32 and x is not None:
                    entry["master"] = take(x)
                state[key] = entry
        groups = []
        for group in self.param_groups:
            g = {k: _plain(v) for k, v in group.items() if k not in ("params", "param_names")}
            g["params"] = [self._names[self._index[id(p)]] for p in group["params"]]
            groups.append(g)
        return {"format": FORMAT, "version": FORMAT_VERSION, "param_groups": groups, "state": state}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict` (any number of ranks); keep this rank's part."""
        if state_dict.get("format") != FORMAT:
            raise ValueError(
                f"not an OffloadAdamW state (format={state_dict.get('format')!r}); torch "
                "optimizer states are keyed by index and cannot be mapped onto names"
            )
        if self._side is not None:
            self._side.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint has {len(groups)} param groups, this optimizer "
                f"{len(self.param_groups)}; build it with the same grouping"
            )
        for saved, group in zip(groups, self.param_groups, strict=True):
            names = [self._names[self._index[id(p)]] for p in group["params"]]
            if list(saved["params"]) != names:
                missing = sorted(set(names) ^ set(saved["params"]))[:5]
                raise ValueError(f"param names differ from the checkpoint's, e.g. {missing}")
            for k, val in saved.items():
                if k != "params":
                    group[k] = tuple(val) if k == "betas" else val
        state = state_dict["state"]
        init_master: list[int] = []
        for i in range(len(self._params)):
            entries = self._entries(i)
            have = [key in state for key, _ in entries]
            if not any(have):
                self._steps[i] = 0
                self._zero_units(i)
                continue
            if not all(have):
                raise ValueError(
                    f"checkpoint has only some experts of {self._names[i]!r}; "
                    "was it saved with a different number of experts?"
                )
            self._steps[i] = int(state[entries[0][0]]["step"])
            self._step_t[i].fill_(float(self._steps[i]))
            has_master = False
            for key, ks in entries:
                entry = state[key]
                flat = {
                    n: entry[n].reshape(-1)
                    for n in ("exp_avg", "exp_avg_sq", "master")
                    if n in entry
                }
                has_master = "master" in flat
                pos = 0
                for k in ks:
                    u = self._units[k]
                    if u.shard == self.my_shard:
                        sl = slice(u.off, u.off + u.numel)
                        self._exp_avg[sl].copy_(flat["exp_avg"][pos : pos + u.numel])
                        self._exp_avg_sq[sl].copy_(flat["exp_avg_sq"][pos : pos + u.numel])
                        if has_master and self._master is not None:
                            self._master[sl].copy_(flat["master"][pos : pos + u.numel])
                    pos += u.numel
            if not has_master:
                init_master.append(i)
        if init_master and not self.in_place:
            self._init_master(init_master)
        self._grads_ready = False

    def _zero_units(self, i: int) -> None:
        for k in self._my_units:
            u = self._units[k]
            if u.pidx == i:
                self._exp_avg[u.off : u.off + u.numel].zero_()
                self._exp_avg_sq[u.off : u.off + u.numel].zero_()


# ------------------------------------------------------------------------------ helpers


def _adamw(
    xs: list[Tensor],
    gs: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """AdamW on lists of fp32 CPU tensors: torch's fused kernel, or a foreach fallback."""
    if hasattr(torch, "_fused_adamw_"):
        torch._fused_adamw_(
            xs,
            gs,
            ms,
            vs,
            [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        return
    torch._foreach_mul_(xs, 1 - lr * weight_decay)  # pragma: no cover - torch < 2.4
    torch._foreach_lerp_(ms, gs, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
    for x, m, v, s in zip(xs, ms, vs, steps, strict=True):
        t = float(s)
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        x.addcdiv_(m, denom, value=-lr / bc1)


def _host_group(group: Any) -> Any:
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


def _weak_grad_hook(opt: OffloadAdamW) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook that calls ``opt._grad_hook`` while ``opt`` is alive."""
    ref = weakref.ref(opt)

    def hook(p: Tensor) -> None:
        live = ref()
        if live is not None:
            live._grad_hook(p)

    return hook


def _cast_on_device(device_side: Tensor, host_side: Tensor) -> bool:
    """Whether a copy between a device tensor and an fp32 host buffer changes dtype on a GPU."""
    return device_side.is_cuda and device_side.dtype != host_side.dtype


def _all_zero(t: Tensor) -> bool:
    """Exactly zero everywhere (NaN is not).

    A busy expert's gradient almost never has 64 evenly spread zeros, so a strided probe
    answers "no" for it at once; only a probe of zeros pays the full pass (aminmax: one read,
    no bool copy). The answer is exact either way.
    """
    if t.numel() == 0:
        return True
    if bool(t[:: max(1, t.numel() // 64)].any()):  # NaN counts as nonzero here too
        return False
    lo, hi = torch.aminmax(t)
    return bool(lo == 0) and bool(hi == 0)


def _check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str) -> None:
    """Raise ValueError naming the bad hyper-parameter, as torch.optim.AdamW does."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}lr must be a float or a 1-element tensor, got {lr.shape}")
        lr = float(lr)
    if not lr >= 0.0:
        raise ValueError(f"Invalid {where}lr={lr}: the learning rate must be >= 0")
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"Invalid {where}betas={betas!r}: give two numbers in [0, 1)") from None
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid {where}betas[0]={b1}: must be in [0, 1)")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid {where}betas[1]={b2}: must be in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"Invalid {where}eps={eps}: must be >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid {where}weight_decay={weight_decay}: must be >= 0")


def _parse_moment_dtype(value: torch.dtype | str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if isinstance(value, torch.dtype) and value in (torch.float32, torch.bfloat16):
        return value
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(
        f"moment_dtype={value!r} is not supported; use torch.float32 or torch.bfloat16"
    )


def _plain(value: Any) -> Any:
    """Hyper-parameter values as weights_only-loadable plain objects (tuples -> lists)."""
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 else value.detach().cpu().clone()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
