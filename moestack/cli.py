"""The ``moestack`` command: verbs around training runs (training itself is moestack-train).

    moestack eval RUN_DIR [--checkpoint PATH] [--batches N]   validation loss and perplexity
    moestack eval RUN_DIR --offload [--capacity N --policy P --prefetch --generate N]
                                                              the same with experts served from
                                                              safetensors through an expert cache
    moestack telemetry MODEL TEXT OUT                         route a text through an MoE model,
                                                              write its trace and a report
    moestack simulate TRACE [--policies ..] [--capacities ..] replay a trace through caches
    moestack report RUN_DIR [--out DIR]                       plots and an HTML page of a run
    moestack prereg lock|run|analyze FILE                     pre-registered experiments

Each verb prints its result; bad input ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from moestack.config import CacheConfig
from moestack.errors import MoestackError

log = logging.getLogger("moestack")


def cmd_eval(args: argparse.Namespace) -> dict:
    from moestack.data import eval_batches
    from moestack.evaluation import evaluate, resolve_device
    from moestack.runs import load_run, run_corpus

    run = load_run(args.run_dir, args.checkpoint)
    cfg = run.cfg
    device = resolve_device(args.device or cfg.device)
    corpus = run_corpus(cfg)
    batches = eval_batches(
        corpus.val, cfg.batch_size, cfg.data.seq_len, args.batches or cfg.eval_batches
    )
    if args.offload:
        metrics = _eval_offloaded(args, run, batches, device)
    else:
        run.model.to(device)
        metrics = evaluate(run.model, batches, device)
    result = {"checkpoint": str(run.checkpoint), **metrics}
    print(json.dumps(result, indent=2))
    return result


def _csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def cmd_telemetry(args: argparse.Namespace) -> None:
    from moestack.telemetry import run_telemetry

    out = run_telemetry(
        args.model,
        args.text,
        args.out,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        policies=_csv(args.policies),
        capacities=[int(c) for c in _csv(args.capacities)] or None,
        device=args.device,
        record_probs=args.record_probs,
    )
    print(f"trace and report written to {out}")


def cmd_simulate(args: argparse.Namespace) -> None:
    from moestack.telemetry import RoutingTrace, sweep

    trace = RoutingTrace.load(args.trace)
    from moestack.cache.policies import default_capacities

    top_k = max(trace.top_k) if isinstance(trace.top_k, list | tuple) else int(trace.top_k)
    capacities = [int(c) for c in _csv(args.capacities)] or list(default_capacities(top_k))
    results = sweep(trace, policies=_csv(args.policies), capacities=capacities)
    print(f"{'policy':<12} {'capacity':>8} {'hit rate':>9} {'misses':>10} {'misses/token':>13}")
    for stats in results:
        print(
            f"{stats.policy:<12} {stats.capacity:>8} {stats.hit_rate:>9.4f} {stats.misses:>10} "
            f"{stats.misses_per_token:>13.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=2))


def cmd_report(args: argparse.Namespace) -> None:
    from moestack.telemetry import render_report

    index = render_report(args.run_dir, out_dir=args.out or None, trace_dir=args.trace or None)
    print(f"report: {index}")


def _cache_config(args: argparse.Namespace, cfg: CacheConfig) -> CacheConfig:
    """The run's cache settings with the command line's on top."""
    changes: dict[str, Any] = {"prefetch": args.prefetch or cfg.prefetch}
    if args.policy:
        changes["policy"] = args.policy
    if args.capacity:
        changes.update(capacity=args.capacity, capacity_bytes=0)
    if args.capacity_bytes:
        changes.update(capacity=0, capacity_bytes=args.capacity_bytes)
    if args.warmup >= 0:
        changes["warmup"] = args.warmup
    return dataclasses.replace(cfg, **changes)


def _eval_offloaded(args: argparse.Namespace, run: Any, batches: list, device: Any) -> dict:
    """Every expert weight lives only in the safetensors store and the cache."""
    from moestack.cache import evaluate_offloaded, generate_offloaded, open_or_write_store

    cache_cfg = _cache_config(args, run.cfg.cache)
    if cache_cfg.policy == "belady":
        raise MoestackError("--policy belady needs the future: use `moestack simulate` on a trace")
    store_dir = args.store_dir or cache_cfg.store_dir or run.run_dir / "experts"
    store = open_or_write_store(
        run.model, store_dir, run.cfg.model, source=str(Path(run.checkpoint).resolve())
    )
    run.model.to(device)  # before offloading: released experts are meta tensors
    bias = args.cache_aware_bias
    result = evaluate_offloaded(run.model, store, batches, device, cache_cfg, cache_aware_bias=bias)
    if args.generate:
        prompt = torch.tensor(list(args.prompt.encode("utf-8")), dtype=torch.long)
        out = generate_offloaded(
            run.model, store, prompt, args.generate, device, cache_cfg, cache_aware_bias=bias
        )
        text = bytes(t for t in out["tokens"] if 0 < t < 256)
        result["generation"] = args.prompt + text.decode("utf-8", "replace")
    return result


def cmd_prereg(args: argparse.Namespace) -> None:
    from moestack import prereg

    if args.action != "lock" and (args.force or args.amend is not None):
        raise MoestackError(f"--force and --amend belong to `prereg lock`, not `{args.action}`")
    if args.action == "lock":
        target = prereg.lock(
            args.file, force=args.force, amend=args.amend, out_dir=args.out or None
        )
        print(f"{'amended' if args.amend is not None else 'locked'}: {target}")
    elif args.action == "run":
        runs = prereg.run(args.file, out_dir=args.out or None)
        print(f"{len(runs)} runs in {runs[0].parent if runs else args.out}")
    else:
        report = prereg.analyze(args.file, out_dir=args.out or None, report_dir=args.report or None)
        print(Path(report).read_text())
        print(f"report: {report}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestack", description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)

    p = verbs.add_parser("eval", help="validation loss and perplexity of a run's checkpoint")
    p.add_argument("run_dir", help="a moestack-train output directory")
    p.add_argument("--checkpoint", help="a checkpoint folder (default: the run's newest)")
    p.add_argument("--batches", type=int, default=0, help="validation batches (default: the run's)")
    p.add_argument("--device", default="", help="cpu or cuda (default: the run's)")
    p.add_argument("--offload", action="store_true", help="serve experts from the store + cache")
    p.add_argument(
        "--policy", default="", help="lru, lfu, static, lru+static (default: cache.policy)"
    )
    p.add_argument("--capacity", type=int, default=0, help="experts per layer (default: 2 x top_k)")
    p.add_argument("--capacity-bytes", type=int, default=0, help="or a byte budget per layer")
    p.add_argument(
        "--prefetch", action="store_true", help="load predicted next-layer experts early"
    )
    p.add_argument(
        "--warmup", type=int, default=-1, help="static policies: requests counted before pinning"
    )
    p.add_argument("--store-dir", default="", help="expert store (default: RUN_DIR/experts)")
    p.add_argument(
        "--cache-aware-bias", type=float, default=0.0, help="router bias to resident experts"
    )
    p.add_argument(
        "--generate", type=int, default=0, help="also greedily generate N bytes (--offload)"
    )
    p.add_argument("--prompt", default="def ", help="prompt for --generate")
    p.set_defaults(func=cmd_eval)

    p = verbs.add_parser("telemetry", help="run a transformers MoE model over a text file")
    p.add_argument(
        "model", help="local model dir, config .json, or a tiny model type (mixtral, ...)"
    )
    p.add_argument("text", help="a text file")
    p.add_argument("out", help="output directory for the trace, metrics and report")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--policies", default="lru,lfu,static,lru+static,belady")
    p.add_argument("--capacities", default="", help="experts per layer (default: k and 2k)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--record-probs", action="store_true")
    p.set_defaults(func=cmd_telemetry)

    p = verbs.add_parser("simulate", help="replay a routing trace through cache policies")
    p.add_argument("trace", help="a trace directory (RoutingTrace.save / a run's trace/...)")
    p.add_argument("--policies", default="lru,lfu,static,lru+static,belady")
    p.add_argument("--capacities", default="", help="experts per layer (default: k and 2k)")
    p.add_argument("--json", default="", help="also write the results here")
    p.set_defaults(func=cmd_simulate)

    p = verbs.add_parser("report", help="render plots and an HTML page for a run directory")
    p.add_argument("run_dir")
    p.add_argument("--out", default="", help="where to write (default: RUN_DIR/report)")
    p.add_argument("--trace", default="", help="trace directory (default: found in RUN_DIR)")
    p.set_defaults(func=cmd_report)

    p = verbs.add_parser("prereg", help="lock, run and analyze a pre-registered study")
    p.add_argument("action", choices=("lock", "run", "analyze"))
    p.add_argument("file", help="a pre-registration YAML, e.g. configs/experiment/prereg_cpu.yaml")
    p.add_argument("--out", default="", help="where the runs live (default: runs/prereg/<study>)")
    p.add_argument("--report", default="", help="analyze: report folder (default: <out>/report)")
    p.add_argument("--force", action="store_true", help="lock: re-lock before any run exists")
    p.add_argument(
        "--amend",
        metavar="REASON",
        default=None,
        help="lock: re-lock after runs exist; the reason is kept in the lock and the report",
    )
    p.set_defaults(func=cmd_prereg)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (MoestackError, ValueError) as err:
        print(f"moestack {args.verb}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
