"""The on-disk format of a routing trace: header schema, chunk files, and their checks.

A trace directory (format ``moestack-routing-trace``, version 1) holds ``header.json`` and
``chunk-NNNNNN.safetensors`` files (``moestack.telemetry.trace`` describes the fields). Every
value read from disk is untrusted: ``parse_header`` checks the header against the schema
(required keys, types, versions, sizes), ``chunk_path`` keeps every file it names inside the
trace folder, ``check_chunk_file`` (at load, from the chunk's safetensors header) and
``read_chunk_file`` (when the rows are used) check shapes, dtypes and expert ids. Each
refusal is one ``TraceFormatError`` line naming the file, the field or value, and what to do.

Writes are durable: a chunk is written to ``<name>.tmp``, fsynced and renamed into place,
then ``header.json`` (the list of chunks) the same way, then the folder is fsynced. A process
killed at any point leaves a header listing only complete chunks; ``*.tmp`` files and chunk
files the header does not list are ignored by readers (with a warning naming them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np

log = logging.getLogger(__name__)

FORMAT_NAME = "moestack-routing-trace"
FORMAT_VERSION = 1
HEADER_FILE = "header.json"
RANGES_KEY = "expert_ranges"  # chunk metadata: JSON [[min, max] or null, ...] per layer
CHECKSUM = "blake2b"  # chunks[i].blake2b: BLAKE2b-256 (hex) of the chunk file as written
_REDO = "the trace is damaged or was not written by moestack; re-record it"


class TraceFormatError(ValueError):
    """A trace file is missing, truncated, foreign or inconsistent with its header."""


@dataclass
class TraceChunk:
    """n token rows of a trace (see ``moestack.telemetry.trace`` for the fields)."""

    seq: np.ndarray
    pos: np.ndarray
    experts: list[np.ndarray]
    probs: list[np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.seq.shape[0])


class ChunkLayout(Protocol):
    """What a chunk's tensors must look like: a ``TraceHeader`` or a ``RoutingTrace``."""

    top_k: list[int]
    num_experts: list[int]
    record_probs: bool


@dataclass
class TraceHeader:
    """A checked ``header.json``."""

    layer_names: list[str]
    top_k: list[int]
    num_experts: list[int]
    expert_bytes: list[int | None]
    record_probs: bool
    num_tokens: int
    chunks: list[dict[str, Any]]  # {"file": str, "tokens": int}
    dropped_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def expert_dtype(num_experts: int) -> np.dtype:
    """int16 ids where they fit, else int32."""
    return np.dtype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


def id_range_problem(ids: np.ndarray, num_experts: int) -> str | None:
    """Why ``ids`` are not expert ids of a layer of ``num_experts`` (-1 = did not run)."""
    if ids.size == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    return _range_problem(lo, hi, num_experts)


def _range_problem(lo: int, hi: int, num_experts: int) -> str | None:
    if lo < -1:
        return f"negative expert id {lo} (only -1, 'layer did not run', is allowed)"
    if hi >= num_experts:
        return f"expert id {hi} but num_experts={num_experts} (ids must be < num_experts)"
    return None


