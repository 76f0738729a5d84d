"""The tuned-config table: a kernel's tile config (``KernelConfig``), a table entry with where
it came from (``TableEntry``: a seed, or measured with its run's provenance), and the table
``kernels/tuned_configs.json`` (or ``MOESTACK_TUNED_CONFIGS``) read, checked (``_table_check``)
and looked up per GPU and key, with the nearest row bucket's entry where the key's own is
missing. ``tuning`` chooses among the table, its autotune cache and its candidates; the
format of the table and the order of that choice are described there."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ._table_check import check_entry, check_structure, read_table_json

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
# 2: keys carry the transposed-weight flag and the row bucket (format 1 tables are ignored).
# 3: entries may name their backend ("triton" or "torch"); format 2 entries, which have no
# backend field, are read as "triton". Entries of kind "mm" may also say ``persistent`` and
# ``num_programs`` (written only where persistent, so classic entries read as before); an
# entry without them is the classic kernel, so the format stays 3.
# 4: every entry says where it came from ("source": "seed", or "measured" with its
# "provenance"); a moestack reading format 3 would take the field for a tile field.
TABLE_FORMAT = 4
READABLE_FORMATS = (2, 3, 4)
BACKENDS = ("triton", "torch")
# Where a table entry came from, and what a measured one records of the run that timed it.
ENTRY_SOURCES = ("seed", "measured")
PROVENANCE_FIELDS = ("gpu", "date", "torch", "triton")


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options.

    For the row-grouped GEMM, block_m x block_n is the output tile and block_k the
    reduction step. For the weight-gradient kernel, block_m x block_n is the tile of the
    [K, M] weight and block_k the number of token rows reduced per step.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    backend: str = "triton"  # "torch": torch._grouped_mm (weight gradients only)
    # The persistent grouped GEMM (kind "mm" only): a grid of ``num_programs`` programs
    # (0: one per SM) walking a tile table, instead of one program per tile.
    persistent: bool = False
    num_programs: int = 0
    # Kind "mm_dswiglu" only: the SwiGLU backward in the epilogue of G's GEMM (this tile),
    # instead of G's own GEMM (kind "mm") and the elementwise pass (``UNFUSED_DSWIGLU``).
    fused: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; use one of {BACKENDS}")
        if self.persistent and self.backend != "triton":
            raise ValueError(
                f"persistent=True runs moestack's persistent kernel, not backend="
                f"{self.backend!r}; use backend='triton'"
            )
        if self.fused and (self.persistent or self.backend != "triton"):
            raise ValueError(
                "fused=True runs the classic kernel's SwiGLU-backward epilogue; use "
                "persistent=False and backend='triton'"
            )
        if self.num_programs < 0 or (self.num_programs and not self.persistent):
            raise ValueError(
                f"num_programs={self.num_programs} needs persistent=True and must be >= 0 "
                "(0: one program per SM)"
            )


@dataclass(frozen=True)
class TableEntry:
    """One entry of the tuned table: its config, where it came from (``ENTRY_SOURCES``:
    "seed", never timed at its key; "measured", timed on the GPU its ``provenance`` names,
    with the date, torch and triton of that run) and the key it is stored under (a
    neighbouring row bucket's, where a lookup's own bucket has no entry)."""

    config: KernelConfig
    source: str = "seed"
    provenance: dict[str, str] | None = None
    key: str = ""

    def __post_init__(self) -> None:
        if self.source not in ENTRY_SOURCES:
            raise ValueError(f"source={self.source!r} is unknown; use one of {ENTRY_SOURCES}")
        if self.source == "seed" and self.provenance is not None:
            raise ValueError(
                'a seed has no provenance; drop it, or mark the entry "source": "measured"'
            )
        if self.source == "measured":
            given = self.provenance or {}
            missing = [f for f in PROVENANCE_FIELDS if not given.get(f)]
            if missing:
                raise ValueError(
                    f"a measured entry needs its provenance's {missing}; give "
                    f'{list(PROVENANCE_FIELDS)}, or mark the entry "source": "seed"'
                )


def run_provenance(gpu: str) -> dict[str, str]:
    """What a measured entry records of this run: the GPU, today's date, torch's and
    triton's versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # a config put in the cache by hand, without triton
        triton_version = "not installed"
    return {
        "gpu": gpu,
        "date": dt.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton_version,
    }


