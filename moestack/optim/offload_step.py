"""OffloadAdamW's step: the host update of this rank's shard (exact, or delayed in a worker
thread) and the weights back into the parameters.

``step()`` runs the update one of four ways: serial and exact (:meth:`_step_spans`, then
:meth:`_return_weights`), serial and delayed (:meth:`_launch_update`: the update runs in a
worker thread while the next step computes, :meth:`synchronize` applies it), or pipelined,
exact or delayed (:mod:`moestack.optim.offload_pipeline`). Every update first takes the
master weights of parameters stepped for the first time and, with split master weights,
what was written into the parameters since (:meth:`_start_update`).

The class here is one part of :class:`moestack.optim.offload.OffloadAdamW` (a mixin): it
holds no state of its own and reads what the optimizer's constructor laid out.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestack.optim import buckets, collectives, device_comm, fused, split_master, transfer, update
from moestack.optim.plan import ShardPlan, group_spans, param_ranges


class OffloadStep:
    """The update half of OffloadAdamW: ``step()``, the delayed update, the copy back."""

    # laid out by OffloadAdamW's constructor (moestack.optim.offload)
    _params: list[Tensor]
    _plan: ShardPlan
    _host: transfer.HostBuffers
    _pipe: buckets.Pipeline | None
    _dcomm: device_comm.DeviceComm | None
    _fused: fused.FusedHostStep | None
    _side: Any
    _ranks: Any
    _steps: list[int]
    _active: list[bool]
    _idle: set[int]
    _grad_scale: float
    _grads_ready: bool
    _pending: Any
    _worker: concurrent.futures.ThreadPoolExecutor | None
    _copies_done: Any
    _span_cache: dict[Any, list[tuple[int, int, int, int]]]
    _moment_scratch: Tensor | None
    _stamps: dict[int, tuple[int, int]]
    _loaded_prints: dict[int, tuple[int, ...]]
    in_place: bool
    num_shards: int
    update_delay: int
    delay_warmup: int
    param_groups: list[dict[str, Any]]

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
        self._pending = PendingUpdate(future, self._active, self._idle)

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
        assert isinstance(pending, PendingUpdate)
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

    def _gathered(self, buf: Tensor | None, out: Tensor | None = None) -> Tensor | None:
        """The full ``[num_shards * stride]`` buffer of a per-shard buffer, in ``out`` or a new
        tensor (collective when sharded)."""
        if buf is None or self.num_shards == 1:
            return buf
        return collectives.gather_shards(buf, out, self._plan.stride, self._ranks)


@dataclass(frozen=True)
class PendingUpdate:
    """A delayed update in flight: its worker's future, and which parameters (and idle
    experts) it steps, for the copy back."""

    future: concurrent.futures.Future
    active: list[bool]
    idle: set[int]
