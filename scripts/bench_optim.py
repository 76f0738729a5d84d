"""Benchmark OffloadAdamW: memory per parameter, host step throughput, bf16 moments, skipping.

Measures, in one process:
  1. device and host bytes per parameter, counted from tensor sizes and devices, for
     OffloadAdamW against mixed-precision torch AdamW (bf16 weights/grads, fp32 master+state);
  2. host step throughput (params/s) of OffloadAdamW's variants (in place; master copy with
     the reference path or the fused step, native or compiled; bf16 weights; bf16 moments)
     against torch.optim.AdamW(fused=True) updating fp32 parameters in place, and as a
     fraction of each variant's bandwidth bound: the bytes it must move per parameter over
     the copy bandwidth measured in the same run (STREAM-style copy). For 1, 2 and all
     threads; a table per thread count, and the reference step's time by part;
  2b. the step kernels alone (torch's ``_fused_adamw_`` and the native kernel, same
     streams and the whole step's), to show what reads and writes cost;
  3. bf16 host moments: moment bytes and parameter drift against fp32 torch AdamW after N steps;
  4. skip_idle_experts: drift of an expert idle half of the steps against dense AdamW;
  5. on a GPU (when present): optimizer step time with offload against torch AdamW on the
     device;
  6. a whole training step (forward, backward, clip, optimizer) of an MoE transformer with
     OffloadAdamW (bf16 device weights, fp32 state on the host; pipelined, serial, updated in
     backward, delayed) against fused torch AdamW on the device (fp32 weights under bf16
     autocast), and torchao's CPUOffloadOptimizer when it is installed (CUDA only), each
     clipped and unclipped: time, peak device memory, OffloadAdamW's step in parts, and on
     CUDA the time the compute stream sits idle per step (CUDA events) and the pinned copy
     bandwidth each way and both at once. On a GPU the model is the 137M-parameter m137
     config; on the CPU a tiny one (a dry run of the code). Each contender records whether
     its step ran pipelined and which host kernel ran it (the table shows them); one that
     fails is recorded with its error and the others still run;
  7. the loss of the delayed update over N steps against the exact one (its own
     ``--only delay_loss`` run; ``--delay-loss-budget-s`` fits it into a time cap).

    python scripts/bench_optim.py [--params 8e6] [--experts 8] [--reps 10] [--json out.json]
        [--only throughput] [--thread-counts 1,2,all] [--rounds 3]
        [--skip-variants master_bf16_compile] [--delay-loss-steps 200]
        [--delay-loss-budget-s 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any
from unittest import mock

import torch

from moestack import bench
from moestack.optim import OffloadAdamW, fused
from moestack.optim.train_bench import (
    delayed_loss,
    gpu_step_time,
    make_params,
    release,
    set_grads,
    train_step_time,
    train_table,
)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory(n: float, experts: int) -> dict[str, Any]:
    """Bytes per parameter on the device and on the host, by counting tensors."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = make_params(n, experts, torch.bfloat16, device)
    numel = sum(p.numel() for _, p in params)
    set_grads(params, 1)
    opt = OffloadAdamW(params, lr=1e-3)
    opt.step()
    model_bytes = sum(nbytes(p) + nbytes(p.grad) for _, p in params)
    host = opt.host_buffers()
    own_device = sum(nbytes(t) for t in opt.device_buffers().values())  # transfer scratch
    host_on_device = sum(nbytes(t) for t in host.values() if t.device.type != "cpu")
    host_bytes = sum(nbytes(t) for t in host.values() if t.device.type == "cpu")
    state = sum(nbytes(host[k]) for k in ("master", "exp_avg", "exp_avg_sq") if k in host)
    # Mixed-precision baseline: bf16 weights + grads, fp32 master and torch AdamW state.
    master = [torch.nn.Parameter(p.detach().float()) for _, p in params]
    for m, (_, p) in zip(master, params, strict=True):
        m.grad = p.grad.float()
    base = torch.optim.AdamW(master, lr=1e-3)
    base.step()
    for m in master:  # the fp32 grads are a transient of the baseline; count them as freed
        m.grad = None
    base_state = sum(nbytes(t) for s in base.state.values() for t in s.values())
    base_bytes = model_bytes + sum(nbytes(m) for m in master) + base_state
    out = {
        "params": numel,
        "where": device,
        "offload_device_B_per_param": (model_bytes + host_on_device + own_device) / numel,
        "offload_device_scratch_MiB": own_device / 2**20,
        "offload_host_B_per_param": host_bytes / numel,
        "offload_host_state_B_per_param": state / numel,
        "mixed_adamw_device_B_per_param": base_bytes / numel,
        "host_buffers": {k: nbytes(t) / numel for k, t in host.items()},
    }
    if device == "cpu":
        out["note"] = "no GPU: 'device' counts the model's weights and grads by role"
    release(opt)
    return out


