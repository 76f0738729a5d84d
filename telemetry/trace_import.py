"""Routing traces recorded by other tools, written as moestack trace folders.

``import_trace(src, out)`` reads one of two layouts, told apart by the file's first bytes:

- ``npz``, the numpy archive of moe-routing-lab: ``experts``, integer ids [L, T, k] (layer,
  token, slot; the slots in router order, int16 in the published files) and ``meta``, a
  JSON string with at least ``num_experts`` and ``top_k`` (``top_k`` must equal k; when it
  has ``n_moe_layers``, that must equal L). The meta is kept in the trace's ``meta.source``.
- ``records``, the binary stream of the llama.cpp eval-callback tracer: records repeated to
  the end of the file, each little-endian int32 ``layer``, ``n_tokens``, ``k``, then
  ``n_tokens * k`` int32 expert ids (token-major, slots in router order). A layer's records,
  concatenated in file order, are its tokens. Layers are the distinct ``layer`` values in
  increasing order, named ``layer<value>``; every layer must hold the same number of tokens
  and keep one k. The stream does not say how many experts a layer has, so ``num_experts``
  is required.

Neither layout records sequence boundaries: the T tokens are imported as one sequence
(sequence id 0, positions 0..T-1) in file order, the order the model read them. Replay does
not use sequence ids; the switch rate then counts every consecutive pair of tokens.

An npz member's .npy header is checked against the member's size before numpy reads it: a
header claiming more bytes than the member holds (2^40 tokens in a small file), or a zip
directory claiming more uncompressed bytes than the compressed ones can hold (deflate:
1032 to 1), is refused without allocating what it claims.

Everything is read and checked before anything is written: expert ids in [0, num_experts)
(a bad one is named by layer, token and slot), shapes, dtypes, the meta, record headers,
truncated records, a k that changes within a layer, layers of unequal length. A refusal is
one ``MoestackError`` line naming the file and the problem, and leaves nothing behind. The
trace is then written with ``RoutingTrace`` into a hidden folder beside ``out`` and renamed
into place, so ``out`` holds a whole trace or does not exist.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moestack.atomic import install_dir, out_of_space, recover_dir, temp_dir
from moestack.errors import MoestackError
from moestack.telemetry.trace import RoutingTrace

__all__ = [
    "FORMATS",
    "ImportedRouting",
    "detect_format",
    "import_trace",
    "read_npz",
    "read_records",
]

log = logging.getLogger(__name__)

FORMATS = ("npz", "records")
_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"
_RECORD_HEADER = 3  # int32 layer, n_tokens, k
# The most bytes one compressed byte can stand for: deflate's limit is 1032 to 1 (258-byte
# matches at 2 bits each); a stored member holds what it says.
_MAX_RATIO = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: 1032}


@dataclass
class ImportedRouting:
    """A foreign trace read and checked: per layer its [T, k] expert ids."""

    layer_names: list[str]
    experts: list[np.ndarray]
    num_experts: int
    layout: str  # "npz" or "records"
    source_meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.experts[0].shape[0])


def _refuse(src: Path, problem: str) -> MoestackError:
    """The one-line refusal of ``src`` (a message from numpy or json kept on one line)."""
    return MoestackError(f"{src}: {' '.join(problem.split())}")


def detect_format(src: str | os.PathLike[str]) -> str:
    """``npz`` (a zip archive) or ``records`` (anything else) from the first bytes of ``src``."""
    src = Path(src)
    if not src.exists():
        raise _refuse(src, "not found; give the trace file to import")
    if not src.is_file():
        raise _refuse(src, "not a file; give the trace file to import")
    with open(src, "rb") as f:
        head = f.read(8)
    if not head:
        raise _refuse(src, "the file is empty: nothing to import")
    if head.startswith(_NPY_MAGIC):
        raise _refuse(src, "a single .npy array, not an .npz archive with 'experts' and 'meta'")
    return "npz" if head.startswith(_ZIP_MAGIC) else "records"


# --------------------------------------------------------------------------- checks
def _check_ids(src: Path, name: str, ids: np.ndarray, num_experts: int) -> None:
    """Refuse an id outside [0, num_experts) or a token's repeated id, naming its layer,
    token and slot."""
    bad = (ids < 0) | (ids >= num_experts)
    if not bad.any():
        _check_distinct(src, name, ids)
        return
    token, slot = np.unravel_index(int(np.argmax(bad)), ids.shape)
    raise _refuse(
        src,
        f"{name} token {token} slot {slot}: expert id {int(ids[token, slot])} is outside "
        f"[0, num_experts={num_experts}) ({int(bad.sum())} such ids); give the model's "
        "number of experts or fix the file",
    )


def _check_distinct(src: Path, name: str, ids: np.ndarray) -> None:
    """Refuse a token whose k expert ids repeat one: top-k ids are distinct, and a repeat
    would count one expert's load twice and inflate the hit rates."""
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        return
    ordered = np.sort(ids, axis=1)
    repeat = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if not repeat.any():
        return
    token = int(np.argmax(repeat))
    raise _refuse(
        src,
        f"{name} token {token}: expert ids {ids[token].tolist()} repeat an id "
        f"({int(repeat.sum())} such tokens); a token's top-k expert ids are distinct: fix the file",
    )


