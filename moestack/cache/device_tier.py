"""The device tier of ExpertCache: experts as flat byte buffers, slots for them in one device
buffer, and the copies that fill the slots.

Why flat: an expert's tensors (``w1`` then ``w2``) are views of one contiguous buffer in
the host tier (``ExpertStore.load`` reads them so), so a load is one host-to-device copy
(``copy_expert``) into a slot, and the tensors on the device are views of that slot.

Why slots: every layer's resident experts live in rows of one preallocated ``[S, slot
bytes]`` buffer (``SlotPool``); a layer's computation indexes it through an expert -> slot
table, so a resident expert is never copied again (``stacked`` gives ``{"w1": [S, D, 2F],
"w2": [S, F, D]}`` views of all slots at once).

Streams (CUDA): a cache's ``Copier`` issues demand loads on a high-priority stream and
prefetches on a second stream, so a miss is not queued behind speculative copies in
stream order. Every copy is ordered after the work already queued on the compute stream
(a slot being overwritten may still be read there) and records an event right after it;
a layer call makes the compute stream wait only on the events of its own copies. A slot's
last copy (``SlotPool.pending``) is waited on by the next write into that slot from
another stream (a dropped prefetch's slot taken by a demand load). No host
synchronisation. On the CPU every copy is a plain synchronous copy and there are no
events.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from moestack.cache.store_format import ExpertEntry

Expert = dict[str, torch.Tensor]
SLOT_ALIGN = 256  # bytes: each slot (and so each expert's first tensor) starts aligned


def copy_expert(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
    """The one copy of a load: an expert's flat host buffer into its device slot."""
    dst.copy_(src, non_blocking=non_blocking)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where each tensor of an expert lies in its flat buffer: in order, end to end."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]  # bytes
    nbytes: int

    @classmethod
    def of(cls, expert: Expert) -> ExpertLayout:
        """The layout of ``expert``'s tensors laid end to end in dict order."""
        offsets, pos = [], 0
        for t in expert.values():
            if pos % t.element_size():
                raise ValueError(
                    f"expert tensors {list(expert)} cannot be laid end to end: a "
                    f"{t.dtype} tensor would start at byte {pos}"
                )
            offsets.append(pos)
            pos += t.nbytes
        return cls(
            tuple(expert),
            tuple(tuple(t.shape) for t in expert.values()),
            tuple(t.dtype for t in expert.values()),
            tuple(offsets),
            pos,
        )

    @classmethod
    def of_entry(cls, entry: ExpertEntry) -> ExpertLayout:
        """The layout of an expert store's expert (``w1`` directly followed by ``w2``)."""
        return cls(
            ("w1", "w2"),
            (tuple(entry.w1.shape), tuple(entry.w2.shape)),
            (entry.w1.dtype, entry.w2.dtype),
            (0, entry.w1.nbytes),
            entry.w1.nbytes + entry.w2.nbytes,
        )

    def views(self, flat: torch.Tensor) -> Expert:
        """The expert's tensors as views of one flat uint8 buffer ``[nbytes]``."""
        return {
            name: flat[off : off + _numel(shape) * _size(dtype)].view(dtype).view(shape)
            for name, shape, dtype, off in zip(
                self.names, self.shapes, self.dtypes, self.offsets, strict=True
            )
        }

    def stacked(self, flat_SB: torch.Tensor) -> Expert:
        """Every row's tensors at once: ``{name: [S, *shape]}`` views of ``flat_SB [S, B]``."""
        rows = flat_SB.shape[0]
        return {
            name: flat_SB[:, off : off + _numel(shape) * _size(dtype)]
            .view(dtype)
            .view(rows, *shape)
            for name, shape, dtype, off in zip(
                self.names, self.shapes, self.dtypes, self.offsets, strict=True
            )
        }

    def flat(self, expert: Expert, *, pin: bool) -> torch.Tensor:
        """``expert`` as one flat uint8 buffer: the buffer its tensors already are views of
        (no copy; what ``ExpertStore.load`` returns), else a packed copy (``pin``: page-locked)."""
        view = flat_view(expert)
        if view is not None and view.numel() == self.nbytes:
            return view
        out = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        for dst, src in zip(self.views(out).values(), expert.values(), strict=True):
            dst.copy_(src)
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def flat_view(expert: Expert) -> torch.Tensor | None:
    """The one uint8 buffer ``expert``'s tensors are contiguous views of, end to end in
    order; None when they are not laid out so."""
    tensors = list(expert.values())
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    start = pos = tensors[0].storage_offset() * tensors[0].element_size()
    for t in tensors:
        same = t.untyped_storage().data_ptr() == storage.data_ptr()
        if not (same and t.is_contiguous() and t.storage_offset() * t.element_size() == pos):
            return None
        pos += t.nbytes
    flat = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    return flat.set_(storage, start, (pos - start,))


