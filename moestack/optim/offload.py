"""OffloadAdamW: AdamW whose state lives in host memory, sharded over data-parallel ranks.

Why: Adam's fp32 master weights and two moments cost 12 bytes per parameter, three times the
bf16 weights and gradients a device needs for training. This optimizer keeps them in host
memory (pinned when CUDA is present) and, under ``torch.distributed``, splits them over the
ranks (ZeRO-1), so the device holds only the model weights and their gradients (4 bytes per
parameter with bf16 weights, ``optim.param_dtype``). Each rank keeps flat fp32 buffers for
the master weights and moments of its shard only (layout: :mod:`moestack.optim.plan`). One step:

1. Gradients are packed into a flat host buffer (on CUDA the copies start inside backward,
   from post-accumulate-grad hooks on a side stream: :mod:`moestack.optim.transfer`), reduced
   over the ranks and averaged (:mod:`moestack.optim.collectives`).
2. The rank steps its shard with torch's fused CPU AdamW kernel in a few large contiguous
   slices (:mod:`moestack.optim.update`).
3. The updated master weights are all-gathered and copied back into the parameters (on CUDA
   on a side stream; the compute stream waits on an event, the host does not).

With ``fused_step`` (the default, ``"auto"``) a master-copy step runs in one pass over host
memory instead (:mod:`moestack.optim.fused`): each gradient element is read once as it
arrived, master weight and moments are updated and the narrowed weight written in the same
pass; on one process with CPU parameters nothing is packed or copied back at all. With bf16
parameters in one process and the native kernel, the master weights are kept split: their
bf16 halves are the weights themselves (or the staging buffer) and only 2-byte remainders
sit in the master buffer (:mod:`moestack.optim.split_master`). Steps 1-3 stay as the
reference path (``fused_step="off"``, and the fallback when no kernel builds).

With every parameter on a GPU in one process, the step is pipelined instead
(``pipeline="auto"``, :mod:`moestack.optim.buckets`): gradients cross in buckets, in their own
dtype, each bucket stepped in a worker thread and its weights sent back on a stream of its own,
the compute stream waiting per bucket (per layer with :meth:`OffloadAdamW.wait_per_layer`);
a delayed update (below) goes through the same buckets.

Sharded over several ranks with every parameter on a GPU, steps 1 and 3 run on the devices
instead (``reduce_on_device="auto"``, :mod:`moestack.optim.device_comm`): a reduce-scatter of
the gradients over the optimizer's own (NCCL) group, each rank copying its 1/N shard to the
host in the gradients' dtype, and an all-gather of the new weights there.

With gradient accumulation, run every micro-batch but the last inside ``opt.no_sync()`` (as
with DDP; moestack.trainer does): the gradients then cross to the host once per step.

On a CPU-only machine without ``torch.distributed`` and with fp32 parameters, host and
device are the same memory, so the optimizer steps the parameters in place and keeps no
separate master copy (``in_place`` is then True); otherwise a separate fp32 master copy is
kept. The master copy is initialised from the parameters at their first step (or by
``load_state_dict``), so weights loaded into the model after the optimizer was built count.

Checkpoints are keyed by parameter name, experts one by one, so a state saved with N ranks
loads with M ranks (:mod:`moestack.optim.state_format`). ``state_dict()`` is collective: every
rank must call it, and every rank returns the same full state (save it from rank 0).
``load_state_dict`` takes that full dict on every rank and keeps the rank's own part.

With ``update_delay=1`` the host update runs in a worker thread while the device computes the
next step (ZeRO-Offload's "delayed parameter update"): ``step()`` first waits for the update
the previous ``step()`` launched and copies its weights into the parameters, then launches
the update with this step's gradients. So the gradient that moves ``w_t`` to ``w_{t+1}`` was
computed at ``w_{t-1}``; AdamW itself is exact (its step count counts the updates, and each
update takes the learning rate, clipping factor and gradients of the step that launched
it). The first ``delay_warmup`` steps run exact. Pipelined, every bucket's update is
launched at ``step()`` and its weights go back at the next one.
:meth:`OffloadAdamW.synchronize` applies the update in flight; ``state_dict``,
``load_state_dict``, evaluation and the end of training call it (docs/optim.md says when to
prefer the delay).

Gradient clipping must go through :meth:`OffloadAdamW.clip_grad_norm_`, which measures the
norm of the reduced (averaged) gradients across all shards (in one process: each gradient's
fp32 norm on the device, combined in fp64 in parameter order, the same for the serial and
the pipelined step, :func:`moestack.optim.update.total_norm`);
``torch.nn.utils.clip_grad_norm_`` would see only the local, unreduced ``.grad`` and, on
CUDA, run after the gradients were already copied to the host. Do not wrap the model in DDP:
this optimizer reduces the gradients itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestack.optim import (
    buckets,
    collectives,
    device_comm,
    fused,
    split_master,
    state_format,
    switches,
    transfer,
    update,
)
from moestack.optim.offload_plan import plan_offload
from moestack.optim.plan import (
    DEFAULT_EXPERT_PATTERN,
    ParamSpec,
    Unit,
    expert_flags,
    group_spans,
    param_ranges,
)

log = logging.getLogger(__name__)


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
        fused_step: how a master-copy step runs: ``"auto"`` (the native kernel, else
            torch.compile, else the reference path), ``"native"``, ``"compile"``, or ``"off"``
            (the reference path: pack, torch's fused AdamW, copy back). A kernel that cannot
            be built falls back to the reference path with one logged line.
        update_delay: 0 (exact: the update ends inside ``step()``) or 1 (the host update runs
            while the next step computes, whose forward and backward see the weights before
            it: see the module docstring). A delayed update keeps a master copy and a second
            host gradient buffer (a parameter's gradient bytes: 2 where bf16 gradients
            cross through the buckets, else 4, per parameter of the shard).
        delay_warmup: the first steps that run exact before the delay starts (counted by the
            updates made, so a resumed run goes on as it was).
        pipeline: step bucket by bucket (:mod:`moestack.optim.buckets`): ``"auto"`` (the
            default) where every parameter is on a GPU and ``overlap`` is on, one process,
            fp32 or bf16 parameters (exact or delayed updates); True forces it (CPU
            parameters too); False never. Its host updates need the fused kernel: where
            none loads (no C++ compiler), "auto" runs the serial step instead, with a logged
            warning, and :attr:`serial_reason` says why (so do the device collectives).
        bucket_mb: megabytes of gradients per bucket of the pipelined step (a byte at least).
        reduce_on_device: with sharded state over several ranks, reduce-scatter the
            gradients and all-gather the new weights on the devices, over ``process_group``
            (:mod:`moestack.optim.device_comm`): ``"auto"`` (the default) where every
            parameter is on a GPU (NCCL); True forces it (CPU parameters over gloo too);
            False keeps the collectives on the host (gloo).
        update_in_backward: a pipelined step updates each bucket as soon as its gradients
            land, during backward (no clipping then: ``clip_grad_norm_`` refuses; a
            non-finite loss cannot be skipped; accumulate micro-batches inside
            :meth:`no_sync`). Without it the buckets are stepped at ``step()``.
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
        fused_step: str = "auto",
        update_delay: int = 0,
        delay_warmup: int = 1,
        pipeline: bool | str = "auto",
        bucket_mb: float = buckets.DEFAULT_BUCKET_MB,
        update_in_backward: bool = False,
        reduce_on_device: bool | str = "auto",
    ) -> None:
        update.check_hparams(lr, betas, eps, weight_decay, where="")
        update.check_offload(offload)
        fused.check_choice(fused_step)
        switches.check_switch("pipeline", pipeline)
        switches.check_switch("reduce_on_device", reduce_on_device)
        _check_delay(update_delay, delay_warmup, in_place, update_in_backward)
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r}: give a positive number of megabytes")
        self.bucket_bytes = int(bucket_mb * 2**20)
        if self.bucket_bytes < 1:
            raise ValueError(
                f"bucket_mb={bucket_mb!r} makes buckets of 0 bytes: give bucket_mb >= {2**-20:.3g}"
                " (one byte; tens of megabytes pay)"
            )
        self.update_in_backward = bool(update_in_backward)
        self.update_delay, self.delay_warmup = int(update_delay), int(delay_warmup)
        self.moment_dtype = update.parse_moment_dtype(moment_dtype)
        self._built = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.shard_state = bool(shard)
        self.overlap = bool(overlap)
        self.skip_idle_experts = bool(skip_idle_experts)
        self._join_process_group(process_group)
        self._collect_params(expert_params, expert_pattern)
        self._decide(in_place, fused_step, pipeline, reduce_on_device)
        self._lay_out_state()
        self._reset_step_state()
        self._setup_transfers()
        self._built = True
        log.info(
            "OffloadAdamW: %d tensors, %d elements, %d shard(s), this rank holds %d "
            "(in_place=%s, moments %s, fused step %s)",
            *(len(self._params), self._plan.total, self.num_shards, self._plan.own_size),
            *(self.in_place, self.moment_dtype, fused.describe(self._fused)),
        )

    # ----------------------------------------------------------------- construction steps

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a group's hyper-parameters; groups cannot be added after construction."""
        if getattr(self, "_built", False):
            raise NotImplementedError(
                "OffloadAdamW lays out its host state at construction; build a new optimizer "
                "with all param groups instead of calling add_param_group later"
            )
        update.check_group(param_group, self.defaults)
        super().add_param_group(param_group)
        update.check_floating(self.param_groups[-1]["params"])

    def _join_process_group(self, process_group: Any) -> None:
        """Find this rank's place among the data-parallel ranks."""
        self._ranks = collectives.join(process_group)
        self._device_group = process_group  # the device collectives' (the host's may be gloo)
        self.world_size, self.rank = self._ranks.world_size, self._ranks.rank
        self._dist = self._ranks.distributed

    def _collect_params(
        self, expert_params: Iterable[Tensor] | None, expert_pattern: str | None
    ) -> None:
        """Flatten the param groups into one list of parameters, names and group indices."""
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
        self._is_expert = expert_flags(self._params, self._names, expert_params, expert_pattern)

    def _decide(
        self, in_place: bool | None, fused_step: str, pipeline: bool | str, on_device: bool | str
    ) -> None:
        """Decide the shards, in place or not, the fused step's mode, the pipeline, where
        the collectives run and the buffers (:func:`plan_offload`, the rules a memory plan
        counts with too). A pipelined step and device collectives need the fused kernel now
        (neither has a reference path): without one, "auto" plans again without them."""
        self.serial_reason: str | None = None  # why "auto" fell back to the serial step
        self._plan_with(in_place, fused_step, pipeline, on_device)
        needs_kernel = self._layout.pipelined or self._layout.device_reduce
        devices = {p.device for p in self._params}
        forced = _forced(pipeline=pipeline, reduce_on_device=on_device)
        if needs_kernel and len(devices) > 1:  # their streams and events are one device's
            if forced:
                raise ValueError(
                    f"{forced} every parameter on one device, not "
                    f"{sorted(map(str, devices))}; use 'auto'"
                )
            self.serial_reason = (
                f"the parameters are on several devices {sorted(map(str, devices))}"
            )
            log.info("OffloadAdamW: %s: the serial step runs", self.serial_reason)
            self._plan_with(in_place, fused_step, False, False)
            needs_kernel = False
        if needs_kernel and not self._fused.resolve():
            why = self._fused.why_not or "no backend loads"
            if forced:
                raise RuntimeError(
                    f"{forced} the fused host step's kernel, and none loads here ({why}); "
                    "install a C++ compiler (or set CXX), or use 'auto'"
                )
            self._fall_back_to_serial(why, in_place, fused_step)
        if self.update_in_backward and not self._layout.pipelined:
            because = f": {self.serial_reason}" if self.serial_reason else ""
            raise ValueError(
                "update_in_backward=True needs the pipelined step, which these settings do "
                f"not take (see OffloadAdamW's pipeline argument){because}"
            )

    def _fall_back_to_serial(self, why: str, in_place: bool | None, fused_step: str) -> None:
        """Plan again without the pipelined step or device collectives "auto" chose, whose
        host updates need the fused kernel, where none loads; say so (a GPU run is then
        several times slower, see docs/optim.md)."""
        planned = {
            "the pipelined step": self._layout.pipelined,
            "the device collectives": self._layout.device_reduce,
        }
        lost = [name for name, on in planned.items() if on]
        self.serial_reason = f"the fused host step's kernel does not load ({why})"
        log.warning(
            "OffloadAdamW: %s turned off, the serial step runs instead: %s; install a C++ "
            "compiler (g++, or set CXX) for the native kernel",
            " and ".join(lost),
            self.serial_reason,
        )
        self._plan_with(in_place, fused_step, False, False)

    def _plan_with(
        self, in_place: bool | None, fused_step: str, pipeline: bool | str, on_device: bool | str
    ) -> None:
        """The plan, and the fused step it asks for."""
        self._layout = plan_offload(
            [ParamSpec.of(p) for p in self._params],
            *(self._group_of, self._is_expert),
            world_size=self.world_size if self._dist else 1,
            rank=self.rank,
            shard=self.shard_state,
            fused_step=fused_step,
            moment_dtype=self.moment_dtype,
            in_place=in_place,
            update_delay=self.update_delay,
            pipeline=pipeline,
            overlap=self.overlap,
            skip_idle_experts=self.skip_idle_experts,
            reduce_on_device=on_device,
            backend=device_comm.backend_of(self._device_group) if self._dist else None,
        )
        self._plan = self._layout.shards
        self.num_shards = self._plan.num_shards
        self.my_shard = self._plan.my_shard
        self.in_place = self._layout.in_place
        self._fused = None
        if self._layout.mode is not None:
            self._fused = fused.FusedHostStep(
                *(fused_step, self._layout.mode, self._layout.split, self._layout.staging_dtype),
                dtypes={p.dtype for p in self._params},
                moment_dtype=self.moment_dtype,
                grad_dtype=self._layout.grad_dtype,
                kept=16
                + 2 * len(self.param_groups) * (1 + 4 * self._plan.total // self.bucket_bytes),
            )

    def _lay_out_state(self) -> None:
        """Allocate this rank's host buffers, as the plan lists them."""
        self._host = transfer.alloc_host_buffers(self._layout.host, transfer.pinned(self._params))

    def _reset_step_state(self) -> None:
        """Step counters and the per-step bookkeeping of gradients, all empty."""
        self._steps = [0] * len(self._params)
        self._span_cache: dict[Any, list[tuple[int, int, int, int]]] = {}
        self._grads_ready = False
        self._moment_scratch: Tensor | None = None  # fp32 slices of bf16 moments
        # the clipping factors applied since the gradients landed: the fused step applies
        # them as it reads the gradients, and a norm measured on p.grad is scaled by them
        self._grad_scale = 1.0
        self._pending: _PendingUpdate | _PendingBuckets | None = None  # delayed: in flight
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # delayed updates
        self._copies_done: Any = None  # CUDA event: the weights copied back have left the host
        self._idle: set[int] = set()  # indices (into the plan's units) of owned units skipped now
        self._active = [False] * len(self._params)
        self._stamps: dict[int, tuple[int, int]] = {}  # direct split: (address, version) seen
        self._loaded_prints: dict[int, tuple[int, ...]] = {}  # direct split: weights as loaded

    def _setup_transfers(self) -> None:
        """The side stream (or the pipeline's streams), the device scratch and, with
        overlap, the gradient hooks."""
        self._hooks: list[Any] = []
        self._hooked = [False] * len(self._params)
        self._pipe: buckets.Pipeline | None = None
        if self._layout.pipelined:
            specs = [ParamSpec.of(p) for p in self._params]
            trainable = [p.requires_grad for p in self._params]
            cut = buckets.make_buckets(specs, trainable, self.bucket_bytes)
            self._pipe = buckets.Pipeline(cut, len(self._params), self._params[0].device)
        self._dcomm: device_comm.DeviceComm | None = None
        if self._layout.device_reduce:  # no hooks: the gradients stay until the reduction
            device = self._params[0].device
            dtype = self._layout.grad_dtype
            self._dcomm = device_comm.DeviceComm(self._plan, device, dtype, self._device_group)
        on_host = self._pipe is None and self._dcomm is None
        self._side = transfer.side_stream(self._params, self.overlap) if on_host else None
        self._scratch = transfer.DeviceScratch(self._params)  # see _to_host / _to_device
        self._defer_copies = False  # inside no_sync(): hooks start no copies
        if (self._side is not None and not self.in_place) or self._pipe is not None:
            # The hooks hold the optimizer weakly: a hook registry lives in C++, out of reach
            # of Python's garbage collector, so a strong reference would keep a dropped
            # optimizer (and its device scratch) alive as long as the parameters.
            hook = transfer.weak_grad_hook(self)
            for p in self._params:
                if p.requires_grad:  # torch refuses hooks on frozen tensors
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    @property
    def pipelined(self) -> bool:
        """Whether the step runs bucket by bucket (:mod:`moestack.optim.buckets`)."""
        return self._pipe is not None

    @property
    def host_step(self) -> str:
        """How a step runs on the host: ``"in_place"``, ``"native"`` or ``"compile"`` (the
        fused step), ``"off"`` (the reference path), or ``"pending"`` (fused, its kernel is
        chosen at the first step)."""
        return "in_place" if self.in_place else fused.backend_of(self._fused)

    @property
    def _direct(self) -> bool:
        """The fused step reads ``p.grad`` and writes ``p.data`` itself (no pack, no copy)."""
        return self._fused is not None and self._fused.mode == fused.DIRECT

    def host_buffers(self) -> dict[str, Tensor]:
        """Every host tensor this optimizer owns, by role (for memory accounting)."""
        out = self._host.by_role()
        if self._moment_scratch is not None:
            out["bf16_moment_scratch"] = self._moment_scratch
        return out

    def device_buffers(self) -> dict[str, Tensor]:
        """Every device tensor this optimizer owns (the dtype-change scratch, once used; the
        device collectives' buffers)."""
        out = {f"xfer_scratch/{dev}": buf for dev, buf in self._scratch.buffers.items()}
        if self._dcomm is not None:
            out.update(self._dcomm.buffers())
        return out

    # ----------------------------------------------------------------------- gradients

    def _grad_hook(self, p: Tensor) -> None:
        """Post-accumulate-grad hook (CUDA): start this gradient's copy to the host."""
        i = self._index[id(p)]
        if self._defer_copies:  # inside no_sync(): a later backward copies the sum
            self._hooked[i] = False
            return
        if self._pipe is not None:
            self._land_grad(i, p)
            return
        assert self._side is not None and self._host.comm is not None
        grad = p.grad
        if grad is None:
            return
        transfer.wait_for_compute(self._side, p.device)
        with transfer.on_stream(self._side):
            transfer.pack_grad(self._host.comm, self._plan, i, grad.view(-1), True, self._to_host)
            grad.record_stream(self._side)
        self._hooked[i] = True
        self._grads_ready = False

    def _land_grad(self, i: int, p: Tensor) -> None:
        """Pipelined hook: queue parameter i's gradient to the host on the pipeline's copy
        stream; when it completes its bucket, the bucket's norm and event (and with
        ``update_in_backward`` its update)."""
        pipe, grad = self._pipe, p.grad
        assert pipe is not None and self._host.comm is not None
        b = pipe.bucket_of[i]
        if grad is None or b is None:
            return
        if pipe.submitted[b]:
            raise RuntimeError(
                f"a gradient of {self._names[i]!r} accumulated after its bucket was updated: "
                "with update_in_backward=True run every micro-batch but the last inside "
                "optimizer.no_sync()"
            )
        if self._pending is None:  # an exact update of this bucket reads its host memory (a
            pipe.wait_update(b)  # delayed one reads the other gradient buffer)
        with pipe.d2h_stream():
            transfer.pack_grad(self._host.comm, self._plan, i, grad.view(-1), True, self._to_host)
            if grad.is_cuda:
                grad.record_stream(torch.cuda.current_stream(grad.device))
            done = pipe.arrive(i)
            if done is not None:
                pipe.land(done, *self._grads_of(pipe.buckets[done].pidxs))
        self._hooked[i] = True
        self._grads_ready = False
        if done is not None and self.update_in_backward:
            self._submit_buckets([done], list(pipe.buckets[done].pidxs))

    def _grads_of(self, pidxs: Sequence[int]) -> tuple[list[int], list[Tensor]]:
        """Those of parameters ``pidxs`` that have a gradient, and their gradients."""
        have = [i for i in pidxs if self._params[i].grad is not None]
        return have, [self._params[i].grad for i in have]  # type: ignore[misc]

    def _land_remaining(self) -> None:
        """Pipelined: pack the gradients no hook sent (no overlap, frozen or unused
        parameters) and land every bucket not landed yet."""
        pipe = self._pipe
        assert pipe is not None and self._host.comm is not None
        for b, bucket in enumerate(pipe.buckets):
            if pipe.landed[b]:
                continue
            if self._pending is None:
                pipe.wait_update(b)
            with pipe.d2h_stream():
                for i in sorted(pipe.waiting[b]):
                    g = self._params[i].grad
                    if g is not None:
                        flat = g.view(-1)
                        transfer.pack_grad(
                            self._host.comm, self._plan, i, flat, True, self._to_host
                        )
                have, grads = self._grads_of(bucket.pidxs)
                for g in grads:  # read on the copy stream: not freed before it has read them
                    if g.is_cuda:
                        g.record_stream(torch.cuda.current_stream(g.device))
                pipe.land(b, have, grads)

    def _submit_buckets(
        self, todo: Sequence[int], pidxs: Sequence[int], grads: Tensor | None = None
    ) -> list[tuple[int, list[int]]]:
        """Pipelined: start the host updates of buckets ``todo`` (in this order), whose
        parameters with gradients are ``pidxs``, with this step's hyper-parameters; return
        each bucket with the parameters it steps. A delayed update (``grads``: the gradient
        buffer handed to it) leaves its weights on the host for :meth:`_send_pending`."""
        pipe = self._pipe
        assert pipe is not None
        self._start_update(pidxs)
        steps, scale, want = list(self._steps), self._grad_scale, set(pidxs)
        hparams = [update.group_hparams(group) for group in self.param_groups]
        host = self._host
        if grads is None:
            pipe.mark_compute(todo)  # what the compute stream has queued reads the weights
        else:
            host = dataclasses.replace(self._host, grad=grads, comm=None)
            pipe.mark_launch()  # the worker waits for this step's gradients by it
        out = []
        for b in todo:
            mine = [i for i in pipe.buckets[b].pidxs if i in want]
            jobs = []
            for gi, hp in enumerate(hparams):
                spans = buckets.bucket_spans(self._plan, mine, gi, steps, pipe.span_cache)
                if spans:
                    jobs.append((spans, hp))
            job = functools.partial(self._update_bucket, b, jobs, steps, scale, mine, host)
            pipe.submit(b, job, sends=grads is None)
            out.append((b, mine))
        return out

    def _update_bucket(
        self,
        b: int,
        jobs: list[tuple[list[tuple[int, int, int, int]], dict[str, float]]],
        steps: list[int],
        scale: float,
        pidxs: list[int],
        host: transfer.HostBuffers,
    ) -> None:
        """The worker's part of bucket b: once its gradients are on the host and its last
        weights have left, the host step of its slices of ``host``, then (exact: ``host``
        is the optimizer's own buffers) its weights back, after the compute queued when the
        update was submitted (it may still read them)."""
        pipe = self._pipe
        assert pipe is not None
        exact = host is self._host
        if exact:
            pipe.wait_landed(b)
        else:  # a later step's landing may have recorded the bucket's event again by now
            pipe.wait_launched()
        pipe.wait_sent(b)
        with torch.no_grad():
            self._step_spans(jobs, host, steps, scale)
            if exact:
                pipe.send_back(b, functools.partial(self._copy_back, pidxs))

    def _copy_back(self, pidxs: Sequence[int]) -> None:
        """Pipelined: the updated weights of parameters ``pidxs`` into them, bf16 ones from
        the staging buffer, fp32 ones from the master (no dtype changes on the way)."""
        staged, master = self._host.staging, self._host.master
        assert master is not None
        for i in pidxs:
            flat = self._params[i].data.view(-1)
            src = staged if staged is not None and staged.dtype == flat.dtype else master
            assert src.dtype == flat.dtype, (src.dtype, flat.dtype)
            for s in self._plan.segs_of[i]:
                dst = flat[s.start : s.start + s.numel]
                self._to_device(dst, src[s.off : s.off + s.numel], non_blocking=dst.is_cuda)

    def _sync_grads(self) -> None:
        """Make the averaged gradients of this rank's shard ready on the host."""
        if self._grads_ready:
            return
        if self._pipe is not None:
            self._active = [p.grad is not None for p in self._params]
            outside = [
                i for i, a in enumerate(self._active) if a and self._pipe.bucket_of[i] is None
            ]
            if outside:
                raise RuntimeError(
                    f"{self._names[outside[0]]!r} has a gradient but was frozen when the "
                    "optimizer was built, so the pipelined step has no bucket for it; build "
                    "the optimizer after setting requires_grad"
                )
            self._land_remaining()
            self._idle = set()
            self._grads_ready = True
            return
        self._resolve_fused()
        self._active = collectives.any_rank([p.grad is not None for p in self._params], self._ranks)
        self._grad_scale = 1.0
        if self._dcomm is not None:  # summed on the devices; the step takes the mean
            assert self._host.grad is not None
            self._dcomm.reduce_grads(self._params, self._host.grad)
            self._grad_scale = 1.0 / self.num_shards
        elif not self.in_place and not self._direct:
            assert self._host.comm is not None and self._host.grad is not None
            self._pack_remaining_grads()
            collectives.average_grads(
                self._host.comm, self._host.grad, self.num_shards > 1, self._ranks
            )
        self._idle = (
            update.idle_experts(self._plan, self._active, self._unit_grad)
            if self.skip_idle_experts
            else set()
        )
        self._grads_ready = True

    def _resolve_fused(self) -> None:
        """Choose the fused step's kernel (at the first step); without one, run the reference
        path from now on, with the gradient buffers the direct mode did without."""
        if self._fused is not None and not self._fused.resolve():
            self._fused = None
            transfer.for_reference_path(self._host, self._plan, self._params)

    def _pack_remaining_grads(self) -> None:
        """Wait for the copies the hooks started; copy every gradient they did not."""
        assert self._host.comm is not None
        transfer.synchronize(self._side)
        for i, p in enumerate(self._params):
            if self._hooked[i] and p.grad is not None:
                continue
            flat = p.grad.view(-1) if p.grad is not None else None
            transfer.pack_grad(self._host.comm, self._plan, i, flat, False, self._to_host)
        self._hooked = [False] * len(self._params)

    def _unit_grad(self, u: Unit) -> Tensor:
        if self.in_place or self._direct:
            g = self._params[u.pidx].grad
            assert g is not None
            return g.view(-1)[u.start : u.start + u.numel]
        assert self._host.grad is not None
        return self._host.grad[u.off : u.off + u.numel]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradients to a global 2-norm of ``max_norm``; return the norm.

        Call this instead of ``torch.nn.utils.clip_grad_norm_``: the norm is taken after the
        cross-rank reduction, over every shard, and the gradients the step consumes are scaled
        (when state is offloaded, the device ``.grad`` is left as it is: the fused step
        applies the factor as it reads the gradients, the reference path scales its host
        copy). Same formula as torch: ``coef = min(1, max_norm / (norm + 1e-6))``.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported; OffloadAdamW clips 2-norms")
        total = self.grad_norm()
        self.scale_grads(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The 2-norm of the averaged gradients over every shard, as the step will read them
        (the first half of ``clip_grad_norm_``; expert parallelism combines two of them)."""
        self._sync_grads()
        if self._pipe is not None:  # the buckets' norms, taken on the device as they landed
            return self._pipe.total_norm() * self._grad_scale
        if not self._dist:  # one process: the gradients on the devices are the averaged ones
            norms = update.param_norms([p.grad for p in self._params])
            return update.total_norm(norms) * self._grad_scale
        assert self._host.grad is not None
        local = update.sum_of_squares(self._host.grad[: self._plan.own_size])
        if self.num_shards > 1:
            collectives.sum_over_ranks(local, self._ranks)
        total = local.sqrt()
        if self._fused is not None:  # the norm of the gradients as the step will read them
            total = total * self._grad_scale
        return total

    @torch.no_grad()
    def scale_grads(self, coef: Tensor | float) -> None:
        """Multiply the gradients the next step consumes by ``coef`` (the second half of
        ``clip_grad_norm_``)."""
        self._sync_grads()
        if self._pipe is not None and any(self._pipe.submitted):
            raise RuntimeError(
                "the gradients cannot be scaled: their buckets' updates have started "
                "(update_in_backward=True); build the optimizer without it to clip"
            )
        if self.in_place:
            torch._foreach_mul_([p.grad for p in self._params if p.grad is not None], coef)
        elif self._fused is not None:
            self._grad_scale *= float(coef)
        else:  # the reference path reads its host copy, scaled here; the factor is kept
            assert self._host.grad is not None  # for the norm of the device gradients
            self._host.grad.mul_(coef)
            self._grad_scale *= float(coef)

    # ------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step on this rank's shard, then the updated weights back to the params
        (with ``update_delay``: the previous step's weights, this step's update launched)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_grads()
        if self._pipe is not None and self._delays_now():
            self._launch_buckets(self._pipe)
        elif self._pipe is not None:
            if self._pending is not None:  # not after a delayed update, but for safety
                self.synchronize()
            self._finish_pipelined_step(self._pipe)
        elif self._delays_now():
            self._launch_update()
        else:
            self.synchronize()
            self._start_update()
            self._step_spans(self._jobs(), self._host, self._steps, self._grad_scale)
            self._return_weights(self._active, self._idle)
        self._grads_ready = False
        return loss

    def _finish_pipelined_step(self, pipe: buckets.Pipeline) -> None:
        """Pipelined: start every bucket not started yet (in forward order); the compute
        stream then waits for each bucket's weights, here or (:meth:`wait_per_layer`) in the
        next forward before the layer using them."""
        try:
            todo = [b for b in reversed(range(len(pipe.buckets))) if not pipe.submitted[b]]
            if todo:
                pidxs = [i for b in todo for i in pipe.buckets[b].pidxs if self._active[i]]
                self._submit_buckets(todo, pidxs)
            for b in reversed(range(len(pipe.buckets))):
                if not pipe.covered[b]:
                    pipe.release(b)
            pipe.after_copies()  # later work on the gradients follows their copies
        finally:
            pipe.new_step()
            self._grad_scale = 1.0

    def _launch_buckets(self, pipe: buckets.Pipeline) -> None:
        """Pipelined and delayed: the previous update's weights sent back (the compute
        stream waits for each bucket's, here or in the next forward), this step's gradient
        buffer handed to the worker with the spare in its place, and every bucket's update
        launched (in forward order), its weights left on the host until the next step."""
        try:
            self._send_pending(pipe)
            grads = self._host.swap_grads()
            todo = list(reversed(range(len(pipe.buckets))))
            pidxs = [i for b in todo for i in pipe.buckets[b].pidxs if self._active[i]]
            self._pending = _PendingBuckets(self._submit_buckets(todo, pidxs, grads))
            pipe.after_copies()  # later work on the gradients follows their copies
        finally:
            pipe.new_step()
            self._grad_scale = 1.0

    def _send_pending(self, pipe: buckets.Pipeline) -> None:
        """Pipelined: wait for the delayed update in flight, bucket by bucket in the order
        it runs, and send each one's weights back on the host-to-device stream; the compute
        stream waits for them here, or before the layer using them (:meth:`wait_per_layer`).
        A bucket whose update raised keeps its weights; every other bucket's still go back
        (the device stays in step with the master copy where it can), then the first error
        is raised."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        assert isinstance(pending, _PendingBuckets)
        errors: list[BaseException] = []
        for b, pidxs in pending.buckets:
            try:
                pipe.send_now(b, functools.partial(self._copy_back, pidxs))
            except Exception as err:  # the worker's: raised below, after the others
                errors.append(err)
        for b, _ in pending.buckets:
            if not pipe.covered[b]:
                pipe.release(b)
        if errors:
            raise errors[0]

    def _delays_now(self) -> bool:
        """Whether this step's update is delayed: past the first ``delay_warmup`` updates."""
        return bool(self.update_delay) and max(self._steps, default=0) >= self.delay_warmup

    def _start_update(self, pidxs: Sequence[int] | None = None) -> None:
        """What every update does first: the master weights of parameters stepped for the
        first time taken from them, outside writes taken in, the step counts moved on; of
        the active parameters, or of ``pidxs`` (a pipelined step's buckets)."""
        if pidxs is None:
            pidxs = [i for i, a in enumerate(self._active) if a]
        first = [i for i in pidxs if self._steps[i] == 0]
        if first and not self.in_place:
            self._init_master(first)
        if self._split and self._direct:
            self._take_outside_writes()
        for i in pidxs:
            self._steps[i] += 1

    def _jobs(self) -> list[tuple[list[tuple[int, int, int, int]], dict[str, float]]]:
        """The spans to step and the hyper-parameters of every param group, as they are now
        (a delayed update keeps them: the learning rate is the launching step's)."""
        jobs = []
        for gi, group in enumerate(self.param_groups):
            spans = self._spans(gi)
            if spans:
                jobs.append((spans, update.group_hparams(group)))
        return jobs

    def _step_spans(
        self,
        jobs: list[tuple[list[tuple[int, int, int, int]], dict[str, float]]],
        host: transfer.HostBuffers,
        steps: Sequence[int],
        scale: float,
    ) -> None:
        """AdamW on the spans of ``jobs`` of the buffers ``host`` (a delayed update's view
        reads the gradient buffer it was handed)."""
        for spans, hparams in jobs:
            if self._fused is not None:
                self._fused.run(spans, self._params, host, steps, hparams, scale)
                continue
            runs = update.slices(spans, self._params, host, steps, self.in_place)
            self._moment_scratch = update.step_runs(runs, hparams, self._moment_scratch)

    def _launch_update(self) -> None:
        """Delayed: this step's reduced gradients out of reach of the next backward, the
        previous update's weights into the parameters, this step's update to the worker."""
        grads = self._host.swap_grads()
        self.synchronize()
        self._start_update()
        view = dataclasses.replace(self._host, grad=grads, comm=None)
        args = (self._jobs(), view, list(self._steps), self._grad_scale, self._copies_done)
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="offload-adamw-update"
            )
        future = self._worker.submit(self._run_delayed, *args)
        self._pending = _PendingUpdate(future, self._active, self._idle)

    def _run_delayed(
        self,
        jobs: list[tuple[list[tuple[int, int, int, int]], dict[str, float]]],
        host: transfer.HostBuffers,
        steps: Sequence[int],
        scale: float,
        copies_done: Any,
    ) -> None:
        """The worker's part of a delayed update: once the weights copied back last time have
        left the host buffers, the host step."""
        if copies_done is not None:
            copies_done.synchronize()
        with torch.no_grad():
            self._step_spans(jobs, host, steps, scale)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Apply the delayed update in flight, if any: wait for it, then copy its weights into
        the parameters. Call it before reading the weights between steps (evaluation, a
        checkpoint of the model, the end of training); a no-op without ``update_delay``.
        A pipelined step's updates are waited for here too."""
        if self._pipe is not None:
            self._send_pending(self._pipe)
            self._pipe.drain()
            self._copies_done = None
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        assert isinstance(pending, _PendingUpdate)
        pending.future.result()
        self._return_weights(pending.active, pending.idle)
        self._copies_done = transfer.copies_done(self._side)

    @property
    def _split(self) -> bool:
        """The master weights are the bf16 weights plus remainders (:mod:`.split_master`)."""
        return self._fused is not None and self._fused.split

    def _take_outside_writes(self) -> None:
        """Direct split mode: a parameter written in place since the last step (its version
        moved: ``nn.init``, ``p.copy_`` under no_grad, ``model.load_state_dict``) or replaced
        becomes its master weight exactly (remainders 0). A write through ``p.data`` is not
        versioned: it becomes the master to within half a bf16 ulp (the old remainders).
        Weights written back unchanged after a ``load_state_dict`` of this optimizer (a
        model loaded after it) keep the loaded remainders (:func:`split_master.fingerprint`)."""
        stamps = [(p.data_ptr(), p._version) for p in self._params]
        changed = []
        for i, stamp in enumerate(stamps):
            if self._steps[i] == 0 or self._stamps.get(i, stamp) == stamp:
                continue
            loaded = self._loaded_prints.get(i)
            if loaded is None or split_master.fingerprint(self._params[i]) != loaded:
                changed.append(i)
        if changed:
            split_master.init(self._host, self._plan, self._params, changed, direct=True)
        self._stamps = dict(enumerate(stamps))
        self._loaded_prints = {}

    def _init_master(self, pidxs: list[int]) -> None:
        """Copy the current parameters into the master buffer (first step / load)."""
        assert self._host.master is not None
        if self._split:
            split_master.init(self._host, self._plan, self._params, pidxs, self._direct)
            return
        transfer.init_master(self._host.master, self._plan, self._params, pidxs)

    def _spans(self, gi: int) -> list[tuple[int, int, int, int]]:
        """The slices to step for group gi (:func:`moestack.optim.plan.group_spans`)."""
        per_param = self.in_place or (self._fused is not None and self._fused.per_param)
        state = (self._idle, self._active, self._steps)
        return group_spans(self._plan, gi, *state, per_param, self._span_cache)

    def _return_weights(self, active: Sequence[bool], idle_units: set[int]) -> None:
        """Copy the updated master weights (all shards) of the ``active`` parameters back into
        them, but the idle experts' ``idle_units``; the staged fused step's bf16 weights come
        from its staging buffer."""
        if self.in_place or self._direct:
            return
        if self._dcomm is not None:  # this shard's new weights, gathered on the devices
            assert self._host.master is not None
            own = self._host.staging if self._host.staging is not None else self._host.master
            self._dcomm.gather_weights(self._params, own[: self._plan.own_size], active)
            return
        assert self._host.master is not None and self._host.comm is not None
        src = self._gathered(self._host.master, self._host.comm)
        assert src is not None
        idle = None
        if idle_units and self.num_shards == 1:
            idle = param_ranges(self._plan.units[k] for k in idle_units)
        staged = self._host.staging if self._fused is not None else None
        transfer.return_weights(
            self._params, self._plan, src, active, idle, self._side, self._to_device, staged
        )

    # ------------------------------------------------------------------- host <-> device

    def _xfer_buffer(self, device: torch.device) -> Tensor:
        """The fp32 device scratch through which 16-bit tensors change dtype on the device."""
        return self._scratch.get(device)

    def _to_host(self, dst: Tensor, src: Tensor, non_blocking: bool) -> None:
        """fp32 host ``dst`` <- ``src`` (see :func:`moestack.optim.transfer.copy_to_host`)."""
        transfer.copy_to_host(dst, src, non_blocking, self._xfer_buffer)

    def _to_device(self, dst: Tensor, src: Tensor, non_blocking: bool) -> None:
        """``dst`` <- fp32 host ``src`` (see :func:`moestack.optim.transfer.copy_to_device`)."""
        transfer.copy_to_device(dst, src, non_blocking, self._xfer_buffer)

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
        optimizer), with every update in flight applied first (:meth:`synchronize`) and the
        worker threads stopped; later steps copy gradients synchronously (and start a
        worker again where they need one)."""
        self.synchronize()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._hooked = [False] * len(self._params)
        if self._pipe is not None:
            self._pipe.remove_layer_hooks()
            self._pipe.close()  # its worker thread (a later step starts another)
        if self._worker is not None:  # the delayed update's, idle now
            self._worker.shutdown(wait=True)
            self._worker = None

    def close(self) -> None:
        """Done with this optimizer: the update in flight applied to the parameters, the
        hooks removed and the worker threads stopped (:meth:`remove_hooks`). Dropping a
        delayed optimizer without it would lose the update launched by its last step."""
        self.remove_hooks()

    @torch.no_grad()
    def wait_per_layer(self, model: torch.nn.Module) -> None:
        """Pipelined: let the next forward wait for each layer's weights just before that
        layer (a forward pre-hook on each of ``model``'s layers, :func:`buckets.layers_of`)
        instead of for all of them at the end of ``step()``; the rest of each step's update
        then overlaps the forward. A layer's forward must use only parameters under it or
        under a layer run before it. No-op without the pipelined step."""
        if self._pipe is not None:
            self._pipe.wait_per_layer(buckets.layers_of(model), self._index)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch: clear ``.grad``; also forget host gradients not yet consumed."""
        super().zero_grad(set_to_none=set_to_none)
        self._grads_ready = False
        self._hooked = [False] * len(self._params)
        if self._pipe is not None and not any(self._pipe.submitted):
            self._pipe.new_step()  # gradients dropped before the step: none of them counts
            self._grad_scale = 1.0

    # ------------------------------------------------------------------------ checkpoint

    def _name_of(self, p: Tensor) -> str:
        return self._names[self._index[id(p)]]

    def _gathered(self, buf: Tensor | None, out: Tensor | None = None) -> Tensor | None:
        """The full ``[num_shards * stride]`` buffer of a per-shard buffer, in ``out`` or a new
        tensor (collective when sharded)."""
        if buf is None or self.num_shards == 1:
            return buf
        return collectives.gather_shards(buf, out, self._plan.stride, self._ranks)

    def state_dict(self) -> dict[str, Any]:
        """Full, name-keyed state (collective when sharded: call it on every rank).

        The format is described in :mod:`moestack.optim.state_format`. A delayed update in
        flight is applied first (:meth:`synchronize`).
        """
        self.synchronize()
        transfer.synchronize(self._side)
        if self._split and self._direct:  # writes since the last step count, as a step would
            self._take_outside_writes()
        master = self._host.master
        if self._split:  # saved as fp32, as without the split (one process: nothing to gather)
            master = split_master.joined(self._host, self._plan, self._params, self._direct)
        gathered = {
            "exp_avg": self._gathered(self._host.exp_avg),
            "exp_avg_sq": self._gathered(self._host.exp_avg_sq),
            "master": self._gathered(master),
        }
        state = state_format.pack_state(
            self._plan, self._params, self._names, self._is_expert, self._steps, gathered
        )
        groups = state_format.save_groups(self.param_groups, self._name_of)
        return state_format.assemble(groups, state)

    def own_expert_state(self) -> dict[str, Any]:
        """The entries (:meth:`state_dict`'s) of the expert units this rank's shard holds,
        keyed ``name/expert<local id>``; not collective: nothing is gathered (expert
        parallelism's checkpoints are written by the ranks owning the experts). A delayed
        update in flight is waited for on the host, its weights left to go back (over the
        ranks when sharded) at the next :meth:`synchronize` or step."""
        return state_format.pack_own_experts(
            self._plan, self._params, self._names, self._is_expert, self._steps, self._own_state()
        )

    def own_shard_state(self) -> dict[str, Any]:
        """The pieces (:func:`state_format.pack_own_shard`) of the non-expert parameters in
        this rank's shard; not collective (expert parallelism's checkpoints are written by
        the ranks holding the state; a delayed update in flight is waited for as
        :meth:`own_expert_state` does). Unsharded, rank 0 alone returns them (every rank
        holds the same)."""
        if self.num_shards == 1 and self.rank != 0:
            self.synchronize()  # unsharded: collective-free, and the update in flight ends here
            return {}
        return state_format.pack_own_shard(
            self._plan, self._params, self._names, self._is_expert, self._steps, self._own_state()
        )

    def _own_state(self) -> dict[str, Tensor | None]:
        """This rank's own state buffers, every update in flight ended first: the moments
        and the fp32 master (joined from a split one). Collective-free: sharded, a delayed
        update's weights (gathered over the ranks) are left to go back at the next
        :meth:`synchronize` or step; unsharded it is applied (nothing is gathered)."""
        if self.num_shards > 1 and isinstance(self._pending, _PendingUpdate):
            self._pending.future.result()  # the host state is final; the all-gather waits
        else:
            self.synchronize()
        transfer.synchronize(self._side)
        master = self._host.master
        if self._split:
            master = split_master.joined(self._host, self._plan, self._params, self._direct)
        return {"exp_avg": self._host.exp_avg, "exp_avg_sq": self._host.exp_avg_sq,
                "master": master}  # fmt: skip

    def groups_state(self) -> dict[str, Any]:
        """:meth:`state_dict` without any entry: the param groups alone (not collective)."""
        groups = state_format.save_groups(self.param_groups, self._name_of)
        return state_format.assemble(groups, {})

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict` (any number of ranks); keep this rank's part."""
        state_format.check_format(state_dict)
        self.synchronize()  # an update in flight would write over what is loaded
        transfer.synchronize(self._side)
        state_format.restore_groups(state_dict["param_groups"], self.param_groups, self._name_of)
        state = state_dict["state"]
        targets = self._host.state()
        if self._split:  # the fp32 master is loaded whole, then split
            targets["master"] = torch.zeros(self._plan.host_size, dtype=torch.float32)
        loaded = [self._load_param(i, state, targets) for i in range(len(self._params))]
        init_master = [i for i, has in enumerate(loaded) if has is False]
        if self._split:
            with_master = [i for i, has in enumerate(loaded) if has]
            split_master.load(
                self._host, self._plan, self._params, targets["master"], with_master, self._direct
            )
        if init_master and not self.in_place:
            self._init_master(init_master)
        self._stamps = {i: (p.data_ptr(), p._version) for i, p in enumerate(self._params)}
        if self._split and self._direct:
            self._loaded_prints = {
                i: split_master.fingerprint(p) for i, p in enumerate(self._params)
            }
        self._grads_ready = False

    def _load_param(self, i: int, state: dict[str, Any], targets: dict[str, Tensor]) -> bool | None:
        """Load parameter i's saved state into ``targets``; return whether the state held its
        master weights (False: they must be taken from the parameter), None when the state
        holds nothing for it (it starts afresh)."""
        name, is_expert = self._names[i], self._is_expert[i]
        loaded = state_format.unpack_param(self._plan, state, i, name, is_expert, targets)
        if loaded is None:
            self._steps[i] = 0
            return None
        self._steps[i], has_master = loaded
        return has_master


@dataclass(frozen=True)
class _PendingUpdate:
    """A delayed update in flight: its worker's future, and which parameters (and idle
    experts) it steps, for the copy back."""

    future: concurrent.futures.Future
    active: list[bool]
    idle: set[int]


@dataclass(frozen=True)
class _PendingBuckets:
    """A pipelined delayed update in flight: each bucket (in the order the worker runs
    them, their futures in :attr:`buckets.Pipeline.futures`) and the parameters it steps,
    whose weights go back when the next step (or a synchronize) applies it."""

    buckets: list[tuple[int, list[int]]]


def _forced(**given: bool | str) -> str:
    """The switches ``given`` as True (not "auto"), as the subject of a refusal
    ("pipeline=True needs", "a=True and b=True need"); "" when none is."""
    names = [f"{name}=True" for name, value in given.items() if value is True]
    if not names:
        return ""
    return " and ".join(names) + (" needs" if len(names) == 1 else " need")


def _check_delay(
    update_delay: int, delay_warmup: int, in_place: bool | None, update_in_backward: bool
) -> None:
    """Refuse a delay other than 0 or 1, a negative warm-up, and a delay stepping in place
    or updating in backward."""
    if update_delay not in (0, 1) or isinstance(update_delay, bool):
        raise ValueError(f"update_delay={update_delay!r}: use 0 (exact) or 1 (one step delayed)")
    if not isinstance(delay_warmup, int) or isinstance(delay_warmup, bool) or delay_warmup < 0:
        raise ValueError(f"delay_warmup={delay_warmup!r}: use a whole number of steps >= 0")
    if update_delay and in_place:
        raise ValueError(
            "in_place=True steps the parameters themselves, which a delayed update must leave "
            "as they are while the next step computes; use in_place=None with update_delay=1"
        )
    if update_delay and update_in_backward:
        raise ValueError(
            "update_in_backward=True updates each bucket during its own backward, exactly; "
            "a delayed update runs in the next step's shadow: use one of them"
        )
