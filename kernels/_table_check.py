"""The checks of a tuned-config table file (``tuned_table.table_path()``) before any of its configs
reaches a launch: the file is read as JSON of the table's structure, and every entry's
fields are ones the kernels can launch.

A table is an object ``{"format": N, "gpus": {gpu: {key: entry}}}`` (format 3 tables may add
``"sources": {gpu: {key: {date, torch, triton}}}``); an entry an object of ``KernelConfig``
fields, ``source`` and ``provenance``. A file that is no such table (not JSON, nested past
what Python's parser takes, a list) or an entry that is wrong (an unknown field, a tile of
2^40 or of "128", a tile that is no power of two) raises one ``ValueError`` line naming the
file, the GPU, the key and the field, as the kernels refuse bad input everywhere: a table
that was edited by hand is refused as a whole, never read in part, so a run uses the tiles
its table says or none of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The kernels' limits. Tile sides are powers of two (``tl.arange`` takes no other), at least
# 16 (``tl.dot``'s smallest) and at most 256 (the largest side a candidate has, and the
# persistent kernel's TMA box); warps a power of two up to 32 (1024 threads a program).
TILE_SIDES = (16, 256)
WARPS = (1, 32)
STAGES = (1, 8)
GROUP_M = (1, 256)
PROGRAMS = (0, 1 << 16)  # the persistent grid (0: one program per SM)


def _refuse(where: str, problem: str) -> ValueError:
    return ValueError(
        f"tuned-config table {where}: {problem}; fix the file, or point MOESTACK_TUNED_CONFIGS "
        "at another one"
    )


def read_table_json(path: Path) -> dict[str, Any]:
    """The table file at ``path`` parsed, an object (``ValueError`` naming the file if it
    cannot be read, is not JSON, is nested too deep for the parser, or holds no object)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise _refuse(str(path), f"cannot be read ({err})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise _refuse(str(path), "not a table: its JSON is nested too deep to read") from None
    except ValueError as err:
        raise _refuse(str(path), f"not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise _refuse(
            str(path), f"holds a {type(data).__name__}, not an object with 'format' and 'gpus'"
        )
    return data


def _mapping(value: Any, where: str, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _refuse(where, f"{name} is a {type(value).__name__}, not an object")
    return value


def check_structure(data: dict[str, Any], where: str) -> None:
    """Refuse a table whose ``gpus`` (or format 3's ``sources``) is not an object of objects
    of objects, naming the part that is not."""
    for part in ("gpus", "sources"):
        for gpu, entries in _mapping(data.get(part, {}), where, repr(part)).items():
            for key, entry in _mapping(entries, where, f"{part!r}[{gpu!r}]").items():
                _mapping(entry, where, f"entry {key!r} of {gpu!r}")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _power_of_two(bounds: tuple[int, int]) -> Callable[[Any], str | None]:
    lo, hi = bounds

    def check(value: Any) -> str | None:
        if _int(value) and lo <= value <= hi and value & (value - 1) == 0:
            return None
        return f"a power of two from {lo} to {hi}"

    return check


def _integer(bounds: tuple[int, int]) -> Callable[[Any], str | None]:
    lo, hi = bounds
    return lambda value: None if _int(value) and lo <= value <= hi else f"an integer {lo}..{hi}"


def _of_type(kind: type) -> Callable[[Any], str | None]:
    return lambda value: None if type(value) is kind else f"a {kind.__name__}"


def _provenance(value: Any) -> str | None:
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return None
    return "an object of strings (gpu, date, torch, triton)"


_FIELDS: dict[str, Callable[[Any], str | None]] = {
    "block_m": _power_of_two(TILE_SIDES),
    "block_n": _power_of_two(TILE_SIDES),
    "block_k": _power_of_two(TILE_SIDES),
    "group_m": _integer(GROUP_M),
    "num_warps": _power_of_two(WARPS),
    "num_stages": _integer(STAGES),
    "backend": _of_type(str),
    "persistent": _of_type(bool),
    "num_programs": _integer(PROGRAMS),
    "fused": _of_type(bool),
    "source": _of_type(str),
    "provenance": _provenance,
}


def check_entry(raw: dict[str, Any], known: set[str]) -> None:
    """Refuse an entry with a field outside ``known`` or a value the kernels cannot launch,
    naming the field and its value (``ValueError``; the table's reader adds the file, GPU
    and key)."""
    for name, value in raw.items():
        if name not in known:
            raise ValueError(f"field {name!r} is unknown (known: {sorted(known)})")
        check = _FIELDS.get(name)
        why = check(value) if check is not None else None
        if why is not None:
            raise ValueError(f"{name}={value!r} is not {why}")
