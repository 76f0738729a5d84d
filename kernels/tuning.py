"""Tile-config selection for the grouped-GEMM kernels: tuned table, autotuning, defaults.

A config is chosen per (kernel kind, E, K, M, dtype, kernel flags) and per GPU name, in
this order:

1. the in-process autotune cache (the only mutable module state);
2. the checked-in table ``kernels/tuned_configs.json`` (or the file named by
   ``MOESTACK_TUNED_CONFIGS``), keyed by ``torch.cuda.get_device_name()``, written by
   ``scripts/tune_kernels.py`` on that GPU;
3. autotuning: time every candidate once with ``triton.testing.do_bench`` on the real
   arguments and keep the fastest (set ``MOESTACK_AUTOTUNE=0`` to skip and use the
   heuristic default instead, e.g. under CUDA-graph capture);
4. under ``TRITON_INTERPRET=1``: one fixed small config, no timing.

The kernels only overwrite their outputs (no atomics, no accumulation into inputs), so
running a candidate several times while timing it cannot change the result.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
TABLE_FORMAT = 1


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
_WGRAD_CANDIDATES = (
    KernelConfig(128, 128, 64, 8, 8, 3),
    KernelConfig(128, 128, 32, 8, 4, 4),
    KernelConfig(128, 256, 64, 8, 8, 3),
    KernelConfig(64, 128, 64, 8, 4, 4),
    KernelConfig(128, 64, 64, 8, 4, 4),
    KernelConfig(64, 64, 64, 8, 4, 4),
)
CANDIDATES: dict[str, tuple[KernelConfig, ...]] = {
    "mm": _MM_CANDIDATES,
    "mm_swiglu": _SWIGLU_CANDIDATES,
    "wgrad": _WGRAD_CANDIDATES,
}

# The autotune cache: (gpu name, key) -> config.
_AUTOTUNE_CACHE: dict[tuple[str, str], KernelConfig] = {}


def make_key(kind: str, E: int, K: int, M: int, dtype: torch.dtype, flags: str) -> str:
    """The table key of one kernel variant at one problem size (token count excluded)."""
    return f"{kind}|E={E}|K={K}|M={M}|{str(dtype).removeprefix('torch.')}|{flags}"


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
    """The tuned config for ``key`` on ``gpu`` from the table, or None."""
    entry = _read_table(str(table_path())).get(gpu, {}).get(key)
    return KernelConfig(**entry) if entry else None


def _clip(cfg: KernelConfig, K: int, M: int, kind: str) -> KernelConfig:
    """Shrink tiles that are far larger than the problem (tiny K or M), minimum 16."""

    def fit(block: int, dim: int) -> int:
        return max(16, min(block, 1 << max(dim - 1, 1).bit_length()))

    if kind == "wgrad":  # output tile over [K, M]; block_k runs over token rows
        return replace(cfg, block_m=fit(cfg.block_m, K), block_n=fit(cfg.block_n, M))
    return replace(cfg, block_n=fit(cfg.block_n, M), block_k=fit(cfg.block_k, K))


def candidates(kind: str, K: int, M: int, dtype: torch.dtype) -> list[KernelConfig]:
    """The distinct candidate configs for one kernel kind, clipped to the problem size.

    float32 tiles use half the reduction step, so that the pipelined shared-memory buffers
    of the 16-bit configs still fit (e.g. on A100-class GPUs).
    """
    out: list[KernelConfig] = []
    for cfg in CANDIDATES[kind]:
        c = _clip(cfg, K, M, kind)
        if dtype == torch.float32:
            c = replace(c, block_k=max(16, c.block_k // 2))
        if c not in out:
            out.append(c)
    return out


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


def _benchmark(key: str, cands: list[KernelConfig], run: Callable[[KernelConfig], None]):
    from triton.testing import do_bench

    best, best_ms = None, float("inf")
    for cfg in cands:
        try:
            ms = do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20)
        except Exception as exc:  # e.g. out of shared memory for this tile on this GPU
            log.debug("config %s failed for %s: %s", cfg, key, exc)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no kernel config could run for {key}")
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
