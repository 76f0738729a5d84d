"""A host tier filled ahead: every expert of an ExpertStore read once into (pinned) host
memory, then served to any number of ExpertCaches in the store's place.

ExpertCache's own host tier (``CacheConfig.host_capacity``) fills on misses and belongs to
one cache; a server that replays several caches over the same model, or that wants no disk
read on its first misses, reads the store once with ``HostTier.read(store)``. ``load``
returns the held expert (``w1`` and ``w2`` views of one buffer, so a load to the device is
one copy) and counts the call; every other attribute is the store's.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

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
    """Every expert of ``store`` held in host memory (``read`` builds one); a drop-in for
    the store wherever ExpertCache takes one."""

    reads_disk = False  # a load is served from memory (ExpertCacheStats.bytes_read stays 0)

    def __init__(self, store: ExpertStore, experts: dict[tuple[int, int], dict]) -> None:
        self._store = store
        self._experts = experts
        self._lock = threading.Lock()
        self.loads = 0  # load calls served, each one expert moved on by its caller
        self.nbytes = store_bytes(store)

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
        return cls(store, dict(zip(keys, held, strict=True)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def load(self, layer: int, expert: int, *, pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """The held ``{"w1", "w2"}`` of one expert (the caller must not write into it);
        ``pin_memory`` is the store's argument, decided once by ``read``."""
        try:
            held = self._experts[(layer, expert)]
        except KeyError:
            raise MoestackError(
                f"expert {expert} of layer {layer} is not in the host tier of {self._store.path} "
                f"({self._store.num_layers} layers x {self._store.num_experts} experts)"
            ) from None
        with self._lock:
            self.loads += 1
        return held
