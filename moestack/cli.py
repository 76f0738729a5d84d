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
import json
import logging
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from moestack import checkpoint
from moestack.config import TrainConfig
from moestack.errors import MoestackError

log = logging.getLogger("moestack")


def load_run_config(run_dir: Path | str) -> TrainConfig:
    """The resolved config a training run wrote into ``run_dir/config.yaml``."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise MoestackError(f"{path} not found: {run_dir} is not a moestack run directory")
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def resolve_checkpoint(run_dir: Path, checkpoint_path: str | None) -> Path:
    if checkpoint_path:
        return Path(checkpoint_path)
    latest = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    if latest is None:
        raise MoestackError(f"{run_dir / 'checkpoints'} holds no checkpoint")
    return latest


def cmd_eval(args: argparse.Namespace) -> dict:
    from moestack.data import eval_batches, load_corpus
    from moestack.model import MoETransformer
    from moestack.train import evaluate, resolve_device

    run_dir = Path(args.run_dir)
    cfg = load_run_config(run_dir)
    ckpt = resolve_checkpoint(run_dir, args.checkpoint)
    device = resolve_device(args.device or cfg.device)
    model = MoETransformer(cfg.model)
    checkpoint.load_model_weights(ckpt, model, cfg.model)
    corpus = load_corpus(cfg.data)
    batches = eval_batches(
        corpus.val, cfg.batch_size, cfg.data.seq_len, args.batches or cfg.eval_batches
    )
    if not args.offload:
        model.to(device)
        result = {"checkpoint": str(ckpt), **evaluate(model, batches, device)}
    else:
        result = {
            "checkpoint": str(ckpt),
            **_eval_offloaded(args, cfg, run_dir, ckpt, model, batches, device),
        }
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
        capacities=[int(c) for c in _csv(args.capacities)],
        device=args.device,
        record_probs=args.record_probs,
    )
    print(f"trace and report written to {out}")


def cmd_simulate(args: argparse.Namespace) -> None:
    from moestack.telemetry import RoutingTrace, sweep

    trace = RoutingTrace.load(args.trace)
    top_k = max(trace.top_k) if isinstance(trace.top_k, list | tuple) else int(trace.top_k)
    capacities = [int(c) for c in _csv(args.capacities)] or [top_k, 2 * top_k]
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


def _eval_offloaded(args, cfg, run_dir, ckpt, model, batches, device) -> dict:
    """Every expert weight lives only in the safetensors store and the cache."""
    from moestack.cache import evaluate_offloaded, generate_offloaded, open_or_write_store

    policy = args.policy or cfg.cache.policy
    if policy == "belady":
        raise MoestackError("--policy belady needs the future: use `moestack simulate` on a trace")
    store_dir = args.store_dir or cfg.cache.store_dir or run_dir / "experts"
    store = open_or_write_store(model, store_dir, cfg.model, source=str(Path(ckpt).resolve()))
    model.to(device)  # before offloading: released experts are meta tensors
    options = dict(
        policy=policy,
        capacity=args.capacity or cfg.cache.capacity or None,
        capacity_bytes=args.capacity_bytes or cfg.cache.capacity_bytes or None,
        prefetch=args.prefetch or cfg.cache.prefetch,
        cache_aware_bias=args.cache_aware_bias,
        warmup=args.warmup if args.warmup >= 0 else cfg.cache.warmup,
    )
    result = evaluate_offloaded(model, store, batches, device, **options)
    if args.generate:
        prompt = torch.tensor(list(args.prompt.encode("utf-8")), dtype=torch.long)
        out = generate_offloaded(model, store, prompt, args.generate, device, **options)
        text = bytes(t for t in out["tokens"] if 0 < t < 256)
        result["generation"] = args.prompt + text.decode("utf-8", "replace")
    return result


def cmd_prereg(args: argparse.Namespace) -> None:
    from moestack import prereg

    if args.action == "lock":
        print(f"locked: {prereg.lock(args.file, force=args.force)}")
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
    p.add_argument("--capacities", default="2,4")
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
    p.add_argument("--force", action="store_true", help="lock: replace an existing lock")
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
