"""Activation checkpointing, torch.compile and the memory plan, measured in one process.

1. Saved activation bytes per token (``moestack.memory_plan.measure_activations``: every
   storage a training forward leaves alive for backward) and the step time (forward,
   backward, AdamW step) of each ``model.checkpointing`` mode on the small model.
2. The default run's step (tiny model, batch 16 x 256) eager against ``compile=true``; the
   first compiled steps (the compile itself) are timed apart.
3. The plan's figures for m137 (CUDA, bf16 weights): adamw, offload_adamw, offload_adamw at 2
   and 8 data-parallel ranks.

With ``--device cuda``, instead, on a GPU (scripts/gpu_check.sh, phase bench_memory): the m137
model's training step (8 x 512 tokens, bf16 autocast, device AdamW, the default expert impl)
in each ``model.checkpointing`` mode and with ``compile=true``: the peak allocated memory
(``torch.cuda.max_memory_allocated`` over the timed steps), what the step adds to what stays
allocated between steps (weights, optimizer state), the plan's device total, and the step time.

Times are medians of ``--steps`` steps after the warm-up steps; ratios are within this process.

    python scripts/bench_memory.py [--steps 5] [--json out.json] [--device cuda]
"""

from __future__ import annotations

import statistics

import torch

from moestack import bench
from moestack.config import CHECKPOINTING
from moestack.device import autocast_context
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

    def step() -> None:
        model(tokens, targets=targets).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = bench.times(step, repeats=warmup + steps)
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


CUDA_RUN = ["model=m137", "batch_size=8", "data.seq_len=512"]  # the GPU rows' run
CUDA_DEVICE = "cuda"


def cuda_step_row(overrides: list[str], steps: int, compile: bool = False) -> dict:
    """Peak memory and step time of one m137 configuration's training step on the GPU."""
    cfg = compose_config([*CUDA_RUN, *overrides])
    device = torch.device(CUDA_DEVICE)
    torch.manual_seed(0)
    model = cfg.model.build().to(device)
    if compile:
        model.compile_blocks()
    opt = build_optimizer(model, cfg.optim)
    g = torch.Generator().manual_seed(0)
    shape = (cfg.batch_size, cfg.data.seq_len)
    tokens, targets = (torch.randint(1, 256, shape, generator=g).to(device) for _ in range(2))

    def step() -> None:
        with autocast_context(device):
            loss = model(tokens, targets=targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    # kernels (and the compile) before the timed steps
    warmup_s = sum(bench.times(step, device, repeats=2 if compile else 1))
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()  # weights and optimizer state, between steps
    times = bench.times(step, device, repeats=steps)
    peak = torch.cuda.max_memory_allocated()
    plan = plan_memory(cfg, device="cuda")
    return {"overrides": overrides, "compile": compile, "peak_mib": peak / 2**20,
            "step_adds_mib": (peak - resident) / 2**20, "resident_mib": resident / 2**20,
            "planned_device_mib": plan.total("device") / 2**20,
            "planned_activations_mib": plan.line("activations").bytes / 2**20,
            "step_s": statistics.median(times), "warmup_s": warmup_s}  # fmt: skip


def bench_cuda(steps: int, json_path: str = "") -> list[dict]:
    """Each checkpointing mode eager, then mode none compiled; printed and written (to
    ``json_path``, if given) as they finish."""
    print(f"[cuda] {' '.join(CUDA_RUN)}: bf16 autocast, adamw (MiB; step s; x none)")
    print(
        f"[cuda] {'run':<22} {'peak':>8} {'step adds':>10} {'plan':>8} {'step s':>8} {'x none':>7}"
    )
    rows = []
    runs = [([f"model.checkpointing={m}"], False) for m in CHECKPOINTING]
    for overrides, compile in [*runs, (["model.checkpointing=none"], True)]:
        row = cuda_step_row(overrides, steps, compile)
        torch.cuda.empty_cache()  # the row's model and optimizer are gone: start from empty
        rows.append(row)
        name = overrides[0].split("=")[1] + (" compile=true" if compile else "")
        print(f"[cuda] {name:<22} {row['peak_mib']:>8.0f} {row['step_adds_mib']:>10.0f} "
              f"{row['planned_device_mib']:>8.0f} {row['step_s']:>8.3f} "
              f"{row['step_s'] / rows[0]['step_s']:>7.2f}", flush=True)  # fmt: skip
        if json_path:
            bench.write_json(
                json_path, {"gpu": torch.cuda.get_device_name(), "cuda": rows}, device=CUDA_DEVICE
            )
    print(f"[cuda] compile (first two compiled steps): {rows[-1]['warmup_s']:.1f} s")
    return rows


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
    parser = bench.parser(__doc__, steps=5, json="", threads=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU rows instead of the CPU ones (default: cpu)")  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        bench_cuda(args.steps, args.json)
        return
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
        bench.write_json(args.json, {"checkpointing": ckpt, "compile": comp, "plans": plans})


if __name__ == "__main__":
    main()