# --------------------------------------------------------------------------- header schema
def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(file: Path, name: str, want: str, got: Any) -> NoReturn:
    raise TraceFormatError(f"{file}: field {name!r} must be {want}, got {_show(got)}; {_REDO}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _take(obj: dict, key: str, file: Path, name: str, want: str, ok: Any) -> Any:
    if key not in obj:
        raise TraceFormatError(f"{file}: required field {name!r} is missing; {_REDO}")
    if not ok(obj[key]):
        _bad(file, name, want, obj[key])
    return obj[key]


def _count(obj: dict, key: str, file: Path, name: str, minimum: int = 0) -> int:
    want = f"an integer >= {minimum}"
    return _take(obj, key, file, name, want, lambda v: _is_int(v) and v >= minimum)


def _parse_layer(raw: Any, file: Path, i: int) -> tuple[str, int, int, int | None]:
    name = f"layers[{i}]"
    if not isinstance(raw, dict):
        _bad(file, name, "an object", raw)
    layer = _take(raw, "name", file, f"{name}.name", "a string", lambda v: isinstance(v, str))
    num_experts = _count(raw, "num_experts", file, f"{name}.num_experts", 1)
    top_k = _count(raw, "top_k", file, f"{name}.top_k", 1)
    if top_k > num_experts:
        _bad(file, f"{name}.top_k", f"<= num_experts={num_experts}", top_k)
    size = raw.get("expert_bytes")
    if size is not None and not (_is_int(size) and size >= 0):
        _bad(file, f"{name}.expert_bytes", "an integer >= 0 or null", size)
    return layer, top_k, num_experts, size


def _parse_chunks(raw: list, file: Path) -> list[dict[str, Any]]:
    chunks = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            _bad(file, f"chunks[{i}]", "an object", entry)
        name = _take(
            entry, "file", file, f"chunks[{i}].file", "a file name", lambda v: isinstance(v, str)
        )
        parsed = {"file": name, "tokens": _count(entry, "tokens", file, f"chunks[{i}].tokens")}
        if CHECKSUM in entry:  # written since checksums were added; older chunks have none
            parsed[CHECKSUM] = _take(entry, CHECKSUM, file, f"chunks[{i}].{CHECKSUM}",
                                     "64 hex digits", _is_hex_digest)  # fmt: skip
        chunks.append(parsed)
    return chunks


def _is_hex_digest(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def file_digest(path: Path) -> str:
    """BLAKE2b-256 (hex) of a file, read in 16 MiB blocks."""
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
    return digest.hexdigest()


def parse_header(raw: Any, file: Path) -> TraceHeader:
    """Check a decoded ``header.json`` against the version-1 schema (unknown keys ignored)."""
    if not isinstance(raw, dict):
        _bad(file, "<top level>", f"a JSON object ({FORMAT_NAME} header)", raw)
    if raw.get("format") != FORMAT_NAME:
        raise TraceFormatError(
            f"{file}: not a {FORMAT_NAME} header (format={_show(raw.get('format'))}); "
            "give the folder a moestack trace was written to"
        )
    if not _is_int(raw.get("version")) or raw["version"] != FORMAT_VERSION:
        raise TraceFormatError(
            f"{file}: format version {_show(raw.get('version'))} is not supported "
            f"(this moestack reads version {FORMAT_VERSION}); use the moestack that wrote it"
        )
    layers = _take(raw, "layers", file, "layers", "a non-empty list", _nonempty_list)
    parsed = [_parse_layer(x, file, i) for i, x in enumerate(layers)]
    probs = _take(raw, "record_probs", file, "record_probs", "true or false", _is_bool)
    num_tokens = _count(raw, "num_tokens", file, "num_tokens")
    chunks = _parse_chunks(_take(raw, "chunks", file, "chunks", "a list", _is_list), file)
    listed = sum(c["tokens"] for c in chunks)
    if listed != num_tokens:
        _bad(file, "num_tokens", f"the sum of chunks[].tokens ({listed})", num_tokens)
    dropped = raw.get("dropped_tokens", 0)
    if not (_is_int(dropped) and dropped >= 0):
        _bad(file, "dropped_tokens", "an integer >= 0", dropped)
    meta = raw.get("meta", {})
    if not isinstance(meta, dict):
        _bad(file, "meta", "an object", meta)
    return TraceHeader(
        layer_names=[p[0] for p in parsed],
        top_k=[p[1] for p in parsed],
        num_experts=[p[2] for p in parsed],
        expert_bytes=[p[3] for p in parsed],
        record_probs=probs,
        num_tokens=num_tokens,
        chunks=chunks,
        dropped_tokens=dropped,
        meta=dict(meta),
    )


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_list(value: Any) -> bool:
    return isinstance(value, list)


def _nonempty_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value)


def read_header(path: Path) -> TraceHeader:
    """The checked header of the trace folder ``path``."""
    header_file = path / HEADER_FILE
    if not path.is_dir():
        raise TraceFormatError(
            f"{path}: not a routing-trace directory (expected a folder with {HEADER_FILE})"
        )
    if not header_file.is_file():
        raise TraceFormatError(f"{header_file}: missing; {path} is not a routing trace")
    try:
        raw = json.loads(header_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise TraceFormatError(f"{header_file}: unreadable or truncated JSON: {err}") from err
    return parse_header(raw, header_file)


# --------------------------------------------------------------------------- chunk files
def chunk_path(root: Path, name: str, where: str) -> Path:
    """``root / name``, refused unless it is a file path that stays inside ``root``."""
    header_file = root / HEADER_FILE
    reason = None
    if not name or "\x00" in name or not Path(name).parts or name == HEADER_FILE:
        reason = "not a chunk file name"
    elif os.path.isabs(name) or Path(name).is_absolute() or name.startswith(("/", "\\")):
        reason = "an absolute path"
    elif ".." in Path(name).parts or ".." in name.replace("\\", "/").split("/"):
        reason = "a '..' path"
    else:
        try:
            inside, target = root.resolve(), (root / name).resolve()
        except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop
            inside, target, reason = root, root, f"a path that does not resolve ({err})"
        if reason is None and not target.is_relative_to(inside):
            reason = f"resolves to {target} (a symlink out of the folder)"
        elif reason is None and target == inside:
            reason = "the folder itself"
    if reason is not None:
        raise TraceFormatError(
            f"{header_file}: {where}={_show(name)} is {reason}; a trace reads only files inside "
            f"{root}: remove that entry or re-record the trace"
        )
    return root / name


def _fsync(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder
    finally:
        os.close(fd)


def write_header(root: Path, header: dict[str, Any]) -> None:
    """Write ``header.json`` atomically and durably."""
    tmp = root / (HEADER_FILE + ".tmp")
    tmp.write_text(json.dumps(header, indent=1))
    _fsync(tmp)
    os.replace(tmp, root / HEADER_FILE)
    _fsync(root, directory=True)


def write_chunk_file(file: Path, chunk: TraceChunk) -> str:
    """Write one chunk (with each layer's id range in its metadata), atomically, fsynced;
    returns its checksum for the header."""
    from safetensors.numpy import save_file

    tensors = {"seq": chunk.seq, "pos": chunk.pos}
    ranges = []
    for layer, ids in enumerate(chunk.experts):
        tensors[f"experts.{layer}"] = np.ascontiguousarray(ids)
        ranges.append([int(ids.min()), int(ids.max())] if ids.size else None)
        if chunk.probs is not None:
            tensors[f"probs.{layer}"] = np.ascontiguousarray(chunk.probs[layer])
    meta = {"format": FORMAT_NAME, "version": str(FORMAT_VERSION), RANGES_KEY: json.dumps(ranges)}
    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    _fsync(tmp)
    digest = file_digest(tmp)
    os.replace(tmp, file)
    _fsync(file.parent, directory=True)  # the chunk is in place before a header lists it
    return digest


def _unreadable(file: Path, err: Exception) -> TraceFormatError:
    if isinstance(err, FileNotFoundError):
        return TraceFormatError(f"{file}: chunk file listed in {HEADER_FILE} is missing")
    return TraceFormatError(
        f"{file}: cannot read routing-trace chunk (truncated or not safetensors): {err}"
    )


def _declared_ranges(file: Path, meta: dict[str, str], layers: int) -> list | None:
    if RANGES_KEY not in meta:
        return None  # written before ranges were recorded: the ids are read instead
    try:
        ranges = json.loads(meta[RANGES_KEY])
        ok = isinstance(ranges, list) and len(ranges) == layers
        ok = ok and all(r is None or (len(r) == 2 and all(map(_is_int, r))) for r in ranges)
    except (ValueError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise TraceFormatError(f"{file}: malformed {RANGES_KEY!r} metadata; {_REDO}")
    return ranges


def check_chunk_file(
    file: Path, header: ChunkLayout, tokens: int, digest: str | None = None
) -> None:
    """Load-time check: the checksum the header lists, then from the chunk's safetensors
    header its format, row count and id ranges.

    Chunks without recorded id ranges (older writers) have their expert ids read instead;
    chunks without a checksum (older writers) are not verified.
    """
    from safetensors import safe_open

    if digest is not None and file_digest(file) != digest:
        raise TraceFormatError(
            f"{file}: its {CHECKSUM} differs from the one in {HEADER_FILE} (the file changed "
            "after it was written); re-record the trace"
        )

    try:
        with safe_open(str(file), framework="np") as f:
            meta = f.metadata() or {}
            shape = f.get_slice("seq").get_shape() if "seq" in set(f.keys()) else None
            ranges = _declared_ranges(file, meta, len(header.top_k))
            if ranges is None and meta.get("format") == FORMAT_NAME:
                ranges = []
                for layer in range(len(header.top_k)):
                    ids = f.get_tensor(f"experts.{layer}")
                    ranges.append([int(ids.min()), int(ids.max())] if ids.size else None)
    except TraceFormatError:
        raise
    except Exception as err:  # safetensors raises its own error type for bad files
        raise _unreadable(file, err) from err
    if meta.get("format") != FORMAT_NAME or shape is None or list(shape) != [tokens]:
        raise TraceFormatError(
            f"{file}: not a chunk of this trace (format={meta.get('format')!r}, "
            f"seq shape {shape}, header says {tokens} tokens)"
        )
    for layer, (r, e) in enumerate(zip(ranges, header.num_experts, strict=True)):
        problem = None if r is None else _range_problem(r[0], r[1], e)
        if problem is not None:
            raise TraceFormatError(
                f"{file}: layer {layer} has {problem}; fix layers[{layer}].num_experts in "
                f"{HEADER_FILE} or re-record the trace"
            )


def read_chunk_file(file: Path, header: ChunkLayout, tokens: int) -> TraceChunk:
    """Every row of one chunk, checked: tensors present, shapes, dtypes, expert ids."""
    from safetensors import safe_open

    n_layers = len(header.top_k)
    try:
        with safe_open(str(file), framework="np") as f:
            keys = set(f.keys())
            need = {"seq", "pos"} | {f"experts.{i}" for i in range(n_layers)}
            if header.record_probs:
                need |= {f"probs.{i}" for i in range(n_layers)}
            if not need <= keys:
                raise TraceFormatError(
                    f"{file}: missing tensors {sorted(need - keys)}; not a chunk of this trace"
                )
            seq, pos = f.get_tensor("seq"), f.get_tensor("pos")
            experts = [f.get_tensor(f"experts.{i}") for i in range(n_layers)]
            probs = None
            if header.record_probs:
                probs = [f.get_tensor(f"probs.{i}") for i in range(n_layers)]
    except TraceFormatError:
        raise
    except Exception as err:  # safetensors raises its own error type for bad files
        raise _unreadable(file, err) from err
    chunk = TraceChunk(seq, pos, experts, probs)
    _check_rows(file, header, chunk, tokens)
    return chunk


def _check_rows(file: Path, header: ChunkLayout, chunk: TraceChunk, n: int) -> None:
    ok = chunk.seq.shape == (n,) and chunk.pos.shape == (n,)
    ok &= all(e.shape == (n, k) for e, k in zip(chunk.experts, header.top_k, strict=True))
    if chunk.probs is not None:
        ok &= all(p.shape == (n, e) for p, e in zip(chunk.probs, header.num_experts, strict=True))
    if not ok:
        raise TraceFormatError(
            f"{file}: shapes do not match {HEADER_FILE} ({n} tokens, top_k={header.top_k}, "
            f"num_experts={header.num_experts})"
        )
    ints = [chunk.seq, chunk.pos, *chunk.experts]
    if not all(np.issubdtype(a.dtype, np.integer) for a in ints):
        raise TraceFormatError(f"{file}: seq, pos and experts.<l> must be integer tensors; {_REDO}")
    for layer, (ids, e) in enumerate(zip(chunk.experts, header.num_experts, strict=True)):
        problem = id_range_problem(ids, e)
        if problem is not None:
            raise TraceFormatError(
                f"{file}: layer {layer} has {problem}; fix layers[{layer}].num_experts in "
                f"{HEADER_FILE} or re-record the trace"
            )


def stray_files(root: Path, listed: set[str]) -> list[str]:
    """Files a killed writer can leave that readers ignore: ``*.tmp`` and unlisted chunks."""
    try:
        names = sorted(p.name for p in root.iterdir())
    except OSError:
        return []
    return [
        n
        for n in names
        if n.endswith(".tmp") or (n.startswith("chunk-") and n.endswith(".safetensors"))
        if n not in listed
    ]
