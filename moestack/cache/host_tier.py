"""The host tier of the expert cache: experts of an ExpertStore held in (pinned) host
memory, between the store on disk and the cache's device tier. One class, filled one of two
ways:

- ahead (``HostTier.read(store, pin=...)``): every expert read once; passed to any number
  of ExpertCaches in the store's place (``ExpertCache(tier, ...)``), so a server that
  replays several caches over one model reads the files once and no miss reads the disk;
- on misses (``HostTier(store, capacity=n, pin=...)``, what an ExpertCache builds for its
  ``host_capacity``): each layer keeps its ``n`` most recently used experts, evicted by
  the replacement module's ``LRUPolicy`` (the one LRU the cache and the simulator share).

An expert is held as ``ExpertStore.load`` returns it: ``w1`` and ``w2`` views of one
buffer, so a load to the device is one copy.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from moestack.cache.device_tier import Expert
from moestack.cache.replacement import LRUPolicy
from moestack.cache.store import ExpertStore
from moestack.errors import MoestackError

log = logging.getLogger(__name__)


def available_host_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """Bytes of host memory the kernel says are available (``MemAvailable``), None where it
    does not say (not Linux)."""
    try:
        lines = Path(meminfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def store_bytes(store: ExpertStore, *, pinned: bool = False) -> int:
    """Bytes of every expert of ``store`` (what a full host tier holds); ``pinned``: as
    torch's page-locked allocator takes them, each block rounded up to a power of two."""
    layers, experts = range(store.num_layers), range(store.num_experts)
    sizes = [store.entry(layer, e).nbytes for layer in layers for e in experts]
    if pinned:
        sizes = [1 << max(n - 1, 0).bit_length() for n in sizes]
    return sum(sizes)


class HostTier:
    """Experts of ``store`` in host memory: every one (``experts``, read ahead: ``read``)
    or, with ``capacity``, the ``capacity`` most recently used of each layer, filled on
    misses from the store (page-locked with ``pin``). It knows what it holds: ``store``
    (where its experts come from), ``num_layers``, ``num_experts``, ``expert_bytes``,
    ``nbytes`` (held now) and ``loads`` (experts served)."""

    def __init__(
        self,
        store: ExpertStore,
        experts: dict[tuple[int, int], Expert] | None = None,
        *,
        capacity: int = 0,
        pin: bool = False,
    ) -> None:
        if capacity < 0 or (capacity and experts):
            raise ValueError(
                f"capacity={capacity}: give experts read ahead (capacity 0) or a capacity "
                ">= 1 experts per layer filled on misses"
            )
        self.store = store
        self.num_layers, self.num_experts = store.num_layers, store.num_experts
        self.expert_bytes = store.expert_bytes
        self.capacity = capacity  # 0: holds every expert, read ahead
        self.pin = pin
        self._experts = dict(experts or {})
        self._lru = [LRUPolicy(capacity) for _ in range(self.num_layers)] if capacity else []
        self._lock = threading.Lock()
        self.loads = 0  # experts served, each one moved on by its caller

    @classmethod
    def read(
        cls,
        store: ExpertStore,
        *,
        pin: bool,
        workers: int = 8,
        headroom: float = 0.9,
        progress: bool = True,
    ) -> HostTier:
        """Read every expert of ``store`` into host memory (page-locked with ``pin``, for
        asynchronous copies to a GPU), ``workers`` at a time (reads and checksums release
        the GIL). Refused in one line where the experts exceed ``headroom`` of the host
        memory available."""
        need, free = store_bytes(store, pinned=pin), available_host_bytes()
        if free is not None and need > headroom * free:
            raise MoestackError(
                f"the experts of {store.path} take {need / 2**30:.1f} GiB, more than "
                f"{headroom:.0%} of the {free / 2**30:.1f} GiB of host memory available: "
                "serve them from the store (ExpertCache over it, with host_capacity) instead"
            )
        keys = [(layer, e) for layer in range(store.num_layers) for e in range(store.num_experts)]
        log.info(
            "host tier: reading %d experts (%.1f MiB) of %s", len(keys), need / 2**20, store.path
        )
        with ThreadPoolExecutor(workers) as pool:
            loads = pool.map(lambda key: store.load(*key, pin_memory=pin), keys)
            held = list(
                tqdm(loads, total=len(keys), desc="host tier", unit="expert", disable=not progress)
            )
        return cls(store, dict(zip(keys, held, strict=True)), pin=pin)

    @property
    def nbytes(self) -> int:
        """Bytes of the experts held now (every expert's, read ahead)."""
        with self._lock:
            return sum(t.nbytes for held in self._experts.values() for t in held.values())

    def load(self, layer: int, expert: int, *, pin_memory: bool = False) -> Expert:
        """The held ``{"w1", "w2"}`` of one expert (the caller must not write into it), as
        ``fetch``; ``pin_memory`` is the store's argument, decided once for the tier."""
        return self.fetch(layer, expert)[0]

    def fetch(self, layer: int, expert: int) -> tuple[Expert, bool, int]:
        """One expert for the cache: its tensors, whether a tier filled on misses held them
        (``ExpertCacheStats.host_hits``), and the bytes read from disk for them (a miss of
        a tier filled on misses: read from the store, kept, the least recently used expert
        of the layer evicted)."""
        key = (layer, expert)
        with self._lock:
            held = self._experts.get(key)
            if held is not None:
                self.loads += 1
                if self.capacity:
                    self._lru[layer].access(expert)  # most recently used now
                return held, bool(self.capacity), 0
        if not self.capacity:
            raise MoestackError(
                f"expert {expert} of layer {layer} is not in the host tier of {self.store.path} "
                f"({self.num_layers} layers x {self.num_experts} experts)"
            )
        loaded = self.store.load(layer, expert, pin_memory=self.pin)
        with self._lock:
            self.loads += 1
            _, evicted = self._lru[layer].access(expert)
            self._experts[key] = loaded
            if evicted is not None:
                del self._experts[(layer, evicted)]
        return loaded, False, self.expert_bytes