def _time_steps(opt: torch.optim.Optimizer, reps: int) -> float:
    """Median seconds of ``reps`` steps after one warm-up step (lazy state, kernel build)."""
    return statistics.median(bench.times(opt.step, warmup=1, repeats=reps))


# name: (parameter dtype, bytes per parameter the step must move, optimizer for the params).
# The bytes are what the job needs, read and written once: an fp32 in-place step reads the
# gradient, weight and both moments and writes the last three (7 x 4); a master-copy step
# reads the gradient (2 or 4 bytes) and master + moments (12), writes them back (12) and
# writes the parameter (2 or 4); bf16 moments halve the 16 moment bytes. The native fused
# step with bf16 weights keeps a split master (moestack.optim.split_master): it reads and
# writes the bf16 weight and a 2-byte remainder instead of the fp32 master and the separate
# bf16 write: 2 + 4 + 4 + 16 = 26 bytes, 18 with bf16 moments.
def _offload(**kw: Any) -> Any:
    return lambda ps: OffloadAdamW(ps, **kw)


F32, BF16 = torch.float32, torch.bfloat16
VARIANTS: dict[str, tuple[torch.dtype, int, Any]] = {
    "torch_adamw_fused": (F32, 28, lambda ps: torch.optim.AdamW([p for _, p in ps], fused=True)),
    "offload_in_place": (F32, 28, _offload()),
    "master_fp32_reference": (F32, 32, _offload(in_place=False, fused_step="off")),
    "master_fp32_native": (F32, 32, _offload(in_place=False, fused_step="native")),
    "master_bf16_reference": (BF16, 28, _offload(fused_step="off")),
    "master_bf16_native": (BF16, 26, _offload(fused_step="native")),
    "master_bf16_compile": (BF16, 28, _offload(fused_step="compile")),
    "bf16_moments_reference": (BF16, 20, _offload(moment_dtype=BF16, fused_step="off")),
    "bf16_moments_native": (BF16, 18, _offload(moment_dtype=BF16, fused_step="native")),
    "in_place_bf16_moments": (F32, 20, _offload(moment_dtype=BF16)),
    "skip_idle_dense": (F32, 28, _offload(skip_idle_experts=True)),
}
COPY_ELEMENTS = 1 << 25  # fp32 elements per copy buffer: 128 MiB, well beyond a CPU cache


def copy_bandwidth(reps: int) -> dict[str, float]:
    """Bytes/s of a large fp32 tensor copy (STREAM's copy kernel), and of an in-place scale.

    ``stream``: counted as STREAM counts its copy, 8 bytes per element (read + write).
    ``moved``: 12 bytes per element, what the memory system moves: a store to a line not yet
    in cache first reads it (write-allocate). The bound uses ``moved``; ``scale`` (an
    in-place ``mul_``, 8 bytes per element, nothing to allocate) shows the two agree where
    the copy is 1.5x slower than the scale of the same length.
    """
    src = torch.ones(COPY_ELEMENTS)
    dst = torch.ones_like(src)
    times: dict[str, list[float]] = {"copy": [], "scale": []}
    for _ in range(max(reps, 3)):
        dst.copy_(src)  # also the warm-up of the first repeat
        times["copy"].append(bench.seconds(lambda: dst.copy_(src)))
        times["scale"].append(bench.seconds(lambda: src.mul_(1.0)))
    copy, scale = (statistics.median(times[k]) for k in ("copy", "scale"))
    return {
        "stream": 8 * COPY_ELEMENTS / copy,
        "moved": 12 * COPY_ELEMENTS / copy,
        "scale": 8 * COPY_ELEMENTS / scale,
    }


def thread_counts(arg: str) -> list[int]:
    """The thread counts of ``--thread-counts`` ("1,2,all"; "all" = every core), deduplicated."""
    every = os.cpu_count() or torch.get_num_threads()
    counts = [every if t.strip() == "all" else int(t) for t in arg.split(",") if t.strip()]
    return sorted(set(counts))


