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
    chunk-000000.safetensors    tensors "seq", "pos", "experts.<l>", "probs.<l>" as above

Chunks are written as they fill (``chunk_tokens`` rows) when the trace has a ``path``, and the
header is rewritten atomically after each chunk, so memory stays bounded on long runs and a
crash leaves a readable trace of every chunk written. Without a path, ``max_memory_tokens``
bounds memory by dropping the oldest chunks (``dropped_tokens`` counts them).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FORMAT_NAME = "moestack-routing-trace"
FORMAT_VERSION = 1
HEADER_FILE = "header.json"


class TraceFormatError(ValueError):
    """A trace file is missing, truncated, foreign or inconsistent with its header."""


@dataclass
class TraceChunk:
    """n token rows of a trace (see the module docstring for the fields)."""

    seq: np.ndarray
    pos: np.ndarray
    experts: list[np.ndarray]
    probs: list[np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.seq.shape[0])


def expert_dtype(num_experts: int) -> np.dtype:
    """int16 ids where they fit, else int32."""
    return np.dtype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


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
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        self.layer_names = [str(x) for x in layer_names]
        self.top_k = [int(x) for x in top_k]
        self.num_experts = [int(x) for x in num_experts]
        self.expert_bytes = list(expert_bytes) if expert_bytes is not None else [None] * n
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
            self.path.mkdir(parents=True, exist_ok=True)
            if (self.path / HEADER_FILE).exists():
                raise FileExistsError(
                    f"{self.path / HEADER_FILE} exists: a trace is already there; "
                    "choose an empty trace directory"
                )
            self._write_header()

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
        """Add n token rows (arrays are kept, not copied: do not modify them afterwards)."""
        n = int(np.shape(seq)[0])
        if len(experts) != self.num_layers:
            raise ValueError(f"got experts for {len(experts)} layers, trace has {self.num_layers}")
        rows = []
        for layer, ids in enumerate(experts):
            ids = np.asarray(ids)
            if ids.shape != (n, self.top_k[layer]):
                raise ValueError(
                    f"layer {layer} experts have shape {ids.shape}, expected "
                    f"({n}, top_k={self.top_k[layer]})"
                )
            rows.append(ids.astype(expert_dtype(self.num_experts[layer]), copy=False))
        prob_rows = None
        if self.record_probs:
            if probs is None:
                raise ValueError("this trace records router probabilities: pass probs=")
            prob_rows = [np.asarray(p, dtype=np.float16) for p in probs]
        chunk = TraceChunk(
            np.asarray(seq, dtype=np.int64), np.asarray(pos, dtype=np.int32), rows, prob_rows
        )
        self._pending.append(chunk)
        self._pending_tokens += n
        if self._pending_tokens >= self.chunk_tokens:
            self._seal()

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

    def flush(self) -> None:
        """Write (or gather) every pending row now."""
        self._seal()

    def _write_chunk(self, chunk: TraceChunk) -> None:
        from safetensors.numpy import save_file

        assert self.path is not None
        name = f"chunk-{len(self._disk):06d}.safetensors"
        tensors = {"seq": chunk.seq, "pos": chunk.pos}
        for layer, ids in enumerate(chunk.experts):
            tensors[f"experts.{layer}"] = np.ascontiguousarray(ids)
            if chunk.probs is not None:
                tensors[f"probs.{layer}"] = np.ascontiguousarray(chunk.probs[layer])
        tmp = self.path / (name + ".tmp")
        save_file(
            tensors, str(tmp), metadata={"format": FORMAT_NAME, "version": str(FORMAT_VERSION)}
        )
        os.replace(tmp, self.path / name)
        self._disk.append({"file": name, "tokens": chunk.num_tokens})
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
        tmp = self.path / (HEADER_FILE + ".tmp")
        tmp.write_text(json.dumps(self._header(), indent=1))
        os.replace(tmp, self.path / HEADER_FILE)

    # ------------------------------------------------------------------ reading
    def _read_chunk(self, entry: dict[str, Any]) -> TraceChunk:
        from safetensors import safe_open

        assert self.path is not None
        file = self.path / entry["file"]
        try:
            with safe_open(str(file), framework="np") as f:
                keys = set(f.keys())
                need = {"seq", "pos"} | {f"experts.{i}" for i in range(self.num_layers)}
                if self.record_probs:
                    need |= {f"probs.{i}" for i in range(self.num_layers)}
                if not need <= keys:
                    raise TraceFormatError(
                        f"{file}: missing tensors {sorted(need - keys)}; not a chunk of this trace"
                    )
                seq, pos = f.get_tensor("seq"), f.get_tensor("pos")
                experts = [f.get_tensor(f"experts.{i}") for i in range(self.num_layers)]
                probs = None
                if self.record_probs:
                    probs = [f.get_tensor(f"probs.{i}") for i in range(self.num_layers)]
        except TraceFormatError:
            raise
        except FileNotFoundError as err:
            raise TraceFormatError(
                f"{file}: chunk file listed in {HEADER_FILE} is missing"
            ) from err
        except Exception as err:  # safetensors raises its own error type for bad files
            raise TraceFormatError(
                f"{file}: cannot read routing-trace chunk (truncated or not safetensors): {err}"
            ) from err
        n = int(entry["tokens"])
        shapes_ok = seq.shape == (n,) and pos.shape == (n,)
        shapes_ok &= all(e.shape == (n, k) for e, k in zip(experts, self.top_k, strict=True))
        if not shapes_ok:
            raise TraceFormatError(
                f"{file}: shapes do not match {HEADER_FILE} ({n} tokens, top_k={self.top_k})"
            )
        return TraceChunk(seq, pos, experts, probs)

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
        """Open a trace directory (or its header.json); chunks are read when used."""
        path = Path(path)
        if path.name == HEADER_FILE and path.is_file():
            path = path.parent
        header_file = path / HEADER_FILE
        if not path.is_dir():
            raise TraceFormatError(
                f"{path}: not a routing-trace directory (expected a folder with {HEADER_FILE})"
            )
        if not header_file.is_file():
            raise TraceFormatError(f"{header_file}: missing; {path} is not a routing trace")
        try:
            header = json.loads(header_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TraceFormatError(f"{header_file}: unreadable or truncated JSON: {err}") from err
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
            raise TraceFormatError(
                f"{header_file}: not a {FORMAT_NAME} header (format="
                f"{header.get('format') if isinstance(header, dict) else None!r})"
            )
        if header.get("version") != FORMAT_VERSION:
            raise TraceFormatError(
                f"{header_file}: format version {header.get('version')!r} is not supported "
                f"(this moestack reads version {FORMAT_VERSION})"
            )
        try:
            layers = header["layers"]
            trace = cls.__new__(cls)
            trace.layer_names = [str(x["name"]) for x in layers]
            trace.top_k = [int(x["top_k"]) for x in layers]
            trace.num_experts = [int(x["num_experts"]) for x in layers]
            trace.expert_bytes = [x.get("expert_bytes") for x in layers]
            trace.record_probs = bool(header["record_probs"])
            trace._disk = [
                {"file": str(c["file"]), "tokens": int(c["tokens"])} for c in header["chunks"]
            ]
            trace.meta = dict(header.get("meta", {}))
            trace.dropped_tokens = int(header.get("dropped_tokens", 0))
        except (KeyError, TypeError, ValueError) as err:
            raise TraceFormatError(f"{header_file}: malformed header ({err!r})") from err
        trace.path = path
        trace.chunk_tokens = 1 << 18
        trace.max_memory_tokens = None
        trace._memory, trace._pending, trace._pending_tokens = [], [], 0
        trace._readonly_check()
        return trace

    def _readonly_check(self) -> None:
        """Open every chunk's header: a truncated or foreign chunk fails at load time."""
        from safetensors import safe_open

        assert self.path is not None
        for entry in self._disk:
            file = self.path / entry["file"]
            if not file.is_file():
                raise TraceFormatError(f"{file}: chunk file listed in {HEADER_FILE} is missing")
            try:
                with safe_open(str(file), framework="np") as f:
                    meta = f.metadata() or {}
                    shape = f.get_slice("seq").get_shape()
            except Exception as err:
                raise TraceFormatError(
                    f"{file}: cannot read routing-trace chunk (truncated or not safetensors): {err}"
                ) from err
            if meta.get("format") != FORMAT_NAME or list(shape) != [entry["tokens"]]:
                raise TraceFormatError(
                    f"{file}: not a chunk of this trace (format={meta.get('format')!r}, "
                    f"seq shape {list(shape)}, header says {entry['tokens']} tokens)"
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
