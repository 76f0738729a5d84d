"""The pipelined step of OffloadAdamW: gradient buckets stepped as they may be.

Why: a serial offloaded step waits for every gradient, measures the clipping norm in a host
pass over all of them, steps all the state, then sends every weight back while the device
sits idle (3.04x a device AdamW step on an H200, BENCHMARKS.md). Here the parameters are cut
into buckets of about ``bucket_mb`` of gradients, in the order backward produces them (the
model's last parameters first). For each bucket:

1. its gradients leave the device from the post-accumulate-grad hooks, in their own dtype
   (bf16 gradients cross as bf16, into a bf16 host buffer the host kernel reads as it is),
   on a device-to-host stream; when its last gradient has landed an event is recorded there
   and each of its gradients' fp32 2-norms is taken on the device (one small reduction)
   into a per-parameter vector, so the clipping norm needs no host pass (the vector is
   combined as the serial step combines its own: :func:`update.total_norm`);
2. its host update runs in a worker thread: at ``step()`` (with the clipping factor of the
   summed norms, if ``clip_grad_norm_`` was called), buckets in forward order; or, with
   ``update_in_backward`` (no clipping then), at once when the bucket lands;
3. its weights start back the moment its update ends, on a host-to-device stream of their
   own, and an event marks them there: the compute stream waits per bucket, either at the
   end of ``step()`` or, with :meth:`OffloadAdamW.wait_per_layer`, in the next forward just
   before the layer that uses them.

With a delayed update (``update_delay=1``) steps 1 and 2 run as above, but every bucket's
update is handed to the worker at ``step()`` and its weights stay on the host: the next
``step()`` waits for each bucket's update and sends its weights back
(:meth:`Pipeline.send_now`), after the compute queued by then (the backward that read the
weights before the update).

The arithmetic is the fused host step's, element by element, and the clipping norm is the
serial step's, so the results are bitwise the serial step's, clipped or not.
No buffer or event is made per step (the worker's futures and the norms' scalars, from the
caching allocator, aside): the events, the norms' buffers and the slices each bucket steps
are made once (the slices at a bucket's first step).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestack.optim import transfer, update
from moestack.optim.plan import ParamSpec, ShardPlan, contiguous_runs

DEFAULT_BUCKET_MB = 32.0  # of gradient bytes: tens of MB, as DDP's and DeepSpeed's buckets


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients cross to the host and are stepped together."""

    pidxs: tuple[int, ...]  # in the order backward produces their gradients
    nbytes: int  # of their gradients


