"""Sweep the locality-aware router losses: expert-cache hit rates vs perplexity.

For the baseline router and each locality loss (temporal, window, pin) at several weights,
train the default CPU model, reload its final checkpoint, record which experts every token
of a fixed set of validation batches uses (eval mode), replay that trace through an LRU and
a static-pin cache of ``capacity`` experts per layer (default 2 x top_k) and compare misses
and validation perplexity with the baseline. Each run's router settings come from
configs/router/<loss>.yaml with the loss weight overridden, so the sweep measures the
shipped configs.

    python scripts/sweep_locality.py --steps 300 --weights 0.01,0.03,0.1 \
        --losses temporal,window,pin --out runs/sweep_locality
    python scripts/sweep_locality.py --base-router aux_free --losses temporal --weights 0.03

With ``--base-router NAME`` every run starts from configs/router/NAME.yaml (the baseline is
that config alone) and the locality loss is added to it by its weight.

Writes ``<out>/results.json`` and ``<out>/table.md``; a run whose directory already holds a
``summary.json`` is reused, so an interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from moestack.cache.policies import default_capacity
from moestack.config import TelemetryConfig, TrainConfig, register_configs
from moestack.data import eval_batches, load_corpus
from moestack.model import MoETransformer
from moestack.router import Router
from moestack.runs import load_run
from moestack.trainer import train

log = logging.getLogger("sweep_locality")

LOSSES = ("temporal", "window", "pin")


@dataclass
class Run:
    """One point of the sweep: a router config file and the weight of its locality loss."""

    loss: str  # "baseline" or a name from LOSSES
    weight: float  # weight of that loss (0 for the baseline)
    base: str = ""  # router config the loss is added to ("" = the loss's own config)

    @property
    def name(self) -> str:
        own = "baseline" if self.loss == "baseline" else f"{self.loss}_w{self.weight:g}"
        if not self.base:
            return own
        return self.base if self.loss == "baseline" else f"{self.base}+{own}"

    @property
    def router(self) -> str:
        return self.base or self.loss


def build_config(run: Run, args: argparse.Namespace) -> TrainConfig:
    """The training config of ``run``: configs/router/<loss>.yaml, weight and sizes overridden."""
    overrides = [
        f"router={run.router}",
        f"steps={args.steps}",
        f"batch_size={args.batch_size}",
        f"data.seq_len={args.seq_len}",
        f"seed={args.seed}",
        f"threads={args.threads}",
        f"eval_batches={args.eval_batches}",
        "eval_every=0",
        f"ckpt_every={args.steps}",
        "keep_last=1",
        "telemetry.enabled=false",
        "wandb_mode=disabled",
        "progress=false",
    ]
    if run.loss != "baseline":
        overrides.append(f"router.{run.loss}={run.weight}")
    register_configs()
    with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    train_cfg = OmegaConf.to_object(cfg)
    train_cfg.telemetry = TelemetryConfig(enabled=False)
    return train_cfg


@contextmanager
def record_routing(model: MoETransformer) -> Iterator[list[list[np.ndarray]]]:
    """Fallback recorder (used until moestack.telemetry.attach exists): forward hooks on every
    Router append its chosen experts [T, k] per call; yields one list per layer."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    calls: list[list[np.ndarray]] = [[] for _ in routers]
    handles = []
    for layer, router in enumerate(routers):

        def hook(_module: Any, _inputs: Any, routing: Any, layer: int = layer) -> None:
            calls[layer].append(routing.experts.detach().cpu().numpy())

        handles.append(router.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def routing_trace(model: MoETransformer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Eval-mode routing of ``batches`` as a RoutingTrace (telemetry.attach when available)."""
    model.eval()
    try:
        from moestack.telemetry import attach
    except ImportError:
        attach = None
    with torch.no_grad():
        if attach is not None:
            with attach(model) as telemetry:
                for inputs, _ in batches:
                    model(inputs)
            return telemetry.trace
        from moestack.telemetry.trace import RoutingTrace

        with record_routing(model) as calls:
            for inputs, _ in batches:
                model(inputs)
    batch, seq = batches[0][0].shape
    seq_ids = np.repeat(np.arange(len(batches) * batch, dtype=np.int64), seq)
    pos_ids = np.tile(np.arange(seq, dtype=np.int32), len(batches) * batch)
    experts = [np.concatenate(layer) for layer in calls]
    return RoutingTrace.from_arrays(
        experts, num_experts=model.cfg.moe.num_experts, seq=seq_ids, pos=pos_ids
    )


def replay(trace: Any, capacity: int) -> dict[str, Any]:
    """LRU and static-pin hit rates and misses at ``capacity`` slots per layer."""
    try:
        from moestack.telemetry import simulate
    except ImportError:
        from moestack.telemetry.replay import simulate
    out: dict[str, Any] = {}
    for policy in ("lru", "static"):
        stats = simulate(trace, policy, capacity)
        out[policy] = {"hit_rate": stats.hit_rate, "misses": stats.misses, "hits": stats.hits}
    # Load per layer: max tokens on one expert / mean (1 = balanced, E/k = all on k experts).
    imbalance = []
    for layer in range(trace.num_layers):
        counts = np.bincount(trace.accesses(layer), minlength=trace.num_experts[layer])
        imbalance.append(float(counts.max() / max(counts.mean(), 1e-9)))
    out["imbalance_max"] = max(imbalance)
    return out


def measure(run: Run, args: argparse.Namespace, val_tokens: np.ndarray) -> dict[str, Any]:
    """Train ``run`` (or reuse its finished directory) and replay its validation routing."""
    cfg = build_config(run, args)
    out_dir = Path(args.out) / run.name
    summary_path = out_dir / "summary.json"
    if summary_path.exists():
        log.info("%s: reusing %s", run.name, out_dir)
        summary = json.loads(summary_path.read_text())
    else:
        log.info("%s: training %d steps into %s", run.name, cfg.steps, out_dir)
        summary = train(cfg, out_dir)
    model = load_run(out_dir).model
    batches = eval_batches(val_tokens, cfg.batch_size, cfg.data.seq_len, args.replay_batches)
    capacity = args.capacity or default_capacity(cfg.model.moe.top_k)
    result = {
        "run": run.name,
        "loss": run.loss,
        "weight": run.weight,
        "val_loss": summary["loss/val"],
        "perplexity": summary["eval/perplexity"],
        "capacity": capacity,
        **replay(routing_trace(model, batches), capacity),
    }
    log.info("%s: %s", run.name, json.dumps(result))
    return result


def table(results: list[dict[str, Any]]) -> str:
    """Markdown table: each run against the baseline (first row)."""
    base = results[0]

    def delta(value: float, ref: float) -> str:
        return f"{100 * (value - ref) / ref:+.1f}%" if ref else "n/a"

    lines = [
        "| run | val ppl | d ppl | LRU hit | LRU misses | d LRU misses | static hit "
        "| d static misses | max imbalance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['run']} | {r['perplexity']:.3f} | {delta(r['perplexity'], base['perplexity'])} "
            f"| {r['lru']['hit_rate']:.3f} | {r['lru']['misses']} "
            f"| {delta(r['lru']['misses'], base['lru']['misses'])} "
            f"| {r['static']['hit_rate']:.3f} "
            f"| {delta(r['static']['misses'], base['static']['misses'])} "
            f"| {r['imbalance_max']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--weights", default="0.01,0.03,0.1", help="comma-separated weights")
    parser.add_argument("--losses", default=",".join(LOSSES), help=f"subset of {LOSSES}")
    parser.add_argument("--out", default="runs/sweep_locality", help="output directory")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--eval-batches", type=int, default=8, help="batches for val perplexity")
    parser.add_argument("--replay-batches", type=int, default=8, help="batches in the trace")
    parser.add_argument("--capacity", type=int, default=0, help="experts/layer (0 = 2 x top_k)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--base-router", default="", help="add the losses to configs/router/<this>.yaml"
    )
    args = parser.parse_args(argv)
    unknown = set(args.losses.split(",")) - set(LOSSES)
    if unknown:
        parser.error(f"--losses has {sorted(unknown)}; use names from {LOSSES}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    weights = [float(w) for w in args.weights.split(",")]
    runs = [Run("baseline", 0.0, args.base_router)]
    runs += [Run(loss, w, args.base_router) for loss in args.losses.split(",") for w in weights]
    first = build_config(runs[0], args)
    val_tokens = load_corpus(first.data).val
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for run in runs:
        results.append(measure(run, args, val_tokens))
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "table.md").write_text(table(results) + "\n")
    best = min(r["lru"]["misses"] for r in results[1:]) if len(results) > 1 else math.nan
    log.info(
        "\n%s\nbest LRU miss change vs baseline: %+.1f%%",
        table(results),
        100 * (best - results[0]["lru"]["misses"]) / max(results[0]["lru"]["misses"], 1),
    )
    return results


if __name__ == "__main__":
    main()
