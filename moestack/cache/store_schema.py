"""The structure of an expert store's ``index.json``, checked before any field is used.

``index.json`` is read from disk, so it is untrusted: JSON that parses but has the wrong
structure (a list, a missing key, a string where a size belongs, an unknown dtype, a file
path that leaves the store folder) must be refused in one line naming the file and the
field, never surface as a KeyError/TypeError traceback or read a file outside the store.
``check_index`` is a small hand-written schema: required keys, the type and range of each
field, dtype names from ``DTYPES``, the layout from ``LAYOUTS``, a version this code reads,
and the consistency the reader relies on (the expert table is layers x experts, each tensor's
byte size matches its shape and dtype and lies inside its file). ``member_path`` resolves a
file name of the index inside the store folder, symlinks included.
"""

from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath
from typing import Any

from moestack.cache.store_format import (
    CHECKSUM,
    DTYPES,
    FORMAT,
    LAYOUTS,
    READ_VERSIONS,
    TensorEntry,
)
from moestack.errors import MoestackError

_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
_HEX = re.compile(r"^[0-9a-f]{64}$")


class _Checker:
    """Field checks of one index file; every failure is a MoestackError naming the field."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def fail(self, field: str, problem: str) -> MoestackError:
        return MoestackError(
            f"{self.where}: field {field} {problem}; the expert store is corrupt: delete "
            f"{self.where.parent} and rebuild it (rerun `moestack eval RUN --offload` or "
            "ExpertStore.write)"
        )

    def obj(self, value: Any, field: str, keys: tuple[str, ...]) -> dict[str, Any]:
        """``value`` is a JSON object holding every key of ``keys``."""
        if not isinstance(value, dict):
            raise self.fail(field or "(top level)", f"is {_kind(value)}, expected an object")
        for key in keys:
            if key not in value:
                raise self.fail(f"{field}.{key}" if field else key, "is missing")
        return value

    def array(self, value: Any, field: str, length: int | None = None) -> list[Any]:
        """``value`` is a JSON array (of ``length`` items when given)."""
        if not isinstance(value, list):
            raise self.fail(field, f"is {_kind(value)}, expected an array")
        if length is not None and len(value) != length:
            raise self.fail(field, f"has {len(value)} items, expected {length}")
        return value

    def int(self, value: Any, field: str, minimum: int = 0) -> int:
        """``value`` is an integer (not a bool, not a float) of at least ``minimum``."""
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(field, f"is {_kind(value)}, expected an integer")
        if value < minimum:
            raise self.fail(field, f"is {value}, expected at least {minimum}")
        return value

    def choice(self, value: Any, field: str, allowed: tuple[Any, ...]) -> Any:
        """``value`` is one of ``allowed`` (compared with its type: True is not 1)."""
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise self.fail(field, f"is {value!r}, expected one of {list(allowed)}")
        return value

    def name(self, value: Any, field: str) -> str:
        """``value`` is a relative path staying inside the store folder (as text)."""
        if not isinstance(value, str) or not value or "\0" in value:
            raise self.fail(field, f"is {value!r}, expected a file name inside the store")
        pure = PurePosixPath(value)
        if pure.is_absolute() or value.startswith("\\") or ".." in pure.parts:
            raise self.fail(field, f"is {value!r}: a path outside the store folder is refused")
        return value


def _kind(value: Any) -> str:
    """A short description of a JSON value for error messages."""
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def check_index(index: Any, where: Path) -> dict[str, Any]:
    """``index`` (parsed from ``where``) if its structure is a store index this code reads.

    MoestackError naming ``where`` and the first bad field otherwise. Checks everything the
    reader indexes or converts, so a store that passes never fails with another error type.
    """
    c = _Checker(where)
    keys = ("format", "version", "layout", "model", "expert_bytes", "files", "experts")
    c.obj(index, "", keys)
    c.choice(index["format"], "format", (FORMAT,))
    version = c.choice(index["version"], "version", READ_VERSIONS)
    c.choice(index["layout"], "layout", LAYOUTS)
    model = _check_model(c, index["model"])
    expert_bytes = c.int(index["expert_bytes"], "expert_bytes", 1)
    if not isinstance(index.get("meta", {}), dict):
        raise c.fail("meta", f"is {_kind(index['meta'])}, expected an object")
    sizes = _check_files(c, index["files"], version)
    rows = c.array(index["experts"], "experts", model["num_layers"])
    for layer, row in enumerate(rows):
        c.array(row, f"experts[{layer}]", model["num_experts"])
        for e, item in enumerate(row):
            field = f"experts[{layer}][{e}]"
            c.obj(item, field, ("file", "w1", "w2"))
            file = c.name(item["file"], f"{field}.file")
            if file not in sizes:
                raise c.fail(f"{field}.file", f"is {file!r}, which 'files' does not list")
            lo, size = sizes[file]
            total = 0
            for t in ("w1", "w2"):
                total += _check_tensor(c, item[t], f"{field}.{t}", model["dtype"], lo, size)
            if total != expert_bytes:
                raise c.fail(field, f"holds {total} bytes, expert_bytes says {expert_bytes}")
    return index


def _check_model(c: _Checker, model: Any) -> dict[str, Any]:
    """The ``model`` object: positive sizes, a top_k or null, a known dtype name."""
    dims = ("num_layers", "num_experts", "d_model", "d_ff")
    c.obj(model, "model", (*dims, "dtype"))
    for key in dims:
        c.int(model[key], f"model.{key}", 1)
    if model.get("top_k") is not None:
        c.int(model["top_k"], "model.top_k", 1)
    c.choice(model["dtype"], "model.dtype", tuple(DTYPES))
    return model


def _check_files(c: _Checker, files: Any, version: int) -> dict[str, tuple[int, int]]:
    """The ``files`` table: ``{name: (data start, size)}``; version 2 needs checksums."""
    sizes: dict[str, tuple[int, int]] = {}
    for i, record in enumerate(c.array(files, "files")):
        field = f"files[{i}]"
        need = ("file", "size", "data_start") + ((CHECKSUM,) if version >= 2 else ())
        c.obj(record, field, need)
        name = c.name(record["file"], f"{field}.file")
        if name in sizes:
            raise c.fail(f"{field}.file", f"repeats {name!r}")
        size = c.int(record["size"], f"{field}.size", 8)
        start = c.int(record["data_start"], f"{field}.data_start", 8)
        if start > size:
            raise c.fail(f"{field}.data_start", f"is {start}, past the file size {size}")
        if version >= 2 and not (
            isinstance(record[CHECKSUM], str) and _HEX.match(record[CHECKSUM])
        ):
            raise c.fail(f"{field}.{CHECKSUM}", "is not a 64-digit lowercase hex digest")
        sizes[name] = (start, size)
    if not sizes:
        raise c.fail("files", "is empty")
    return sizes


def _check_tensor(c: _Checker, t: Any, field: str, dtype: str, lo: int, size: int) -> int:
    """One tensor entry: its shape and dtype give its nbytes, its bytes lie in the data
    section ``[lo, size)`` of its file. Returns nbytes."""
    c.obj(t, field, ("offset", "nbytes", "shape", "dtype"))
    c.choice(t["dtype"], f"{field}.dtype", (dtype,))
    shape = c.array(t["shape"], f"{field}.shape", 2)
    for i, dim in enumerate(shape):
        c.int(dim, f"{field}.shape[{i}]", 1)
    offset = c.int(t["offset"], f"{field}.offset", lo)
    nbytes = c.int(t["nbytes"], f"{field}.nbytes", 1)
    if nbytes != math.prod(shape) * _ITEMSIZE[dtype]:
        raise c.fail(
            f"{field}.nbytes",
            f"is {nbytes}, its shape {shape} of {dtype} needs "
            f"{math.prod(shape) * _ITEMSIZE[dtype]}",
        )
    if offset + nbytes > size:
        raise c.fail(
            f"{field}.offset", f"+ nbytes ends at {offset + nbytes}, past the file size {size}"
        )
    return nbytes


def header_matches(h: Any, te: TensorEntry, start: int) -> bool:
    """A safetensors header item ``h`` describes tensor entry ``te`` (dtype, shape, absolute
    offsets); False, never an exception, for a header item of the wrong structure."""
    if not isinstance(h, dict):
        return False
    shape, offsets = h.get("shape"), h.get("data_offsets")
    return (
        isinstance(h.get("dtype"), str)
        and DTYPES.get(h["dtype"]) == te.dtype
        and isinstance(shape, list)
        and tuple(shape) == te.shape
        and isinstance(offsets, list)
        and all(isinstance(o, int) for o in offsets)
        and [start + o for o in offsets] == [te.offset, te.offset + te.nbytes]
    )


def member_path(root: Path, name: str, where: Path) -> Path:
    """``root / name`` once it resolves inside ``root`` (a symlink may not lead out).

    ``name`` has passed ``check_index`` (relative, no ``..``); this adds the filesystem's
    view. MoestackError naming the entry otherwise.
    """
    path = root / name
    if not path.resolve().is_relative_to(root.resolve()):
        raise MoestackError(
            f"{where}: file {name!r} resolves to {path.resolve()}, outside the store folder "
            f"{root} (a symlink leads out); refused: delete {root} and rebuild the store "
            "(rerun `moestack eval RUN --offload` or ExpertStore.write)"
        )
    return path
