"""The tensors of a transformers model folder, from its safetensors headers alone.

``folder_tensors(DIR)`` reads the header of every weight file of the folder (the 8-byte
length and the JSON table at its start, never the data) and returns each tensor's file,
dtype, shape and byte range. It is how a folder is checked before transformers or the
expert-store writer reads a tensor: a truncated file (a tensor's bytes past the end of the
file), a header that is no safetensors table, or a shard index naming a tensor its file
does not hold is one MoestackError naming the file and the tensor, where the safetensors
library would only say that the file is "not fully covered".
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.interop.hf_config import SAFETENSORS_INDEX, shard_map, weight_files

_MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors file as its header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte range in the data part of the file
    end: int


def _fix(file: Path) -> str:
    return f"the file is damaged or incomplete; re-download or re-save the model into {file.parent}"


def _is_int_list(value: Any, length: int | None = None) -> bool:
    """A JSON list of non-negative integers (of ``length`` items if given)."""
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


def _entry(file: Path, key: str, value: Any) -> TensorHeader:
    """One header entry checked: its structure and its byte count."""
    if not (
        isinstance(value, dict)
        and isinstance(value.get("dtype"), str)
        and _is_int_list(value.get("shape"))
        and _is_int_list(value.get("data_offsets"), 2)
        and value["data_offsets"][0] <= value["data_offsets"][1]
    ):
        raise MoestackError(f"{file}: tensor {key} has a malformed header entry; {_fix(file)}")
    dtype, shape, (start, end) = value["dtype"], tuple(value["shape"]), value["data_offsets"]
    itemsize = _ITEMSIZE.get(dtype)  # an unknown dtype is left to the safetensors reader
    if itemsize is not None and end - start != math.prod(shape) * itemsize:
        raise MoestackError(
            f"{file}: tensor {key} ({dtype} {shape}) spans {end - start} bytes, its shape "
            f"needs {math.prod(shape) * itemsize}; {_fix(file)}"
        )
    return TensorHeader(file, dtype, shape, start, end)


def _check_inside(file: Path, tensors: dict[str, TensorHeader], data_bytes: int) -> None:
    """Refuse a file whose data ends before its last tensor, naming the first tensor cut."""
    past = sorted((h.start, key) for key, h in tensors.items() if h.end > data_bytes)
    if past:
        key = past[0][1]
        more = f" (and {len(past) - 1} more after it)" if len(past) > 1 else ""
        raise MoestackError(
            f"{file}: truncated: tensor {key}{more} ends at byte {tensors[key].end} of the "
            f"data, the file holds {data_bytes}; {_fix(file)}"
        )


def read_header(file: Path) -> dict[str, TensorHeader]:
    """Every tensor of the safetensors ``file`` from its header; MoestackError naming the
    file (and the tensor) when the header is unreadable or a tensor lies past the end."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(size - 8, _MAX_HEADER):
                raise MoestackError(
                    f"{file}: truncated or not a safetensors file ({size} bytes, header length "
                    f"{length}); {_fix(file)}"
                )
            table = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MoestackError(
            f"{file}: its safetensors header is not valid JSON; {_fix(file)}"
        ) from None
    except OSError as err:
        raise MoestackError(f"{file}: cannot be read ({err})") from None
    if not isinstance(table, dict):
        raise MoestackError(f"{file}: its safetensors header is no table; {_fix(file)}")
    tensors = {
        key: _entry(file, key, value) for key, value in table.items() if key != "__metadata__"
    }
    _check_inside(file, tensors, size - 8 - length)
    return tensors


def folder_tensors(folder: Path) -> dict[str, TensorHeader]:
    """Every tensor of the model folder and where it lies (see the module docstring); a
    tensor the shard index places in a file that does not hold it is refused, naming both."""
    per_file = {file: read_header(file) for file in weight_files(folder)}
    shards = shard_map(folder)
    if shards is None:  # one model.safetensors
        return next(iter(per_file.values()))
    tensors: dict[str, TensorHeader] = {}
    for key, file in shards.items():
        if key not in per_file[file]:
            raise MoestackError(
                f"{folder / SAFETENSORS_INDEX} places tensor {key} in {file.name}, which does "
                "not hold it; re-save the model"
            )
        tensors[key] = per_file[file][key]
    return tensors
