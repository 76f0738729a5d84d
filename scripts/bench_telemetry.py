"""Benchmark telemetry: training-step overhead (a ratio, one process) and replay speed.

Trains the default model (MoETransformer(ModelConfig()), AdamW) on random byte tokens,
batch 16 x 256, with telemetry attached (policies lru and static, capacities 2 and 4, as the
default config), alternating single steps with recording paused and recording on; every
``--log-every`` recorded steps ``interval_metrics()`` runs and its time counts in that step.
Reported: the median of the paired ratios (step on / neighbouring step off) - 1, robust to
the load of a shared machine, and the "accounted" overhead: the time measured inside
telemetry (router hooks timed on real router outputs, plus interval_metrics) per step over
the median step time. Then the recorded trace is replayed through every policy at capacity
4 (requests per second).

    python scripts/bench_telemetry.py [--pairs 12 --log-every 10 --json out.json]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from moestack import ModelConfig, MoETransformer, bench
from moestack.cache.policies import POLICIES
from moestack.telemetry import Telemetry, attach, simulate


def train_step(model: MoETransformer, opt: torch.optim.Optimizer, batch: int, seq: int) -> float:
    """Seconds of one optimizer step on random tokens."""
    tokens = torch.randint(0, 256, (batch, seq + 1))

    def step() -> None:
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return bench.seconds(step)


def hook_seconds(
    tel: Telemetry, model: MoETransformer, batch: int, seq: int, reps: int = 20
) -> float:
    """Seconds the router hooks take per forward, timed on real router outputs (best of reps)."""
    x = torch.randn(batch * seq, model.cfg.d_model)
    with tel.paused(), torch.no_grad():
        calls = [(spec.module, spec.module(x)) for spec in tel.routers]
    hooks = [next(iter(spec.module._forward_hooks.values())) for spec in tel.routers]
    saved = tel._call
    best = float("inf")
    for _ in range(reps):
        tel._call = type(saved)(batch, seq)  # a fresh forward call of the timed shape
        pairs = zip(hooks, calls, strict=True)
        best = min(best, bench.seconds(lambda p=pairs: [hook(m, (x,), y) for hook, (m, y) in p]))
    tel._call = saved  # what the timing recorded is dropped
    return best


def paired_steps(
    model: MoETransformer, opt: torch.optim.Optimizer, tel: Telemetry, args: argparse.Namespace
) -> dict[str, list[float]]:
    """``--pairs`` pairs of single steps, recording paused and on, alternating which runs
    first; every ``--log-every`` recorded steps ``interval_metrics()`` runs, its time counted
    in that step (and kept in ``interval``)."""
    out: dict[str, list[float]] = {"off": [], "on": [], "ratios": [], "interval": []}
    recorded = 0
    for pair in range(args.pairs):
        times = {}
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            if mode == "off":
                with tel.paused():
                    times[mode] = train_step(model, opt, args.batch, args.seq)
                continue
            t = train_step(model, opt, args.batch, args.seq)
            recorded += 1
            if recorded % args.log_every == 0:
                out["interval"].append(bench.seconds(tel.interval_metrics))
                t += out["interval"][-1]
            times[mode] = t
        out["off"].append(times["off"])
        out["on"].append(times["on"])
        out["ratios"].append(times["on"] / times["off"])
    if not out["interval"]:
        took = bench.seconds(tel.interval_metrics)
        out["interval"].append(took * args.log_every / max(recorded, 1))
    return out


def print_results(results: dict[str, Any], args: argparse.Namespace) -> None:
    off_med, on_med = results["step_s_without"], results["step_s_with"]
    print(f"telemetry overhead: default model, batch {args.batch}x{args.seq}, {args.pairs} pairs")
    print(f"  step, recording paused   {off_med * 1000:9.1f} ms (median)")
    print(f"  step, recording          {on_med * 1000:9.1f} ms (median)")
    print(f"  router hooks             {results['hook_ms_per_step']:9.2f} ms per step")
    print(
        f"  interval_metrics         {results['interval_metrics_ms']:9.1f} ms per "
        f"{args.log_every} steps"
    )
    print(f"  overhead, paired median  {100 * results['overhead_paired_median']:9.2f} %")
    print(f"  overhead, accounted      {100 * results['overhead_accounted']:9.2f} %")
    print(f"replay at capacity 4, {results['trace_requests_per_layer']} requests per layer")
    rows = [
        (name, f"{row['accesses_per_s']:,.0f}", f"{row['hit_rate']:.3f}")
        for name, row in results["replay_capacity4"].items()
    ]
    print(bench.table(("policy", "requests/s", "hit rate"), rows, "<11 >14 >9", "  "))


def main() -> None:
    parser = bench.parser(__doc__, json="")
    parser.add_argument("--pairs", type=int, default=12, help="off/on step pairs")
    parser.add_argument("--log-every", type=int, default=10, help="interval_metrics period")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MoETransformer(ModelConfig()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tel = attach(model, policies=("lru", "static"), capacities=(2, 4))
    with tel.paused():
        train_step(model, opt, args.batch, args.seq)  # warm-up
    steps = paired_steps(model, opt, tel, args)
    hook_s = hook_seconds(tel, model, args.batch, args.seq)
    tel.detach()
    trace = tel.trace
    off_med = statistics.median(steps["off"])
    interval_med = statistics.median(steps["interval"])
    results: dict[str, Any] = {
        "step_s_without": off_med,
        "step_s_with": statistics.median(steps["on"]),
        "overhead_paired_median": statistics.median(steps["ratios"]) - 1.0,
        "overhead_accounted": (hook_s + interval_med / args.log_every) / off_med,
        "hook_ms_per_step": 1000 * hook_s,
        "interval_metrics_ms": 1000 * interval_med,
        "log_every": args.log_every,
        "tokens_per_step": args.batch * args.seq,
        "steps": {"off": steps["off"], "on": steps["on"]},
        "threads": torch.get_num_threads(),
    }
    replay = {}
    for name in POLICIES:
        stats = simulate(trace, name, 4, reuse=False)
        replay[name] = {"accesses_per_s": stats.accesses_per_s, "hit_rate": stats.hit_rate}
    results["replay_capacity4"] = replay
    results["trace_requests_per_layer"] = int(trace.accesses(0).size)
    print_results(results, args)
    if args.json:
        bench.write_json(args.json, results, indent=1)


if __name__ == "__main__":
    main()