def throughput(
    n: float, experts: int, reps: int, threads: list[int], rounds: int, skip: Sequence[str] = ()
) -> dict:
    """Host step params/s of every variant (but those in ``skip``) against
    torch.optim.AdamW(fused=True), and as a fraction of its bandwidth bound (its bytes at the
    copy bandwidth measured in the same process, :func:`copy_bandwidth`), for each thread
    count.

    Other jobs may share the cores, so each round measures every thread count and variant
    once (the median of ``reps`` steps), and each (thread count, variant) keeps its best
    round; the ratios are of those best rounds.
    """
    variants = {name: v for name, v in VARIANTS.items() if name not in skip}
    built: dict[str, tuple[Any, int]] = {}
    for name, (dtype, _, build) in variants.items():
        params = make_params(n, experts, dtype, "cpu")
        set_grads(params, 2)
        built[name] = (build(params), sum(p.numel() for _, p in params))
    best: dict[tuple[int, str], float] = {}
    for _ in range(rounds):
        for nt in threads:
            torch.set_num_threads(nt)
            for key, bps in copy_bandwidth(reps).items():
                best[nt, key] = max(best.get((nt, key), 0.0), bps)
            for name, (opt, numel) in built.items():
                best[nt, name] = max(best.get((nt, name), 0.0), numel / _time_steps(opt, reps))
    out: dict[str, Any] = {"params": built["torch_adamw_fused"][1], "rounds": rounds}
    for nt in threads:
        rows = {}
        for name, (_, nbytes, _) in variants.items():
            rows[name] = {
                "backend": getattr(built[name][0], "host_step", "torch"),
                "bytes_per_param": nbytes,
                "params_per_s": best[nt, name],
                "vs_torch_fused": best[nt, name] / best[nt, "torch_adamw_fused"],
                "of_bandwidth_bound": best[nt, name] * nbytes / best[nt, "moved"],
            }
        out[f"threads_{nt}"] = {
            "copy_moved_GBps": best[nt, "moved"] / 1e9,
            "copy_stream_GBps": best[nt, "stream"] / 1e9,
            "scale_in_place_GBps": best[nt, "scale"] / 1e9,
            "variants": rows,
        }
    for opt, _ in built.values():
        release(opt)
    del built
    out.update(step_parts(n, experts, reps))  # at the last (largest) thread count
    return out


def print_table(rows: dict[str, Any]) -> None:
    """The throughput section as one table per thread count."""
    print(f"  {rows['params']:,} parameters, best of {rows['rounds']} interleaved rounds")
    for key, table in rows.items():
        if not key.startswith("threads_"):
            continue
        nt = key.removeprefix("threads_")
        print(
            f"\n  {nt} thread(s): copy moves {table['copy_moved_GBps']:.1f} GB/s (the bound; "
            f"STREAM count {table['copy_stream_GBps']:.1f}), in-place scale "
            f"{table['scale_in_place_GBps']:.1f} GB/s"
        )
        head = ("variant", "backend", "B/param", "Mparam/s", "vs torch", "of bound")
        print("  {:<24} {:<9} {:>7} {:>9} {:>8} {:>8}".format(*head))
        for name, r in table["variants"].items():
            print(
                f"  {name:<24} {r['backend']:<9} {r['bytes_per_param']:>7} "
                f"{r['params_per_s'] / 1e6:>9.0f} {r['vs_torch_fused']:>7.2f}x "
                f"{r['of_bandwidth_bound']:>8.2f}"
            )
    print()