def parse_entry(raw: dict[str, Any], key: str, record: dict[str, str] | None) -> TableEntry:
    """One table entry as stored (``raw``: the config's fields, ``source`` and, if measured,
    ``provenance``). Without ``source`` (a table written before format 4): measured with
    ``record`` (its ``sources[gpu][key]`` stamp, the GPU added) where there is one, else a
    seed. A field the kernels cannot launch raises ValueError naming it (``check_entry``)."""
    check_entry(raw, {f.name for f in fields(KernelConfig)} | {"source", "provenance"})
    config = dict(raw)
    source = config.pop("source", None)
    provenance = config.pop("provenance", None)
    if source is None:
        source, provenance = ("measured", record) if record else ("seed", None)
    return TableEntry(KernelConfig(**config), source, provenance, key)


def parse_table(data: dict[str, Any], where: str) -> dict[str, dict[str, TableEntry]]:
    """``{gpu: {key: TableEntry}}`` of a table of a readable format (``where`` names it in
    errors): a table of another structure (``check_structure``), an entry that is no config
    the kernels can launch, or names an unknown source, raises naming it."""
    check_structure(data, where)
    records = data.get("sources", {})  # format 3: {gpu: {key: {date, torch, triton}}}
    out: dict[str, dict[str, TableEntry]] = {}
    for gpu, entries in data.get("gpus", {}).items():
        for key, raw in entries.items():
            stamp = records.get(gpu, {}).get(key)
            record = {"gpu": gpu, **stamp} if stamp else None
            try:
                out.setdefault(gpu, {})[key] = parse_entry(raw, key, record)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"tuned-config table {where}: entry {key!r} of {gpu!r}: {exc}; fix or "
                    "delete the entry (scripts/tune_kernels.py rewrites what it measures)"
                ) from exc
    return out


def entry_json(entry: TableEntry) -> dict[str, Any]:
    """``entry`` as stored in a table: the config's fields (``table_entry``), its source and,
    if measured, its provenance."""
    out: dict[str, Any] = {**table_entry(entry.config), "source": entry.source}
    if entry.provenance is not None:
        out["provenance"] = dict(entry.provenance)
    return out


@functools.lru_cache(maxsize=4)
def read_table(path: str) -> dict[str, dict[str, TableEntry]]:
    """The table at ``path`` as ``{gpu: {key: TableEntry}}`` ({} where there is no file or
    its format is not one this moestack reads), read once per path (``cache_clear`` forgets)."""
    p = Path(path)
    if not p.is_file():
        return {}
    data = read_table_json(p)  # an object, else one ValueError naming the file
    if data.get("format") not in READABLE_FORMATS:
        log.warning(
            "ignoring tuned-config table %s: unknown format %r (this moestack reads formats "
            "%s); rerun scripts/tune_kernels.py to rewrite it",
            p,
            data.get("format"),
            ", ".join(map(str, READABLE_FORMATS)),
        )
        return {}
    return parse_table(data, str(p))


def table_path() -> Path:
    """Where the tuned table is read from (``MOESTACK_TUNED_CONFIGS`` overrides)."""
    return Path(os.environ.get("MOESTACK_TUNED_CONFIGS", str(TABLE_PATH)))


def lookup_entry(gpu: str, key: str) -> TableEntry | None:
    """The table's entry for ``key`` on ``gpu`` (its config and source), or None.

    Without an entry at the key's row bucket, the entry of the nearest bucket (in powers of
    two; the smaller one on a tie) of the same variant is used: a neighbour's tile beats
    autotuning mid-run, or the untimed default where autotuning is off. Its ``key`` says
    which bucket's it is.
    """
    entries = read_table(str(table_path())).get(gpu, {})
    entry = entries.get(key)
    if entry is None:
        variant, _, bucket = key.rpartition("|R=")
        if not bucket.isdigit():
            return None
        want = int(bucket).bit_length()
        near = [
            (abs(int(b).bit_length() - want), int(b), k)
            for k in entries
            for v, _, b in [k.rpartition("|R=")]
            if v == variant and b.isdigit()
        ]
        entry = entries[min(near)[2]] if near else None
    return entry


def lookup_table(gpu: str, key: str) -> KernelConfig | None:
    """The tuned config for ``key`` on ``gpu`` from the table (``lookup_entry``), or None."""
    entry = lookup_entry(gpu, key)
    return entry.config if entry else None


def table_entry(cfg: KernelConfig) -> dict[str, int | str | bool]:
    """``cfg``'s fields as a table entry holds them (``entry_json`` adds the source): every
    field, less ``persistent`` and ``num_programs`` for a classic config and ``fused`` for an
    unfused one (their entries read the same in a moestack without the persistent kernel or
    the fused SwiGLU backward)."""
    entry = asdict(cfg)
    if not cfg.persistent:
        del entry["persistent"], entry["num_programs"]
    if not cfg.fused:
        del entry["fused"]
    return entry