class SlotPool:
    """``count`` expert slots in one device buffer ``[count, slot_bytes]`` (allocated on
    first use) and the free ones; the caller guards it with its lock."""

    def __init__(self, count: int, layout: ExpertLayout, device: torch.device) -> None:
        self.count = count
        self.layout = layout
        self.device = device
        self.slot_bytes = -(-layout.nbytes // SLOT_ALIGN) * SLOT_ALIGN
        self._flat_SB: torch.Tensor | None = None
        self._stacked: Expert | None = None
        self.free = list(range(count - 1, -1, -1))  # pop() hands out slot 0 first
        # CUDA: slot -> (stream, event) of the last copy issued into it
        self._writes: dict[int, tuple[torch.cuda.Stream, torch.cuda.Event]] = {}

    @property
    def flat_SB(self) -> torch.Tensor:
        if self._flat_SB is None:
            self._flat_SB = torch.empty(
                self.count, self.slot_bytes, dtype=torch.uint8, device=self.device
            )
        return self._flat_SB

    @property
    def stacked(self) -> Expert:
        """``{name: [count, *shape]}``: every slot's tensors, views of the buffer."""
        if self._stacked is None:
            self._stacked = self.layout.stacked(self.flat_SB)
        return self._stacked

    def row(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s expert bytes ``[layout.nbytes]`` (a view)."""
        return self.flat_SB[slot, : self.layout.nbytes]

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("expert slot pool exhausted: a cache bookkeeping error")
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def held(self) -> int:
        return self.count - len(self.free)

    def wrote(
        self, slot: int, stream: torch.cuda.Stream | None, event: torch.cuda.Event | None
    ) -> None:
        """Note a copy into ``slot`` issued on ``stream``, ``event`` recorded after it (no-op
        without an event: the CPU)."""
        if stream is not None and event is not None:
            self._writes[slot] = (stream, event)

    def pending(self, slot: int, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """The event a new write into ``slot`` on ``stream`` must wait for first: the slot's
        last copy when another stream issued it (streams run in order, so one issued on
        ``stream`` is already ahead of the write); None when there is none."""
        last = self._writes.get(slot)
        if last is None or last[0] == stream:
            return None
        return last[1]


class Copier:
    """Host-to-device copies of experts (CUDA): demand loads on a high-priority stream,
    prefetches on a second stream (both created once), each copy ordered after the work
    given in ``after`` and followed by an event the compute stream waits on where the copy
    is used. Plain synchronous copies on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # priority: lower is higher (out of range: clamped to the highest). CUDA applies it to
        # kernels only, not to host-to-device copies: what a demand load gains is its own
        # in-order stream, not queued behind the prefetches
        self.demand = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.prefetch = torch.cuda.Stream(device) if self.cuda else None

    def stream(self, prefetch: bool) -> torch.cuda.Stream | None:
        """The stream a demand load (``prefetch=False``) or a prefetch is copied on."""
        return self.prefetch if prefetch else self.demand

    def compute_stream(self) -> torch.cuda.Stream | None:
        """The calling thread's current stream, where layers compute (None on the CPU)."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def marker(self) -> torch.cuda.Event | None:
        """An event at the end of the compute stream's queued work (None on the CPU): copies
        issued later from other threads wait on it (``copy(after=...)``)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def after_compute(self) -> None:
        """Order the demand loads issued from now on after the compute stream's queued work."""
        if self.demand is not None:
            self.demand.wait_stream(torch.cuda.current_stream(self.device))

    def copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        prefetch: bool = False,
        after: Iterable[torch.cuda.Event | None] = (),
    ) -> torch.cuda.Event | None:
        """One expert's copy, ``src`` (host, flat) into ``dst`` (a device slot row), on the
        demand or the prefetch stream after the events ``after`` (None entries skipped).
        Returns an event recorded right after the copy (None on the CPU)."""
        stream = self.stream(prefetch)
        if stream is None:
            copy_expert(dst, src, non_blocking=False)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            copy_expert(dst, src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def compute_waits(self, events: Iterable[torch.cuda.Event | None]) -> None:
        """Make the compute stream wait for ``events`` (None entries skipped; no host
        synchronisation): the copies a layer call uses, and nothing else."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for event in events:
            if event is not None:
                compute.wait_event(event)
