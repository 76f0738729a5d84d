"""The per-rank files of an expert-parallel checkpoint: each rank writes the experts it owns.

Under expert parallelism a checkpoint (:mod:`moestack.checkpoint`) holds, beside
``model.safetensors`` (then only the tensors every rank holds: attention, embeddings,
routers, norms) and ``train_state.pt`` (the common optimizer state, scheduler, data and RNG,
written by rank 0), one or two files per rank:

    rank00001.experts.safetensors   rows [lo, hi) of every expert tensor, the experts this
                                    rank holds (written by the first replica of each block)
    rank00001.optim.pt              the optimizer state of the experts this rank owns
                                    (:mod:`moestack.optim.expert_state`)
    rank00001.shard.pt              its ZeRO shard of OffloadAdamW's state of the
                                    replicated parameters (their "rows" are the rank's
                                    shard index, [rank, rank + 1): every reader reads all)

``meta.json`` lists every file with its size and sha256, and under ``parts`` each rank file's
kind and rows, so a reader at any layout (any ``ep``, any number of ranks, one process) opens
and verifies only the files holding the experts it needs and reads only its rows of them. No
rank gathers another rank's experts, weights or optimizer state.

Each rank file also records itself: the rank that wrote it, its kind and its rows (an
experts file in its safetensors metadata, a ``.pt`` part under ``RECORD``).
``check_rank_file`` compares that record with what meta.json's ``parts`` say of the file's
name, so files swapped between ranks (or copied from another checkpoint) under a meta.json
re-signed over them are refused, naming the file, instead of loading one rank's experts
into another's rows. Files written before the records are checked as far as they say
(an experts file's rows).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from torch import nn

from moestack.atomic import fsync_file, sha256_file
from moestack.errors import MoestackError

EXPERTS = "experts"  # a part holding expert weights
OPTIMIZER = "optimizer"  # a part holding expert optimizer state
SHARD = "optimizer_shard"  # a part holding a rank's shard of the replicated optimizer state
_SUFFIX = {EXPERTS: "experts.safetensors", OPTIMIZER: "optim.pt", SHARD: "shard.pt"}
PART_NAME = re.compile(r"rank(?P<rank>\d{5})\.(?P<suffix>experts\.safetensors|optim\.pt|shard\.pt)")

Rows = tuple[int, int]
RECORD = "rank_file"  # the key of a .pt part's own record: {"rank", "kind", "rows"}


@dataclass(frozen=True)
class Part:
    """One rank file of a checkpoint: its name, what it holds (experts ``[lo, hi)``), and
    its size and sha256 as written."""

    name: str
    kind: str  # EXPERTS, OPTIMIZER or SHARD
    rows: Rows
    size: int
    sha256: str

    def record(self) -> dict[str, Any]:
        """What meta.json's ``parts`` says of it (sizes and digests sit in their tables)."""
        return {"kind": self.kind, "rows": list(self.rows)}


def part_name(rank: int, kind: str) -> str:
    return f"rank{rank:05d}.{_SUFFIX[kind]}"


def expert_tensor_rows(model: nn.Module) -> dict[str, Rows]:
    """Every routed expert tensor of ``model`` (of a module with ``expert_tensor_names`` and
    an ``expert_offset``), by parameter name: the rows ``[lo, hi)`` of the whole it holds."""
    return {name: rows for name, rows, _ in _expert_tensors(model)}


def sharded_expert_rows(model: nn.Module) -> dict[str, Rows]:
    """The expert tensors of ``model`` that hold some experts only (expert parallelism:
    ``parallel.shard_experts``), by parameter name: the rows ``[lo, hi)`` of the whole."""
    return {name: rows for name, rows, whole in _expert_tensors(model) if rows[1] - rows[0] < whole}


