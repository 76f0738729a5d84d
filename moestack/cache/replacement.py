"""Expert-cache replacement algorithms: one implementation for telemetry replay and the real cache.

Build them by name through the registry, ``moestack.cache.policies``.

A policy tracks which keys (expert ids of one MoE layer, ints >= 0) are resident in a cache
of ``capacity`` slots. The simulator (``moestack.telemetry.simulate``) and the real
``ExpertCache`` drive the same objects:

- ``access(key) -> (hit, evicted)``: one request. On a miss the key is loaded for this use;
  afterwards ``contains(key)`` says whether the policy kept it (a policy may *bypass*: serve a
  miss without caching it) and ``evicted`` is the key that left the cache to make room, or
  None. A real cache loads on a miss, stores the key when ``contains(key)`` is true, and drops
  ``evicted``.
- ``access_many(keys) -> hits``: the same requests in order, as a bool array; it leaves the
  policy in exactly the state the ``access`` loop would. LRU, static and lru+static do it
  vectorised (numpy); the others loop.
- ``contains(key)``, ``resident()`` (sorted keys), ``len(policy)``.

Policies:

- ``lru``: evict the least recently used key. O(1) per access (OrderedDict).
- ``lfu``: evict the resident key with the fewest requests so far; counts are kept for every
  key ever seen, also after eviction ("perfect" LFU), ties go to the least recently used.
  O(log capacity) amortised (a heap with lazy deletion).
- ``static``: pin ``capacity`` keys, given (``pinned=``) or the most requested ones in the
  first ``warmup`` requests (ties: smaller key first). During the warm-up nothing is cached;
  afterwards a pinned key is loaded on its first request (a miss) and stays; any other key
  is served without caching. ``pin(keys)`` re-pins.
- ``lru+static``: ``num_pinned`` slots pinned as in ``static`` (default ``capacity // 2``),
  the other ``capacity - num_pinned`` slots an LRU cache for the unpinned keys. Requests for
  pinned keys never touch the LRU part. During the warm-up only the LRU part caches.
- ``belady``: the offline optimum (fewest misses) for a known request sequence, given whole
  as ``future=``: on a miss it evicts the resident key whose next request is furthest away,
  or bypasses the new key when that key's own next request is further than all of theirs.
  Requests must follow ``future`` exactly. O(log capacity) amortised.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

# Below this many requests the vectorised paths loop instead (numpy set-up costs more).
_VECTOR_MIN = 256
# Words (64 keys each) in one level of stack_distances' sparse table: 32 MB.
_TABLE_WORDS = 1 << 22


def _check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity={capacity!r} must be an int >= 1 (expert slots per layer)")
    return int(capacity)


def _as_keys(keys: Iterable[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(keys if isinstance(keys, np.ndarray) else list(keys))
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0):
        raise ValueError(f"keys must be non-negative integer expert ids; got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _small(values: np.ndarray) -> np.ndarray:
    """``values`` (ints >= 0) in the narrowest unsigned dtype that holds them: numpy's stable
    sort is a radix sort for 8 and 16 bits, several times faster than for int64."""
    top = int(values.max()) if values.size else 0
    dtype = np.uint8 if top < 1 << 8 else np.uint16 if top < 1 << 16 else np.int64
    return values.astype(dtype, copy=False)


def _previous(ids: np.ndarray) -> np.ndarray:
    """For each position, the index of the previous position with the same id (-1: none)."""
    prev = np.full(ids.size, -1, dtype=np.int64)
    if ids.size > 1:
        order = np.argsort(_small(ids), kind="stable")
        same = ids[order[1:]] == ids[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
    return prev


def _window_distinct(ids: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """For each position i with ``prev[i] >= 0``: how many distinct ids lie strictly between
    ``prev[i]`` and i (0 elsewhere); ``ids`` are ints >= 0, as dense as may be.

    Each id is one bit of a row of 64-bit words; a window's ids are the OR of its rows, read
    off a sparse table (level L, row j: the OR of rows j .. j + 2^L - 1) as two overlapping
    power-of-two halves, and counted with a popcount. The levels are built one at a time and
    each answers the windows of its length class, so memory is two levels of ``len(ids)``
    rows. Work: O(n log n) words.
    """
    n = ids.size
    out = np.zeros(n, dtype=np.int64)
    ends = np.flatnonzero(prev >= 0)
    starts = prev[ends] + 1
    keep = ends > starts  # an empty window counts 0
    ends, starts = ends[keep], starts[keep]
    if ends.size == 0:
        return out
    word_of, bit = ids >> 6, np.left_shift(np.uint64(1), (ids & 63).astype(np.uint64))
    table = [np.where(word_of == w, bit, np.uint64(0)) for w in range(int(word_of.max()) + 1)]
    level = _small(np.frexp((ends - starts).astype(np.float64))[1] - 1)  # floor(log2(len))
    top = int(level.max())
    order = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[order], np.arange(top + 2))
    for lvl in range(top + 1):
        sel = order[bounds[lvl] : bounds[lvl + 1]]
        if sel.size:
            end, start = ends[sel], starts[sel]
            mid = end - (1 << lvl)
            count = np.zeros(sel.size, dtype=np.int64)
            for word in table:
                count += np.bitwise_count(word[start] | word[mid])
            out[end] = count
        if lvl < top:
            half = 1 << lvl
            table = [word[:-half] | word[half:] for word in table]
    return out


def stack_distances(keys: np.ndarray, last: np.ndarray, tick: int) -> tuple[np.ndarray, np.ndarray]:
    """LRU stack (reuse) distances of ``keys``, vectorised.

    ``last[u]`` is the tick of key u's latest request (-1: never; ticks of different keys
    differ); the requests get ticks ``tick, tick+1, ...``. Returns ``dist`` (int64 [n]: distinct
    other keys requested since the same key's previous request, -1 for a first request) and
    the updated ``last`` (a new array, as long as needed). An LRU cache of capacity c hits
    exactly when 0 <= dist < c.

    The keys seen before (``last``) go first, oldest first, then ``keys``: a distance is the
    count of distinct keys in the window between two requests of a key (``_window_distinct``).
    Work: O(n log n x words) numpy, words = distinct keys / 64, whatever the distances; inputs
    longer than a table of ``_TABLE_WORDS`` words are taken in pieces.
    """
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.size
    size = max(int(last.size), int(keys.max()) + 1 if n else 0)
    state = np.full(size, -1, dtype=np.int64)
    state[: last.size] = last
    if n == 0:
        return np.zeros(0, dtype=np.int64), state
    old = np.flatnonzero(state >= 0)
    words = min(size, old.size + n) // 64 + 1  # at least the sparse table's row width
    step = max(4096, _TABLE_WORDS // words - old.size)
    if n > step:  # in pieces, each starting from the state the previous one left
        parts = []
        for begin in range(0, n, step):
            dist, state = stack_distances(keys[begin : begin + step], state, tick + begin)
            parts.append(dist)
        return np.concatenate(parts), state
    old = old[np.argsort(state[old], kind="stable")]
    seq = np.concatenate([old, keys])
    if size <= 8 * seq.size:  # dense ids through a lookup table, else by sorting
        ids = (np.cumsum(np.bincount(seq, minlength=size) > 0) - 1)[seq]
    else:
        ids = np.unique(seq, return_inverse=True)[1]
    prev = _previous(ids)
    dist = _window_distinct(ids, prev)[old.size :]
    dist[prev[old.size :] < 0] = -1
    latest = np.ones(seq.size, dtype=bool)  # each key's latest request: no one's previous
    latest[prev[prev >= 0]] = False
    latest[: old.size] = False
    where = np.flatnonzero(latest)
    state[seq[where]] = tick + where - old.size
    return dist, state


class CachePolicy:
    """Base class: the request API shared by the simulator and the real expert cache."""

    name = "base"

    def __init__(self, capacity: int) -> None:
        self.capacity = _check_capacity(capacity)

    def access(self, key: int) -> tuple[bool, int | None]:
        """Request ``key``: (hit, key evicted to make room or None)."""
        raise NotImplementedError

    def access_many(self, keys: Iterable[int] | np.ndarray) -> np.ndarray:
        """Request every key in order; bool hit per request."""
        arr = _as_keys(keys)
        access = self.access
        return np.fromiter((access(k)[0] for k in arr.tolist()), dtype=bool, count=arr.size)

    def contains(self, key: int) -> bool:
        """Whether ``key`` is resident now."""
        raise NotImplementedError

    def resident(self) -> list[int]:
        """The resident keys, sorted."""
        raise NotImplementedError

    def __contains__(self, key: object) -> bool:
        return self.contains(key)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.resident())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, resident={self.resident()})"


class LRUPolicy(CachePolicy):
    """Least recently used: O(1) per request."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def access(self, key: int) -> tuple[bool, int | None]:
        order = self._order
        if key in order:
            order.move_to_end(key)
            return True, None
        evicted = None
        if len(order) >= self.capacity:
            evicted, _ = order.popitem(last=False)
        order[key] = None
        return False, evicted

    def access_many(self, keys: Iterable[int] | np.ndarray) -> np.ndarray:
        arr = _as_keys(keys)
        if arr.size < _VECTOR_MIN:  # numpy's set-up would cost more than the dict walk
            return super().access_many(arr)
        resident = list(self._order)
        size = max(int(arr.max()) + 1, max(resident, default=-1) + 1)
        last = np.full(size, -1, dtype=np.int64)
        last[resident] = np.arange(len(resident))  # recency order as pseudo ticks
        dist, last = stack_distances(arr, last, len(resident))
        hits = (dist >= 0) & (dist < self.capacity)
        present = np.flatnonzero(last >= 0)
        newest = present[np.argsort(last[present], kind="stable")][-self.capacity :]
        self._order = OrderedDict((int(k), None) for k in newest)
        return hits

    def discard(self, key: int) -> bool:
        """Drop ``key`` if resident; whether it was."""
        return self._order.pop(key, 0) is None

    def contains(self, key: int) -> bool:
        return key in self._order

    def resident(self) -> list[int]:
        return sorted(self._order)

    def recency(self) -> list[int]:
        """Resident keys from least to most recently used."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)


class LFUPolicy(CachePolicy):
    """Perfect LFU (counts survive eviction), ties to the least recently used.

    The heap holds one entry (count, tick, key) per key at least, pushed when the key is
    loaded; a hit only updates the key's count and tick, so its entry becomes a lower bound
    (both only grow while it stays). Choosing a victim renews the stale entries it meets at
    the top, drops those of keys no longer resident, and takes the first entry that is its
    key's (count, tick) now: no resident key can be below it (ticks differ, so no ties)."""

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._count: dict[int, int] = {}
        self._tick: dict[int, int] = {}  # last request time of resident keys
        self._heap: list[tuple[int, int, int]] = []  # (count, tick, key), lower bounds
        self._now = 0

    def access(self, key: int) -> tuple[bool, int | None]:
        self._now += 1
        count = self._count.get(key, 0) + 1
        self._count[key] = count
        tick = self._tick
        if key in tick:
            tick[key] = self._now  # its heap entry stays a lower bound
            return True, None
        evicted = None
        if len(tick) >= self.capacity:
            evicted = self._pop_victim()
        tick[key] = self._now
        self._push(count, key)
        return False, evicted

    def access_many(self, keys: Iterable[int] | np.ndarray) -> np.ndarray:
        """``access`` in order, its hits handled in the loop (no method call, no heap
        operation), the misses through the same ``_pop_victim`` and ``_push``."""
        arr = _as_keys(keys).tolist()
        hits = np.zeros(len(arr), dtype=bool)
        counts, tick, capacity = self._count, self._tick, self.capacity
        for i, key in enumerate(arr):
            self._now = now = self._now + 1
            count = counts.get(key, 0) + 1
            counts[key] = count
            if key in tick:
                tick[key] = now
                hits[i] = True
                continue
            if len(tick) >= capacity:
                self._pop_victim()
            tick[key] = now
            self._push(count, key)
        return hits

    def _push(self, count: int, key: int) -> None:
        heap = self._heap
        heapq.heappush(heap, (count, self._now, key))
        if len(heap) > 8 * self.capacity + 64:  # drop stale entries
            self._heap = [(self._count[k], t, k) for k, t in self._tick.items()]
            heapq.heapify(self._heap)

    def _pop_victim(self) -> int:
        heap, tick, counts = self._heap, self._tick, self._count
        while True:
            count, t, key = heap[0]
            now = tick.get(key)
            if now is None:  # evicted since it was pushed
                heapq.heappop(heap)
            elif now == t and counts[key] == count:
                heapq.heappop(heap)
                del tick[key]
                return key
            else:  # requested since: renewed with its count and tick now
                heapq.heapreplace(heap, (counts[key], now, key))

    def count(self, key: int) -> int:
        """Requests of ``key`` so far."""
        return self._count.get(key, 0)

    def contains(self, key: int) -> bool:
        return key in self._tick

    def resident(self) -> list[int]:
        return sorted(self._tick)

    def __len__(self) -> int:
        return len(self._tick)


def top_keys(counts: np.ndarray, n: int) -> list[int]:
    """The n keys with the highest counts (ties: smaller key), only keys with count > 0."""
    keys = np.flatnonzero(counts > 0)
    order = np.lexsort((keys, -counts[keys]))
    return [int(k) for k in keys[order][:n]]


class LRUStaticPolicy(CachePolicy):
    """``num_pinned`` pinned slots plus an LRU part for the other keys."""

    name = "lru+static"

    def __init__(
        self,
        capacity: int,
        pinned: Sequence[int] | None = None,
        *,
        num_pinned: int | None = None,
        warmup: int = 0,
    ) -> None:
        super().__init__(capacity)
        if num_pinned is None:
            num_pinned = len(pinned) if pinned is not None else self.capacity // 2
        if not 0 <= num_pinned <= self.capacity:
            raise ValueError(f"num_pinned={num_pinned} must be in [0, capacity={self.capacity}]")
        if warmup < 0:
            raise ValueError(f"warmup={warmup} must be >= 0 requests")
        if pinned is None and warmup == 0 and num_pinned > 0:
            raise ValueError(
                f"{self.name}: give pinned=[expert ids] or warmup=N > 0 requests to choose the "
                "most used experts from"
            )
        self.num_pinned = int(num_pinned)
        self.warmup = int(warmup)
        lru_slots = self.capacity - self.num_pinned
        self._lru = LRUPolicy(lru_slots) if lru_slots > 0 else None
        self._pinned: set[int] | None = None
        self._loaded: set[int] = set()
        self._counts = np.zeros(0, dtype=np.int64)
        self._seen = 0
        if pinned is not None:
            self.pin(pinned)
        elif self.num_pinned == 0:
            self.pin(())

    @property
    def pinned(self) -> list[int] | None:
        """The pinned keys (None while the warm-up still chooses them)."""
        return None if self._pinned is None else sorted(self._pinned)

    def pin(self, keys: Iterable[int]) -> list[int]:
        """Pin ``keys`` (at most ``num_pinned``); returns the keys that stop being resident."""
        new = {int(k) for k in keys}
        if len(new) > self.num_pinned:
            raise ValueError(
                f"{len(new)} keys to pin but only num_pinned={self.num_pinned} pinned slots"
            )
        dropped = sorted(self._loaded - new)
        self._loaded &= new
        if self._lru is not None:
            for key in new:
                if self._lru.discard(key):
                    self._loaded.add(key)  # already in memory: moves to the pinned part
        self._pinned = new
        return dropped

    def _count_warmup(self, keys: np.ndarray) -> None:
        if keys.size:
            counts = np.bincount(keys, minlength=max(self._counts.size, int(keys.max()) + 1))
            counts[: self._counts.size] += self._counts
            self._counts = counts
        self._seen += int(keys.size)
        if self._seen >= self.warmup:
            self.pin(top_keys(self._counts, self.num_pinned))

    def access(self, key: int) -> tuple[bool, int | None]:
        if self._pinned is None:
            result = self._lru.access(key) if self._lru is not None else (False, None)
            self._count_warmup(np.array([key], dtype=np.int64))
            return result
        if key in self._pinned:
            if key in self._loaded:
                return True, None
            self._loaded.add(key)
            return False, None
        if self._lru is None:
            return False, None
        return self._lru.access(key)

    def access_many(self, keys: Iterable[int] | np.ndarray) -> np.ndarray:
        arr = _as_keys(keys)
        hits = np.zeros(arr.size, dtype=bool)
        start = 0
        if self._pinned is None:  # warm-up part: only the LRU part caches
            start = min(arr.size, self.warmup - self._seen)
            head = arr[:start]
            if self._lru is not None:
                hits[:start] = self._lru.access_many(head)
            self._count_warmup(head)
        rest = arr[start:]
        if rest.size == 0:
            return hits
        pinned = np.fromiter(self._pinned, dtype=np.int64, count=len(self._pinned))
        is_pinned = np.isin(rest, pinned)
        part = is_pinned.copy()
        for key in self._pinned - self._loaded:  # first request of an unloaded pin misses
            where = np.flatnonzero(rest == key)
            if where.size:
                part[where[0]] = False
                self._loaded.add(key)
        if self._lru is not None:
            part[~is_pinned] = self._lru.access_many(rest[~is_pinned])
        hits[start:] = part
        return hits

    def contains(self, key: int) -> bool:
        return key in self._loaded or (self._lru is not None and self._lru.contains(key))

    def resident(self) -> list[int]:
        lru = self._lru.resident() if self._lru is not None else []
        return sorted(self._loaded.union(lru))


class StaticPolicy(LRUStaticPolicy):
    """Every slot pinned: the most used experts (given, or chosen on the warm-up requests)."""

    name = "static"

    def __init__(
        self, capacity: int, pinned: Sequence[int] | None = None, *, warmup: int = 0
    ) -> None:
        super().__init__(capacity, pinned, num_pinned=_check_capacity(capacity), warmup=warmup)


def next_uses(keys: np.ndarray) -> np.ndarray:
    """For each request, the index of the next request of the same key (len(keys) if none)."""
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.size
    nxt = np.full(n, n, dtype=np.int64)
    if n > 1:
        order = np.argsort(keys, kind="stable")
        same = keys[order[1:]] == keys[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    return nxt


class BeladyPolicy(CachePolicy):
    """Offline optimum (Belady's MIN with bypass) for the request sequence ``future``."""

    name = "belady"

    def __init__(self, capacity: int, future: Sequence[int] | np.ndarray) -> None:
        super().__init__(capacity)
        self._future = _as_keys(future)
        self._next = next_uses(self._future).tolist()
        self._keys = self._future.tolist()
        self._t = 0
        self._resident: dict[int, int] = {}  # key -> index of its next request
        self._heap: list[tuple[int, int]] = []  # (-next request, key), lazily invalidated

    def access(self, key: int) -> tuple[bool, int | None]:
        t = self._t
        if t >= len(self._keys):
            raise ValueError(
                f"belady: request {t} is past the end of the future it was given "
                f"({len(self._keys)} requests); build it with the whole sequence"
            )
        if self._keys[t] != key:
            raise ValueError(
                f"belady: request {t} is key {key} but the future given says {self._keys[t]}; "
                "requests must follow future= exactly"
            )
        self._t = t + 1
        nxt = self._next[t]
        resident = self._resident
        if key in resident:
            resident[key] = nxt
            self._push(nxt, key)
            return True, None
        if len(resident) < self.capacity:
            resident[key] = nxt
            self._push(nxt, key)
            return False, None
        heap = self._heap
        while True:  # resident key requested furthest in the future
            neg, victim = heap[0]
            if resident.get(victim) == -neg:
                break
            heapq.heappop(heap)
        if -neg <= nxt:  # the new key is needed last of all: serve it without caching
            return False, None
        heapq.heappop(heap)
        del resident[victim]
        resident[key] = nxt
        self._push(nxt, key)
        return False, victim

    def _push(self, nxt: int, key: int) -> None:
        heapq.heappush(self._heap, (-nxt, key))
        if len(self._heap) > 8 * self.capacity + 64:
            self._heap = [(-n, k) for k, n in self._resident.items()]
            heapq.heapify(self._heap)

    def contains(self, key: int) -> bool:
        return key in self._resident

    def resident(self) -> list[int]:
        return sorted(self._resident)

    def __len__(self) -> int:
        return len(self._resident)
