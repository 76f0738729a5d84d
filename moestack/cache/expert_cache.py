"""ExpertCache: a per-layer cache of expert weights in fast memory, filled from an ExpertStore.

Tiers: the *device* tier (``device``: the GPU when there is one, else host memory) holds
``capacity`` experts per layer and is managed by a policy from ``moestack.cache.policies``
(the same objects ``moestack.telemetry.simulate`` replays); an optional *host* tier
(``host_capacity`` experts per layer, LRU, page-locked on CUDA machines) sits between the
device and the *disk* (the store). On a CPU device the device tier is host memory and
the host tier is off.

Policy state and prefetch: the policy sees exactly the caller's requests, in order, and
nothing else. A prefetch does not touch the policy: it reads into a per-layer *staging
buffer*. A request that the policy counts as a miss is served from the staging buffer when
the expert was prefetched (a prefetch hit: no or a shorter I/O wait), else from the host
tier or the disk. Hence hits and misses, with or without prefetch, are exactly the
simulator's for the same request sequence; prefetch only changes ``stall_s``. Staged
experts that are not requested before the layer's next batch of requests (``get_many``) or
the next ``prefetch`` of that layer are dropped and counted as ``prefetch_wasted``.

Thread safety: each layer has a lock around its policy, resident set and staging buffer;
the statistics have their own lock; store reads are positional reads on shared file
descriptors. Prefetch reads run in a thread pool without holding the layer lock.

``CacheConfig`` (the ``cache`` section of a run's config) sits here beside the cache it
configures; moestack.config assembles it into the run's config.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moestack.cache.policies import CachePolicy, check_policy, make_policy
from moestack.cache.store import ExpertStore
from moestack.checks import check

log = logging.getLogger(__name__)

Expert = dict[str, torch.Tensor]


@dataclasses.dataclass
class CacheConfig:
    """Expert cache: capacity and policy for offloaded evaluation and for telemetry replay."""

    policy: str = "lru"  # "lru", "lfu", "static", "lru+static", "belady" (replay only)
    capacity: int = 0  # experts per layer held in fast memory, >= top_k (0 = 2 x top_k)
    capacity_bytes: int = 0  # alternatively a byte budget per layer (0 = use capacity)
    warmup: int = 1024  # static policies: requests per layer counted before pinning
    prefetch: bool = False  # predict and load the next layer's experts in the background
    store_dir: str = ""  # where the safetensors expert store lives ("" = <run dir>/experts)

    def __post_init__(self) -> None:
        check_policy(self.policy, "cache.policy")
        check(self.capacity >= 0, f"cache.capacity={self.capacity} must be >= 0 (0 = 2 x top_k)")
        check(self.warmup >= 0, f"cache.warmup={self.warmup} must be >= 0")
        check(self.capacity_bytes >= 0, f"cache.capacity_bytes={self.capacity_bytes} must be >= 0")
        check(
            not (self.capacity and self.capacity_bytes),
            f"cache.capacity={self.capacity} and cache.capacity_bytes={self.capacity_bytes} are "
            "both set; give one of them",
        )


@dataclasses.dataclass
class ExpertCacheStats:
    """Counters of one cache. ``hits``/``misses`` are the policy's (one per request);
    ``loads`` are reads that went below the device tier (deduplicated within a ``get_many``),
    ``bytes_read`` the bytes read from disk, ``stall_s`` the seconds callers waited on I/O."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    host_hits: int = 0
    bytes_read: int = 0
    stall_s: float = 0.0
    prefetch_issued: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_rate
        out["requests"] = self.requests
        return out


class _Layer:
    """One layer's cache state; guarded by ``lock`` except the host tier (``host_lock``)."""

    def __init__(self, policy: CachePolicy) -> None:
        self.lock = threading.Lock()
        self.policy = policy
        self.resident: dict[int, Expert] = {}
        self.staged: dict[int, Future[Expert]] = {}
        self.host: OrderedDict[int, Expert] = OrderedDict()  # guarded by host_lock
        self.host_lock = threading.Lock()  # separate: prefetch workers take it, not ``lock``
        self.log: list[tuple[int, bool]] | None = None


