"""One ExpertCache's state per layer and the checks of its arguments.

Each layer has its own policy (the replacement algorithm the simulator replays), the slots
its resident experts hold in the device tier, its staged prefetches (a slot reserved and a
read in flight), its access log (``record=True``) and its expert -> row table on the
device. The cache's lock guards all of it. The checks refuse, in one line, a capacity that
cannot hold one token's experts, pins for another number of layers and negative tier sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from moestack.cache.host_tier import HostTier
from moestack.cache.policies import CachePolicy, make_policy
from moestack.cache.store import ExpertStore


class Staged:
    """A prefetched expert: the slot reserved for it, the read that fills it (its result:
    the event recorded after the slot's copy, None on the CPU) and, once that read is
    waited on, the event."""

    def __init__(self, slot: int, future: Future[torch.cuda.Event | None]) -> None:
        self.slot = slot
        self.future = future
        self.event: torch.cuda.Event | None = None


class LayerState:
    """One layer's cache state (guarded by the cache's lock)."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.slot_of: dict[int, int] = {}  # the policy's resident experts -> their slots
        self.staged: dict[int, Staged] = {}
        self.log: list[tuple[int, bool]] | None = None
        self.lut_E: torch.Tensor | None = None  # expert -> row, on the device
        self.lut_rows: dict[int, int] = {}  # what lut_E holds (written entries only)

    def lookup(self, rows: dict[int, int], num_experts: int, device: torch.device) -> torch.Tensor:
        """The layer's expert -> row table on ``device`` (``[num_experts]``, int64), with
        ``rows`` written (only the entries that changed: none when every expert hit in place)."""
        if self.lut_E is None:
            self.lut_E = torch.full((num_experts,), -1, dtype=torch.int64, device=device)
        changed = [(e, r) for e, r in rows.items() if self.lut_rows.get(e) != r]
        if not changed:
            return self.lut_E
        if device.type == "cuda":  # one small async copy from page-locked memory
            idx_rows = torch.tensor(changed, dtype=torch.int64).T.contiguous().pin_memory()
            idx_rows = idx_rows.to(device, non_blocking=True)
            self.lut_E.index_copy_(0, idx_rows[0], idx_rows[1])
        else:
            for expert, row in changed:
                self.lut_E[expert] = row
        self.lut_rows.update(changed)
        return self.lut_E


def checked_capacity(
    store: ExpertStore, capacity: int | None, capacity_bytes: int | None, top_k: int | None
) -> int:
    """Experts per layer from ``capacity`` or ``capacity_bytes``, refused in one line where
    it is not an int or one token's ``top_k`` experts would not fit."""
    if capacity_bytes:
        if capacity:
            raise ValueError("give capacity (experts per layer) or capacity_bytes, not both")
        capacity = int(capacity_bytes) // store.expert_bytes
        what = f"capacity_bytes={capacity_bytes} ({capacity} experts of {store.expert_bytes} bytes)"
    else:
        what = f"capacity={capacity}"
    if capacity is None or isinstance(capacity, bool) or not isinstance(capacity, int):
        raise ValueError(f"capacity={capacity!r} must be an int (experts per layer)")
    if capacity < max(1, top_k or 1):
        raise ValueError(
            f"{what} is smaller than top_k={top_k or 1}: one token's experts would not fit; "
            f"use capacity >= {top_k or 1}"
        )
    return capacity


def check_options(
    store: ExpertStore,
    pinned: Sequence[Sequence[int]] | None,
    host_capacity: int,
    prefetch_slots: int | None,
) -> None:
    """Refuse pins for another number of layers and negative tier sizes, in one line."""
    if pinned is not None and len(pinned) != store.num_layers:
        raise ValueError(
            f"pinned has {len(pinned)} entries, the store has {store.num_layers} layers"
        )
    if host_capacity < 0:
        raise ValueError(f"host_capacity={host_capacity} must be >= 0")
    if prefetch_slots is not None and prefetch_slots < 0:
        raise ValueError(f"prefetch_slots={prefetch_slots} must be >= 0")


def new_layers(
    num_layers: int,
    policy: str,
    capacity: int,
    pinned: Sequence[Sequence[int]] | None,
    warmup: int,
    num_pinned: int | None,
) -> list[LayerState]:
    """Each layer's state with its own policy (its pins where ``pinned`` gives them)."""
    return [
        LayerState(
            make_policy(
                policy,
                capacity,
                pinned=None if pinned is None else list(pinned[i]),
                warmup=warmup,
                num_pinned=num_pinned,
            )
        )
        for i in range(num_layers)
    ]


def host_tier_of(
    source: ExpertStore | HostTier, host_capacity: int, on_gpu: bool
) -> tuple[ExpertStore, HostTier | None]:
    """The store a cache reads and its host tier: ``source`` itself where it is a tier read
    ahead, else one filled on misses holding ``host_capacity`` experts per layer (page-locked;
    only with a CUDA device: on the CPU the device tier is host memory), else none."""
    if isinstance(source, HostTier):
        if host_capacity and on_gpu:
            raise ValueError(
                f"host_capacity={host_capacity} with a HostTier that holds every expert "
                "already: give host_capacity=0"
            )
        return source.store, source
    if host_capacity and on_gpu:
        return source, HostTier(source, capacity=host_capacity, pin=True)
    return source, None
