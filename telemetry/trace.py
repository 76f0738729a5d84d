"""RoutingTrace: which experts every token used, per MoE layer, and its on-disk format.

In memory a trace is a list of chunks. Each chunk holds ``n`` token rows:

- ``seq`` int64 [n]: sequence id. Each forward pass of a batch [B, S] gives its B sequences
  fresh ids (a running counter), except a continuation (generation with a KV cache, whose
  positions do not start at 0), which keeps the previous call's ids.
- ``pos`` int32 [n]: position of the token in its sequence; -1 marks a padding token (an
  ``attention_mask`` zero), which replay skips.
- ``experts[l]`` [n, k_l] (int16, or int32 past 32767 experts): the experts layer l chose,
  slots in router order (descending router score); -1 where the layer did not run.
- ``probs[l]`` float16 [n, E_l] (optional): the router's probabilities over all experts.

Replay order (what ``RoutingTrace.accesses`` returns and ``simulate`` feeds the caches): rows
in recording order, which is the model's flattening of [B, S]: the sequences of a batch one
after another, tokens of a sequence in order; within a token its k slots in router order.
Each layer is its own cache, so replay is per layer.

On disk a trace is a directory (format ``moestack-routing-trace``, version 1)::

    header.json                 {"format": "moestack-routing-trace", "version": 1,
                                 "layers": [{"name", "top_k", "num_experts",
                                             "expert_bytes"}, ...],
                                 "record_probs": bool, "num_tokens": N,
                                 "chunks": [{"file": "chunk-000000.safetensors",
                                             "tokens": n}, ...],
                                 "meta": {...}}
    chunk-000000.safetensors    tensors "seq", "pos", "experts.<l>", "probs.<l>" as above;
                                metadata "format", "version", "expert_ranges" (per layer
                                [min, max] id, a cheap check at load)

Chunks are written as they fill (``chunk_tokens`` rows) when the trace has a ``path``, and at
``flush()`` (``Telemetry.flush()`` at every training checkpoint): each chunk is fsynced and
renamed into place, then the header listing it is rewritten atomically, so memory stays
bounded on long runs. Without a path, ``max_memory_tokens`` bounds memory by dropping the
oldest chunks (``dropped_tokens`` counts them).

A folder left by a killed writer (no final ``close()``) loads with exactly the chunks its
header lists: every row appended before the last ``flush()`` or automatic chunk, nothing
after it. Leftover ``*.tmp`` files and a chunk file renamed in just before the kill but not yet
listed are ignored, with a warning naming them. A folder whose writer never wrote a chunk holds
no tokens, and ``load`` refuses it (so does ``simulate`` an empty trace).

``load`` trusts nothing on disk (``moestack.telemetry.trace_format``): the header must match the
schema, every chunk file must lie inside the folder, and expert ids must be -1 or below the
layer's ``num_experts``; each refusal is one ``TraceFormatError`` line naming the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moestack.telemetry.trace_format import (
    CHECKSUM,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_FILE,
    TraceChunk,
    TraceFormatError,
    TraceHeader,
    check_chunk_file,
    chunk_path,
    expert_dtype,
    id_range_problem,
    read_chunk_file,
    read_header,
    stray_files,
    write_chunk_file,
    write_header,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HEADER_FILE",
    "RoutingTrace",
    "TraceChunk",
    "TraceFormatError",
    "chunk_accesses",
    "expert_dtype",
]

log = logging.getLogger(__name__)


def _concat(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    if not parts:
        return empty
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class RoutingTrace:
    """Per-layer expert ids of every token, with sequence and position ids."""

    def __init__(
        self,
        layer_names: Sequence[str],
        top_k: Sequence[int],
        num_experts: Sequence[int],
        *,
        expert_bytes: Sequence[int | None] | None = None,
        record_probs: bool = False,
        path: str | os.PathLike[str] | None = None,
        chunk_tokens: int = 1 << 18,
        max_memory_tokens: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        n = len(layer_names)
        if len(top_k) != n or len(num_experts) != n:
            raise ValueError(
                f"layer_names ({n}), top_k ({len(top_k)}) and num_experts ({len(num_experts)}) "
                "must have one entry per MoE layer"
            )
        if expert_bytes is not None and len(expert_bytes) != n:
            raise ValueError(
                f"expert_bytes has {len(expert_bytes)} entries, give one per layer ({n})"
            )
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        self.layer_names = [str(x) for x in layer_names]
        self.top_k = [int(x) for x in top_k]
        self.num_experts = [int(x) for x in num_experts]
        self.expert_bytes = [
            int(b) if isinstance(b, np.integer) else b for b in (expert_bytes or [None] * n)
        ]
        self.record_probs = bool(record_probs)
        self.chunk_tokens = int(chunk_tokens)
        self.max_memory_tokens = max_memory_tokens
        self.meta: dict[str, Any] = dict(meta or {})
        self.path = Path(path) if path is not None else None
        self.dropped_tokens = 0
        self._disk: list[dict[str, Any]] = []  # {"file", "tokens"} of chunks on disk
        self._memory: list[TraceChunk] = []  # complete chunks kept in memory
        self._pending: list[TraceChunk] = []  # rows not yet gathered into a chunk
        self._pending_tokens = 0
        if self.path is not None:
            self._check_layout()
            self.path.mkdir(parents=True, exist_ok=True)
            if (self.path / HEADER_FILE).exists():
                raise FileExistsError(
                    f"{self.path / HEADER_FILE} exists: a trace is already there; "
                    "choose an empty trace directory"
                )
            self._write_header()

    def _check_layout(self) -> None:
        """Refuse what the header schema would refuse, so every trace written loads."""
        for i, (k, e, b) in enumerate(
            zip(self.top_k, self.num_experts, self.expert_bytes, strict=True)
        ):
            if not 1 <= k <= e:
                raise ValueError(f"layer {i}: top_k={k} must be in [1, num_experts={e}]")
            if b is not None and not (isinstance(b, int) and b >= 0):
                raise ValueError(f"layer {i}: expert_bytes={b!r} must be an int >= 0 or None")
        if not self.layer_names:
            raise ValueError("a trace on disk needs at least one MoE layer")

    # ------------------------------------------------------------------ recording
    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def num_tokens(self) -> int:
        """Rows held (on disk and in memory), not counting dropped ones."""
        on_disk = sum(c["tokens"] for c in self._disk)
        return on_disk + sum(c.num_tokens for c in self._memory) + self._pending_tokens

    def append(
        self,
        seq: np.ndarray,
        pos: np.ndarray,
        experts: Sequence[np.ndarray],
        probs: Sequence[np.ndarray] | None = None,
    ) -> None:
        """Add n token rows (arrays are kept, not copied: do not modify them afterwards).

        Expert ids must be -1 (the layer did not run) or in [0, num_experts): anything else
        raises ``ValueError`` before a row is kept.
        """
        n = int(np.shape(seq)[0])
        if len(experts) != self.num_layers:
            raise ValueError(f"got experts for {len(experts)} layers, trace has {self.num_layers}")
        if np.shape(pos) != (n,):
            raise ValueError(f"pos has shape {np.shape(pos)}, expected ({n},) like seq")
        rows = [self._checked_ids(layer, np.asarray(ids), n) for layer, ids in enumerate(experts)]
        prob_rows = None
        if self.record_probs:
            if probs is None:
                raise ValueError("this trace records router probabilities: pass probs=")
            prob_rows = [np.asarray(p, dtype=np.float16) for p in probs]
            for layer, p in enumerate(prob_rows):
                if p.shape != (n, self.num_experts[layer]):
                    raise ValueError(
                        f"layer {layer} probs have shape {p.shape}, expected "
                        f"({n}, num_experts={self.num_experts[layer]})"
                    )
        if n == 0:
            return
        chunk = TraceChunk(
            np.asarray(seq, dtype=np.int64), np.asarray(pos, dtype=np.int32), rows, prob_rows
        )
        self._pending.append(chunk)
        self._pending_tokens += n
        if self._pending_tokens >= self.chunk_tokens:
            self._seal()

    def _checked_ids(self, layer: int, ids: np.ndarray, n: int) -> np.ndarray:
        """``ids`` [n, k] of ``layer`` in the trace's dtype, refused if not expert ids."""
        if ids.shape != (n, self.top_k[layer]):
            raise ValueError(
                f"layer {layer} experts have shape {ids.shape}, expected "
                f"({n}, top_k={self.top_k[layer]})"
            )
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"layer {layer} experts have dtype {ids.dtype}; give integer ids")
        problem = id_range_problem(ids, self.num_experts[layer])
        if problem is not None:
            raise ValueError(
                f"layer {layer} ({self.layer_names[layer]}) has {problem}; "
                "give the layer's true num_experts or fix the ids"
            )
        return ids.astype(expert_dtype(self.num_experts[layer]), copy=False)

    def _gather_pending(self) -> TraceChunk | None:
        if not self._pending:
            return None
        parts = self._pending
        self._pending, self._pending_tokens = [], 0
        if len(parts) == 1:
            return parts[0]
        return TraceChunk(
            np.concatenate([p.seq for p in parts]),
            np.concatenate([p.pos for p in parts]),
            [np.concatenate([p.experts[i] for p in parts]) for i in range(self.num_layers)],
            None
            if not self.record_probs
            else [np.concatenate([p.probs[i] for p in parts]) for i in range(self.num_layers)],
        )

    def _seal(self) -> None:
        chunk = self._gather_pending()
        if chunk is None:
            return
        if self.path is not None:
            self._write_chunk(chunk)
            return
        self._memory.append(chunk)
        if self.max_memory_tokens is not None:
            held = sum(c.num_tokens for c in self._memory)
            while len(self._memory) > 1 and held > self.max_memory_tokens:
                old = self._memory.pop(0)
                held -= old.num_tokens
                if self.dropped_tokens == 0:
                    log.warning(
                        "routing trace over max_memory_tokens=%d: dropping the oldest tokens "
                        "(give a trace directory to keep them all)",
                        self.max_memory_tokens,
                    )
                self.dropped_tokens += old.num_tokens

    def flush(self) -> int:
        """Write every pending row now; returns the rows on disk (0 without a ``path``).

        With a ``path``: the pending rows become one chunk file (none if nothing is pending),
        fsynced, then ``header.json`` lists it (atomic rename, fsynced), so the folder loads
        with every row appended so far even if the process dies right after. Without a
        ``path``: the pending rows become an in-memory chunk.
        """
        self._seal()
        return sum(c["tokens"] for c in self._disk)

    def _write_chunk(self, chunk: TraceChunk) -> None:
        assert self.path is not None
        name = f"chunk-{len(self._disk):06d}.safetensors"
        digest = write_chunk_file(self.path / name, chunk)
        self._disk.append({"file": name, "tokens": chunk.num_tokens, CHECKSUM: digest})
        self._write_header()

    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "layers": [
                {"name": n, "top_k": k, "num_experts": e, "expert_bytes": b}
                for n, k, e, b in zip(
                    self.layer_names, self.top_k, self.num_experts, self.expert_bytes, strict=True
                )
            ],
            "record_probs": self.record_probs,
            "num_tokens": sum(c["tokens"] for c in self._disk),
            "dropped_tokens": self.dropped_tokens,
            "chunks": list(self._disk),
            "meta": self.meta,
        }

    def _write_header(self) -> None:
        assert self.path is not None
        write_header(self.path, self._header())

    # ------------------------------------------------------------------ reading
    def _read_chunk(self, entry: dict[str, Any]) -> TraceChunk:
        assert self.path is not None
        file = chunk_path(self.path, entry["file"], "chunks[].file")
        return read_chunk_file(file, self, entry["tokens"])

    def iter_chunks(self) -> Iterator[TraceChunk]:
        """Every chunk in recording order (disk first, then memory and pending rows)."""
        for entry in self._disk:
            yield self._read_chunk(entry)
        yield from self._memory
        yield from self._pending

    def _column(self, pick: Any, empty: np.ndarray) -> np.ndarray:
        return _concat([pick(c) for c in self.iter_chunks()], empty)

    def experts(self, layer: int) -> np.ndarray:
        """Expert ids [N, k] of ``layer`` (-1 where the layer did not run)."""
        self._check_layer(layer)
        empty = np.zeros((0, self.top_k[layer]), dtype=expert_dtype(self.num_experts[layer]))
        return self._column(lambda c: c.experts[layer], empty)

    def probs(self, layer: int) -> np.ndarray:
        """Router probabilities [N, E] of ``layer`` (only if recorded)."""
        self._check_layer(layer)
        if not self.record_probs:
            raise ValueError("this trace has no router probabilities; attach(record_probs=True)")
        empty = np.zeros((0, self.num_experts[layer]), dtype=np.float16)
        return self._column(lambda c: c.probs[layer], empty)

    def sequence_ids(self) -> np.ndarray:
        return self._column(lambda c: c.seq, np.zeros(0, dtype=np.int64))

    def position_ids(self) -> np.ndarray:
        return self._column(lambda c: c.pos, np.zeros(0, dtype=np.int32))

    def accesses(self, layer: int) -> np.ndarray:
        """The layer's expert requests in replay order (padding and -1 skipped), int64."""
        parts = [chunk_accesses(c, layer) for c in self.iter_chunks()]
        return _concat(parts, np.zeros(0, dtype=np.int64))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer={layer} out of range: the trace has {self.num_layers} layers")

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the whole trace as a trace directory at ``path`` (must not hold a trace)."""
        path = Path(path)
        if self.path is not None and path.resolve() == self.path.resolve():
            self.flush()
            return path
        out = RoutingTrace(
            self.layer_names,
            self.top_k,
            self.num_experts,
            expert_bytes=self.expert_bytes,
            record_probs=self.record_probs,
            path=path,
            chunk_tokens=self.chunk_tokens,
            meta=self.meta,
        )
        out.dropped_tokens = self.dropped_tokens
        for chunk in self.iter_chunks():
            out._pending.append(chunk)
            out._pending_tokens += chunk.num_tokens
            out.flush()
        out._write_header()
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Open a trace directory (or its header.json); chunks are read when used.

        Every chunk the header lists is checked (inside the folder, present, its format, row
        count and expert-id range); rows are checked again when read. A folder left by a
        killed writer loads with the chunks its header lists (see ``trace_format``).
        """
        path = Path(path)
        if path.name == HEADER_FILE and path.is_file():
            path = path.parent
        header = read_header(path)
        if header.num_tokens == 0:
            raise TraceFormatError(
                f"{path / HEADER_FILE}: the trace holds no tokens (no chunk was written: the "
                "recorder stopped before flush() or close()); record a trace with tokens"
            )
        trace = cls.__new__(cls)
        trace.layer_names = header.layer_names
        trace.top_k = header.top_k
        trace.num_experts = header.num_experts
        trace.expert_bytes = header.expert_bytes
        trace.record_probs = header.record_probs
        trace._disk = header.chunks
        trace.meta = header.meta
        trace.dropped_tokens = header.dropped_tokens
        trace.path = path
        trace.chunk_tokens = 1 << 18
        trace.max_memory_tokens = None
        trace._memory, trace._pending, trace._pending_tokens = [], [], 0
        trace._readonly_check(header)
        return trace

    def _readonly_check(self, header: TraceHeader) -> None:
        """Check every chunk's file header: a bad entry or chunk fails at load time."""
        assert self.path is not None
        seen: dict[Path, int] = {}
        files = []
        for i, entry in enumerate(self._disk):  # the paths first, then the files they name
            file = chunk_path(self.path, entry["file"], f"chunks[{i}].file")
            first = seen.setdefault(file.resolve(), i)
            if first != i:
                raise TraceFormatError(
                    f"{self.path / HEADER_FILE}: chunks[{i}].file={entry['file']!r} is also "
                    f"chunks[{first}].file: a chunk is listed twice; re-record the trace"
                )
            files.append(file)
        for file, entry in zip(files, self._disk, strict=True):
            if not file.is_file():
                raise TraceFormatError(f"{file}: chunk file listed in {HEADER_FILE} is missing")
            check_chunk_file(file, header, entry["tokens"], entry.get(CHECKSUM))
        stray = stray_files(self.path, {e["file"] for e in self._disk})
        if stray:
            log.warning(
                "%s: ignoring %d file(s) the header does not list (left by a writer that "
                "stopped mid-write): %s",
                self.path,
                len(stray),
                ", ".join(stray[:5]) + (" ..." if len(stray) > 5 else ""),
            )

    @classmethod
    def from_arrays(
        cls,
        experts: Sequence[np.ndarray],
        *,
        num_experts: int | Sequence[int] | None = None,
        seq: np.ndarray | None = None,
        pos: np.ndarray | None = None,
        expert_bytes: int | None = None,
    ) -> RoutingTrace:
        """An in-memory trace from per-layer [N, k] id arrays (one sequence if no ids given)."""
        experts = [np.asarray(e).reshape(len(e), -1) for e in experts]
        n = experts[0].shape[0]
        if num_experts is None:
            num_experts = [int(e.max()) + 1 if e.size else 1 for e in experts]
        elif isinstance(num_experts, int):
            num_experts = [num_experts] * len(experts)
        trace = cls(
            [f"layer{i}" for i in range(len(experts))],
            [e.shape[1] for e in experts],
            num_experts,
            expert_bytes=[expert_bytes] * len(experts),
        )
        trace.append(
            np.zeros(n, dtype=np.int64) if seq is None else seq,
            np.arange(n, dtype=np.int32) if pos is None else pos,
            experts,
        )
        return trace

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}" if self.path is not None else ""
        return (
            f"RoutingTrace(layers={self.num_layers}, tokens={self.num_tokens}, "
            f"top_k={self.top_k}, num_experts={self.num_experts}{where})"
        )


def chunk_accesses(chunk: TraceChunk, layer: int) -> np.ndarray:
    """Replay-order requests of one chunk and layer: rows with pos >= 0, ids >= 0."""
    ids = chunk.experts[layer]
    valid = chunk.pos >= 0
    if not valid.all():
        ids = ids[valid]
    flat = ids.reshape(-1).astype(np.int64)
    if flat.size and flat.min() < 0:
        flat = flat[flat >= 0]
    return flat
