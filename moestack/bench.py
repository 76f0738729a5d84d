"""The harness of the benchmark scripts (``scripts/bench_*.py``, ``scripts/profile_moe.py``).

One home for what every benchmark needs, so that a script states its contenders and cases
and nothing else:

- the common command-line options (:func:`parser`);
- timing (:func:`seconds`, :func:`times`, :func:`median_ms`, :func:`interleave`): a call is
  timed between two ``torch.cuda.synchronize`` on a CUDA device (the kernels it queued are
  counted, not only their launch), warm-up calls come before the timed ones, and contenders
  compared against each other are called in turn, round after round, so that a load that
  drifts (another job, the clock) slows them alike;
- the median and range over repeats (:func:`spread`, :func:`median_range`);
- the environment record (machine, torch version, commit, date: :func:`environment`);
- table printing (:func:`table`) and JSON output (:func:`write_json`, atomic);
- the pieces two scripts share: the page-cache drop of cold reads (:func:`drop_pages`), the
  dense matmul rate (:func:`dense_matmul_tflops`), the MoE layer's shapes and steps
  (``bench_moe.py`` and ``profile_moe.py``) and the tuned-table save (``bench_moe.py
  --save-tuned`` and ``tune_kernels.py``).

Scripts import it as ``from moestack import bench``: no script imports another.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moestack import atomic

log = logging.getLogger(__name__)

# The common options: name -> (type, help). A script names the ones it takes, with its default.
COMMON: dict[str, tuple[type, str]] = {
    "json": (str, "write the results here as JSON"),
    "device": (str, "torch device (cpu, cuda, cuda:1)"),
    "threads": (int, "torch CPU threads (0 = torch's default)"),
    "warmup": (int, "untimed warm-up calls (or steps) before the timed ones"),
    "repeats": (int, "timed repeats (the median is reported, with the range)"),
    "reps": (int, "timed repeats (the median is reported)"),
    "rounds": (int, "interleaved rounds: every contender once a round"),
    "steps": (int, "timed steps"),
}


def parser(doc: str | None, **defaults: Any) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description, and the
    common options of :data:`COMMON` named in ``defaults`` (``--json``, ``--device``, ...)
    with the script's default for each."""
    description = (doc or "").split("\n\n")[0].strip()
    ap = argparse.ArgumentParser(description=description)
    for name, default in defaults.items():
        kind, help_ = COMMON[name]
        ap.add_argument(f"--{name}", type=kind, default=default, help=help_)
    return ap


# --------------------------------------------------------------------------- timing
def synchronize(device: torch.device | str | None) -> None:
    """Wait for the kernels queued on ``device`` when it is a CUDA device (else nothing)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], Any], device: torch.device | str | None = None) -> float:
    """Wall seconds of one call of ``fn``, its queued CUDA kernels included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def times(
    fn: Callable[[], Any],
    device: torch.device | str | None = None,
    warmup: int = 0,
    repeats: int = 1,
) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [seconds(fn, device) for _ in range(repeats)]


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn``: on CUDA triton's ``do_bench`` (it flushes the L2 cache
    between calls; ``warmup`` x 10 ms of warm-up, ``repeats`` x 50 ms timed), elsewhere the
    median of ``repeats`` calls after ``warmup``."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup * 10, rep=repeats * 50, return_mode="median"))
    return 1e3 * statistics.median(times(fn, device, warmup, repeats))


def interleave(
    contenders: Mapping[str, Callable[[], Any]],
    rounds: int,
    warmup: int = 0,
    device: torch.device | str | None = None,
    rotate: bool = True,
) -> dict[str, list[float]]:
    """Seconds of each contender's call, the contenders called in turn: ``warmup`` untimed
    rounds, then ``rounds`` timed ones; with ``rotate`` the order turns by one each round
    (no contender always runs first, after the others' allocations)."""
    names = list(contenders)
    out: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + rounds):
        shift = round_ % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            took = seconds(contenders[name], device)
            if round_ >= warmup:
                out[name].append(took)
    return out