def step_parts(n: float, experts: int, reps: int) -> dict[str, Any]:
    """Where the reference master-copy step's time goes (pack, update, copy back), and the
    update alone of the fused step as a GPU machine's host runs it (packed fp32 gradients
    in, bf16 weights out to the staging buffer): on a GPU machine the pack and the copy back
    are DMA transfers, the host runs only the update. Each repeat times torch's fused AdamW,
    the reference parts and the staged update back to back; medians over the repeats."""
    params = make_params(n, experts, torch.float32, "cpu")
    set_grads(params, 2)
    torch_opt = torch.optim.AdamW([p for _, p in params], fused=True)
    ref = OffloadAdamW(params, in_place=False, fused_step="off")
    bf16 = make_params(n, experts, torch.bfloat16, "cpu")
    set_grads(bf16, 2)
    with mock.patch.object(fused, "choose_mode", return_value=fused.STAGED):
        staged = OffloadAdamW(bf16, fused_step="native")
    for opt in (torch_opt, ref, staged):
        opt.step()  # lazy state, kernel build

    def pack() -> None:
        ref._grads_ready = False
        ref._sync_grads()

    calls = {  # run back to back in this order each repeat
        "torch": torch_opt.step,
        "pack": pack,
        "update": lambda: ref._step_spans(ref._jobs(), ref._host, ref._steps, ref._grad_scale),
        "copy_back": lambda: ref._return_weights(ref._active, ref._idle),
        "staged": lambda: staged._step_spans(
            staged._jobs(), staged._host, staged._steps, staged._grad_scale
        ),
    }
    secs = bench.interleave(calls, reps, rotate=False)
    ms = {k: 1e3 * statistics.median(v) for k, v in secs.items()}
    parts = ("pack", "update", "copy_back")
    rows: dict[str, Any] = {f"offload_master_copy_{k}_ms": ms[k] for k in parts}
    rows["offload_master_copy_update_only_vs_fused"] = ms["torch"] / ms["update"]
    rows["staged_update_ms"] = ms["staged"]
    rows["staged_update_only_vs_fused"] = ms["torch"] / ms["staged"]
    rows["staged_update_backend"] = staged.host_step
    rows["torch_adamw_fused_ms"] = ms["torch"]
    for opt in (ref, staged):
        release(opt)
    return rows


def drift(steps: int, experts: int) -> dict[str, Any]:
    """bf16 moments and skip_idle_experts against dense fp32 torch AdamW after `steps` steps."""
    n = 2e5
    ref_p = make_params(n, experts, torch.float32, "cpu")
    bf_p = make_params(n, experts, torch.float32, "cpu")
    skip_p = make_params(n, experts, torch.float32, "cpu")
    ref = torch.optim.AdamW([p for _, p in ref_p], lr=1e-3, weight_decay=0.1)
    bf = OffloadAdamW(bf_p, lr=1e-3, weight_decay=0.1, moment_dtype=torch.bfloat16)
    skip = OffloadAdamW(skip_p, lr=1e-3, weight_decay=0.1, skip_idle_experts=True)
    idle = experts - 1
    for step in range(steps):
        set_grads(ref_p, 100 + step)
        for _, r in ref_p:
            r.grad.add_(0.05)  # a consistent direction, as real gradients have
            if step % 2 and r.ndim == 3:
                r.grad[idle] = 0  # the last expert gets no tokens every other step
        for other in (bf_p, skip_p):
            for (_, o), (_, r) in zip(other, ref_p, strict=True):
                o.grad = r.grad.clone()
        ref.step()
        bf.step()
        skip.step()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    ref_w = {k: p.detach() for k, p in ref_p}
    start = {k: p.detach() for k, p in make_params(n, experts, torch.float32, "cpu")}
    bf_err = max(rel(p.detach(), ref_w[k]) for k, p in bf_p)
    upd = max(rel(ref_w[k], start[k]) for k in ref_w)  # size of the total update, for scale
    w1 = dict(skip_p)["layer.moe.w1"].detach()
    ref_w1 = ref_w["layer.moe.w1"]
    idle_err = rel(
        w1[idle] - start["layer.moe.w1"][idle], ref_w1[idle] - start["layer.moe.w1"][idle]
    )
    busy_err = rel(w1[:idle], ref_w1[:idle])
    moments_fp32 = 8
    bufs = bf.host_buffers()
    return {
        "steps": steps,
        "bf16_moment_B_per_param": (nbytes(bufs["exp_avg"]) + nbytes(bufs["exp_avg_sq"]))
        / bufs["exp_avg"].numel(),
        "fp32_moment_B_per_param": moments_fp32,
        "bf16_param_rel_err_vs_fp32_adamw": bf_err,
        "update_norm_rel_to_weights": upd,
        "skip_idle_expert_update_rel_err_vs_dense": idle_err,
        "skip_busy_experts_rel_err_vs_dense": busy_err,
    }


