"""OffloadAdamW's pipelined step: gradients to the host, updates and weights back, bucket
by bucket (:mod:`moestack.optim.buckets`), exact or delayed.

With every parameter on a GPU in one process, each bucket's gradients cross as they land
in backward (:meth:`_land_grad`), its host update runs in the pipeline's worker thread
(:meth:`_update_bucket`) and its weights go back on a stream of their own
(:meth:`_copy_back`), the compute stream waiting per bucket. A delayed update launches
every bucket at ``step()`` (:meth:`_launch_buckets`) and sends its weights back at the next
one (:meth:`_send_pending`).

The class here is one part of :class:`moestack.optim.offload.OffloadAdamW` (a mixin): it
holds no state of its own and reads what the optimizer's constructor laid out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestack.optim import buckets, transfer, update
from moestack.optim.plan import ShardPlan


class OffloadPipeline:
    """The bucketed step of OffloadAdamW: landing, submitting, updating, sending back."""

    # laid out by OffloadAdamW's constructor (moestack.optim.offload)
    _params: list[Tensor]
    _names: list[str]
    _plan: ShardPlan
    _host: transfer.HostBuffers
    _pipe: buckets.Pipeline | None
    _pending: Any
    _steps: list[int]
    _active: list[bool]
    _hooked: list[bool]
    _grad_scale: float
    _grads_ready: bool
    update_in_backward: bool
    param_groups: list[dict[str, Any]]

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
            self._pending = PendingBuckets(self._submit_buckets(todo, pidxs, grads))
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
        assert isinstance(pending, PendingBuckets)
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


@dataclass(frozen=True)
class PendingBuckets:
    """A pipelined delayed update in flight: each bucket (in the order the worker runs
    them, their futures in :attr:`buckets.Pipeline.futures`) and the parameters it steps,
    whose weights go back when the next step (or a synchronize) applies it."""

    buckets: list[tuple[int, list[int]]]