def fresh_cuda_memory() -> int:
    """Free what earlier contenders left (a collection, the allocator's cached blocks) and
    reset the peak counter; the bytes still allocated, to subtract from the next peak."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


# --------------------------------------------------------------------------- figures
def spread(values: Sequence[float]) -> dict[str, float]:
    """The median and the range of ``values``: ``{"median", "min", "max"}``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_range(median: float, low: float, high: float, fmt: str = ".2f", unit: str = "") -> str:
    """``"m (lo-hi)"``, each formatted with ``fmt``; ``unit`` after the median."""
    return f"{median:{fmt}}{unit} ({low:{fmt}}-{high:{fmt}})"


def machine(device: torch.device | str | None = None) -> str:
    """The GPU's name on a CUDA device, else the CPU's (or the machine's architecture)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows of it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache
def _environment(device: str | None) -> dict[str, Any]:
    from moestack.provenance import git_state

    return {
        "machine": machine(device),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        **git_state(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
    }


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a figure was measured on: the machine (the GPU on a CUDA device), CPU count,
    torch (and CUDA) version, moestack's commit and whether the tree had changes, the UTC
    date of the process's first record and the host (worked out once per process)."""
    return dict(_environment(None if device is None else str(device)))


# --------------------------------------------------------------------------- output
def write_json(
    path: str | Path, payload: Any, indent: int | None = 2, device: torch.device | str | None = None
) -> None:
    """``payload`` as JSON at ``path``, all or nothing (a run stopped mid-write leaves the
    previous file): scripts write after every case, so a cut run keeps what it measured. A
    dict payload gets the :func:`environment` record of ``device`` as ``"environment"``."""
    if isinstance(payload, dict) and "environment" not in payload:
        payload = {**payload, "environment": environment(device)}
    _write(Path(path), payload, indent)


def _write(path: Path, payload: Any, indent: int | None = 2) -> None:
    atomic.write_text(path, json.dumps(payload, indent=indent) + "\n")


def table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], align: str, indent: str = ""
) -> str:
    """A fixed-width table: ``align`` gives each column's format spec, space-separated
    (``"<24 >8 >9"``), applied to the header and to every row's cells (the scripts format
    their figures into the cells); lines start with ``indent``."""
    specs = align.split()
    if len(specs) != len(header):
        raise ValueError(f"align {align!r} has {len(specs)} columns, the header {len(header)}")
    lines = [header, *rows]
    return "\n".join(
        indent + " ".join(f"{cell:{spec}}" for cell, spec in zip(line, specs, strict=True))
        for line in lines
    )


# --------------------------------------------------------------------------- shared cases
def drop_pages(files: Iterable[Path]) -> None:
    """Ask the kernel to drop the files' cached pages (clean pages only: fsync first), so
    that the next read comes from the disk (a cold read)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dense_matmul_tflops(
    device: torch.device, dtype: torch.dtype, warmup: int = 2, repeats: int = 5
) -> float:
    """TFLOP/s of one square matmul (8192 on a GPU, 1024 elsewhere) in ``dtype``: the rate
    a layer's useful FLOPs are compared with, measured in the same run."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / median_ms(lambda: a @ b, device, warmup, repeats) / 1e9


# The MoE layer's shapes: name, experts, top_k, d_model, d_ff, tokens.
MOE_CPU_SHAPES = [
    ("cpu-E8", 8, 2, 512, 1024, 2048),
    ("cpu-E64", 64, 8, 512, 256, 2048),
    ("cpu-E128", 128, 8, 512, 128, 2048),
]
MOE_GPU_SHAPES = [
    ("mixtral-8k", 8, 2, 4096, 14336, 8192),
    ("mixtral-16k", 8, 2, 4096, 14336, 16384),
    ("qwen3_30b-8k", 128, 8, 2048, 768, 8192),
    ("qwen3_30b-16k", 128, 8, 2048, 768, 16384),
    ("olmoe-8k", 64, 8, 2048, 1024, 8192),
    ("olmoe-16k", 64, 8, 2048, 1024, 16384),
]


