"""Activation checkpointing, torch.compile and the memory plan, measured in one process.

1. Saved activation bytes per token (``moestack.memory_plan.measure_activations``: every
   storage a training forward leaves alive for backward) and the step time (forward,
   backward, AdamW step) of each ``model.checkpointing`` mode on the small model.
2. The default run's step (tiny model, batch 16 x 256) eager against ``compile=true``; the
   first compiled steps (the compile itself) are timed apart.
3. The plan's figures for m137 (CUDA, bf16 weights): adamw, offload_adamw, offload_adamw at 2
   and 8 data-parallel ranks.

Times are medians of ``--steps`` steps after ``--warmup``; ratios are within this process.

    python scripts/bench_memory.py [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moestack.config import CHECKPOINTING
from moestack.memory_plan import measure_activations, plan_memory
from moestack.optim import build_optimizer
from moestack.prereg.compose import compose_config


def _step_times(cfg, tokens, targets, steps: int, warmup: int, compile: bool = False):
    """(median step seconds, seconds of the warm-up steps) of forward + backward + step."""
    torch.manual_seed(0)
    model = cfg.model.build()
    if compile:
        model.compile_blocks()
    opt = build_optimizer(model, cfg.optim)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        model(tokens, targets=targets).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]), sum(times[:warmup])


def bench_checkpointing(steps: int) -> list[dict]:
    rows = []
    base = compose_config(["model=small", "model.moe.impl=torch"])
    g = torch.Generator().manual_seed(0)
    shape = (base.batch_size, base.data.seq_len)
    tokens, targets = (torch.randint(1, 256, shape, generator=g) for _ in range(2))
    for mode in CHECKPOINTING:
        cfg = compose_config(["model=small", "model.moe.impl=torch", f"model.checkpointing={mode}"])
        torch.manual_seed(0)
        saved = measure_activations(cfg.model.build(), tokens, targets)
        planned = plan_memory(cfg, device="cpu").line("activations").bytes
        step, _ = _step_times(cfg, tokens, targets, steps, warmup=1)
        rows.append({"mode": mode, "saved_bytes_per_token": saved / tokens.numel(),
                     "planned_bytes_per_token": planned / tokens.numel(), "step_s": step})  # fmt: skip
    return rows


def bench_compile(steps: int) -> dict:
    cfg = compose_config(["model.moe.impl=torch"])
    g = torch.Generator().manual_seed(0)
    shape = (cfg.batch_size, cfg.data.seq_len)
    tokens, targets = (torch.randint(1, 256, shape, generator=g) for _ in range(2))
    eager, _ = _step_times(cfg, tokens, targets, steps, warmup=1)
    compiled, compile_s = _step_times(cfg, tokens, targets, steps, warmup=2, compile=True)
    return {"eager_step_s": eager, "compiled_step_s": compiled, "compile_s": compile_s}


def plan_rows() -> list[dict]:
    rows = []
    for optim, ranks in (("adamw", 1), ("offload_adamw", 1), ("offload_adamw", 2),
                         ("offload_adamw", 8)):  # fmt: skip
        plan = plan_memory(compose_config(["model=m137", f"optim={optim}"]), ranks, "cuda")
        rows.append({"optim": optim, "ranks": ranks, "device_mib": plan.total("device") / 2**20,
                     "host_mib": plan.total("host") / 2**20,
                     "lines": {ln.what: ln.bytes / 2**20 for ln in plan.lines}})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default: 5)")
    parser.add_argument("--json", default="", help="also write the results here (default: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = bench_checkpointing(args.steps)
    print(f"{'mode':<10} {'saved B/token':>14} {'planned':>10} {'step s':>8} {'x none':>7}")
    for r in ckpt:
        print(f"{r['mode']:<10} {r['saved_bytes_per_token']:>14.0f} "
              f"{r['planned_bytes_per_token']:>10.0f} {r['step_s']:>8.3f} "
              f"{r['step_s'] / ckpt[0]['step_s']:>7.2f}")  # fmt: skip
    comp = bench_compile(args.steps)
    print(f"default run step: eager {comp['eager_step_s']:.3f} s, compiled "
          f"{comp['compiled_step_s']:.3f} s ({comp['compiled_step_s'] / comp['eager_step_s']:.2f}x),"
          f" compile (first 2 steps) {comp['compile_s']:.1f} s")  # fmt: skip
    plans = plan_rows()
    for r in plans:
        print(f"m137 {r['optim']:<14} ranks={r['ranks']}: device {r['device_mib']:.0f} MiB, "
              f"host {r['host_mib']:.0f} MiB")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpointing": ckpt, "compile": comp, "plans": plans}, f, indent=2)


if __name__ == "__main__":
    main()