def _meta_int(src: Path, meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if key not in meta:
        raise _refuse(src, f"meta has no {key!r}; it needs at least num_experts and top_k")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(src, f"meta {key}={value!r} must be an integer >= 1")
    return value


def _check_num_experts(src: Path, given: int | None) -> None:
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
        raise _refuse(src, f"num_experts={given!r} must be an integer >= 1")


# --------------------------------------------------------------------------- npz
def _member_bytes(src: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    """The uncompressed bytes of ``info``: the zip directory's number, refused where its
    compressed bytes could not hold that many (a damaged or forged directory). Methods
    without a known bound (bzip2, lzma) are counted by decompressing, keeping nothing."""
    ratio = _MAX_RATIO.get(info.compress_type)
    if ratio is None:
        with archive.open(info) as f:
            return sum(len(block) for block in iter(lambda: f.read(1 << 20), b""))
    if info.file_size > info.compress_size * ratio:
        raise _refuse(
            src,
            f"archive member {info.filename} says it holds {info.file_size} bytes from "
            f"{info.compress_size} compressed bytes, more than they can hold; the zip "
            "directory is damaged: re-save the trace (numpy.savez)",
        )
    return info.file_size


def _check_member(src: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """Refuse a member whose .npy header claims more bytes (shape x itemsize) than the
    member holds, before numpy allocates what the header claims."""
    holds = _member_bytes(src, archive, info)
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0  # 3.0 differs in the text's encoding only
        )
        shape, _, dtype = read(f)
        data = holds - f.tell()
    if dtype.hasobject:
        return  # a pickled array: np.load(allow_pickle=False) refuses it
    claims = math.prod(shape) * dtype.itemsize
    if claims > data:
        raise _refuse(
            src,
            f"archive member {info.filename}: its header says shape {shape} of {dtype.str} "
            f"and so claims {claims} bytes, the member holds {data}; the file is cut or "
            "damaged: re-save the trace (numpy.savez)",
        )


def _check_npz_sizes(src: Path) -> None:
    """Every member np.load will read checked against the bytes it holds (``_check_member``);
    what zipfile or numpy cannot parse is left to np.load's own refusal."""
    try:
        with zipfile.ZipFile(src) as archive:
            names = set(archive.namelist())
            for key in ("experts", "meta"):  # the member np.load reads for each key
                name = key if key in names else f"{key}.npy"
                if name in names:
                    _check_member(src, archive, archive.getinfo(name))
    except MoestackError:
        raise
    except (OSError, ValueError, TypeError, EOFError, SyntaxError, zipfile.BadZipFile,
            zlib.error) as err:  # fmt: skip
        raise _refuse(src, f"not a readable .npz archive (truncated or damaged): {err}") from err


def _load_npz_arrays(src: Path) -> tuple[np.ndarray, np.ndarray]:
    """``experts`` and ``meta`` of the archive, read without pickle, once each member's
    header is known to claim no more than the member holds."""
    _check_npz_sizes(src)
    try:
        with np.load(src, allow_pickle=False) as archive:
            names = sorted(archive.files)
            missing = [key for key in ("experts", "meta") if key not in names]
            if missing:
                raise _refuse(
                    src,
                    f"the archive has no {' or '.join(repr(m) for m in missing)} array "
                    f"(it holds {names}); expected 'experts' [layers, tokens, k] and 'meta'",
                )
            return archive["experts"], archive["meta"]
    except MoestackError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as err:
        raise _refuse(src, f"not a readable .npz archive (truncated or damaged): {err}") from err


def _parse_meta(src: Path, raw: np.ndarray) -> dict[str, Any]:
    if raw.dtype.kind not in "US" or raw.size != 1:
        raise _refuse(src, f"meta must be one JSON string, got dtype {raw.dtype} shape {raw.shape}")
    text = raw.reshape(()).item()
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise _refuse(src, f"meta is not valid JSON: {err}") from err
    if not isinstance(meta, dict):
        raise _refuse(src, f"meta must be a JSON object, got {type(meta).__name__}")
    return meta


def read_npz(src: str | os.PathLike[str], num_experts: int | None = None) -> ImportedRouting:
    """Read and check an npz trace (``experts`` [L, T, k], ``meta`` JSON); see the module."""
    src = Path(src)
    _check_num_experts(src, num_experts)
    experts, raw_meta = _load_npz_arrays(src)
    meta = _parse_meta(src, raw_meta)
    if experts.ndim != 3 or 0 in experts.shape:
        raise _refuse(
            src, f"experts has shape {experts.shape}; expected [layers, tokens, k], none empty"
        )
    if experts.dtype.kind not in "iu":
        raise _refuse(src, f"experts has dtype {experts.dtype}; expected integer ids (int16)")
    layers, _, k = experts.shape
    n_experts = _meta_int(src, meta, "num_experts")
    top_k = _meta_int(src, meta, "top_k")
    if top_k != k:
        raise _refuse(src, f"meta top_k={top_k} but experts holds k={k} slots per token")
    if "n_moe_layers" in meta and meta["n_moe_layers"] != layers:
        raise _refuse(
            src, f"meta n_moe_layers={meta['n_moe_layers']!r} but experts holds {layers} layers"
        )
    if num_experts is not None and num_experts != n_experts:
        raise _refuse(
            src,
            f"num_experts={num_experts} given but the meta says {n_experts}; "
            "leave it out for an npz (its meta says it)",
        )
    if k > n_experts:
        raise _refuse(src, f"k={k} slots per token exceeds num_experts={n_experts}")
    names = [f"layer{i}" for i in range(layers)]
    for name, ids in zip(names, experts, strict=True):
        _check_ids(src, name, ids, n_experts)
    return ImportedRouting(names, list(experts), n_experts, "npz", meta)


# --------------------------------------------------------------------------- records
@dataclass
class _LayerRecords:
    """Where one layer's records lie in the stream (their ids are gathered at the end)."""

    k: int
    first: int  # index of the layer's first record (for messages)
    starts: list[int] = field(default_factory=list)  # word offset of each record's ids
    tokens: list[int] = field(default_factory=list)  # tokens of each record

    def ids(self, words: np.ndarray) -> np.ndarray:
        """The layer's records concatenated in stream order: [tokens, k]."""
        lengths = np.asarray(self.tokens, dtype=np.int64) * self.k
        before = np.cumsum(lengths) - lengths  # words of the layer ahead of each record
        shift = np.repeat(np.asarray(self.starts, dtype=np.int64) - before, lengths)
        return words[shift + np.arange(int(lengths.sum()))].reshape(-1, self.k)


def _record_bytes(src: Path) -> bytes:
    data = src.read_bytes()
    if len(data) % 4:
        raise _refuse(
            src,
            f"truncated record: {len(data)} bytes is not a whole number of int32 words "
            f"({len(data) % 4} bytes left over at the end)",
        )
    return data


def _parse_records(src: Path, data: bytes, num_experts: int) -> dict[int, _LayerRecords]:
    """Where each layer's records lie, every record header checked as it is read."""
    unpack = struct.Struct("<3i").unpack_from
    layers: dict[int, _LayerRecords] = {}
    at, index, end = 0, 0, len(data) // 4

    def where() -> str:
        return f"record {index} (byte {4 * at})"

    while at < end:
        if end - at < _RECORD_HEADER:
            raise _refuse(
                src,
                f"truncated record: {where()} has {end - at} of the 3 header words "
                "(layer, n_tokens, k)",
            )
        layer, n_tokens, k = unpack(data, 4 * at)
        if layer < 0 or n_tokens < 0 or k < 1:
            raise _refuse(
                src,
                f"{where()} has layer={layer}, n_tokens={n_tokens}, k={k}: not a record of the "
                "tracer's stream (layer >= 0, n_tokens >= 0, k >= 1); the file is damaged or "
                "another format",
            )
        if k > num_experts:
            raise _refuse(src, f"{where()}: layer {layer} has k={k} > num_experts={num_experts}")
        start = at + _RECORD_HEADER
        stop = start + n_tokens * k
        if stop > end:
            raise _refuse(
                src,
                f"truncated record: {where()} (layer {layer}, {n_tokens} tokens x k={k}) needs "
                f"{n_tokens * k} ids, the file has {end - start} left",
            )
        entry = layers.get(layer)
        if entry is None:
            entry = layers[layer] = _LayerRecords(k, index)
        elif k != entry.k:
            raise _refuse(
                src,
                f"{where()}: layer {layer} changes k from {entry.k} (record {entry.first}) to "
                f"{k}; a layer keeps one k",
            )
        if n_tokens:
            entry.starts.append(start)
            entry.tokens.append(n_tokens)
        at, index = stop, index + 1
    return layers


def read_records(src: str | os.PathLike[str], num_experts: int | None) -> ImportedRouting:
    """Read and check the tracer's binary record stream (``num_experts`` required)."""
    src = Path(src)
    if num_experts is None:
        raise _refuse(
            src,
            "a binary record stream does not say how many experts a layer has; give "
            "num_experts (--num-experts N)",
        )
    _check_num_experts(src, num_experts)
    data = _record_bytes(src)
    layers = _parse_records(src, data, num_experts)
    if not layers:
        raise _refuse(src, "holds no records: nothing to import")
    order = sorted(layers)
    counts = {layer: sum(layers[layer].tokens) for layer in order}
    if len(set(counts.values())) > 1:
        most = max(order, key=lambda layer: counts[layer])
        least = min(order, key=lambda layer: counts[layer])
        raise _refuse(
            src,
            f"layers of unequal length: layer {most} has {counts[most]} tokens, layer {least} "
            f"{counts[least]}; every layer must hold the same tokens (a cut or mixed trace)",
        )
    if counts[order[0]] == 0:
        raise _refuse(src, "its records hold no tokens: nothing to import")
    names = [f"layer{layer}" for layer in order]
    words = np.frombuffer(data, dtype="<i4")
    experts = [layers[layer].ids(words) for layer in order]
    for name, ids in zip(names, experts, strict=True):
        _check_ids(src, name, ids, num_experts)
    meta = {"layers": order}  # the tracer's layer indices, in trace order
    return ImportedRouting(names, experts, num_experts, "records", meta)


# --------------------------------------------------------------------------- writing
def _check_out(out: Path) -> None:
    if out.is_dir() and not any(out.iterdir()):
        return  # an empty folder is replaced
    if out.exists() or out.is_symlink():
        raise MoestackError(f"{out}: exists; give a new folder for the imported trace")


def _make_parents(out: Path) -> list[Path]:
    """Create the missing folders above ``out``; the ones created, outermost first."""
    missing = [p for p in reversed(out.parents) if not p.exists()]
    created: list[Path] = []
    try:
        for folder in missing:
            folder.mkdir()
            created.append(folder)
    except BaseException:
        _remove_created(created)
        raise
    return created


def _remove_created(created: list[Path]) -> None:
    """Remove the folders ``_make_parents`` created, innermost first (those still empty)."""
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _write_trace(routing: ImportedRouting, src: Path, out: Path, progress: bool) -> None:
    """Write ``routing`` as a trace folder at ``out``, whole or not at all (the folders
    created above it are removed again on a failure)."""
    from tqdm.auto import tqdm

    created = _make_parents(out)
    tmp = temp_dir(out)  # .OUT.tmp-PID; an import killed midway left one recover_dir removes
    n = routing.num_tokens
    meta = {
        "imported_from": str(src),
        "import_format": routing.layout,
        "sequences": "one sequence, positions 0..T-1 (the source records none)",
        "source": routing.source_meta,
    }
    try:
        trace = RoutingTrace(
            routing.layer_names,
            [int(ids.shape[1]) for ids in routing.experts],
            [routing.num_experts] * len(routing.experts),
            path=tmp,
            meta=meta,
        )
        seq = np.zeros(n, dtype=np.int64)
        pos = np.arange(n, dtype=np.int32)
        step = trace.chunk_tokens
        with tqdm(total=n, desc="import", unit="token", disable=not progress) as bar:
            for start in range(0, n, step):
                stop = min(start + step, n)
                trace.append(
                    seq[start:stop], pos[start:stop], [e[start:stop] for e in routing.experts]
                )
                trace.flush()
                bar.update(stop - start)
        install_dir(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        needed = sum(int(e.size) for e in routing.experts) * 2 + n * 12
        full = out_of_space(err, out.parent, needed, f"the trace {out}")
        if full is not None:
            raise full from err
        raise


def import_trace(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    num_experts: int | None = None,
    progress: bool = False,
) -> RoutingTrace:
    """Write the foreign trace ``src`` as a moestack trace folder ``out``; returns it loaded.

    The layout (``npz`` or ``records``) is told from the file's first bytes. ``num_experts``
    is required for ``records``; for an ``npz`` it must agree with the meta.
    ``out`` must not exist (or be an empty folder). Bad input raises one ``MoestackError``
    line and writes nothing.
    """
    src, out = Path(src), Path(out)
    fmt = detect_format(src)
    recover_dir(out)  # what an import killed midway left beside it
    _check_out(out)
    routing = read_npz(src, num_experts) if fmt == "npz" else read_records(src, num_experts)
    _write_trace(routing, src, out, progress)
    log.debug(
        "imported %s (%s): %d layers x %d tokens, top-%s of %d experts -> %s",
        src,
        fmt,
        len(routing.layer_names),
        routing.num_tokens,
        "/".join(sorted({str(e.shape[1]) for e in routing.experts})),
        routing.num_experts,
        out,
    )
    return RoutingTrace.load(out)
