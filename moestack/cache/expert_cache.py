"""ExpertCache: a per-layer cache of expert weights in fast memory, filled from an ExpertStore.

Tiers: the *device* tier (``device``: the GPU when there is one, else host memory) holds
``capacity`` experts per layer and is managed by a policy from ``moestack.cache.policies``
(the same objects ``moestack.telemetry.simulate`` replays); an optional *host* tier
(``moestack.cache.host_tier.HostTier``) sits between the device and the *disk* (the
store): the cache's own (``host_capacity`` experts per layer, LRU, page-locked; on CUDA
machines only: on a CPU device the device tier is host memory), or one holding every
expert, read ahead and given in the store's place.

Device tier (``moestack.cache.device_tier``): an expert is one flat buffer (``w1`` then
``w2``) and a load is one copy of it into a *slot* of one device buffer shared by all
layers; its tensors on the device are views of the slot. ``serve`` hands a layer call the
slots as they are plus an expert -> slot table on the device (no copy of a resident
expert). On CUDA demand loads run on a high-priority copy stream and prefetches on a
second one; a call makes the compute stream wait on the events of its own copies only (its
loads, its prefetch hits), never on other layers' prefetches, and a write into a slot whose
last copy another stream issued waits on that copy's event first (no host
synchronisation); on the CPU they are plain copies.

Policy state and prefetch: the policy sees exactly the caller's requests, in order, and
nothing else. A prefetch does not touch the policy: it reads into a free slot reserved for
it (staged). A request that the policy counts as a miss is served from the staged slot
when the expert was prefetched (a prefetch hit: no or a shorter I/O wait; the slot becomes
the expert's), else from the host tier or the disk. Hence hits and misses, with or without
prefetch, are exactly the simulator's for the same request sequence; prefetch only changes
the waits. Staged experts that are not requested before the layer's next batch of requests
(``get_many``/``serve``) or the next ``prefetch`` of that layer are dropped and counted as
``prefetch_wasted``.

Thread safety: one lock around the policies, slots and staging; the host tier and the
statistics have their own locks; store reads are positional reads on shared file
descriptors. Prefetch reads and copies run in a thread pool without the lock, into slots
reserved for them. ``serve``'s views are for one caller at a time (a model's forward).

``CacheConfig`` (the ``cache`` section of a run's config) sits here beside the cache it
configures; moestack.config assembles it into the run's config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from moestack.cache.cache_state import (
    LayerState,
    Staged,
    check_options,
    checked_capacity,
    host_tier_of,
    new_layers,
)
from moestack.cache.device_tier import Copier, Expert, ExpertLayout, SlotPool
from moestack.cache.host_tier import HostTier
from moestack.cache.policies import check_policy
from moestack.cache.store import ExpertStore
from moestack.checks import check

log = logging.getLogger(__name__)


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
    ``host_hits`` the loads a host tier filled on misses served (a tier read ahead serves
    the rest of them, with no disk read), ``bytes_read`` the bytes read from disk, ``bytes_to_device`` the bytes copied into the
    device tier (prefetches included), ``stall_s`` the seconds callers waited on the host for
    reads (on CUDA the device copies are waited on by the compute stream, not counted)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    host_hits: int = 0
    bytes_read: int = 0
    bytes_to_device: int = 0
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


@dataclasses.dataclass(frozen=True)
class ServedExperts:
    """One layer call's experts on the device: ``weights`` ``{"w1": [N, D, 2F], "w2": [N, F,
    D]}`` (views of the device tier's slots, or of a buffer of this call's experts where
    they do not all fit in slots at once) and ``lut_E`` ``[E]`` (int64, on the device), the
    row of each requested expert in them; the other entries are stale."""

    weights: Expert
    lut_E: torch.Tensor


class ExpertCache:
    """Serve ``get(layer, expert) -> {"w1": [D, 2F], "w2": [F, D]}`` through a policy-managed
    cache of ``capacity`` experts per layer (or ``capacity_bytes`` per layer).

    ``store`` is an ExpertStore, or a ``HostTier`` read ahead from one (``self.store`` is
    then the tier's store and ``self.host`` the tier; else ``self.host`` is the cache's own
    tier of ``host_capacity`` experts per layer on a CUDA device, or None).
    ``pinned`` (per layer, a list of expert ids) and ``warmup`` (requests per layer) choose
    the pins of "static" / "lru+static", ``num_pinned`` splits "lru+static". ``top_k`` is the
    model's experts per token (default: the store's); a capacity below it is an error.
    ``record=True`` keeps each layer's (expert, hit) sequence for ``access_log``.
    ``prefetch_slots`` (default top_k) is how many prefetched experts may wait on the
    device at once, over all layers.
    """

    def __init__(
        self,
        store: ExpertStore | HostTier,
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
        prefetch_slots: int | None = None,
        record: bool = False,
    ) -> None:
        check_policy(policy, "policy", online=True)
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device} is not supported: use cpu or cuda")
        on_gpu = self.device.type == "cuda"
        self.store, self.host = host_tier_of(store, host_capacity, on_gpu)
        store = self.store
        self.policy_name = policy
        top_k = top_k if top_k is not None else store.top_k
        capacity = checked_capacity(store, capacity, capacity_bytes, top_k)
        check_options(store, pinned, host_capacity, prefetch_slots)
        self.capacity = capacity
        self.top_k = top_k
        self.host_capacity = host_capacity if on_gpu else 0
        self._pin = on_gpu
        self._layers = new_layers(store.num_layers, policy, capacity, pinned, warmup, num_pinned)
        if record:
            for layer in self._layers:
                layer.log = []
        self._stats = ExpertCacheStats()
        self._stats_lock = threading.Lock()
        self._lock = threading.Lock()  # policies, slots, staging (not the host tier's)
        self.prefetch_enabled = bool(prefetch)
        self._pool = (
            ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="expert-prefetch")
            if prefetch
            else None
        )
        self.layout = ExpertLayout.of_entry(store.entry(0, 0))
        spare = max(1, top_k or 1)  # a call's experts the policy did not keep (static)
        self.prefetch_slots = (
            (spare if prefetch_slots is None else prefetch_slots) if prefetch else 0
        )
        self._slots = SlotPool(
            store.num_layers * capacity + spare + self.prefetch_slots, self.layout, self.device
        )
        self._staged_count = 0
        self._copier = Copier(self.device)  # a demand and a prefetch copy stream per cache

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
        Staged prefetches of this layer left unused afterwards count as wasted. The tensors
        returned are the caller's own (a copy of the slot on the device: ``w1`` and ``w2``
        views of one buffer); ``serve`` is the copy-free way for a layer's computation.
        """
        with self._lock:
            flat, rows = self._admit(layer, experts, drop_staged=_drop_staged)
            return {
                e: self.layout.views(flat[row, : self.layout.nbytes].clone())
                for e, row in rows.items()
            }

    def serve(self, layer: int, experts: Sequence[int]) -> ServedExperts:
        """Requests ``experts`` of ``layer`` as ``get_many`` does, for the layer's computation:
        the experts stay where they are on the device (``ServedExperts``: views of the slots
        and an expert -> row table), no copy of a resident expert. The views are valid for
        work queued on the current stream before the next request of this cache; on CUDA the
        current stream already waits for the loads (no host synchronisation)."""
        with self._lock:
            flat, rows = self._admit(layer, experts, drop_staged=True)
            state = self._layers[layer]
            weights = (
                self._slots.stacked if flat is self._slots.flat_SB else self.layout.stacked(flat)
            )
            return ServedExperts(weights, state.lookup(rows, self.store.num_experts, self.device))

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start background reads of ``experts`` of ``layer`` that are not resident.

        Returns how many reads were started; a no-op when the cache was built without
        ``prefetch=True``. Earlier staged experts of the layer not in ``experts`` are dropped.
        At most ``prefetch_slots`` experts wait on the device at once; the rest are skipped.
        """
        if self._pool is None:
            return 0
        state = self._layer(layer)
        wanted = [int(e) for e in dict.fromkeys(experts)]
        for expert in wanted:
            if not 0 <= expert < self.store.num_experts:
                raise ValueError(f"expert={expert} out of range in prefetch(layer={layer})")
        started = wasted = 0
        with self._lock:
            for expert in list(state.staged):
                if expert not in wanted:
                    self._drop(state.staged.pop(expert))
                    wasted += 1
            marker = None
            for expert in wanted:
                if expert in state.staged or state.policy.contains(expert):
                    continue
                if self._staged_count >= self.prefetch_slots or not self._slots.free:
                    break
                if marker is None:
                    marker = self._copier.marker()
                slot = self._slots.take()
                self._staged_count += 1
                dst = self._slots.row(slot)  # here: the buffer is allocated under the lock
                after = (marker, self._slots.pending(slot, self._copier.prefetch))
                fut = self._pool.submit(self._read_async, layer, expert, dst, after)
                state.staged[expert] = Staged(slot, fut)
                started += 1
        with self._stats_lock:
            self._stats.prefetch_issued += started
            self._stats.prefetch_wasted += wasted
        return started

    def resident(self, layer: int) -> list[int]:
        """Experts of ``layer`` resident in the device tier now, sorted."""
        state = self._layer(layer)
        with self._lock:
            return state.policy.resident()

    def access_log(self, layer: int) -> list[tuple[int, bool]]:
        """(expert, hit) of every request of ``layer`` so far (needs ``record=True``)."""
        state = self._layer(layer)
        if state.log is None:
            raise ValueError("build the cache with record=True to keep access logs")
        with self._lock:
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
    def _layer(self, layer: int) -> LayerState:
        if not isinstance(layer, int) or not 0 <= layer < len(self._layers):
            raise ValueError(
                f"layer={layer!r} out of range: the store has {len(self._layers)} layers"
            )
        return self._layers[layer]

    def _admit(
        self, layer: int, experts: Sequence[int], *, drop_staged: bool
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """Run the requests through the policy and put every requested expert on the device
        (caller holds the lock). Returns the flat buffer ``[N, B]`` they are rows of and
        {expert: row}: the slot buffer when the call's experts fit in slots beside the other
        layers' residents, else a buffer of this call's experts only."""
        state = self._layer(layer)
        policy = state.policy
        used: dict[int, None] = {}
        hits = misses = 0
        experts = [int(e) for e in experts]
        for expert in experts:  # all checked before the policy sees any
            if not 0 <= expert < self.store.num_experts:
                raise ValueError(
                    f"expert={expert} out of range: layer {layer} has "
                    f"{self.store.num_experts} experts"
                )
        for expert in experts:
            hit, _ = policy.access(expert)
            if state.log is not None:
                state.log.append((expert, hit))
            hits += hit
            misses += not hit
            used[expert] = None
        keep = {e for e in (*state.slot_of, *used) if policy.contains(e)}
        staged_kept = (
            {} if drop_staged else {e: s for e, s in state.staged.items() if e not in used}
        )
        wasted = [e for e in state.staged if e not in used and e not in staged_kept]
        for expert in wasted:
            self._drop(state.staged.pop(expert))
        for expert in [e for e in state.slot_of if e not in keep and e not in used]:
            self._slots.give(state.slot_of.pop(expert))  # evicted, not needed by this call
        with self._stats_lock:  # the policy has counted them, whatever the loads do
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.prefetch_wasted += len(wasted)
        own = len(state.slot_of) + len(state.staged)
        others = self._slots.held - own
        need = len(keep | set(used)) + len(staged_kept)
        if need <= self._slots.count - others:
            rows = self._admit_slots(state, layer, sorted(used), keep)
            flat = self._slots.flat_SB
        else:
            flat, rows = self._admit_buffer(state, layer, sorted(used), keep)
        return flat, rows

    def _admit_slots(
        self, state: LayerState, layer: int, used: list[int], keep: set[int]
    ) -> dict[int, int]:
        """Every requested expert into a slot: a resident one stays, a staged one keeps its
        slot, the others are loaded into free slots (one copy each); the experts the policy
        did not keep give their slots back after the call. The compute stream waits on this
        call's copies (also when a load fails): its prefetch hits' events and the event
        after its last load (the demand stream runs in order)."""
        copier = self._copier
        rows = {e: state.slot_of[e] for e in used if e in state.slot_of}
        loads = [e for e in used if e not in rows]
        hits: list[torch.cuda.Event | None] = []
        last_load = None
        if loads:
            copier.after_compute()
        try:
            for expert in loads:
                staged = state.staged.pop(expert, None)
                if staged is not None:
                    self._staged_count -= 1
                    if self._wait_staged(staged, layer, expert):
                        rows[expert] = staged.slot
                        hits.append(staged.event)
                        continue
                    slot = staged.slot  # the prefetch failed: read it here, into its slot
                else:
                    slot = self._slots.take()
                try:
                    last_load = self._load_slot(layer, expert, slot)
                except BaseException:
                    self._settle_failed_call(state, rows, keep, slot)
                    raise
                rows[expert] = slot
        finally:
            copier.compute_waits([*hits, last_load])
        for expert in used:
            if expert in keep:
                state.slot_of[expert] = rows[expert]
            else:  # served but not kept (static, lfu): its slot is free after this call
                state.slot_of.pop(expert, None)
                self._slots.give(rows[expert])
        return rows

    def _settle_failed_call(
        self, state: LayerState, rows: dict[int, int], keep: set[int], slot: int
    ) -> None:
        """A load of this call failed (``slot`` was to take it): every slot goes back or to
        the expert it holds, so none leaks. The experts loaded so far stay resident where the
        policy keeps them; the policy may still count the failed one (and later ones) as
        resident: a later request finds no slot for it and loads it again."""
        self._slots.give(slot)
        for expert, row in rows.items():
            if state.slot_of.get(expert) == row:
                continue
            if expert in keep:
                state.slot_of[expert] = row
            else:
                self._slots.give(row)

    def _admit_buffer(
        self, state: LayerState, layer: int, used: list[int], keep: set[int]
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """More experts in this call than free slots (a long prompt on a small cache): copy
        them into a buffer of their own (resident and staged ones from their slots, the
        others loaded into it, one copy each), then the kept ones into slots. The compute
        stream waits on this call's copies before it reads them, and also when a load fails
        (``flat`` is then freed on the compute stream, which must not reuse it while a copy
        still writes it)."""
        copier = self._copier
        rows = {e: i for i, e in enumerate(used)}
        flat = torch.empty(len(used), self._slots.slot_bytes, dtype=torch.uint8, device=self.device)
        nbytes = self.layout.nbytes
        on_device: dict[int, int] = {}  # expert -> slot holding it now
        hits: list[torch.cuda.Event | None] = []
        last_load = None
        copier.after_compute()
        try:
            for expert in used:
                if expert in state.slot_of:
                    on_device[expert] = state.slot_of[expert]
                    continue
                staged = state.staged.pop(expert, None)
                if staged is not None:
                    self._staged_count -= 1
                    if self._wait_staged(staged, layer, expert):
                        on_device[expert] = staged.slot
                        state.slot_of[expert] = staged.slot  # released below unless kept
                        hits.append(staged.event)
                        continue
                    self._slots.give(staged.slot)
                last_load = self._load(layer, expert, flat[rows[expert], :nbytes])
        finally:
            copier.compute_waits([*hits, last_load])
        for expert, slot in on_device.items():  # device to device, on the compute stream
            flat[rows[expert], :nbytes].copy_(self._slots.row(slot))
        for expert in list(state.slot_of):
            if expert not in keep:
                self._slots.give(state.slot_of.pop(expert))
        for expert in used:
            if expert in keep and expert not in state.slot_of:
                slot = self._slots.take()  # its last copy (a dropped prefetch's) may still run
                copier.compute_waits([self._slots.pending(slot, copier.compute_stream())])
                self._slots.row(slot).copy_(flat[rows[expert], :nbytes])
                state.slot_of[expert] = slot
        return flat, rows

    def _wait_staged(self, staged: Staged, layer: int, expert: int) -> bool:
        """Wait for a prefetch's read (host time, counted as stall); False if it failed."""
        start = time.perf_counter()
        try:
            self._finish_read(staged)
            ok = True
        except Exception as err:  # a failed prefetch is retried synchronously
            log.warning("prefetch of layer %d expert %d failed: %s", layer, expert, err)
            ok = False
        with self._stats_lock:
            self._stats.stall_s += time.perf_counter() - start
            if ok:
                self._stats.loads += 1
                self._stats.prefetch_hits += 1
        return ok

    def _finish_read(self, staged: Staged) -> None:
        """Wait on the host for a prefetch's read (raising what it raised); its copy becomes
        the slot's last write, which a later write from another stream waits on."""
        staged.event = staged.future.result()
        self._slots.wrote(staged.slot, self._copier.prefetch, staged.event)

    def _drop(self, staged: Staged) -> None:
        """Give a staged expert's slot back (after its read, if running: it writes the slot;
        its copy may still run on the device, so the slot keeps its event)."""
        if not staged.future.cancel():
            with contextlib.suppress(Exception):
                self._finish_read(staged)
        self._staged_count -= 1
        self._slots.give(staged.slot)

    def _host_flat(self, layer: int, expert: int) -> tuple[torch.Tensor, bool, int]:
        """The expert's flat host buffer: (buffer, a host tier filled on misses held it,
        bytes read from disk), through the host tier where there is one."""
        if self.host is not None:
            held, host_hit, nbytes = self.host.fetch(layer, expert)
        else:
            held = self.store.load(layer, expert, pin_memory=self._pin)
            host_hit, nbytes = False, self.store.expert_bytes
        return self.layout.flat(held, pin=self._pin), host_hit, nbytes

    def _load_slot(self, layer: int, expert: int, slot: int) -> torch.cuda.Event | None:
        """Serve a miss into ``slot`` (caller holds the lock), after the slot's last copy
        where the prefetch stream issued it (a dropped or failed prefetch's slot)."""
        demand = self._copier.demand
        after = [self._slots.pending(slot, demand)]
        event = self._load(layer, expert, self._slots.row(slot), after=after)
        self._slots.wrote(slot, demand, event)
        return event

    def _load(
        self,
        layer: int,
        expert: int,
        dst: torch.Tensor,
        after: Sequence[torch.cuda.Event | None] = (),
    ) -> torch.cuda.Event | None:
        """Serve a miss into ``dst`` (caller holds the lock): host tier or disk, one copy on
        the demand stream after ``after``. Returns the event after the copy (CUDA)."""
        start = time.perf_counter()
        host, host_hit, nbytes = self._host_flat(layer, expert)
        event = self._copier.copy(dst, host, after=after)
        stall = time.perf_counter() - start
        with self._stats_lock:
            s = self._stats
            s.stall_s += stall
            s.loads += 1
            s.bytes_read += nbytes
            s.bytes_to_device += self.layout.nbytes
            s.host_hits += host_hit
        log.debug("layer %d expert %d loaded (host tier: %s)", layer, expert, host_hit)
        return event

    def _read_async(
        self,
        layer: int,
        expert: int,
        dst: torch.Tensor,
        after: Sequence[torch.cuda.Event | None],
    ) -> torch.cuda.Event | None:
        """Prefetch worker: host tier or disk into ``dst`` (the reserved slot's row), without
        the lock, on the prefetch stream after ``after`` (the compute stream's marker, the
        slot's last copy from another stream). Returns the event after the copy (CUDA)."""
        host, _, nbytes = self._host_flat(layer, expert)
        event = self._copier.copy(dst, host, prefetch=True, after=after)
        with self._stats_lock:
            self._stats.bytes_read += nbytes
            self._stats.bytes_to_device += self.layout.nbytes
        return event
