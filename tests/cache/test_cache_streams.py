"""The cache's CUDA stream ordering, on the CPU: torch.cuda's Stream, Event and current
stream are replaced by a model in which a stream holds the set of copies its future work
is ordered after (a copy runs after that set; an event records it; a wait adds it), and
every expert copy is logged with its stream and destination slot. Checked: serving layer i
makes the compute stream wait on layer i's copies and never on layer i+1's prefetches; a
demand load does not queue behind prefetches, but waits on the pending copy of a slot it
reuses; a failed load still leaves the compute stream waiting on the copies issued."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers.cache import tiny_model

import moestack.cache.device_tier as device_tier
from moestack.cache import ExpertCache, ExpertStore
from moestack.cache.device_tier import Copier


@dataclasses.dataclass(frozen=True)
class Copy:
    """One logged expert copy: the stream it was issued on, the slot it writes (None: a
    call's own buffer) and the copies it runs after."""

    id: int
    stream: str
    slot: int | None
    after: frozenset[int]


class FakeStream:
    """A stream as the set of copies its future work runs after."""

    names = itertools.count()

    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.name = f"stream{next(self.names)}"
        self.priority = priority
        self.after: set[int] = set()

    def wait_event(self, event: FakeEvent) -> None:
        self.after |= event.covers

    def wait_stream(self, other: FakeStream) -> None:
        self.after |= other.after


class FakeEvent:
    """An event: the copies its stream was ordered after when it was recorded."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.covers: frozenset[int] = frozenset()

    def record(self, stream: FakeStream | None = None) -> None:
        self.covers = frozenset((stream or FakeCuda.active.current_stream()).after)

    def wait(self, stream: FakeStream) -> None:
        stream.wait_event(self)


class FakeCuda:
    """The patched torch.cuda calls (thread-local current streams, as CUDA's) and the log of
    copies; ``slot_of`` maps a destination pointer to its slot once a cache is attached."""

    active: FakeCuda

    def __init__(self) -> None:
        self.compute = FakeStream()
        self.local = threading.local()
        self.lock = threading.Lock()
        self.copies: list[Copy] = []
        self.streams: dict[str, FakeStream] = {}
        self.cache: ExpertCache | None = None

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

    def copy_expert(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
        stream = self.current_stream()
        assert stream is not self.compute, "an expert copy was issued on the compute stream"
        with self.lock:
            copy = Copy(len(self.copies), stream.name, self._slot(dst), frozenset(stream.after))
            self.copies.append(copy)
            self.streams[stream.name] = stream
            stream.after.add(copy.id)
        dst.copy_(src)

    def _slot(self, dst: torch.Tensor) -> int | None:
        assert self.cache is not None
        pool = self.cache._slots
        offset = dst.data_ptr() - pool.flat_SB.data_ptr()
        return offset // pool.slot_bytes if 0 <= offset < pool.flat_SB.nbytes else None

    def since(self, start: int) -> list[Copy]:
        with self.lock:
            return self.copies[start:]


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda's streams and events replaced by the model above; the cache built with
    ``attach`` copies through a real Copier on a (fake) CUDA device."""
    fake = FakeCuda()
    FakeCuda.active = fake
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(device_tier, "copy_expert", fake.copy_expert)
    return fake


def attach(fake: FakeCuda, cache: ExpertCache) -> ExpertCache:
    fake.cache = cache
    cache._copier = Copier(torch.device("cuda"))
    return cache


def settle(cache: ExpertCache, layer: int) -> None:
    """Wait (on the host) until the prefetch reads of ``layer`` have issued their copies."""
    for staged in list(cache._layers[layer].staged.values()):
        staged.future.result()


def waited_during(fake: FakeCuda, call: Callable[[], object]) -> tuple[set[int], list[Copy]]:
    """The copies the compute stream newly waits on after ``call()``, and those it issued."""
    before, start = set(fake.compute.after), len(fake.copies)
    call()
    return fake.compute.after - before, fake.since(start)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ExpertStore.write(tiny_model(num_experts=16), tmp_path_factory.mktemp("s") / "store")


def test_a_layer_waits_on_its_own_copies_only(cuda, store):
    cache = attach(cuda, ExpertCache(store, 2, "lru", prefetch=True, prefetch_workers=1))
    with cache:
        start = len(cuda.copies)
        assert cache.prefetch(1, [4, 5]) == 2  # the next layer's, before this layer's call
        settle(cache, 1)
        p4, p5 = cuda.since(start)
        waited, issued = waited_during(cuda, lambda: cache.serve(0, [0, 1]))
        assert len(issued) == 2 and waited == {c.id for c in issued}  # exactly its loads
        # layer 1: 4 is a prefetch hit, 5 is dropped and its slot goes to 6's demand load,
        # which must wait for 5's copy; the compute stream waits on these and nothing else
        waited, issued = waited_during(cuda, lambda: cache.serve(1, [4, 6]))
        (d6,) = issued
        assert d6.slot == p5.slot, "test setup: 6 is loaded into the dropped prefetch's slot"
        assert waited == {p4.id, p5.id, d6.id}
        assert cache.stats.prefetch_hits == 1 and cache.stats.prefetch_wasted == 1


def test_prefetch_then_serve_replay_never_waits_on_the_next_layer(cuda, tmp_path):
    """CachedExperts' order (prefetch layer i+1, then serve layer i) over 4 layers: each
    call waits on every copy it reads (its loads, its prefetch hits) and on none of the
    next layer's prefetches."""
    store = ExpertStore.write(tiny_model(num_experts=32, top_k=4, n_layers=4), tmp_path / "s")
    cache = attach(cuda, ExpertCache(store, 8, "lru", prefetch=True, prefetch_workers=1))
    rng = random.Random(0)
    last_into: dict[int, int] = {}  # slot -> the last copy into it
    with cache:
        for _step, layer in itertools.product(range(20), range(4)):
            start = len(cuda.copies)
            if layer + 1 < 4:
                cache.prefetch(layer + 1, rng.sample(range(32), 4))
                settle(cache, layer + 1)
            next_layer = {c.id for c in cuda.since(start)}
            last_into.update((c.slot, c.id) for c in cuda.since(start))
            requests = rng.sample(range(32), 4)
            start = len(cuda.copies)
            served = cache.serve(layer, requests)
            issued = cuda.since(start)
            last_into.update((c.slot, c.id) for c in issued)
            rows = {int(served.lut_E[e]) for e in requests}
            needed = {c.id for c in issued} | {last_into[r] for r in rows if r in last_into}
            assert needed <= cuda.compute.after  # every copy this call reads
            assert not cuda.compute.after & next_layer, (layer, cuda.compute.after & next_layer)
        stats = cache.stats
    assert stats.prefetch_hits > 0 and stats.misses > stats.prefetch_hits


def test_a_demand_load_reuses_a_prefetch_slot_after_its_copy_only(cuda, store):
    """A dropped prefetch's slot taken by a demand load: the load (on its own, higher
    priority stream) runs after that prefetch's copy and not after another layer's
    prefetch still pending."""
    cache = attach(cuda, ExpertCache(store, 2, "lru", prefetch=True, prefetch_workers=1))
    with cache:
        start = len(cuda.copies)
        cache.prefetch(0, [5])
        settle(cache, 0)
        cache.prefetch(1, [6])
        settle(cache, 1)
        p5, p6 = cuda.since(start)
        _, issued = waited_during(cuda, lambda: cache.serve(0, [1]))  # 5 is dropped
        (d1,) = issued
    assert d1.slot == p5.slot, "test setup: 1 is loaded into the dropped prefetch's slot"
    assert p5.id in d1.after, "the demand load may overwrite the slot before the prefetch"
    assert p6.id not in d1.after, "a demand load queued behind another layer's prefetch"
    demand, prefetch = cuda.streams[d1.stream], cuda.streams[p5.stream]
    assert demand is not prefetch and demand.priority < prefetch.priority


def test_a_kept_expert_written_into_a_dropped_prefetch_slot_waits_for_its_copy(cuda, store):
    """More experts than free slots (a buffer of the call's own): the kept ones are copied
    on the compute stream into slots, here the dropped prefetches' slots, whose copies the
    compute stream must wait for first."""
    cache = attach(cuda, ExpertCache(store, 2, "lru", prefetch=True, prefetch_workers=1))
    with cache:
        cache.serve(1, [0, 1])  # the other layer holds two slots
        start = len(cuda.copies)
        cache.prefetch(0, [14, 15])
        settle(cache, 0)
        prefetched = {c.id for c in cuda.since(start)}
        waited, issued = waited_during(cuda, lambda: cache.serve(0, list(range(9))))
    assert len(issued) == 9 and all(c.slot is None for c in issued)  # the call's buffer
    assert prefetched <= waited


@pytest.mark.parametrize("many", [False, True], ids=["slots", "buffer"])
def test_a_failed_load_still_waits_on_the_copies_issued(cuda, store, many):
    """The 6th read of a call fails: the compute stream (where the call's buffer is freed,
    and the slots are read next) still waits on the five copies already issued."""
    cache = attach(cuda, ExpertCache(store, 8 if not many else 2, "lru"))
    real, reads = store.load, {"n": 0}

    def failing(*args, **kwargs):
        reads["n"] += 1
        if reads["n"] == 6:
            raise OSError("transient read error")
        return real(*args, **kwargs)

    def call() -> None:
        with pytest.raises(OSError, match="transient"):
            cache.serve(0, list(range(8)))

    store.load = failing
    try:
        waited, issued = waited_during(cuda, call)
    finally:
        store.load = real
    assert reads["n"] == 6 and len(issued) == 5
    assert all((c.slot is None) == many for c in issued)
    assert {c.id for c in issued} <= waited
