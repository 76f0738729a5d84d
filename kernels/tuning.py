"""Tile-config selection for the grouped-GEMM kernels: tuned table, autotuning, defaults.

A config is chosen per (kernel kind, E, K, M, dtype, kernel flags, row bucket) and per GPU
name, in this order:

0. a config forced with ``forced_config`` (tests and checks run every candidate this way);
1. the in-process autotune cache;
2. the checked-in table ``kernels/tuned_configs.json`` (or the file named by
   ``MOESTACK_TUNED_CONFIGS``), keyed by ``torch.cuda.get_device_name()``, written by
   ``scripts/tune_kernels.py`` on that GPU; a key missing at this row bucket takes the
   entry of the nearest bucket of the same variant;
3. autotuning: time every candidate once with ``triton.testing.do_bench`` on the real
   arguments and keep the fastest (set ``MOESTACK_AUTOTUNE=0`` to skip and use the
   heuristic default instead, e.g. under CUDA-graph capture);
4. under ``TRITON_INTERPRET=1``: one fixed small config, no timing.

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
import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
# 2: keys carry the transposed-weight flag and the row bucket (format 1 tables are ignored).
TABLE_FORMAT = 2


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


# One fixed config for the interpreter: big enough that few programs run (the interpreter
# pays per program), small enough that test shapes cross tile borders.
INTERPRET_CONFIG = KernelConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1)

# Small sensible candidate sets for Hopper/Ampere-class GPUs. The first entry is the
# default when autotuning is off and the table has no entry.
_MM_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3),
    KernelConfig(128, 128, 32, 8, 4, 4),
    KernelConfig(128, 256, 64, 8, 8, 3),
    KernelConfig(64, 128, 64, 8, 4, 4),
    KernelConfig(128, 64, 64, 8, 4, 4),
    KernelConfig(64, 64, 64, 8, 4, 4),
    KernelConfig(64, 256, 32, 8, 8, 4),
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
_WGRAD_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3),
    KernelConfig(128, 128, 32, 8, 4, 4),
    KernelConfig(128, 256, 64, 8, 8, 3),
    KernelConfig(64, 128, 64, 8, 4, 4),
    KernelConfig(128, 64, 64, 8, 4, 4),
    KernelConfig(64, 64, 64, 8, 4, 4),
    KernelConfig(128, 128, 64, 8, 8, 5),
    KernelConfig(128, 128, 32, 8, 4, 5),
)
CANDIDATES: dict[str, tuple[KernelConfig, ...]] = {
    "mm": _MM_CANDIDATES,
    "mm_swiglu": _SWIGLU_CANDIDATES,
    "wgrad": _WGRAD_CANDIDATES,
}

# The autotune cache: (gpu name, key) -> config.
_AUTOTUNE_CACHE: dict[tuple[str, str], KernelConfig] = {}
# Configs forced per kernel kind by ``forced_config`` (tests and output checks only).
_FORCED: dict[str, KernelConfig] = {}


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


@functools.lru_cache(maxsize=4)
def _read_table(path: str) -> dict[str, dict[str, dict[str, int]]]:
    p = Path(path)
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if data.get("format") != TABLE_FORMAT:
        log.warning("ignoring tuned-config table %s: unknown format %r", p, data.get("format"))
        return {}
    return data.get("gpus", {})


def table_path() -> Path:
    """Where the tuned table is read from (``MOESTACK_TUNED_CONFIGS`` overrides)."""
    return Path(os.environ.get("MOESTACK_TUNED_CONFIGS", str(TABLE_PATH)))


def lookup_table(gpu: str, key: str) -> KernelConfig | None:
    """The tuned config for ``key`` on ``gpu`` from the table, or None.

    Without an entry at the key's row bucket, the entry of the nearest bucket (in powers of
    two; the smaller one on a tie) of the same variant is used: a neighbour's tile beats
    autotuning mid-run, or the untimed default where autotuning is off.
    """
    entries = _read_table(str(table_path())).get(gpu, {})
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
    return KernelConfig(**entry) if entry else None


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


def candidates(kind: str, K: int, M: int, dtype: torch.dtype) -> list[KernelConfig]:
    """The distinct candidate configs for one kernel kind, fitted to the problem size."""
    out: list[KernelConfig] = []
    for cfg in CANDIDATES[kind]:
        c = fit(cfg, kind, K, M, dtype)
        if c not in out:
            out.append(c)
    return out


@contextlib.contextmanager
def forced_config(kind: str, cfg: KernelConfig) -> Iterator[None]:
    """Inside the block, every launch of ``kind`` uses ``cfg`` (fitted to each launch's
    problem, as the candidates are), under the interpreter too, ahead of the cache and the
    table. For checking each candidate config against a reference; not thread-safe."""
    if kind not in CANDIDATES:
        raise ValueError(f"kind={kind!r} is unknown; use one of {sorted(CANDIDATES)}")
    previous = _FORCED.get(kind)
    _FORCED[kind] = cfg
    try:
        yield
    finally:
        if previous is None:
            _FORCED.pop(kind, None)
        else:
            _FORCED[kind] = previous


def choose_config(
    kind: str,
    key: str,
    device: torch.device,
    K: int,
    M: int,
    dtype: torch.dtype,
    run: Callable[[KernelConfig], None],
    interpret: bool,
) -> KernelConfig:
    """Pick the config for one launch; ``run(cfg)`` launches the kernel (used for timing)."""
    forced = _FORCED.get(kind)
    if forced is not None:
        return fit(forced, kind, K, M, dtype)
    if interpret:
        return INTERPRET_CONFIG
    gpu = torch.cuda.get_device_name(device)
    cached = _AUTOTUNE_CACHE.get((gpu, key))
    if cached is not None:
        return cached
    cfg = lookup_table(gpu, key)
    if cfg is None:
        cands = candidates(kind, K, M, dtype)
        cfg = _benchmark(key, cands, run) if autotune_enabled() else cands[0]
    _AUTOTUNE_CACHE[(gpu, key)] = cfg
    return cfg


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


def _benchmark(key: str, cands: list[KernelConfig], run: Callable[[KernelConfig], None]):
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


def export_cache() -> dict[str, dict[str, dict[str, int]]]:
    """The autotune cache as table entries ``{gpu: {key: config}}`` (for tune_kernels.py)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (gpu, key), cfg in sorted(_AUTOTUNE_CACHE.items()):
        out.setdefault(gpu, {})[key] = asdict(cfg)
    return out


def clear_cache() -> None:
    """Forget every autotuned config and the loaded table (e.g. before re-tuning)."""
    _AUTOTUNE_CACHE.clear()
    _read_table.cache_clear()