def _expert_tensors(model: nn.Module) -> list[tuple[str, Rows, int]]:
    """(name, rows held, experts of the whole) of every routed expert tensor."""
    found = []
    for prefix, module in model.named_modules():
        names = getattr(module, "expert_tensor_names", None)
        if not callable(names) or not hasattr(module, "expert_offset"):
            continue
        for name in names():
            lo, held = module.expert_offset, getattr(module, name).shape[0]
            full = f"{prefix}.{name}" if prefix else name
            found.append((full, (lo, lo + held), module.cfg.num_experts))
    return found


def block_of(rows: dict[str, Rows]) -> Rows:
    """The one expert block ``[lo, hi)`` every tensor of ``rows`` holds (a rank holds the
    same experts in every layer)."""
    blocks = set(rows.values())
    if len(blocks) != 1:
        raise ValueError(f"expert tensors hold different experts {sorted(blocks)[:3]}")
    return blocks.pop()


def write_rank_files(
    folder: Path,
    rank: int,
    model: nn.Module,
    first_replica: bool,
    optimizer_parts: Iterable[dict[str, Any]],
) -> list[Part]:
    """Write what this rank owns into checkpoint ``folder``: its experts' rows (on the first
    replica of each expert block only: the others hold the same) and its optimizer parts
    (:mod:`moestack.optim.expert_state`: its experts', its shard of the replicated
    state). Returns the files written."""
    block = block_of(sharded_expert_rows(model))
    parts = [write_expert_rows(folder, rank, model)] if first_replica else []
    for part in optimizer_parts:
        if part.get("kind") == "offload_shard":
            shard = {**part, RECORD: _record(rank, SHARD, (rank, rank + 1))}
            write = lambda path, shard=shard: torch.save(shard, path)  # noqa: E731
            parts.append(_finish(folder, part_name(rank, SHARD), SHARD, (rank, rank + 1), write))
        else:
            parts.append(write_optimizer_part(folder, rank, part, block))
    return parts


def write_expert_rows(folder: Path, rank: int, model: nn.Module) -> Part:
    """Write this rank's rows of every sharded expert tensor into ``folder``."""
    rows = sharded_expert_rows(model)
    params = dict(model.named_parameters())
    block = block_of(rows)
    tensors = {name: params[name].detach() for name in rows}
    meta = {"rank": str(rank), "kind": EXPERTS, "rows": f"{block[0]},{block[1]}"}
    return _finish(folder, part_name(rank, EXPERTS), EXPERTS, block, lambda path: (
        write_safetensors(path, tensors, meta)))  # fmt: skip