def fwd_bwd(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward+backward of ``module`` on ``x`` (gradients dropped first)."""

    def run() -> None:
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).backward(grad)

    return run


def fwd_only(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One forward of ``module`` on ``x`` without grad."""

    def run() -> None:
        with torch.no_grad():
            module(x)

    return run


def sharing_weights(ours: Any, impl: str) -> Any:
    """The same MoE layer (the very same parameters and router) run through ``impl``."""
    from moestack import MoE, MoEConfig

    cfg = MoEConfig(ours.cfg.num_experts, ours.cfg.top_k, ours.cfg.d_ff, impl)
    with torch.device("meta"):  # no second copy of the weights is ever allocated
        layer = MoE(ours.d_model, cfg, ours.router_cfg)
    layer.router, layer.w1, layer.w2 = ours.router, ours.w1, ours.w2
    return layer


TUNED_NOTE = (
    "Tile configs keyed by torch.cuda.get_device_name(); each entry says where it came "
    'from: "source": "measured" by scripts/tune_kernels.py or scripts/bench_moe.py '
    '--save-tuned, with its "provenance" (GPU, date, torch, triton), or "seed" (never '
    "timed at its key); measured[gpu] is the latest run that measured any. GPUs or "
    "shapes not listed autotune on first use."
)


def save_tuned(out: Path, skip: set[str] | frozenset[str] = frozenset()) -> int:
    """Merge the configs this process measured (never those it read from a table or took as
    untimed defaults), less the keys in ``skip``, into the table at ``out`` (atomically: temp
    file, rename); return how many. Each entry written is ``"source": "measured"`` with this
    run's provenance (GPU, date, torch, triton), and ``measured[gpu]`` stamps the latest run
    that measured any; with nothing measured the file is left as it is. A table of a format
    this moestack still reads keeps its other entries with their sources (an older one's
    entries read as ``tuned_table.parse_table`` reads them: seeds, or measured where its
    ``sources`` record says so) and is rewritten in the current format; one of an older key
    format is replaced."""
    from moestack.kernels import tuned_table, tuning

    gpu = torch.cuda.get_device_name()
    found = {k: v for k, v in tuning.export_cache().get(gpu, {}).items() if k not in skip}
    if not found:
        log.info("nothing measured for %s to save: %s left as it is", gpu, out)
        return 0
    table_ = json.loads(out.read_text()) if out.is_file() else {}
    if table_.get("format", tuned_table.TABLE_FORMAT) not in tuned_table.READABLE_FORMATS:
        log.warning(
            "replacing %s: key format %s, not %s", out, table_["format"], tuned_table.TABLE_FORMAT
        )
        table_ = {}
    gpus = {
        name: {key: tuned_table.entry_json(entry) for key, entry in entries.items()}
        for name, entries in tuned_table.parse_table(table_, str(out)).items()
    }
    gpus.setdefault(gpu, {}).update(found)
    table_.pop("sources", None)  # format 3's provenance, now in each entry
    table_["format"] = tuned_table.TABLE_FORMAT
    table_["gpus"] = {name: dict(sorted(entries.items())) for name, entries in gpus.items()}
    table_.setdefault("measured", {})[gpu] = tuned_table.run_provenance(gpu)
    table_["note"] = TUNED_NOTE
    _write(out, table_)
    count = {k: sum(1 for e in found.values() if e.get(k)) for k in ("persistent", "fused")}
    torch_dw = sum(1 for entry in found.values() if entry.get("backend") == "torch")
    log.info(
        "wrote %d measured configs (%d persistent, %d fused, %d torch dW) for %s to %s",
        *(len(found), count["persistent"], count["fused"], torch_dw, gpu, out),
    )
    return len(found)
