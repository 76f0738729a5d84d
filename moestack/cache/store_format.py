"""The expert store's on-disk format: names, dtypes, index entries, safetensors files.

Layout of a store directory (format ``moestack-expert-store``, version 2):

    index.json                       written last; shapes, dtypes, files, byte offsets, sizes,
                                     and each file's BLAKE2b-256 checksum (``files[i].blake2b``)
    layer_000.safetensors            layout="per_layer": tensors ``e0000.w1``, ``e0000.w2``, ...
    layer_000/expert_0000.safetensors  layout="per_expert": tensors ``w1``, ``w2``

Each expert is ``w1 [D, 2F]`` (SwiGLU gate | up) and ``w2 [F, D]``, stored adjacently so that
one positional read (``os.preadv``) fetches one expert without touching the others. Layer
and expert ids are 0-based MoE-layer and expert indices. The files are plain safetensors
(``safetensors.safe_open`` reads them); the index repeats every tensor's absolute byte
offset so the reader needs no header parsing on the hot path.

Version 2 added the per-file checksum (BLAKE2b with a 32-byte digest, hex, of the whole file)
so that bytes changed on disk are detected the first time a reader opens the file; version-1
stores (no checksums) are still read, unverified. The index's structure is checked by
``moestack.cache.store_schema`` before any field is used.

This module holds what the format is, top to bottom: its constants and dtype names, the
index entries (``TensorEntry``, ``ExpertEntry``) and their JSON, how a layer's experts are
grouped into files, the safetensors header parser, the fsynced single-file writers, and the
extraction of the stacked expert tensors from a model or state dict. ``ExpertStore``
(``moestack.cache.store``) writes and reads whole stores with them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moestack.errors import MoestackError
from moestack.model import ModelConfig

FORMAT = "moestack-expert-store"
VERSION = 2  # 2: files[i].blake2b checksums
READ_VERSIONS = (1, 2)  # versions this code reads (1: no checksums, read unverified)
INDEX_FILE = "index.json"
CHECKSUM = "blake2b"  # the key of a file's checksum in the index's ``files`` records
LAYOUTS = ("per_layer", "per_expert")

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.moe\.(w1|w2)$")
_LAYER_FILE = re.compile(r"^layer_\d{3,}\.safetensors$")
_LAYER_DIR = re.compile(r"^layer_\d{3,}$")
_EXPERT_FILE = re.compile(r"^expert_\d{4,}\.safetensors$")
_DIGEST_CHUNK = 1 << 22


# ---------------------------------------------------------------------- index entries
@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: absolute byte offset in its file, size, shape, dtype."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class ExpertEntry:
    """One expert: its file and its two tensors (w1 directly followed by w2 on disk)."""

    file: str
    w1: TensorEntry
    w2: TensorEntry

    @property
    def nbytes(self) -> int:
        return self.w1.nbytes + self.w2.nbytes


def entry_from_json(e: dict[str, Any]) -> ExpertEntry:
    """The ``ExpertEntry`` of one item of the index's ``experts`` table."""

    def tensor(t: dict[str, Any]) -> TensorEntry:
        return TensorEntry(
            int(t["offset"]), int(t["nbytes"]), tuple(t["shape"]), DTYPES[t["dtype"]]
        )

    return ExpertEntry(e["file"], tensor(e["w1"]), tensor(e["w2"]))


def expert_json(file: str, header: dict[str, Any], data_start: int, prefix: str) -> dict[str, Any]:
    """Index item of the expert whose tensors are ``prefix + "w1"`` / ``"w2"`` in ``file``,
    from that file's safetensors header (offsets made absolute with ``data_start``)."""
    entry: dict[str, Any] = {"file": file}
    for t in ("w1", "w2"):
        h = header[prefix + t]
        lo, hi = h["data_offsets"]
        entry[t] = {
            "offset": data_start + lo,
            "nbytes": hi - lo,
            "shape": h["shape"],
            "dtype": h["dtype"],
        }
    return entry


