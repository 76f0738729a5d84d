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

The class is built from parts, one file each, mixed in: construction (the plan, the host
buffers, the streams and hooks) and the optimizer's lifecycle here; the gradients' way to
the host, their reduction and clipping in :mod:`moestack.optim.offload_grads`; the step and
the delayed update in :mod:`moestack.optim.offload_step`; the bucketed step in
:mod:`moestack.optim.offload_pipeline`; checkpoints in :mod:`moestack.optim.offload_checkpoint`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from moestack.optim import (
    buckets,
    collectives,
    device_comm,
    fused,
    switches,
    transfer,
    update,
)
from moestack.optim.offload_checkpoint import OffloadCheckpoint
from moestack.optim.offload_grads import OffloadGradients
from moestack.optim.offload_pipeline import OffloadPipeline, PendingBuckets
from moestack.optim.offload_plan import plan_offload
from moestack.optim.offload_step import OffloadStep, PendingUpdate
from moestack.optim.plan import (
    DEFAULT_EXPERT_PATTERN,
    ParamSpec,
    expert_flags,
)

log = logging.getLogger(__name__)


class OffloadAdamW(
    OffloadCheckpoint, OffloadStep, OffloadPipeline, OffloadGradients, torch.optim.Optimizer
):
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
        self._pending: PendingUpdate | PendingBuckets | None = None  # delayed: in flight
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

    # ----------------------------------------------------------------- what it holds

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

    # ------------------------------------------------------- hooks, accumulation, closing

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
