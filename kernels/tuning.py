"""Tile-config selection for the grouped-GEMM kernels: tuned table, autotuning, defaults.

A config is chosen per (kernel kind, E, K, M, dtype, kernel flags, row bucket) and per GPU
name, in this order:

0. a config forced with ``forced_config`` (tests and checks run every candidate this way);
1. the in-process autotune cache;
2. the checked-in table ``kernels/tuned_configs.json`` (or the file named by
   ``MOESTACK_TUNED_CONFIGS``), keyed by ``torch.cuda.get_device_name()``, written by
   ``scripts/tune_kernels.py`` on that GPU; a key missing at this row bucket takes the
   entry of the nearest bucket of the same variant; inside ``retune(kinds)`` the entries
   of those kinds are not read (a benchmark re-measures entries seeded or measured before
   their kind's newer candidates existed), inside ``retune(kinds, sources=("seed",))``
   only their seeds are not (a run measures what no measurement stands behind); a file
   that is no table, or an entry the kernels cannot launch (``_table_check``: an unknown
   field, a tile of 2^40 or "128"), is refused in one ValueError naming the file and entry;
3. autotuning: time every candidate once with ``triton.testing.do_bench`` on the real
   arguments and keep the fastest (set ``MOESTACK_AUTOTUNE=0`` to skip and use the
   heuristic default instead, e.g. under CUDA-graph capture);
4. under ``TRITON_INTERPRET=1``: one fixed small config, no timing.

Every table entry says where it came from (``TableEntry``): ``"source": "seed"`` (a starting
point written by hand or carried over from another key, never timed at its own) or
``"source": "measured"`` with its ``provenance`` (the GPU, date, torch and triton of the run
that timed it). ``lookup_entry`` hands back the entry with its source. Tables written before
entries named their source (formats 2 and 3) are still read: an entry without the field is a
seed, unless the table's ``sources[gpu][key]`` record (written by the tuner before format 4)
says when it was measured. Reading them as seeds, not refusing them, keeps their tiles in use
(refused, every launch would autotune mid-run or run the untimed default) while claiming no
measurement the table cannot show.

The cache holds one record per key (``CachedConfig``: the config, where it came from, the
table entry behind it; ``cache_config`` puts one in), so it remembers where each of its
configs came from (``cache_sources``): "measured" (autotuned in this process), "table" or
"default" (untimed); ``entry_sources`` says, per config, whether its tile was measured
(here, or in the run its table entry names, at its own key) or is a seed. ``export_cache``,
what ``scripts/tune_kernels.py`` and ``scripts/bench_moe.py --save-tuned`` write into a
table, holds the measured ones only, each with this run's provenance, so a table entry read
back is never re-stamped as measured.

A config also names its backend. Every kind runs moestack's Triton kernels ("triton"); the
weight gradient may instead run ``torch._grouped_mm``'s 2D x 2D form ("torch"), a candidate
only where that runs (``torch_wgrad_runs``: bf16 on sm90+ CUDA; fp32/bf16/fp16 on the CPU;
16-byte rows), so autotuning measures it against the tiles and the table records the
winner. Without a table entry or autotuning, moestack's kernel is the default. A table's
"torch" entry read where torch's form cannot run (another dtype or GPU class under the same
name) gives moestack's default: chosen by capability, never by a failed launch.

A config of the plain grouped GEMM (kind "mm": the layer's h @ W2, G = dy @ W2^T and
dx = dz @ W1^T, and ``grouped_gemm``) may name the persistent kernel (``persistent``, with
``num_programs`` programs, 0 for one per SM; ``kernels/_persistent.py``). Its candidates
(``PERSISTENT_CANDIDATES``) are timed beside the classic tiles and the table records the
winner; without a table entry or autotuning the classic kernel stays the default, so the
persistent one runs only where it won a measurement (or is forced). Table entries without
the field are classic ones.

G = dy @ W2^T with the SwiGLU backward (kind "mm_dswiglu") runs either unfused (G by the
plain GEMM, kind "mm", then the elementwise pass: ``UNFUSED_DSWIGLU``, the default) or fused
(``fused``: the classic kernel's tile computes G and, in its epilogue, dz, weight * h and
the router-weight gradient's partial sums). Autotuning times the unfused pair against the
fused tiles; without a table entry or autotuning the unfused pair runs.

The flags name the kernel variant, including whether the weight is a transposed view (its
K dimension has unit stride: another memory access pattern, so another best tile); the row
bucket is the power of two at or above the number of sorted rows (the best tile for 2k rows
is rarely the best for 64k).

The kernels only overwrite their outputs (no atomics, no accumulation into inputs), so
running a candidate several times while timing it cannot change the result. While timing,
only a candidate that runs out of resources or fails to compile is skipped: any other error
(an illegal address, say, which leaves the CUDA context unusable) is logged as a warning and
raised, naming the config, instead of being hidden behind "no config could run".
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from .tuned_table import (
    ENTRY_SOURCES,
    KernelConfig,
    TableEntry,
    entry_json,
    lookup_entry,
    read_table,
    run_provenance,
)

log = logging.getLogger(__name__)

# One fixed config for the interpreter: big enough that few programs run (the interpreter
# pays per program), small enough that test shapes cross tile borders.
INTERPRET_CONFIG = KernelConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1)

# Small sensible candidate sets for Hopper/Ampere-class GPUs. The first entry is the
# default when autotuning is off and the table has no entry. A 128x256 or 256x128 fp32
# accumulator is 128 registers a thread at 8 warps: the largest one tile may hold.
_MM_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3),
    KernelConfig(128, 128, 32, 8, 4, 4),
    KernelConfig(128, 256, 64, 8, 8, 3),
    KernelConfig(64, 128, 64, 8, 4, 4),
    KernelConfig(128, 64, 64, 8, 4, 4),
    KernelConfig(64, 64, 64, 8, 4, 4),
    KernelConfig(64, 256, 32, 8, 8, 4),
    KernelConfig(256, 128, 64, 8, 8, 3),
)
# Two accumulators (gate and up) per tile: keep the register budget of one 128x256 tile.
_SWIGLU_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3),
    KernelConfig(128, 64, 64, 8, 4, 4),
    KernelConfig(64, 128, 64, 8, 4, 4),
    KernelConfig(128, 128, 32, 8, 8, 4),
    KernelConfig(64, 64, 64, 8, 4, 4),
)
# The gathered row index is loaded one step ahead of the tiles, so it takes a pipeline stage:
# with num_stages=3 a gathered weight gradient keeps only two tile buffers in flight. The
# num_stages=5 entries keep three (96.5 KiB at 128x128x64 in bf16, compiled for sm_90).
# The MoE backward's operands are contiguous (rows gathered once beforehand): no index
# stage, and 128 rows a step halve the main loop's trips over an expert's rows.
_WGRAD_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3),
    KernelConfig(128, 128, 32, 8, 4, 4),
    KernelConfig(128, 256, 64, 8, 8, 3),
    KernelConfig(64, 128, 64, 8, 4, 4),
    KernelConfig(128, 64, 64, 8, 4, 4),
    KernelConfig(64, 64, 64, 8, 4, 4),
    KernelConfig(128, 128, 64, 8, 8, 5),
    KernelConfig(128, 128, 32, 8, 4, 5),
    KernelConfig(256, 128, 64, 8, 8, 3),
    KernelConfig(128, 128, 128, 8, 8, 3),
)
# G = dy @ W2^T with the SwiGLU backward in its epilogue (kind "mm_dswiglu"): the epilogue
# holds G, gate, up and the dz halves of a tile at once, so the tiles stay at the register
# budget of the fused forward's. Timed against ``UNFUSED_DSWIGLU``, the default.
_DSWIGLU_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3, fused=True),
    KernelConfig(128, 64, 64, 8, 4, 4, fused=True),
    KernelConfig(64, 128, 64, 8, 4, 4, fused=True),
    KernelConfig(128, 128, 32, 8, 8, 4, fused=True),
    KernelConfig(64, 64, 64, 8, 4, 4, fused=True),
)
# Kind "mm_dswiglu" unfused: G by the plain GEMM (its own "mm" config), then the
# elementwise SwiGLU backward (its tile fields are unused).
UNFUSED_DSWIGLU = KernelConfig(128, 128, 64)
# The persistent grouped GEMM (kind "mm"), timed after the classic tiles: its default tile,
# one large tile and a small one for narrow shapes, one program per SM. The classic first
# candidate stays the default when nothing was measured.
PERSISTENT_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3, persistent=True),
    KernelConfig(128, 256, 64, 8, 8, 3, persistent=True),
    KernelConfig(64, 128, 64, 8, 4, 4, persistent=True),
)
# The weight gradient by torch._grouped_mm: a candidate where ``torch_wgrad_runs`` (its tile
# fields are unused).
TORCH_WGRAD = KernelConfig(128, 128, 64, backend="torch")
CANDIDATES: dict[str, tuple[KernelConfig, ...]] = {
    "mm": _MM_CANDIDATES,
    "mm_swiglu": _SWIGLU_CANDIDATES,
    "wgrad": _WGRAD_CANDIDATES,
    "mm_dswiglu": _DSWIGLU_CANDIDATES,
}

# Where a cached config came from: "measured" (timed here), "table" or "default".
SOURCES = ("measured", "table", "default")


@dataclass(frozen=True)
class CachedConfig:
    """One config of the autotune cache: the config launched, where it came from
    (``SOURCES``) and the table entry behind it (the one read, or the one measured here with
    this run's provenance; None for an untimed default, or a config put in the cache by hand
    without one)."""

    config: KernelConfig
    source: str = "measured"
    entry: TableEntry | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} is unknown; use one of {SOURCES}")
        if self.entry is None:
            return
        if self.source == "default":
            raise ValueError("an untimed default has no table entry; pass entry=None")
        if self.entry.config != self.config:
            raise ValueError(
                f"the entry's config {self.entry.config} is not the cached {self.config}; "
                "pass the entry of the config cached, or entry=None"
            )
        if self.source == "measured" and self.entry.source != "measured":
            raise ValueError(
                'a config measured here has a "measured" entry; pass one, or entry=None '
                "(this run's provenance is added)"
            )


# The autotune cache: (gpu name, key) -> the config and where it came from.
_CACHE: dict[tuple[str, str], CachedConfig] = {}
# Configs forced per kernel kind by ``forced_config`` (tests and output checks only).
_FORCED: dict[str, KernelConfig] = {}
# Kinds whose table entries ``retune`` tells the tuner not to read, each with the sources
# (``ENTRY_SOURCES``) of the entries not read.
_RETUNE: dict[str, frozenset[str]] = {}


def row_bucket(rows: int) -> int:
    """The power of two at or above ``rows`` (at least 1): the token-count part of a key."""
    return 1 << max(rows - 1, 0).bit_length()


def make_key(kind: str, E: int, K: int, M: int, dtype: torch.dtype, flags: str, rows: int) -> str:
    """The table key of one kernel variant at one problem size and row bucket."""
    name = str(dtype).removeprefix("torch.")
    return f"{kind}|E={E}|K={K}|M={M}|{name}|{flags}|R={row_bucket(rows)}"


def autotune_enabled() -> bool:
    """Autotune on a cache and table miss unless ``MOESTACK_AUTOTUNE`` is 0/false/off."""
    return os.environ.get("MOESTACK_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off")


# torch._grouped_mm has a CPU kernel from torch 2.9 (2.8 has the op, CUDA only)
_CPU_GROUPED_MM = torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs on ``device`` in ``dtype`` at all: bf16 on sm90+ CUDA,
    fp32/bf16/fp16 on the CPU from torch 2.9 (its other need, 16-byte rows, the callers
    meet or check). The one rule for the torch MoE path and the tuner's dW backend."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    cpu_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return device.type == "cpu" and _CPU_GROUPED_MM and dtype in cpu_dtypes


def torch_wgrad_runs(device: torch.device, dtype: torch.dtype, K: int, M: int) -> bool:
    """Whether torch._grouped_mm's 2D x 2D weight gradient runs here (``grouped_mm_runs``)
    with 16-byte rows of both operands (K and M columns)."""
    size = torch.empty((), dtype=dtype).element_size()
    if (K * size) % 16 or (M * size) % 16:
        return False
    return grouped_mm_runs(device, dtype)


def _clip(cfg: KernelConfig, K: int, M: int, kind: str) -> KernelConfig:
    """Shrink tiles that are far larger than the problem (tiny K or M), minimum 16."""

    def fit(block: int, dim: int) -> int:
        return max(16, min(block, 1 << max(dim - 1, 1).bit_length()))

    if kind == "wgrad":  # output tile over [K, M]; block_k runs over token rows
        return replace(cfg, block_m=fit(cfg.block_m, K), block_n=fit(cfg.block_n, M))
    return replace(cfg, block_n=fit(cfg.block_n, M), block_k=fit(cfg.block_k, K))


def fit(cfg: KernelConfig, kind: str, K: int, M: int, dtype: torch.dtype) -> KernelConfig:
    """``cfg`` as launched for this problem: tiles clipped to tiny K or M, and half the
    reduction step for float32, so that the pipelined shared-memory buffers of the 16-bit
    configs still fit (e.g. on A100-class GPUs)."""
    c = _clip(cfg, K, M, kind)
    if dtype == torch.float32:
        c = replace(c, block_k=max(16, c.block_k // 2))
    return c


def candidates(
    kind: str, K: int, M: int, dtype: torch.dtype, device: torch.device | None = None
) -> list[KernelConfig]:
    """The distinct candidate configs for one kernel kind, fitted to the problem size: for
    the plain GEMM the persistent ones after the classic tiles, for the weight gradient on a
    ``device`` where ``torch_wgrad_runs`` torch's backend last, for G with the SwiGLU
    backward the unfused pair first (the default when nothing is timed)."""
    first = [fit(UNFUSED_DSWIGLU, kind, K, M, dtype)] if kind == "mm_dswiglu" else []
    out: list[KernelConfig] = first
    extra = PERSISTENT_CANDIDATES if kind == "mm" else ()
    for cfg in CANDIDATES[kind] + extra:
        c = fit(cfg, kind, K, M, dtype)
        if c not in out:
            out.append(c)
    if kind == "wgrad" and device is not None and torch_wgrad_runs(device, dtype, K, M):
        out.append(TORCH_WGRAD)
    return out


def default_config(kind: str, K: int, M: int, dtype: torch.dtype) -> KernelConfig:
    """The untimed default of ``kind``: its first candidate, fitted (unfused for G with the
    SwiGLU backward)."""
    return candidates(kind, K, M, dtype)[0]


def _runnable(
    cfg: KernelConfig, kind: str, device: torch.device, K: int, M: int, dtype: torch.dtype
) -> KernelConfig:
    """``cfg``, or moestack's default where ``cfg`` names torch's backend and it cannot run
    here (a table entry of another dtype or GPU class under the same name), or names the
    persistent kernel for a kind it does not run (an edited table)."""
    if cfg.backend == "torch" and not (kind == "wgrad" and torch_wgrad_runs(device, dtype, K, M)):
        log.info(
            "torch's weight gradient cannot run here (%s, %s): moestack's kernel", device, dtype
        )
        return default_config(kind, K, M, dtype)
    if cfg.persistent and kind != "mm":
        log.info("the persistent kernel runs kind 'mm' only, not %r: the default tile", kind)
        return default_config(kind, K, M, dtype)
    if cfg.fused and kind != "mm_dswiglu":
        log.info("fused=True is for kind 'mm_dswiglu' only, not %r: the default tile", kind)
        return default_config(kind, K, M, dtype)
    return cfg


@contextlib.contextmanager
def forced_config(kind: str, cfg: KernelConfig) -> Iterator[None]:
    """Inside the block, every launch of ``kind`` uses ``cfg`` (fitted to each launch's
    problem, as the candidates are), under the interpreter too, ahead of the cache and the
    table. For checking each candidate config against a reference; not thread-safe."""
    if kind not in CANDIDATES:
        raise ValueError(f"kind={kind!r} is unknown; use one of {sorted(CANDIDATES)}")
    if cfg.backend == "torch" and kind != "wgrad":
        raise ValueError(f"backend='torch' is for kind='wgrad' only, not {kind!r}")
    if cfg.persistent and kind != "mm":
        raise ValueError(f"persistent=True is for kind='mm' only, not {kind!r}")
    if cfg.fused and kind != "mm_dswiglu":
        raise ValueError(f"fused=True is for kind='mm_dswiglu' only, not {kind!r}")
    previous = _FORCED.get(kind)
    _FORCED[kind] = cfg
    try:
        yield
    finally:
        if previous is None:
            _FORCED.pop(kind, None)
        else:
            _FORCED[kind] = previous


@contextlib.contextmanager
def retune(kinds: Iterable[str], sources: Iterable[str] = ENTRY_SOURCES) -> Iterator[None]:
    """Inside the block, the tuned table's entries of ``kinds`` whose source is one of
    ``sources`` (``ENTRY_SOURCES``; by default both) are not read: those keys autotune on
    first use (or, with ``MOESTACK_AUTOTUNE=0``, take the untimed default), so that a
    benchmark measures candidates the table's entries were never timed against. The other
    entries of those kinds are read as before: ``sources=("seed",)`` re-measures only what no
    measurement stands behind. An entry's source is the one it has at the key looked up, as
    ``entry_sources`` says: a neighbouring row bucket's entry is a seed there. Configs of
    those kinds the cache holds unmeasured (read from the table, or defaults) whose source
    is one of ``sources`` are dropped on entry; measured ones stay. A block inside another
    adds to it: what the outer block leaves unread stays unread. Not thread-safe."""
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    unknown = sorted(kinds - set(CANDIDATES))
    if unknown:
        raise ValueError(f"retune kinds {unknown} are unknown; use some of {sorted(CANDIDATES)}")
    wanted = frozenset([sources] if isinstance(sources, str) else sources)
    bad = sorted(wanted - set(ENTRY_SOURCES))
    if bad or not wanted:
        what = f"retune sources {bad} are unknown" if bad else "retune got no sources"
        raise ValueError(f"{what}; use some of {list(ENTRY_SOURCES)}")
    for (gpu, key), cached in list(_CACHE.items()):
        unmeasured = key.split("|")[0] in kinds and cached.source != "measured"
        if unmeasured and cached_entry(gpu, key).source in wanted:
            del _CACHE[(gpu, key)]
    previous = dict(_RETUNE)
    _RETUNE.update({k: previous.get(k, frozenset()) | wanted for k in kinds})
    try:
        yield
    finally:
        _RETUNE.clear()
        _RETUNE.update(previous)


def retuning() -> dict[str, tuple[str, ...]]:
    """``{kind: sources}``: the kinds whose table entries of those sources the open
    ``retune`` blocks leave unread (an inner block's sources of a kind add to an outer
    one's; empty outside every block)."""
    return {k: tuple(s for s in ENTRY_SOURCES if s in v) for k, v in sorted(_RETUNE.items())}


def _entry_at(entry: TableEntry, key: str) -> TableEntry:
    """``entry`` as it stands at ``key``: itself at its own key; a seed of its config at
    another (a neighbouring row bucket's entry was never timed at ``key``)."""
    return entry if entry.key == key else TableEntry(entry.config, "seed", None, key)


def _table_entry(gpu: str, kind: str, key: str) -> TableEntry | None:
    """The table's entry for ``key`` (``lookup_entry``), unless ``retune`` leaves entries of
    its source (at ``key``) unread."""
    retuned = _RETUNE.get(kind, frozenset())
    if retuned >= set(ENTRY_SOURCES):  # none of this kind read: no lookup
        return None
    entry = lookup_entry(gpu, key)
    if entry is None or _entry_at(entry, key).source in retuned:
        return None
    return entry


def choose_config(
    kind: str,
    key: str,
    device: torch.device,
    K: int,
    M: int,
    dtype: torch.dtype,
    run: Callable[[KernelConfig], object],
    interpret: bool,
) -> KernelConfig:
    """Pick the config for one launch; ``run(cfg)`` launches the kernel (used for timing)."""
    forced = _FORCED.get(kind)
    if forced is not None:
        return _runnable(fit(forced, kind, K, M, dtype), kind, device, K, M, dtype)
    if interpret:
        return INTERPRET_CONFIG
    gpu = torch.cuda.get_device_name(device)
    cached = _CACHE.get((gpu, key))
    if cached is not None:
        return cached.config
    entry = _table_entry(gpu, kind, key)
    if entry is not None:
        cfg, source = entry.config, "table"
    else:
        cands = candidates(kind, K, M, dtype, device)
        if autotune_enabled():
            cfg, source = _benchmark(key, cands, run), "measured"
            entry = TableEntry(cfg, "measured", run_provenance(gpu), key)
        else:
            cfg, source = cands[0], "default"
    runnable = _runnable(cfg, kind, device, K, M, dtype)
    if runnable != cfg:  # a table entry that cannot run here: the untimed default
        source, entry = "default", None
    cache_config(gpu, key, runnable, source, entry)
    return runnable


def cache_config(
    gpu: str,
    key: str,
    cfg: KernelConfig,
    source: str = "measured",
    entry: TableEntry | None = None,
) -> None:
    """Put ``cfg`` in the autotune cache for ``key`` on ``gpu``, as come from ``source``
    (``SOURCES``) with the table ``entry`` behind it (``CachedConfig``): what
    ``choose_config`` does after choosing, and how tests and checks fill the cache. A
    measured config without an entry exports with this run's provenance."""
    _CACHE[(gpu, key)] = CachedConfig(cfg, source, entry)


def _time_ms(fn: Callable[[], None]) -> float:
    """Milliseconds of one launch, timed by triton (tests replace this on the CPU)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20)


def skippable_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean "this tile cannot run here" and nothing worse: out of shared
    memory or registers, and compile failures (ptxas included, where triton has it)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors

    kinds: list[type[BaseException]] = [errors.OutOfResources, CompilationError]
    ptxas = getattr(errors, "PTXASError", None)  # triton >= 3.2
    if ptxas is not None:
        kinds.append(ptxas)
    return tuple(kinds)


def _skippable(exc: BaseException) -> bool:
    # A launch asking for more registers than the GPU has fails before it starts and leaves
    # the context intact (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); triton reports it as text.
    return isinstance(exc, skippable_errors()) or (
        isinstance(exc, RuntimeError) and "too many resources requested" in str(exc)
    )


def _benchmark(key: str, cands: list[KernelConfig], run: Callable[[KernelConfig], object]):
    best, best_ms = None, float("inf")
    for cfg in cands:
        try:
            ms = _time_ms(lambda cfg=cfg: run(cfg))
        except Exception as exc:
            if not _skippable(exc):
                log.warning("config %s of %s failed: %s: %s", cfg, key, type(exc).__name__, exc)
                raise
            log.info("config %s of %s skipped: %s", cfg, key, str(exc).splitlines()[0])
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(
            f"no tile config of {key} fits this GPU (all {len(cands)} ran out of resources "
            "or failed to compile); add smaller tiles to CANDIDATES in kernels/tuning.py"
        )
    log.info("autotuned %s -> %s (%.3f ms)", key, best, best_ms)
    return best


def source_of(gpu: str, key: str) -> str:
    """Where the cached config of ``key`` came from: one of ``SOURCES`` ("measured" for a
    key the cache does not hold)."""
    cached = _CACHE.get((gpu, key))
    return cached.source if cached is not None else "measured"


def cached_entry(gpu: str, key: str) -> TableEntry:
    """The cached config of ``key`` as a table entry: measured here (with the provenance of
    this run), read from the table at its own key (as the table has it), else a seed (an
    untimed default, or a neighbouring row bucket's entry: never timed at this key)."""
    cached = _CACHE[(gpu, key)]
    if cached.source == "measured":
        if cached.entry is None:  # put in the cache by hand
            return TableEntry(cached.config, "measured", run_provenance(gpu), key)
        return cached.entry
    if cached.entry is not None:
        return _entry_at(cached.entry, key)
    return TableEntry(cached.config, "seed", None, key)


def export_cache(measured_only: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
    """The autotune cache as table entries ``{gpu: {key: entry}}`` (``entry_json``, for
    tune_kernels.py): the configs measured in this process, each "measured" with this run's
    provenance, unless ``measured_only`` is false (then also those read from the table, as the
    table has them, and the untimed defaults, as seeds); each entry names its backend, and a
    persistent or fused one says so."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for gpu, key in sorted(_CACHE):
        if not measured_only or source_of(gpu, key) == "measured":
            out.setdefault(gpu, {})[key] = entry_json(cached_entry(gpu, key))
    return out


def cache_sources() -> dict[str, dict[str, str]]:
    """``{gpu: {key: source}}`` for every cached config (``SOURCES``): what a run measured
    and what it only read or defaulted, for its report."""
    out: dict[str, dict[str, str]] = {}
    for gpu, key in sorted(_CACHE):
        out.setdefault(gpu, {})[key] = source_of(gpu, key)
    return out


def entry_sources() -> dict[str, dict[str, str]]:
    """``{gpu: {key: source}}`` (``ENTRY_SOURCES``) for every cached config: "measured" where
    its tile was timed at this key (in this process, or in the run its table entry names),
    "seed" where it never was (a seeded entry, a neighbouring bucket's, an untimed default),
    so that a run can tell which of its configs a measurement stands behind."""
    out: dict[str, dict[str, str]] = {}
    for gpu, key in sorted(_CACHE):
        out.setdefault(gpu, {})[key] = cached_entry(gpu, key).source
    return out


def clear_cache() -> None:
    """Forget every autotuned config, where each came from, and the loaded table (e.g.
    before re-tuning)."""
    _CACHE.clear()
    read_table.cache_clear()