def index_json(
    layout: str,
    w1s: list[torch.Tensor],
    cfg: ModelConfig | None,
    meta: dict[str, Any],
    files: list[dict[str, Any]],
    experts: list[list[dict[str, Any]]],
) -> dict[str, Any]:
    """The whole ``index.json`` of a store: the model shape from the first layer's ``w1``
    (``w1s`` needs only its first entry and one entry per layer), file and expert tables."""
    num_experts, d_model, two_f = w1s[0].shape
    first = experts[0][0]
    return {
        "format": FORMAT,
        "version": VERSION,
        "layout": layout,
        "model": {
            "num_layers": len(w1s),
            "num_experts": int(num_experts),
            "d_model": int(d_model),
            "d_ff": int(two_f) // 2,
            "top_k": cfg.moe.top_k if cfg is not None else None,
            "dtype": DTYPE_NAMES[w1s[0].dtype],
        },
        "expert_bytes": first["w1"]["nbytes"] + first["w2"]["nbytes"],
        "meta": meta,
        "files": files,
        "experts": experts,
    }


# ---------------------------------------------------------------------- files
def layer_files(
    layer: int, w1: torch.Tensor, w2: torch.Tensor, layout: str
) -> list[tuple[str, dict[str, torch.Tensor], list[str]]]:
    """The files of one layer as ``(relative path, tensors, expert prefixes in expert order)``:
    one file of every expert (per_layer) or one file per expert (per_expert)."""
    num_experts = w1.shape[0]
    if layout == "per_layer":
        tensors = {}
        for e in range(num_experts):
            tensors[f"e{e:04d}.w1"] = w1[e].contiguous()
            tensors[f"e{e:04d}.w2"] = w2[e].contiguous()
        prefixes = [f"e{e:04d}." for e in range(num_experts)]
        return [(f"layer_{layer:03d}.safetensors", tensors, prefixes)]
    return [
        (
            f"layer_{layer:03d}/expert_{e:04d}.safetensors",
            {"w1": w1[e].contiguous(), "w2": w2[e].contiguous()},
            [""],
        )
        for e in range(num_experts)
    ]


def parse_header(path: Path, blob: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """(data start, header dict) of a safetensors file; MoestackError if it is not one."""
    try:
        if blob is None:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > 100_000_000 or n > os.fstat(f.fileno()).st_size - 8:
                    raise ValueError(f"header length {n} exceeds the file")
                raw = f.read(n)
        else:
            (n,) = struct.unpack("<Q", blob[:8])
            raw = blob[8 : 8 + n]
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError, struct.error) as err:
        raise MoestackError(
            f"{path}: not a valid safetensors file ({err}); the store is corrupt: rewrite it "
            "with ExpertStore.write"
        ) from None
    return 8 + n, header


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the one place the store writes bytes)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------- checksums
def digest(data: bytes) -> str:
    """The checksum recorded for a file whose bytes are ``data`` (BLAKE2b-256, hex)."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def fd_digest(fd: int, size: int, path: Path) -> str:
    """The checksum of the first ``size`` bytes of the open file ``fd`` (positional reads,
    so a descriptor shared with readers is safe); MoestackError if the file ends first."""
    h = hashlib.blake2b(digest_size=32)
    done = 0
    while done < size:
        chunk = os.pread(fd, min(_DIGEST_CHUNK, size - done), done)
        if not chunk:
            raise MoestackError(
                f"expert file {path} ended early (offset {done}): it is truncated; rebuild the "
                "store (delete it and rerun `moestack eval RUN --offload`)"
            )
        h.update(chunk)
        done += len(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------- store folders
def foreign_entry(path: Path) -> str | None:
    """Why the existing folder ``path`` is not an expert store (None when it is one).

    A store folder holds an ``index.json`` that names the store format and only the store's
    own files (``layer_LLL.safetensors``, ``layer_LLL/expert_EEEE.safetensors``); only such a
    folder may be replaced when a store is rebuilt, so a run folder or any other data given
    as store_dir is never deleted.
    """
    try:
        index = json.loads((path / INDEX_FILE).read_text())
    except FileNotFoundError:
        return f"it has no {INDEX_FILE}"
    except (OSError, ValueError):
        return f"its {INDEX_FILE} is not readable JSON"
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return f"its {INDEX_FILE} does not say format {FORMAT!r}"
    for entry in sorted(path.iterdir()):
        if entry.name == INDEX_FILE and entry.is_file() and not entry.is_symlink():
            continue
        if _LAYER_FILE.match(entry.name) and entry.is_file() and not entry.is_symlink():
            continue
        if _LAYER_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            for sub in sorted(entry.iterdir()):
                if not (_EXPERT_FILE.match(sub.name) and sub.is_file() and not sub.is_symlink()):
                    return f"it holds {entry.name}/{sub.name}, which is not a store file"
            continue
        return f"it holds {entry.name}, which is not a store file"
    return None


def check_replaceable(path: Path, overwrite: bool) -> None:
    """Refuse to write a store at ``path`` unless it is missing, an empty folder, or (with
    ``overwrite``) an expert store: writing replaces the whole folder, so anything else there
    (a run folder, a checkpoint, the user's data) would be lost."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise MoestackError(
            f"store_dir {path} exists and is not a folder; pick an empty folder or an expert "
            "store folder as store_dir (--store-dir / cache.store_dir)"
        )
    if not any(path.iterdir()):
        return
    why = foreign_entry(path)
    if why is not None:
        raise MoestackError(
            f"store_dir {path} is not a moestack expert store ({why}); refusing to replace it: "
            "pick an empty folder or an expert store folder as store_dir (--store-dir / "
            "cache.store_dir)"
        )
    if not overwrite:
        raise MoestackError(
            f"{path} already exists; pass overwrite=True or choose another store_dir"
        )


