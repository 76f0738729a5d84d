"""The pipelined OffloadAdamW's CUDA stream and event ordering (moestack.optim.buckets), on
the CPU: torch.cuda's Stream, Event and current stream are replaced by a model in which a
stream holds the set of operations its future work runs after (an operation issued on it
runs after that set; an event records it; a stream's wait adds it) and each host thread
holds the set of device operations it knows to have finished (an event's or a stream's
``synchronize`` adds what it covers; waiting for a bucket's host update adds what that
update's thread knew). The real optimizer runs on CPU tensors with a real
:class:`~moestack.optim.buckets.Pipeline` (its streams and events the model's); every
gradient copy to the host, weight copy back, gradient norm, host update and compute read of
a parameter (a layer's forward, a gradient's backward) is logged, then checked:

- a gradient's copy to the host runs on the copy stream, after the backward that produced
  it, and is issued only once the host update that read the same host buffer has ended;
- a bucket's host update starts only once the host knows its gradients landed (every copy
  of them issued before it was submitted) and its previous weights left host memory;
- a weight copy back runs on its own stream, after every compute read of that weight
  issued before it (a forward or backward must not see half-new weights);
- every compute read of a weight runs after every copy of it issued before, whether the
  wait comes at the end of ``step()`` or in a layer's pre-hook (``wait_per_layer``), and a
  layer's pre-hook waits for no bucket of a later layer;
- after ``step()`` the compute stream follows every gradient copy (a later write of the
  gradients), and the clipping norm follows every norm taken on the copy stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from moestack.optim import OffloadAdamW, buckets, transfer, update

D = 8  # width of each layer; weights 256 B, biases 32 B
LAYERS = 4


@dataclasses.dataclass(frozen=True)
class Op:
    """One logged operation: ``kind`` (d2h, h2d, norm, read, update), where it ran (a
    stream's name, or "host"), the parameters it touches, the operations it runs after (a
    stream's set; for a host update, what its thread knew), what the issuing thread knew
    had finished, and for copies to the host and updates, the host gradient buffer."""

    id: int
    kind: str
    where: str
    params: frozenset[int]
    after: frozenset[int]
    known: frozenset[int]
    buffer: tuple[int, int] | None = None  # host bytes [start, end) written or read


class FakeStream:
    """A stream as the set of operations its future work runs after."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.after: set[int] = set()

    def wait_event(self, event: FakeEvent) -> None:
        self.after |= event.covers

    def wait_stream(self, other: FakeStream) -> None:
        self.after |= other.after

    def synchronize(self) -> None:
        FakeCuda.active.learn(self.after)


class FakeEvent:
    """An event: the operations its stream was ordered after when it was last recorded."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.covers: frozenset[int] = frozenset()

    def record(self, stream: FakeStream | None = None) -> None:
        self.covers = frozenset((stream or FakeCuda.active.current_stream()).after)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or FakeCuda.active.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        FakeCuda.active.learn(self.covers)


class FakeCuda:
    """The patched torch.cuda calls (thread-local current streams and host knowledge, as a
    process's threads have) and the log of operations."""

    active: FakeCuda

    def __init__(self) -> None:
        self.compute = FakeStream("compute")
        self.count = 0
        self.local = threading.local()
        self.lock = threading.Lock()
        self.ops: list[Op] = []

    def new_stream(self, device: object = None, priority: int = 0) -> FakeStream:
        with self.lock:
            self.count += 1
            return FakeStream(f"side{self.count}")

    def current_stream(self, device: object = None) -> FakeStream:
        return getattr(self.local, "stream", None) or self.compute

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self.local, "stream", None)
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = before

    def known(self) -> set[int]:
        if not hasattr(self.local, "known"):
            self.local.known = set()
        return self.local.known

    def learn(self, ops: Any) -> None:
        self.known().update(ops)

    def device_op(self, kind: str, params: Any, buffer: tuple[int, int] | None = None) -> Op:
        """An operation queued on the current stream: after what that stream is after."""
        stream = self.current_stream()
        with self.lock:
            op = Op(len(self.ops), kind, stream.name, frozenset(params), frozenset(stream.after),
                    frozenset(self.known()), buffer)  # fmt: skip
            self.ops.append(op)
            stream.after.add(op.id)
        return op

    def host_op(self, kind: str, params: Any, buffer: tuple[int, int] | None = None) -> Op:
        """An operation of the calling host thread: after what that thread knows."""
        with self.lock:
            known = frozenset(self.known())
            op = Op(len(self.ops), kind, "host", frozenset(params), known, known, buffer)
            self.ops.append(op)
        self.known().add(op.id)
        return op

    def of(self, kind: str) -> list[Op]:
        with self.lock:
            return [op for op in self.ops if op.kind == kind]


class WatchedPipeline(buckets.Pipeline):
    """The real pipeline, its streams on (the model of) CUDA although its tensors are on the
    CPU; a bucket's job, observed: it starts knowing what the submitting thread knew, and a
    wait for it teaches the waiting thread what the job knew when it ended."""

    def __init__(self, cut: list[buckets.Bucket], num_params: int, device: torch.device) -> None:
        super().__init__(cut, num_params, device, streams=True)
        self.job_knew: list[frozenset[int]] = [frozenset()] * len(cut)
        self.names = {"d2h": self.d2h.name, "h2d": self.h2d.name}  # type: ignore[union-attr]

    def submit(self, b: int, job: Any, sends: bool = True) -> None:
        fake, submitter_knew = FakeCuda.active, frozenset(FakeCuda.active.known())

        def watched() -> None:
            fake.learn(submitter_knew)
            job()
            self.job_knew[b] = frozenset(fake.known())

        super().submit(b, watched, sends)

    def wait_update(self, b: int) -> None:
        super().wait_update(b)
        FakeCuda.active.learn(self.job_knew[b])


class Layered(nn.Module):
    """LAYERS linear layers in a ModuleList (the layers ``wait_per_layer`` hooks)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.fixture
def fake(monkeypatch):
    """torch.cuda's streams and events replaced by the model; every copy, norm and host
    update of the optimizer logged."""
    fake = FakeCuda()
    FakeCuda.active = fake
    monkeypatch.setattr(torch.cuda, "Stream", fake.new_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(buckets, "Pipeline", WatchedPipeline)
    return fake


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    """The host bytes ``t`` spans (the host buffers are views of one block)."""
    return t.data_ptr(), t.data_ptr() + t.nbytes


def _overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _owner(params: list[torch.Tensor], t: torch.Tensor, grads: bool) -> int:
    """The index of the parameter whose data (or gradient) ``t`` lies in."""
    ptr = t.data_ptr()
    for i, p in enumerate(params):
        ref = p.grad if grads else p.data
        if ref is not None and ref.data_ptr() <= ptr < ref.data_ptr() + ref.nbytes:
            return i
    raise AssertionError("a copy of a tensor that is no parameter's data or gradient")


def _instrument(monkeypatch, fake: FakeCuda, model: nn.Module) -> list[torch.Tensor]:
    """Log the copies, norms and host updates, and the compute reads of the weights: a
    layer's forward (a pre-hook) and a gradient's backward (a hook that runs before the
    optimizer's, so registered first)."""
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    real_to_host, real_to_device = transfer.copy_to_host, transfer.copy_to_device
    real_norms, real_step_spans = update.grad_norms, OffloadAdamW._step_spans

    def to_host(dst, src, non_blocking, scratch):
        fake.device_op("d2h", [_owner(params, src, grads=True)], buffer=_bytes(dst))
        real_to_host(dst, src, non_blocking, scratch)

    def to_device(dst, src, non_blocking, scratch):
        fake.device_op("h2d", [_owner(params, dst, grads=False)])
        real_to_device(dst, src, non_blocking, scratch)

    def grad_norms(grads):
        fake.device_op("norm", [_owner(params, g, grads=True) for g in grads])
        return real_norms(grads)

    def step_spans(self, jobs, host, steps, scale):
        touched = {span[0] for spans, _ in jobs for span in spans}
        fake.host_op("update", touched, buffer=_bytes(host.grad))
        return real_step_spans(self, jobs, host, steps, scale)

    monkeypatch.setattr(transfer, "copy_to_host", to_host)
    monkeypatch.setattr(transfer, "copy_to_device", to_device)
    monkeypatch.setattr(update, "grad_norms", grad_norms)
    monkeypatch.setattr(OffloadAdamW, "_step_spans", step_spans)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: _log(fake, [index[id(p)]]))
    return params


def _log(fake: FakeCuda, params: list[int]) -> None:
    """A compute read of ``params`` (a hook's body: it returns nothing)."""
    fake.device_op("read", params)


def _read_hooks(fake: FakeCuda, model: Layered, params: list[torch.Tensor]) -> None:
    """A forward pre-hook on each layer (after the optimizer's own) logging its read."""
    index = {id(p): i for i, p in enumerate(params)}
    for layer in model.layers:
        mine = [index[id(p)] for p in layer.parameters()]
        layer.register_forward_pre_hook(lambda m, a, mine=mine: _log(fake, mine))


def _train(fake, model, opt, steps: int, clip: bool, between: bool = True) -> None:
    """``steps`` steps of two micro-batches; after each, the compute stream follows every
    gradient copy and (clipping) the norm follows every norm."""
    gen = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        for micro in range(2):
            x = torch.randn(16, D, generator=gen).to(dtype)
            first = micro == 0 and opt.update_in_backward  # its buckets update as they land
            with opt.no_sync() if first else contextlib.nullcontext():
                model(x).float().square().mean().backward()
        # a forward between backward and step() reads the old weights (not with
        # update_in_backward: its updates, and their copies back, start during backward)
        if between and not opt.update_in_backward:
            with torch.no_grad():
                model(torch.randn(4, D, generator=gen).to(dtype))
        if clip:
            opt.clip_grad_norm_(1.0)
            norms = {op.id for op in fake.of("norm")}
            assert norms and norms <= fake.compute.after, "the clipping norm skips a norm"
        opt.step()
        copies = {op.id for op in fake.of("d2h")}
        assert copies <= fake.compute.after, "a gradient copy the compute stream may overtake"
        opt.zero_grad()
    opt.synchronize()
    model(torch.randn(4, D, generator=gen).to(dtype))  # reads the last weights


def _check(fake: FakeCuda, pipe: WatchedPipeline, n_params: int) -> None:
    """The orderings of the module docstring, over the whole log."""
    ops = list(fake.ops)
    by_param = {i: [op for op in ops if i in op.params] for i in range(n_params)}
    counts = {kind: sum(op.kind == kind for op in ops) for kind in ("d2h", "h2d", "update")}
    assert all(counts.values()), counts
    for op in ops:
        mine = [o for i in op.params for o in by_param[i] if o.id < op.id]
        # a device operation follows what its stream waited for, and what its issuing
        # thread knew had finished (after a host wait)
        ordered = op.after | op.known
        if op.kind == "d2h":
            assert op.where == pipe.names["d2h"], op
            reads = {o.id for o in mine if o.kind == "read"}
            assert reads <= ordered, f"gradient copy {op} before the backward that made it"
            read_it = {o.id for o in mine if o.kind == "update" and _overlap(o.buffer, op.buffer)}
            assert read_it <= op.known, f"gradient copy {op} over a buffer an update reads"
        elif op.kind == "h2d":
            assert op.where == pipe.names["h2d"], op
            reads = {o.id for o in mine if o.kind == "read"}
            assert reads <= ordered, f"weight copy {op} under a read issued before it"
        elif op.kind == "read":
            assert op.where == "compute", op
            sent = {o.id for o in mine if o.kind == "h2d"}
            assert sent <= ordered, f"read {op} may see weights still being copied"
        elif op.kind == "update":
            landed = {o.id for o in mine if o.kind == "d2h" and _overlap(o.buffer, op.buffer)}
            assert landed <= op.known, f"update {op} before its gradients landed"
            sent = {o.id for o in mine if o.kind == "h2d"}
            assert sent <= op.known, f"update {op} over weights still being copied back"


CASES = {
    "exact-fp32-clip": (torch.float32, {"in_place": False}, True, False),
    "exact-bf16-clip": (torch.bfloat16, {}, True, False),
    "per-layer-bf16": (torch.bfloat16, {}, False, True),
    "in-backward-fp32": (torch.float32, {"in_place": False, "update_in_backward": True},
                         False, False),
    "in-backward-per-layer": (torch.bfloat16, {"update_in_backward": True}, False, True),
    "delayed-bf16-clip": (torch.bfloat16, {"update_delay": 1}, True, False),
    "delayed-per-layer": (torch.bfloat16, {"update_delay": 1}, False, True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_every_copy_and_update_waits_for_what_it_must(fake, monkeypatch, case):
    dtype, kw, clip, per_layer = CASES[case]
    model = Layered(dtype)
    params = _instrument(monkeypatch, fake, model)
    opt = _optimizer(model, **kw)
    pipe = opt._pipe
    assert isinstance(pipe, WatchedPipeline) and len(pipe.buckets) == LAYERS
    if per_layer:
        opt.wait_per_layer(model)
    _read_hooks(fake, model, params)
    _train(fake, model, opt, steps=4, clip=clip)
    opt.close()
    _check(fake, pipe, len(params))


def _optimizer(model: Layered, **kw: Any) -> OffloadAdamW:
    """Pipelined, one bucket per layer (its weight and bias: exactly a bucket's bytes)."""
    itemsize = next(model.parameters()).dtype.itemsize
    bucket_mb = (D * D + D) * itemsize / 2**20
    return OffloadAdamW(model.parameters(), lr=1e-2, pipeline=True, bucket_mb=bucket_mb, **kw)


@pytest.mark.parametrize("delay", [0, 1])
def test_a_layer_waits_for_its_own_bucket_not_for_later_layers(fake, monkeypatch, delay):
    """wait_per_layer: before layer L's forward the compute stream has waited for the new
    weights of layers 0..L (their buckets released) and for none of a later layer's: those
    still overlap layer L's forward."""
    model = Layered(torch.bfloat16)
    params = _instrument(monkeypatch, fake, model)
    opt = _optimizer(model, update_delay=delay)
    opt.wait_per_layer(model)
    pipe = opt._pipe
    layer_of_bucket = [LAYERS - 1 - b for b in range(len(pipe.buckets))]  # backward's order
    seen: list[tuple[int, list[bool]]] = []
    for n, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda m, a, n=n: seen.append((n, list(pipe.unreleased))) and None
        )
    _read_hooks(fake, model, params)
    _train(fake, model, opt, steps=4, clip=False)
    opt.close()
    _check(fake, pipe, len(params))
    pending_seen = 0
    for layer_no, unreleased in seen:
        for b, layer in enumerate(layer_of_bucket):
            if layer <= layer_no:
                assert not unreleased[b], f"layer {layer_no} runs before bucket {b}'s wait"
            pending_seen += unreleased[b]
    assert pending_seen >= LAYERS  # later layers' buckets were seen still in flight