def machine() -> str:
    """The CPU model and core count, and the date (for the record in BENCHMARKS.md)."""
    return f"{bench.cpu_model()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line, checked; the parser too, for the --only check, which needs the sections."""
    ap = bench.parser(__doc__, reps=10, threads=0, rounds=5, json="")
    ap.add_argument("--params", type=float, default=8e6, help="parameters per measurement")
    ap.add_argument("--experts", type=int, default=8, help="experts in the stacked tensors")
    ap.add_argument("--drift-steps", type=int, default=200, help="steps for drift figures")
    ap.add_argument(
        "--thread-counts",
        default="1,2,all",
        help="throughput: thread counts to measure ('all' = every core; --threads overrides)",
    )
    ap.add_argument(
        "--skip-variants",
        default="",
        help="throughput: comma-separated variants to leave out (default: none; e.g. "
        "master_bf16_compile, whose torch.compile takes most of a toy run); "
        "torch_adamw_fused, the baseline of the ratios, always runs",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated sections to run "
        "(memory,throughput,kernels,drift,gpu,train_step,delay_loss)",
    )
    ap.add_argument("--train-impl", default="torch", help="MoE impl of the train-step model")
    ap.add_argument(
        "--delay-loss-steps", type=int, default=200, help="delay_loss: training steps per mode"
    )
    ap.add_argument(
        "--delay-loss-budget-s",
        type=float,
        default=0.0,
        help="delay_loss: seconds for both modes (0: no limit); the exact mode stops once "
        "half is spent (10 steps at least) and the delayed one runs as many steps",
    )
    args = ap.parse_args()
    skip = [v for v in args.skip_variants.split(",") if v]
    unknown = sorted(set(skip) - set(VARIANTS))
    if unknown:
        ap.error(f"--skip-variants: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if "torch_adamw_fused" in skip:
        ap.error("--skip-variants: torch_adamw_fused is the baseline of the ratios; it always runs")
    return ap, args


def print_section(name: str, rows: dict[str, Any]) -> None:
    """One section's figures: its table where it has one, then every scalar."""
    print(f"\n[{name}]")
    if name == "throughput":
        print_table(rows)
    if name == "kernels":
        print_kernel_table(rows)
    if name == "train_step":
        print(train_table(rows))
    items = [(k, v) for k, v in rows.items() if k != "contenders"]
    if name == "train_step":  # the ratios first, then the step times (a summary's head)
        items.sort(key=lambda kv: 0 if "_vs_" in kv[0] else 1 if "_step_ms" in kv[0] else 2)
    for k, v in items:
        if k.startswith("threads_"):
            continue
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
        print(f"  {k:<45} {v}", flush=True)


def main() -> None:
    ap, args = parse_args()
    skip = [v for v in args.skip_variants.split(",") if v]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sections = {
        "memory": lambda: memory(args.params, args.experts),
        "throughput": lambda: throughput(
            args.params,
            args.experts,
            args.reps,
            [args.threads] if args.threads else thread_counts(args.thread_counts),
            args.rounds,
            skip,
        ),
        "kernels": lambda: kernel_streams(
            args.params,
            args.reps,
            [args.threads] if args.threads else thread_counts(args.thread_counts),
            args.rounds,
        ),
        "drift": lambda: drift(args.drift_steps, args.experts),
        "gpu": lambda: gpu_step_time(args.params, args.experts, args.reps),
        "train_step": lambda: train_step_time(device, args.reps, args.train_impl),
        "delay_loss": lambda: delayed_loss(
            device, args.delay_loss_steps, args.train_impl, args.delay_loss_budget_s
        ),
    }
    wanted = [w for w in args.only.split(",") if w] or list(sections)
    unknown = sorted(set(wanted) - set(sections))
    if unknown:
        ap.error(f"--only: unknown section(s) {unknown}; choose from {list(sections)}")
    results: dict[str, Any] = {"torch": torch.__version__, "machine": machine()}
    print(f"torch: {torch.__version__}; {results['machine']}")
    for name in wanted:  # printed and saved section by section: a stopped run keeps them
        results[name] = sections[name]()
        print_section(name, results[name])
        if args.json:
            bench.write_json(args.json, results)


# name: (gradient dtype, moment dtype, output dtype or None (int16: a split master), bytes
# read, bytes written) per parameter. torch's in-place step reads gradient, weight and both moments (16) and writes the
# last three back (12); the native kernel reads the gradient as it arrives and writes the
# narrowed weight as a separate (streamed) store.
KERNEL_VARIANTS: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype | None, int, int]] = {
    "torch_fused_adamw_kernel": (torch.float32, torch.float32, None, 16, 12),
    "native_fp32_grad_no_out": (torch.float32, torch.float32, None, 16, 12),
    "native_bf16_grad_bf16_out": (torch.bfloat16, torch.float32, torch.bfloat16, 14, 14),
    "native_fp32_grad_bf16_out": (torch.float32, torch.float32, torch.bfloat16, 16, 14),
    "native_bf16_moments": (torch.bfloat16, torch.bfloat16, torch.bfloat16, 10, 10),
    # the whole step with a split master: bf16 weight and int16 remainder read and written
    "native_split_master": (torch.bfloat16, torch.float32, torch.int16, 14, 12),
}