# safetensors' names of the dtypes a checkpoint holds
_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, streamed from their memory
    one tensor at a time (``safetensors.torch.save_file`` first copies every tensor into
    one buffer, doubling the memory of a rank's experts while it saves)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be saved in a checkpoint")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in sorted(tensors):
            flat = tensors[name].detach().contiguous().reshape(-1)
            if flat.numel():
                f.write(memoryview(flat.view(torch.uint8).numpy()))


def write_optimizer_part(folder: Path, rank: int, part: dict[str, Any], block: Rows) -> Part:
    """Write this rank's experts' optimizer state (a part of
    :mod:`moestack.optim.expert_state`, experts within ``block``) into ``folder``."""
    name = part_name(rank, OPTIMIZER)
    recorded = {**part, RECORD: _record(rank, OPTIMIZER, block)}
    return _finish(folder, name, OPTIMIZER, block, lambda path: torch.save(recorded, path))


def _record(rank: int, kind: str, rows: Rows) -> dict[str, Any]:
    """What a .pt part records of itself (``RECORD``)."""
    return {"rank": rank, "kind": kind, "rows": list(rows)}


def _own_record(file: Path) -> dict[str, Any]:
    """What rank file ``file`` records of itself, as {"rank": int, "kind": str, "rows":
    [lo, hi]}, the fields it has ({} for a part written before the records)."""
    try:
        if file.name.endswith(".safetensors"):
            with safetensors.safe_open(file, framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
            own: dict[str, Any] = {k: meta[k] for k in ("kind",) if k in meta}
            if "rank" in meta:
                own["rank"] = int(meta["rank"])
            if "rows" in meta:
                own["rows"] = [int(r) for r in meta["rows"].split(",")]
            return own
        part = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        own = part.get(RECORD, {}) if isinstance(part, dict) else {}
        return dict(own) if isinstance(own, dict) else {"record": own}
    except (safetensors.SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise MoestackError(f"{file} cannot be read ({err}); use another checkpoint") from None


def _describe(record: dict[str, Any]) -> str:
    lo, hi = record.get("rows", ("?", "?"))
    experts = f"experts {lo}..{hi - 1}" if isinstance(hi, int) else f"rows {[lo, hi]}"
    return f"rank {record.get('rank', '?')}'s {record.get('kind', '?')} ({experts})"


def check_rank_file(file: Path, record: dict[str, Any]) -> None:
    """Refuse rank file ``file`` when what it records of itself (its rank, kind and rows)
    is not what meta.json's ``parts`` say of its name (``record``, the rank from the name):
    files swapped between ranks, renamed, or copied from another checkpoint, under a
    meta.json whose digests were recomputed over them. A field the file does not record (a
    file written before the records) is not compared."""
    match = PART_NAME.fullmatch(file.name)
    rank = int(match["rank"]) if match else None
    said = {"rank": rank, "kind": record.get("kind"), "rows": list(record.get("rows", []))}
    own = _own_record(file)
    differ = [key for key in own if own[key] != said.get(key)]
    if differ:
        raise MoestackError(
            f"{file}: holds {_describe(own)} by its own record, but meta.json's parts and its "
            f"name say {_describe(said)} (the {'/'.join(differ)} differ): the rank files were "
            "swapped, renamed or copied from another checkpoint; use another checkpoint"
        )


def _finish(folder: Path, name: str, kind: str, block: Rows, write: Any) -> Part:
    """Write a part with ``write(path)``, fsync it, and take its size and sha256 (read back
    from the page cache: the digest vouches for the bytes on disk)."""
    path = folder / name
    write(path)
    fsync_file(path)
    return Part(name, kind, block, path.stat().st_size, sha256_file(path))


def shared_tensors(model: nn.Module, leave_out: Iterable[str]) -> dict[str, torch.Tensor]:
    """``model``'s state without the tensors named in ``leave_out`` (the rank files hold
    them), a tensor shared under several names (tied embeddings) kept under its first."""
    skip = set(leave_out)
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if name in skip:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous()
    return out


def check_parts(parts: Any) -> str | None:
    """Why meta.json's ``parts`` table is malformed, or None: names must be rank file
    names (never a path), kinds known, rows two integers ``0 <= lo < hi``."""
    if not isinstance(parts, dict):
        return "is not an object"
    for name, record in parts.items():
        match = PART_NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            return (
                f"names {name!r}, not a rank file "
                "(rank<5 digits>.experts.safetensors/.optim.pt/.shard.pt)"
            )
        if not isinstance(record, dict) or record.get("kind") not in _SUFFIX:
            return f"[{name!r}] has no kind in {tuple(_SUFFIX)}"
        if _SUFFIX[record["kind"]] != match["suffix"]:
            return f"[{name!r}] is of kind {record['kind']!r}, which its name does not match"
        rows = record.get("rows")
        if not (isinstance(rows, list) and len(rows) == 2
                and all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
                and 0 <= rows[0] < rows[1]):  # fmt: skip
            return f"[{name!r}] rows {rows!r} are not [lo, hi] with 0 <= lo < hi"
    return None


def overlapping(parts: dict[str, Any], kind: str, want: Rows | None) -> list[tuple[str, Rows]]:
    """The rank files of ``kind`` holding any of experts ``want`` (None: all), ordered by
    their first expert, with their rows."""
    found = []
    for name, record in parts.items():
        lo, hi = record["rows"]
        if record["kind"] == kind and (want is None or (lo < want[1] and want[0] < hi)):
            found.append((name, (lo, hi)))
    return sorted(found, key=lambda item: item[1])