# ---------------------------------------------------------------------- source tensors
def expert_tensors(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], ModelConfig | None]:
    """Stacked ``w1 [E, D, 2F]`` and ``w2 [E, F, D]`` per MoE layer, in layer order."""
    cfg = getattr(model_or_state_dict, "cfg", None)
    if isinstance(model_or_state_dict, nn.Module):
        layers = getattr(model_or_state_dict, "moe_layers", None)
        if layers is None:
            raise ValueError(
                f"{type(model_or_state_dict).__name__} has no .moe_layers; pass a MoETransformer "
                "or its state_dict()"
            )
        w1s = [m.w1.detach() for m in layers]
        w2s = [m.w2.detach() for m in layers]
    else:
        w1s, w2s = _state_dict_tensors(model_or_state_dict)
        cfg = None
    for i, (w1, w2) in enumerate(zip(w1s, w2s, strict=True)):
        check_layer(i, w1, w2)
    return w1s, w2s, cfg


def check_layer(layer: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Refuse one MoE layer's expert weights unless ``w1 [E, D, 2F]``, ``w2 [E, F, D]`` in
    a supported dtype, off the meta device."""
    if w1.device.type == "meta" or w2.device.type == "meta":
        raise ValueError(f"layer {layer}: expert weights are on the meta device (offloaded?)")
    if (
        w1.ndim != 3
        or w2.ndim != 3
        or w1.shape[0] != w2.shape[0]
        or w1.shape[1] != w2.shape[2]
        or w1.shape[2] != 2 * w2.shape[1]
    ):
        raise MoestackError(
            f"layer {layer}: w1 {tuple(w1.shape)} / w2 {tuple(w2.shape)} are not "
            "[E, D, 2F] / [E, F, D]"
        )
    if w1.dtype not in DTYPE_NAMES or w2.dtype != w1.dtype:
        raise MoestackError(f"layer {layer}: unsupported expert dtypes {w1.dtype} / {w2.dtype}")


def _state_dict_tensors(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``layers.<i>.moe.w1`` / ``w2`` of a state dict, for layers 0..n-1 in order."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        match = _KEY.match(key)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = value
    if not found:
        raise MoestackError(
            "the state dict holds no expert weights (keys like layers.0.moe.w1); "
            "pass a MoETransformer state_dict"
        )
    ids = sorted(found)
    if ids != list(range(len(ids))) or any(len(found[i]) != 2 for i in ids):
        raise MoestackError(f"the state dict's MoE layers {ids} are not 0..n-1 each with w1 and w2")
    return [found[i]["w1"].detach() for i in ids], [found[i]["w2"].detach() for i in ids]


def pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from ``offset`` of ``fd``; MoestackError if the file ends first."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise MoestackError(
                f"expert file {path} ended early (offset {offset + done}): it is truncated; "
                "rewrite the store with ExpertStore.write"
            )
        done += n