def make_buckets(
    specs: Sequence[ParamSpec], trainable: Sequence[bool], bucket_bytes: int
) -> list[Bucket]:
    """Buckets of consecutive trainable parameters, last parameter first (backward's order),
    each of at most ``bucket_bytes`` of gradients; a larger parameter has one of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size {bucket_bytes} bytes: give a positive size")
    buckets: list[Bucket] = []
    pidxs: list[int] = []
    size = 0
    for i in reversed(range(len(specs))):
        if not trainable[i]:
            continue
        nbytes = specs[i].numel * specs[i].dtype.itemsize
        if pidxs and size + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(pidxs), size))
            pidxs, size = [], 0
        pidxs.append(i)
        size += nbytes
    if pidxs:
        buckets.append(Bucket(tuple(pidxs), size))
    return buckets


def refusal(
    specs: Sequence[ParamSpec],
    *,
    distributed: bool,
    skip_idle_experts: bool,
    fused_step: str,
    in_place: bool | None,
) -> str | None:
    """Why these settings cannot take the pipelined step (None: they can)."""
    if distributed:
        return "several ranks reduce their gradients on the host after backward"
    if skip_idle_experts:
        return "skip_idle_experts looks at every expert's gradient before any update"
    if fused_step == "off":
        return "fused_step='off' runs the reference path, which steps all the state at once"
    if in_place:
        return "in_place=True steps the parameters themselves"
    if not specs or any(s.dtype not in (torch.float32, torch.bfloat16) for s in specs):
        return "its parameters must be float32 or bfloat16"
    return None


def on_devices(specs: Sequence[ParamSpec]) -> bool:
    """Whether every parameter is on a GPU (where the pipelined step pays)."""
    return bool(specs) and all(s.device != "cpu" for s in specs)


def grad_buffer_dtype(specs: Sequence[ParamSpec]) -> torch.dtype:
    """The dtype gradients cross in: bf16 when every parameter is bf16 (half the bytes, no
    device scratch), else fp32."""
    return torch.bfloat16 if all(s.dtype == torch.bfloat16 for s in specs) else torch.float32


class Pipeline:
    """The buckets of one OffloadAdamW and what each is doing this step.

    Per bucket: the parameters not landed yet, the event of its gradients on the host, its
    squared norm on the device, its host update (a future of the worker thread) and the event
    of its weights back on the device. :meth:`new_step` starts the next step's bookkeeping;
    the updates of the last step may still be running then (their buckets are waited for
    before anything writes into their host memory again).
    """

    def __init__(
        self,
        buckets: list[Bucket],
        num_params: int,
        device: torch.device,
        *,
        streams: bool | None = None,
    ) -> None:
        """``streams``: whether to order the copies with ``torch.cuda`` streams and events;
        None (the optimizer's choice): exactly when ``device`` is a GPU. True on a CPU
        device is for tests, which replace ``torch.cuda``'s streams and events with a model
        of their ordering (tests/optim/test_buckets_streams.py)."""
        self.buckets = buckets
        self.bucket_of: list[int | None] = [None] * num_params
        for b, bucket in enumerate(buckets):
            for i in bucket.pidxs:
                self.bucket_of[i] = b
        self.device = device
        cuda = device.type == "cuda" if streams is None else streams
        self.d2h = torch.cuda.Stream(device=device) if cuda else None
        self.h2d = torch.cuda.Stream(device=device) if cuda else None
        n = len(buckets)
        # the worker thread blocks on these (Event.synchronize): made to sleep, not spin
        self.landed_events = [transfer.host_event() for _ in range(n)] if cuda else None
        self.back_events = [transfer.host_event() for _ in range(n)] if cuda else None
        # per bucket, the compute stream's work queued when its update was submitted
        self.queued_events = [torch.cuda.Event() for _ in range(n)] if cuda else None
        # one stream's work so far, for the other to wait on (Stream.wait_stream would make
        # an event per call); a wait is on the record made before it, so one event each serves
        self._compute_mark = torch.cuda.Event() if cuda else None
        self._d2h_mark = torch.cuda.Event() if cuda else None
        # delayed updates: this step's copies to the host, for the worker to wait on (made
        # once; recorded only when an update is launched, so never for a later step's)
        self.launched_event = transfer.host_event() if cuda else None
        self._back_recorded = [False] * n
        # each parameter's gradient norm, in parameter order (0: no gradient), the one
        # clipping norm's input (update.total_norm), and its fp64 scratch
        self.norms_P = torch.zeros(num_params, dtype=torch.float32, device=device)
        self._wide_P = torch.zeros(num_params, dtype=torch.float64, device=device)
        self._slots = [torch.tensor(b.pidxs, device=device) for b in buckets]  # where they go
        self._partial: dict[tuple[int, ...], Tensor] = {}  # _partial_slots, per set
        self.span_cache: dict[tuple[int, tuple[int, ...]], list[tuple[int, int, int, int]]] = {}
        self.futures: list[concurrent.futures.Future | None] = [None] * n
        self.unreleased = [False] * n  # updated, not yet waited for by the compute stream
        self._job_sends = [True] * n  # its last update's job sends its weights back itself
        self.covered = [False] * n  # a layer's forward pre-hook waits for it (wait_per_layer)
        self._layer_hooks: list[Any] = []
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.new_step()

    def new_step(self) -> None:
        """Nothing landed, nothing submitted: the next step's bookkeeping."""
        self.waiting = [set(b.pidxs) for b in self.buckets]
        self.landed = [False] * len(self.buckets)
        self.submitted = [False] * len(self.buckets)

    # ------------------------------------------------------------ gradients to the host

    def d2h_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Run the enclosed copies and norms on the device-to-host stream, after the work the
        compute stream has queued so far (it produced the gradients)."""
        if self.d2h is None:
            return contextlib.nullcontext()
        assert self._compute_mark is not None
        self._compute_mark.record(torch.cuda.current_stream(self.device))
        self.d2h.wait_event(self._compute_mark)
        return torch.cuda.stream(self.d2h)

    def _after_d2h(self) -> None:
        """Order the current (compute) stream after the copies and norms queued so far on the
        device-to-host stream (no host wait)."""
        if self.d2h is not None:
            assert self._d2h_mark is not None
            self._d2h_mark.record(self.d2h)
            torch.cuda.current_stream(self.device).wait_event(self._d2h_mark)

    def arrive(self, pidx: int) -> int | None:
        """Parameter ``pidx``'s gradient was queued to the host; its bucket if that was the
        bucket's last (None otherwise)."""
        b = self.bucket_of[pidx]
        if b is None:
            return None
        if self.landed[b]:  # accumulated again (no no_sync): the bucket lands anew
            self.landed[b] = False
            self.waiting[b] = set(self.buckets[b].pidxs)
        self.waiting[b].discard(pidx)
        return b if not self.waiting[b] else None

    def land(self, b: int, pidxs: Sequence[int], grads: Sequence[Tensor]) -> None:
        """Bucket ``b`` is complete: the 2-norms of ``grads`` (those of its parameters
        ``pidxs`` that have one) taken on the device into :attr:`norms_P`
        (:func:`update.grad_norms`, one small reduction), and its event recorded after its
        copies. Call inside :meth:`d2h_stream`."""
        slots = self._slots[b]
        if len(pidxs) != len(self.buckets[b].pidxs):  # some have no gradient: theirs are 0
            self.norms_P.index_fill_(0, slots, 0.0)
            slots = self._partial_slots(pidxs)
        if grads:
            self.norms_P.index_copy_(0, slots, update.grad_norms(grads))
        if self.landed_events is not None:
            self.landed_events[b].record()
        self.landed[b] = True

    def _partial_slots(self, pidxs: Sequence[int]) -> Tensor:
        """The device index of parameters ``pidxs`` (a bucket's with a gradient this step),
        made once per set: a tensor built from a list each step would allocate and make the
        host wait on a copy."""
        key = tuple(pidxs)
        slots = self._partial.get(key)
        if slots is None:
            if len(self._partial) > 4 * len(self.buckets):  # the sets keep changing
                self._partial.clear()
            slots = torch.tensor(key, dtype=torch.long).to(self.device)
            self._partial[key] = slots
        return slots

    def total_norm(self) -> Tensor:
        """The 2-norm over every bucket (fp32, on the device), once all have landed: the
        parameters' norms combined by :func:`update.total_norm`, as the serial step does."""
        self._after_d2h()
        return update.total_norm(self.norms_P, self._wide_P)

    # ------------------------------------------------------------------ host updates

    def submit(self, b: int, job: Callable[[], None], sends: bool = True) -> None:
        """Run bucket ``b``'s host update ``job`` in the worker thread (after those submitted
        before it); ``sends``: the job sends the weights back itself (a delayed update's are
        sent by :meth:`send_now` at the next step)."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="offload-adamw-buckets"
            )
        self.submitted[b] = True
        self._job_sends[b] = sends
        if sends:
            self.unreleased[b] = True
        self.futures[b] = self._worker.submit(job)

    def mark_launch(self) -> None:
        """A delayed update is launched: mark the copies to the host queued so far (this
        step's gradients) for :meth:`wait_launched`."""
        if self.d2h is not None:
            assert self.launched_event is not None
            self.launched_event.record(self.d2h)

    def wait_launched(self) -> None:
        """Block (the worker) until the gradients of the launched update are on the host."""
        if self.launched_event is not None:
            self.launched_event.synchronize()

    def send_now(self, b: int, copies: Callable[[], None]) -> None:
        """A delayed update's bucket ``b``, ended: its weights back (``copies``) on the
        host-to-device stream after the compute queued so far (it read the weights before
        the update), for the compute stream to wait for (:meth:`release`)."""
        self.wait_update(b)
        self.mark_compute([b])
        self.send_back(b, copies)
        self.unreleased[b] = True

    def wait_landed(self, b: int) -> None:
        """Block (the worker) until bucket ``b``'s gradients are in host memory."""
        if self.landed_events is not None:
            self.landed_events[b].synchronize()

    def wait_sent(self, b: int) -> None:
        """Block (the worker) until bucket ``b``'s last weights back have left host memory,
        before its update writes over them."""
        if self.back_events is not None and self._back_recorded[b]:
            self.back_events[b].synchronize()

    def mark_compute(self, todo: Sequence[int]) -> None:
        """Record, for each bucket of ``todo`` about to be submitted, the work queued on the
        current (compute) stream so far (it may still read the weights), for
        :meth:`send_back` to wait on. A bucket's event is recorded again only once its last
        update ended (its gradients landed after it), so no update waits on a later one's."""
        if self.queued_events is None:
            return
        stream = torch.cuda.current_stream(self.device)
        for b in todo:
            self.queued_events[b].record(stream)

    def send_back(self, b: int, copies: Callable[[], None]) -> None:
        """Queue bucket ``b``'s weights back (``copies``) on the host-to-device stream, after
        its gradients left (so after backward last read its weights) and after the compute
        queued before the update was submitted (:meth:`mark_compute`), and mark them
        there."""
        if self.h2d is None:
            copies()
            return
        assert self.landed_events is not None and self.back_events is not None
        assert self.queued_events is not None
        self.h2d.wait_event(self.landed_events[b])
        self.h2d.wait_event(self.queued_events[b])
        with torch.cuda.stream(self.h2d):
            copies()
        self.back_events[b].record(self.h2d)
        self._back_recorded[b] = True

    def wait_update(self, b: int) -> None:
        """Block until bucket ``b``'s host update ended (raising its error), so its host
        memory may be written again."""
        future = self.futures[b]
        if future is not None:
            future.result()

    def release(self, b: int) -> None:
        """The compute stream waits for bucket ``b``'s new weights (the host for its
        update); nothing when they were waited for already."""
        if not self.unreleased[b]:
            return
        if self._job_sends[b]:  # its event is recorded when the job ends (a delayed update's
            self.wait_update(b)  # were sent at the step, while the next update may run now)
        if self.back_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self.back_events[b])
        self.unreleased[b] = False

    def after_copies(self) -> None:
        """Order the compute stream after every gradient copy queued so far (no host wait):
        a later write of the gradients (``zero_grad(set_to_none=False)``) waits for them."""
        self._after_d2h()

    def drain(self) -> None:
        """Every update ended and every weight back on the device (the host waits): before
        the host state is read or written from outside a step."""
        for b in range(len(self.buckets)):
            self.wait_update(b)
        if self.h2d is not None:
            self.h2d.synchronize()
        self.unreleased = [False] * len(self.buckets)

    # ------------------------------------------------------------- per-layer waits

    def wait_per_layer(self, layers: Sequence[torch.nn.Module], index: dict[int, int]) -> None:
        """A forward pre-hook on each of ``layers`` that releases the buckets of its
        parameters (``index``: id of a parameter -> its index); a bucket all of whose
        parameters sit under some layer is then left to them by ``step()``."""
        self.remove_layer_hooks()
        under: set[int] = set()
        for layer in layers:
            mine = {index[id(p)] for p in layer.parameters() if id(p) in index}
            under |= mine
            order = sorted({b for i in mine if (b := self.bucket_of[i]) is not None}, reverse=True)
            if order:
                self._layer_hooks.append(layer.register_forward_pre_hook(self._releaser(order)))
        self.covered = [set(bucket.pidxs) <= under for bucket in self.buckets]

    def _releaser(self, order: list[int]) -> Callable[..., None]:
        """The pre-hook of a layer whose parameters sit in buckets ``order``; it holds the
        pipeline weakly (a model outliving its optimizer keeps no worker thread alive)."""
        ref = weakref.ref(self)

        # kept out of torch.compile's graphs (compile=true compiles the blocks with their
        # hooks): a traced stream wait would be dropped, and a flag baked in
        @torch.compiler.disable
        def hook(module: torch.nn.Module, args: Any) -> None:
            pipe = ref()
            if pipe is not None:
                for b in order:
                    pipe.release(b)

        return hook

    def remove_layer_hooks(self) -> None:
        """Drop the per-layer waits: ``step()`` waits for every bucket again, and the
        compute stream waits now for those the next forward would have waited for."""
        for b in range(len(self.buckets)):
            self.release(b)
        for handle in self._layer_hooks:
            handle.remove()
        self._layer_hooks = []
        self.covered = [False] * len(self.buckets)

    def close(self) -> None:
        """Stop the worker thread (after the updates queued)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``model`` in the order of its children: each child, but the items of a
    ``ModuleList`` or ``Sequential`` child (a transformer's blocks) in its place."""
    out: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            out.extend(child.children())
        else:
            out.append(child)
    return out


def bucket_spans(
    plan: ShardPlan,
    pidxs: Sequence[int],
    gi: int,
    steps: Sequence[int],
    cache: dict[tuple[int, tuple[int, ...]], list[tuple[int, int, int, int]]] | None = None,
) -> list[tuple[int, int, int, int]]:
    """The slices ``(pidx, x_start, off, numel)`` of param group ``gi``'s parameters among
    ``pidxs``, one parameter per slice (the staged step writes each one's weights). Slices
    never span two parameters, so the step counts split none: they are kept in ``cache``
    by group and parameters (:attr:`Pipeline.span_cache`), as group_spans keeps its own."""
    key = (gi, tuple(pidxs))
    if cache is not None and key in cache:
        return cache[key]
    want = set(pidxs)
    units = [plan.units[k] for k in plan.my_units]
    todo = [u for u in units if u.group == gi and u.pidx in want]
    spans = contiguous_runs(todo, True, steps)
    if cache is not None:
        if len(cache) > 64 + 4 * len(plan.units):  # active sets keep changing: start over
            cache.clear()
        cache[key] = spans
    return spans