def kernel_streams(n: float, reps: int, threads: list[int], rounds: int) -> dict[str, Any]:
    """The step kernels alone, no optimizer around them: torch's ``_fused_adamw_`` on one flat
    fp32 tensor against the native kernel with the same streams (fp32 gradient, no output)
    and with the whole step's (bf16 gradient in, bf16 weight out). Shows what the reads and
    writes cost: equal bytes need not take equal time when one variant writes more.
    Each round runs every thread count and variant once (median of ``reps`` calls); each
    keeps its best round."""
    numel = int(n)
    calls, alive = _kernel_calls(numel)  # alive: the tensors behind the calls' raw pointers
    best: dict[tuple[int, str], float] = {}
    for _ in range(rounds):
        for nt in threads:
            torch.set_num_threads(nt)
            for name, call in calls.items():
                times = bench.times(call, warmup=1, repeats=reps)
                best[nt, name] = max(best.get((nt, name), 0.0), numel / statistics.median(times))
    del alive
    rows: dict[str, Any] = {"params": numel, "rounds": rounds}
    for nt in threads:
        base = best[nt, "torch_fused_adamw_kernel"]
        rows[f"threads_{nt}"] = {
            name: {
                "bytes_read": read,
                "bytes_written": written,
                "params_per_s": best[nt, name],
                "vs_torch_kernel": best[nt, name] / base,
            }
            for name, (*_, read, written) in KERNEL_VARIANTS.items()
        }
    return rows


def _kernel_calls(numel: int) -> tuple[dict[str, Any], list[Any]]:
    """One call per kernel variant on ``numel`` random parameters, and the tensors they
    point at (kept alive while the calls run)."""
    from moestack.kernels import host_adamw

    kernel = host_adamw.load()
    gen = torch.Generator().manual_seed(0)
    calls = {}
    alive = []
    for name, (g_dt, s_dt, o_dt, _, _) in KERNEL_VARIANTS.items():
        x = torch.randn(numel, generator=gen)
        g = torch.randn(numel, generator=gen).to(g_dt)
        m = (torch.randn(numel, generator=gen) * 0.1).to(s_dt)
        v = (torch.rand(numel, generator=gen) * 0.01).to(s_dt)
        if name.startswith("torch"):
            step = torch.zeros(())
            args = ([x], [g], [m], [v], [], [step])
            hp = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8}
            calls[name] = lambda a=args, h=hp: torch._fused_adamw_(
                *a, amsgrad=False, maximize=False, **h
            )
            continue
        out = None if o_dt is None else torch.empty(numel, dtype=o_dt)
        if o_dt == torch.int16:  # a split master: out holds the weights, x the remainders
            out = torch.empty(numel, dtype=torch.bfloat16)
            x = host_adamw.split_master(x, out)
        coef = host_adamw.coefficients({"lr": 1e-3, "beta1": 0.9, "beta2": 0.999,
                                   "weight_decay": 0.01, "eps": 1e-8}, 10)  # fmt: skip
        alive.append((x, g, m, v, out))
        prepared = kernel.prepare([host_adamw.Seg(x, g, m, v, out, coef)])
        calls[name] = lambda p=prepared, c=coef: kernel.run(p, [c])
    return calls, alive


def print_kernel_table(rows: dict[str, Any]) -> None:
    """The kernels section as one table per thread count."""
    print(f"  {rows['params']:,} parameters, best of {rows['rounds']} interleaved rounds")
    for key, table in rows.items():
        if key.startswith("threads_"):
            print(f"\n  {key.removeprefix('threads_')} thread(s):")
            print("  {:<28} {:>6} {:>9} {:>9} {:>9}".format(
                "kernel", "read", "written", "Mparam/s", "vs torch"))  # fmt: skip
            for name, r in table.items():
                print(
                    f"  {name:<28} {r['bytes_read']:>6} {r['bytes_written']:>9} "
                    f"{r['params_per_s'] / 1e6:>9.0f} {r['vs_torch_kernel']:>8.2f}x"
                )
    print()


if __name__ == "__main__":
    main()