class ExpertCache:
    """Serve ``get(layer, expert) -> {"w1": [D, 2F], "w2": [F, D]}`` through a policy-managed
    cache of ``capacity`` experts per layer (or ``capacity_bytes`` per layer).

    ``pinned`` (per layer, a list of expert ids) and ``warmup`` (requests per layer) choose
    the pins of "static" / "lru+static", ``num_pinned`` splits "lru+static". ``top_k`` is the
    model's experts per token (default: the store's); a capacity below it is an error.
    ``record=True`` keeps each layer's (expert, hit) sequence for ``access_log``.
    """

    def __init__(
        self,
        store: ExpertStore,
        capacity: int | None = None,
        policy: str = "lru",
        device: str | torch.device = "cpu",
        prefetch: bool = False,
        capacity_bytes: int | None = None,
        pinned: Sequence[Sequence[int]] | None = None,
        *,
        warmup: int = 0,
        num_pinned: int | None = None,
        top_k: int | None = None,
        host_capacity: int = 0,
        prefetch_workers: int = 2,
        record: bool = False,
    ) -> None:
        check_policy(policy, "policy", online=True)
        self.store = store
        self.device = torch.device(device)
        self.policy_name = policy
        if capacity_bytes:
            if capacity:
                raise ValueError("give capacity (experts per layer) or capacity_bytes, not both")
            capacity = int(capacity_bytes) // store.expert_bytes
            what = f"capacity_bytes={capacity_bytes} ({capacity} experts of {store.expert_bytes} bytes)"
        else:
            what = f"capacity={capacity}"
        top_k = top_k if top_k is not None else store.top_k
        if capacity is None or isinstance(capacity, bool) or not isinstance(capacity, int):
            raise ValueError(f"capacity={capacity!r} must be an int (experts per layer)")
        if capacity < max(1, top_k or 1):
            raise ValueError(
                f"{what} is smaller than top_k={top_k or 1}: one token's experts would not fit; "
                f"use capacity >= {top_k or 1}"
            )
        if pinned is not None and len(pinned) != store.num_layers:
            raise ValueError(
                f"pinned has {len(pinned)} entries, the store has {store.num_layers} layers"
            )
        if host_capacity < 0:
            raise ValueError(f"host_capacity={host_capacity} must be >= 0")
        self.capacity = capacity
        self.top_k = top_k
        on_gpu = self.device.type == "cuda"
        self.host_capacity = host_capacity if on_gpu else 0
        self._pin = on_gpu
        self._layers = [
            _Layer(
                make_policy(
                    policy,
                    capacity,
                    pinned=None if pinned is None else list(pinned[i]),
                    warmup=warmup,
                    num_pinned=num_pinned,
                )
            )
            for i in range(store.num_layers)
        ]
        if record:
            for layer in self._layers:
                layer.log = []
        self._stats = ExpertCacheStats()
        self._stats_lock = threading.Lock()
        self.prefetch_enabled = bool(prefetch)
        self._pool = (
            ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="expert-prefetch")
            if prefetch
            else None
        )

    # ------------------------------------------------------------------ public API
    @property
    def stats(self) -> ExpertCacheStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats = ExpertCacheStats()

    def get(self, layer: int, expert: int) -> Expert:
        """One request: the expert's tensors on ``device`` (loaded on a miss)."""
        return self.get_many(layer, [expert], _drop_staged=False)[expert]

    def get_many(
        self, layer: int, experts: Sequence[int], *, _drop_staged: bool = True
    ) -> dict[int, Expert]:
        """Requests ``experts`` of ``layer`` in order (repeats allowed); {expert: tensors}.

        Every request goes through the policy (a hit or a miss each), but an expert is read
        at most once per call: a repeated miss reuses the copy this call already holds.
        Staged prefetches of this layer left unused afterwards count as wasted.
        """
        state = self._layer(layer)
        out: dict[int, Expert] = {}
        hits = misses = 0
        with state.lock:
            policy, resident = state.policy, state.resident
            for expert in experts:
                expert = int(expert)
                if not 0 <= expert < self.store.num_experts:
                    raise ValueError(
                        f"expert={expert} out of range: layer {layer} has "
                        f"{self.store.num_experts} experts"
                    )
                hit, evicted = policy.access(expert)
                if state.log is not None:
                    state.log.append((expert, hit))
                if hit:
                    hits += 1
                    tensors = resident.get(expert)
                    if tensors is None:  # policy and resident set disagree: repair
                        tensors = out.get(expert) or self._fetch(state, layer, expert)
                else:
                    misses += 1
                    tensors = out.get(expert) or self._fetch(state, layer, expert)
                out[expert] = tensors
                if evicted is not None:
                    resident.pop(evicted, None)
                if policy.contains(expert):
                    resident[expert] = tensors
                if len(resident) > policy.capacity:
                    self._resync(state)
            wasted = 0
            if _drop_staged and state.staged:
                wasted = len(state.staged)
                for fut in state.staged.values():
                    fut.cancel()
                state.staged.clear()
        with self._stats_lock:
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.prefetch_wasted += wasted
        return out

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start background reads of ``experts`` of ``layer`` that are not resident.

        Returns how many reads were started; a no-op when the cache was built without
        ``prefetch=True``. Earlier staged experts of the layer not in ``experts`` are dropped.
        """
        if self._pool is None:
            return 0
        state = self._layer(layer)
        wanted = [int(e) for e in dict.fromkeys(experts)]
        started = wasted = 0
        with state.lock:
            for expert in list(state.staged):
                if expert not in wanted:
                    state.staged.pop(expert).cancel()
                    wasted += 1
            for expert in wanted:
                if not 0 <= expert < self.store.num_experts:
                    raise ValueError(f"expert={expert} out of range in prefetch(layer={layer})")
                if expert in state.staged or state.policy.contains(expert):
                    continue
                state.staged[expert] = self._pool.submit(self._read_async, state, layer, expert)
                started += 1
        with self._stats_lock:
            self._stats.prefetch_issued += started
            self._stats.prefetch_wasted += wasted
        return started

    def resident(self, layer: int) -> list[int]:
        """Experts of ``layer`` resident in the device tier now, sorted."""
        state = self._layer(layer)
        with state.lock:
            return state.policy.resident()

    def access_log(self, layer: int) -> list[tuple[int, bool]]:
        """(expert, hit) of every request of ``layer`` so far (needs ``record=True``)."""
        state = self._layer(layer)
        if state.log is None:
            raise ValueError("build the cache with record=True to keep access logs")
        with state.lock:
            return list(state.log)

    def close(self) -> None:
        """Stop the prefetch threads (waits for reads in flight)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> ExpertCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ExpertCache(policy={self.policy_name!r}, capacity={self.capacity}, "
            f"device={self.device}, prefetch={self.prefetch_enabled}, store={self.store.path})"
        )

    # ------------------------------------------------------------------ internals
    def _layer(self, layer: int) -> _Layer:
        if not isinstance(layer, int) or not 0 <= layer < len(self._layers):
            raise ValueError(
                f"layer={layer!r} out of range: the store has {len(self._layers)} layers"
            )
        return self._layers[layer]

    def _resync(self, state: _Layer) -> None:
        keep = set(state.policy.resident())
        for key in [k for k in state.resident if k not in keep]:
            del state.resident[key]

    def _fetch(self, state: _Layer, layer: int, expert: int) -> Expert:
        """Serve a miss (caller holds the layer lock): staged prefetch, host tier or disk."""
        start = time.perf_counter()
        tensors: Expert | None = None
        prefetched = False
        fut = state.staged.pop(expert, None)
        if fut is not None:
            try:
                tensors = fut.result()
                prefetched = True
            except Exception as err:  # a failed prefetch is retried synchronously
                log.warning("prefetch of layer %d expert %d failed: %s", layer, expert, err)
        host_hit = False
        nbytes = 0
        if tensors is None:
            host = self._host_get(state, expert)
            host_hit = host is not None
            if host is None:
                host = self.store.load(layer, expert, pin_memory=self._pin)
                nbytes = self.store.expert_bytes
                self._host_put(state, expert, host)
            tensors = self._to_device(host, blocking=True)
        stall = time.perf_counter() - start
        with self._stats_lock:
            s = self._stats
            s.stall_s += stall
            s.loads += 1
            s.bytes_read += nbytes
            s.host_hits += host_hit
            s.prefetch_hits += prefetched
        return tensors

    def _read_async(self, state: _Layer, layer: int, expert: int) -> Expert:
        """Prefetch worker: disk (or host tier) to device, without the layer lock."""
        host = self._host_get(state, expert)
        nbytes = 0
        if host is None:
            host = self.store.load(layer, expert, pin_memory=self._pin)
            nbytes = self.store.expert_bytes
            self._host_put(state, expert, host)
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                tensors = self._to_device(host, blocking=False)
            stream.synchronize()
            # allocated on the side stream, used and freed on the compute stream: without
            # this the allocator could hand the memory to the next prefetch while a kernel
            # of the compute stream still reads it
            compute = torch.cuda.default_stream(self.device)
            for t in tensors.values():
                t.record_stream(compute)
        else:
            tensors = self._to_device(host, blocking=True)
        with self._stats_lock:
            self._stats.bytes_read += nbytes
        return tensors

    def _host_get(self, state: _Layer, expert: int) -> Expert | None:
        if not self.host_capacity:
            return None
        with state.host_lock:
            host = state.host.get(expert)
            if host is not None:
                state.host.move_to_end(expert)
            return host

    def _host_put(self, state: _Layer, expert: int, host: Expert) -> None:
        if not self.host_capacity:
            return
        with state.host_lock:
            state.host[expert] = host
            state.host.move_to_end(expert)
            while len(state.host) > self.host_capacity:
                state.host.popitem(last=False)

    def _to_device(self, host: Expert, *, blocking: bool) -> Expert:
        if self.device.type == "cpu":
            return host
        return {k: v.to(self.device, non_blocking=not blocking) for k, v in host.items()}
