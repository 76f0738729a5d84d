"""Training with streamed experts (``offload_experts``): peak memory and speed against the
resident run.

moestack's model, sized so that its experts take about ``--experts-mb`` (float32), is
fine-tuned (``--trainable``, default lora) for ``--steps`` steps on fixed random tokens, each
mode in a fresh process (spawned, ``--threads`` torch threads):

- ``resident``: every expert in memory (``offload_experts=off``);
- ``host``: the whole model built, its experts written to a store and read into a host tier
  (``offload_experts=host``: on a CUDA machine the experts stay in host memory and only the
  cache's slots are on the GPU; on the CPU this holds them twice while the tier is read);
- ``disk``: the model built with its experts (and their adapters) on meta, the adapters
  materialised, the store written from the experts drawn one layer at a time, and the
  experts streamed from disk through the cache (``offload_experts=disk``): no more than one
  layer's experts is ever in memory besides the cache.

For each mode it records: the peak anonymous resident memory (``RssAnon`` of
/proc/self/status, sampled every 10 ms by a thread) above the process's before the model was
built, so that the page cache of the store's files (the kernel's, reclaimable) is not
counted; ``VmHWM`` (which counts file pages a process maps, here none of the store's: it is
read with pread); the seconds to build and attach (the store's write included); seconds per
step (the median of the steps after the first) and tokens/s; the losses; the cache's
``cache/*`` per step, and beside it ``predicted``: the loads, requests and hit rate that the
run's own routing (every MoE layer's, recorded in each training forward) gives when replayed
through an LRU of the same capacity (``predicted_traffic``; without ``--prefetch`` the two
should be equal). The losses of every mode should be the resident run's, bit for bit on
the CPU (tests/cache/test_streaming.py); the JSON says whether they are.

    python scripts/bench_stream.py [--experts-mb 256] [--steps 5] [--capacity 8] [--prefetch] [--device cuda]
        [--modes resident,disk] [--mmap-threshold-kb 128] [--store-dir DIR] [--json out.json]

``--mmap-threshold-kb 128`` gives every allocation of 128 KiB and more a mapping of its own,
returned to the system when freed (``moestack.host_allocator``, as expert-parallel runs do):
glibc's adaptive default keeps the freed expert buffers of a streamed step in its heap
(a smoke run, 4 layers of 48 MiB of experts each, capacity 4 of 32: 239 MiB peak above the
start without, 187 MiB with; the resident run 307 MiB).

``--device cuda``: the model and the cache's slots on the GPU, the experts in pinned host
memory (``host``) or on disk (``disk``), the resident run's on the GPU; each row then adds
``device_peak_bytes`` (``torch.cuda.max_memory_allocated`` over the timed steps).

Keep runs short on a shared machine: the default sizes take about a minute per mode on two
cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MODES = ("resident", "host", "disk")


def status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB (0 where the kernel does not give it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakSampler:
    """The peak of ``RssAnon`` (KiB), sampled every 10 ms by a daemon thread."""

    def __init__(self) -> None:
        self.peak = status_kb("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, status_kb("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, status_kb("RssAnon"))


def model_config(args: argparse.Namespace) -> Any:
    """moestack's model with ``args.layers`` MoE layers sized so the experts take about
    ``args.experts_mb`` MB in float32."""
    from moestack import ModelConfig, MoEConfig

    per_layer = args.experts * 3 * args.d_model * args.d_ff * 4
    layers = max(1, round(args.experts_mb * 2**20 / per_layer))
    return ModelConfig(
        vocab_size=256, d_model=args.d_model, n_layers=layers, n_heads=4,
        max_seq_len=args.seq,
        moe=MoEConfig(num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff, impl="torch"),
    )  # fmt: skip


def build(mode: str, args: argparse.Namespace, store_root: Path) -> tuple[Any, Any, Any]:
    """The model, its run config and its streaming state (None resident), as the trainer
    would build them for ``mode``."""
    from moestack import MoETransformer
    from moestack.cache.streaming import (
        attach_streaming,
        drawn_expert_layers,
        materialize_expert_adapters,
    )
    from moestack.config import CacheConfig, DataConfig, OptimConfig, TrainConfig
    from moestack.device import move_resident
    from moestack.lora import LoRAConfig, add_adapters_for

    cfg = TrainConfig(
        model=model_config(args), trainable=args.trainable,
        offload_experts="off" if mode == "resident" else mode,
        cache=CacheConfig(capacity=args.capacity, prefetch=args.prefetch),
        data=DataConfig(seq_len=args.seq), lora=LoRAConfig(rank=8),
        optim=OptimConfig(lr=1e-3, warmup_steps=0), seed=0,
    )  # fmt: skip
    model = MoETransformer(cfg.model, seed=0, experts_on_meta=mode == "disk").train()
    add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)
    model.set_trainable(cfg.trainable)
    layers = None
    if mode == "disk":
        materialize_expert_adapters(model, cfg.seed)
        layers = drawn_expert_layers(model, cfg.seed)
    move_resident(model, args.device)  # on a GPU: the cache's slots there, the experts not
    state = attach_streaming(model, cfg, store_root / mode, layers=layers)
    return model, cfg, state


def record_routing(model: Any) -> list[Any]:
    """Forward hooks on every MoE layer's router: for each forward with gradients (a training
    step's; the backward's recomputation does not route again), the experts its tokens chose,
    flat in token order (the order the layer requests them), kept where they are (read after
    the timed steps: no host sync added to them). One tensor per call, in order."""
    import torch

    from moestack.moe import MoE

    calls: list[Any] = []

    def hook(module: Any, inputs: Any, routing: Any) -> None:
        if torch.is_grad_enabled():
            calls.append(routing.experts.detach().reshape(-1))

    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.router.register_forward_hook(hook)
    return calls


def predicted_traffic(calls: list[list[int]], layers: int, capacity: int) -> dict[str, float]:
    """The loads and hit rate a step's routing predicts, per step, for an LRU cache of
    ``capacity`` experts a layer (written out here, not the library's policy): each step's
    forward requests its layers' experts in layer order, its backward the same in reverse
    order; a request hits when the layer's LRU holds its expert; a call loads every expert it
    uses that the LRU did not hold before the call."""
    from collections import OrderedDict

    held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(layers)]
    loads = hits = requests = 0
    steps = len(calls) // layers
    for step in range(steps):
        forward = list(enumerate(calls[step * layers : (step + 1) * layers]))
        for layer, experts in forward + forward[::-1]:
            lru = held[layer]
            loads += len(set(experts) - lru.keys())
            for e in experts:
                hits += e in lru
                lru[e] = None
                lru.move_to_end(e)
                if len(lru) > capacity:
                    lru.popitem(last=False)
            requests += len(experts)
    return {
        "loads": loads / max(steps, 1),
        "requests": requests / max(steps, 1),
        "hit_rate": hits / max(requests, 1),
    }


def run_mode(mode: str, args: argparse.Namespace, store_root: str) -> dict[str, Any]:
    """One mode in this (fresh) process: build, step, measure."""
    import torch

    from moestack import bench
    from moestack.optim.factory import build_training_optimizer

    torch.set_num_threads(args.threads)
    if args.mmap_threshold_kb:  # freed expert buffers back to the system (glibc keeps them)
        from moestack.host_allocator import set_mmap_threshold

        set_mmap_threshold(args.mmap_threshold_kb << 10)
    base_anon = status_kb("RssAnon")
    sampler = PeakSampler()
    start = time.perf_counter()
    model, cfg, state = build(mode, args, Path(store_root))
    build_s = time.perf_counter() - start
    optimizer = build_training_optimizer(model, cfg.optim)
    routing = record_routing(model)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(args.device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    held: list[Any] = []

    def step() -> None:
        loss = model(inputs, targets).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        held.append(loss.detach())

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = bench.times(step, repeats=args.steps, device=args.device)
    losses = [loss.item() for loss in held]
    peak_anon = sampler.stop()
    step_s = statistics.median(times[1:] or times)
    experts_bytes = 3 * cfg.model.d_model * cfg.model.moe.d_ff * 4 * cfg.model.moe.num_experts
    return {
        "mode": mode,
        "n_layers": cfg.model.n_layers,
        "experts_bytes": experts_bytes * cfg.model.n_layers,
        "peak_anon_bytes": (peak_anon - base_anon) * 1024,
        "vm_hwm_bytes": status_kb("VmHWM") * 1024,
        "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "build_s": build_s,
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
        "losses": losses,
        "cache": state.metrics(args.steps) if state is not None else {},
        # LRU without prefetch: what this run's routing predicts (compare with "cache")
        "predicted": predicted_traffic(
            [c.tolist() for c in routing], cfg.model.n_layers, args.capacity
        ),
        "expert_bytes": experts_bytes // cfg.model.moe.num_experts,
    }


def _child(mode: str, args: argparse.Namespace, store_root: str, queue: Any) -> None:
    try:
        queue.put(run_mode(mode, args, store_root))
    except Exception as err:  # reported by the parent, which goes on with the other modes
        queue.put({"mode": mode, "error": f"{type(err).__name__}: {err}"})


def build_parser() -> argparse.ArgumentParser:
    """The command line (its flags checked by gpu_check.sh's test, which passes them)."""
    from moestack import bench  # lazily, as torch: the children import this file

    p = bench.parser(__doc__, steps=5, threads=2, json=None, device="cpu")
    p.add_argument("--experts-mb", type=float, default=256.0)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--capacity", type=int, default=8, help="cache slots per layer")
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--trainable", default="lora", choices=("routers", "lora", "routers+lora"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--mmap-threshold-kb", type=int, default=0,
        help="glibc's mmap threshold in every mode (moestack.host_allocator; 0: glibc's default)",
    )  # fmt: skip
    p.add_argument("--store-dir", default=None, help="where the stores go (default: a temp dir)")
    return p


def main() -> None:
    from moestack import bench

    p = build_parser()
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes {','.join(unknown)}: use {','.join(MODES)}")
    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.store_dir) as store_root:
        for mode in modes:
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(mode, args, store_root, queue))
            proc.start()
            row = result_of(proc, queue, mode)
            proc.join()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}))
            if args.json:  # after every mode: a run cut short keeps what it measured
                bench.write_json(args.json, report_of(args, rows), indent=1)


def result_of(proc: Any, queue: Any, mode: str) -> dict[str, Any]:
    """The row ``proc`` puts on ``queue``, or an error row where it dies without one (killed
    for memory, a crash in native code)."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            if proc.is_alive():
                continue
        try:  # it may have put its row just before exiting
            return queue.get(timeout=1.0)
        except queues.Empty:
            return {"mode": mode, "error": f"its process ended (exit code {proc.exitcode}) "
                    "without a result"}  # fmt: skip


def report_of(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report of the modes run so far; each row beside the resident run's losses:
    equal bit for bit (the CPU), and the largest relative difference (a GPU's kernels may
    sum in another order over the cache's slots than over every expert)."""
    done = [r for r in rows if "losses" in r]
    reference = next((r["losses"] for r in done if r["mode"] == "resident"), None)
    for row in done:
        if reference is None:
            continue
        row["losses_equal_resident"] = row["losses"] == reference
        row["losses_max_rel_diff"] = max(
            (
                abs(a - b) / max(abs(b), 1e-30)
                for a, b in zip(row["losses"], reference, strict=True)
            ),
            default=0.0,
        )
    return {
        "bench": "stream",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "args": vars(args),
        "rows": rows,
    }


if __name__ == "__main__":
    main()
