"""Pilot of a pre-registered study: the seed-to-seed noise a power analysis needs.

Trains some arms x pilot seeds of a study file at one or more step budgets, each run
composed exactly as ``moestack prereg run`` composes it (``Prereg.overrides`` -> hydra
compose -> ``moestack.trainer.train``; only ``steps`` replaced), without the study's lock:
a pilot is not the study, so its seeds must not be the study's. Each run's final checkpoint
is evaluated with the study's own analysis (``analysis.eval_*``: the shared validation set)
and, for comparison, with a small validation set (``--small-eval``; ``0`` skips it). A study
with a ``selection`` block is evaluated on its tuning split (``selection.windows``) only: a
pilot never reads the windows of the confirmatory test. ``--candidate NAME=OVERRIDES`` adds
arms the study does not list (its weights tried in the pilot: ``temporal0.1=router=temporal,
router.temporal=0.1``); ``--bias-grid 0.01,0.03`` evaluates the baseline's runs again with
each cache-aware bias, steered as the study steers (one stream), for the study's choice of
``analysis.cache_biases``; otherwise the pilot leaves the study's steered evaluations out,
so it gives no spread for a hypothesis on a steered metric. Per budget it reports
the baseline's seed-to-seed spread of perplexity and the paired spread of each arm's
perplexity change (arm / baseline - 1 on the same seed), and the seeds
``moestack.prereg.seeds_needed`` derives from it.

    python scripts/pilot_prereg.py experiments/prereg_cpu_v2.yaml --out /tmp/pilot \
        --steps 300,1200 --arms baseline,temporal --seeds 1000,1001,1002,1003 \
        --json docs/prereg_cpu_v2/pilot.json --check-pairing

Writes into each run folder ``prereg_eval.json`` and ``pilot_timing.json``; with ``--json``
the summary and, beside it, ``pilot_steps<N>.json`` per budget (an analyze-style ``runs`` list that
``moestack prereg power --pilot`` reads). Resumable: a finished run (``summary.json``) is
not retrained, an interrupted one resumes from its checkpoint, a cached evaluation is reused;
``--collect`` trains nothing and summarises the runs that finished (a seed an arm lacks is
left out of that arm's pairs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from moestack import checkpoint
from moestack.prereg import (
    EVAL_FILE,
    analysis_key,
    compose_config,
    evaluate_run,
    half_width,
    load,
    seeds_needed,
)
from moestack.prereg.parts import Analysis
from moestack.prereg.spec import Prereg
from moestack.trainer import train

log = logging.getLogger("pilot_prereg")
TIMING_FILE = "pilot_timing.json"
BIAS_FILE = "pilot_bias.json"
SMALL_EVAL = "metrics_small_eval"


def cache_metrics(spec: Prereg) -> tuple[str, str]:
    """The LRU misses and the static hit rate the pilot reports: the study's smallest
    capacity (misses per token, which a batch's or a model's expert count does not rescale)."""
    cap = min(spec.analysis.capacities)
    return f"lru/cap{cap}/misses_per_token", f"static/cap{cap}/hit_rate"


def pilot_analysis(spec: Prereg, *, steering: bool = False) -> Analysis:
    """The study's analysis on its tuning split when it names one (``selection.windows``):
    the weights a pilot picks must be chosen apart from the windows of the test. Without
    ``steering`` its steered evaluations are left out (``--bias-grid`` runs them apart)."""
    analysis = spec.analysis
    if not steering:
        analysis = dataclasses.replace(
            analysis, reroute_taus=(), cache_biases=(), steer_capacities=()
        )
    if spec.selection is None:
        return analysis
    return dataclasses.replace(analysis, eval_windows=spec.selection.windows)


def with_candidates(spec: Prereg, candidates: list[str]) -> Prereg:
    """``spec`` with the arms ``NAME=OVERRIDE,OVERRIDE`` added (settings the pilot tries)."""
    arms = dict(spec.arms)
    for text in candidates:
        name, sep, overrides = text.partition("=")
        if not sep or not overrides or name in arms:
            raise SystemExit(f"--candidate {text!r}: give NAME=OVERRIDES with a new arm name")
        arms[name] = tuple(overrides.split(","))
    runs = dataclasses.replace(spec.runs, arms=arms)
    return dataclasses.replace(spec, runs=runs)


def run_overrides(spec: Prereg, arm: str, seed: int, steps: int) -> list[str]:
    """The study's overrides of one run with ``steps`` replaced (the runner adds out_dir
    and resume)."""
    return [f"steps={steps}" if o.startswith("steps=") else o for o in spec.overrides(arm, seed)]


def check_pairing(spec: Prereg, seeds: list[int]) -> dict[str, Any]:
    """Whether every arm of a seed starts from the baseline's initial weights and sees the
    same batches: built and loaded the way ``moestack.trainer.build_run`` does."""
    from moestack.data import BatchLoader
    from moestack.runs import run_corpus

    out: dict[str, Any] = {}
    for seed in seeds:
        ref_state, ref_batches = None, None
        for arm in spec.arms:
            cfg = compose_config(spec.overrides(arm, seed)).resolve()
            torch.manual_seed(cfg.seed)
            state = cfg.model.build().state_dict()
            loader = BatchLoader(run_corpus(cfg).train, cfg.batch_size, cfg.data.seq_len, cfg.seed)
            batches = [loader.get(i)[0] for i in (0, 1, 999)]
            if ref_state is None:
                ref_state, ref_batches = state, batches
            # Weights both hold; an arm's own buffers (an anchor's reference routing) are
            # listed, not compared: the baseline has none to compare them with.
            shared = state.keys() & ref_state.keys()
            same_init = all(torch.equal(state[k], ref_state[k]) for k in shared)
            same_data = all(torch.equal(a, b) for a, b in zip(batches, ref_batches, strict=True))
            row: dict[str, Any] = {"same_init": same_init, "same_data": same_data}
            if state.keys() ^ ref_state.keys():
                row["not_compared"] = sorted(state.keys() ^ ref_state.keys())
            out[f"{arm}-s{seed}"] = row
    return out


def train_one(spec: Prereg, arm: str, seed: int, steps: int, run_dir: Path) -> dict[str, Any]:
    """Train (or resume, or reuse) one pilot run; its wall and CPU seconds."""
    timing_file = run_dir / TIMING_FILE
    if (run_dir / "summary.json").is_file() and timing_file.is_file():
        return json.loads(timing_file.read_text())
    resume = checkpoint.latest_checkpoint(run_dir / "checkpoints") is not None
    overrides = [*run_overrides(spec, arm, seed, steps), f"out_dir={run_dir}"]
    cfg = compose_config([*overrides, f"resume={str(resume).lower()}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info("%s-s%d, %d steps: %s", arm, seed, steps, "resuming" if resume else "training")
    wall, cpu = time.perf_counter(), time.process_time()
    summary = train(cfg, run_dir)
    timing = {
        "train_wall_s": time.perf_counter() - wall,
        "train_cpu_s": time.process_time() - cpu,
        "resumed": resume,
        "tokens_per_s": summary.get("perf/tokens_per_s"),
        "overrides": overrides,
    }
    timing_file.write_text(json.dumps(timing, indent=2))
    return timing


def evaluate_one(
    spec: Prereg, small: Analysis | None, run: tuple[str, int], run_dir: Path, corpora: dict
) -> dict[str, Any]:
    """The study's evaluation (cached in prereg_eval.json under the study's analysis key, with
    the run's arm and seed as ``analyze`` caches it) and the small-set one, with the CPU
    seconds of the study's evaluation."""
    analysis = pilot_analysis(spec)
    key = analysis_key(SimpleNamespace(analysis=analysis))  # it reads the analysis only
    cached = run_dir / EVAL_FILE
    if cached.is_file():
        record = json.loads(cached.read_text())
        if record.get("analysis_key") == key and (small is None or SMALL_EVAL in record):
            return record
    cpu = time.process_time()
    record = evaluate_run(run_dir, analysis, corpora)
    record["eval_cpu_s"] = time.process_time() - cpu
    record["eval_windows"] = list(analysis.eval_windows)
    if small is not None:
        record[SMALL_EVAL] = evaluate_run(run_dir, small, corpora)["metrics"]
        record["small_eval_tokens"] = (
            small.eval_batches * small.eval_batch_size * small.eval_seq_len
        )
    record.update(run=f"{run[0]}-s{run[1]}", arm=run[0], seed=run[1], analysis_key=key)
    cached.write_text(json.dumps(record, indent=2))
    return record


def spread(
    records: list[dict[str, Any]],
    arms: list[str],
    baseline: str,
    metrics_key: str,
    names: tuple[str, str],
) -> dict[str, Any]:
    """Baseline perplexity spread and, per arm, the paired per-seed changes (``names``: the
    LRU misses and the static hit rate, ``cache_metrics``)."""
    miss, static = names
    by = {(r["arm"], r["seed"]): r[metrics_key] for r in records}
    seeds = sorted({r["seed"] for r in records if r["arm"] == baseline})
    base_ppl = [by[(baseline, s)]["perplexity"] for s in seeds]
    mean = statistics.fmean(base_ppl)
    sd = statistics.stdev(base_ppl) if len(base_ppl) > 1 else math.nan
    out: dict[str, Any] = {
        "baseline_perplexity": base_ppl,
        "baseline_mean": mean,
        "baseline_sd": sd,
        "baseline_cv": sd / mean,
        "baseline_range_rel": (max(base_ppl) - min(base_ppl)) / mean,
        "arms": {},
    }
    for arm in arms:
        if arm == baseline:
            continue
        pairs = [s for s in seeds if (arm, s) in by]
        if not pairs:
            continue
        d_ppl = [by[(arm, s)]["perplexity"] / by[(baseline, s)]["perplexity"] - 1 for s in pairs]
        d_miss = [by[(arm, s)][miss] / by[(baseline, s)][miss] - 1 for s in pairs]
        d_static = [
            by[(arm, s)][static] - by[(baseline, s)][static]
            for s in pairs
            if static in by[(arm, s)]
        ]  # a study without the static policy: none
        row: dict[str, Any] = {"seeds": pairs, "d_ppl": d_ppl, "d_miss": d_miss}
        row["ppl"] = [by[(arm, s)]["perplexity"] for s in pairs]
        row[miss] = [by[(arm, s)][miss] for s in pairs]
        row["d_static_hit"] = d_static
        for name, values in (("d_ppl", d_ppl), ("d_miss", d_miss), ("d_static_hit", d_static)):
            row[f"{name}_mean"] = statistics.fmean(values) if values else math.nan
            row[f"{name}_sd"] = statistics.stdev(values) if len(values) > 1 else math.nan
        if len(d_ppl) > 1:
            row["seeds_needed_0.5pp_95"] = seeds_needed(row["d_ppl_sd"], 0.005, 0.95)
            row["half_width_at_pilot_seeds"] = half_width(row["d_ppl_sd"], len(d_ppl), 0.95)
        out["arms"][arm] = row
    return out


def markdown(summary: dict[str, Any]) -> str:
    """One table: per budget and validation set, the baseline spread and paired spreads."""
    lines = [
        "| steps | validation tokens | baseline ppl (mean) | baseline sd | baseline sd / mean "
        "| arm | paired d ppl mean | paired d ppl sd | seeds for +-0.5 pp | d LRU misses mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for steps, budget in summary["budgets"].items():
        for label, key in (("study", "study_eval"), ("small", "small_eval")):
            if key not in budget:
                continue
            s = budget[key]
            for arm, row in s["arms"].items():
                lines.append(
                    f"| {steps} | {budget[label + '_tokens']:,} | {s['baseline_mean']:.4f} | "
                    f"{s['baseline_sd']:.4f} | {100 * s['baseline_cv']:.2f}% | {arm} | "
                    f"{100 * row['d_ppl_mean']:+.2f}% | {100 * row['d_ppl_sd']:.2f} pp | "
                    f"{row.get('seeds_needed_0.5pp_95', 'n/a')} | {100 * row['d_miss_mean']:+.1f}% |"
                )
    for steps, budget in summary["budgets"].items():
        grid = budget.get("bias_grid")
        if grid and grid["biases"]:
            lines += [
                "",
                f"Cache-aware bias on the baseline ({steps} steps, {grid['capacity']} slots):",
            ]
            lines += [
                "| bias | seeds | d ppl mean | d misses per token mean |",
                "|---|---|---|---|",
            ]
            for bias, row in grid["biases"].items():
                lines.append(
                    f"| {bias} | {len(row['d_ppl'])} | {100 * statistics.fmean(row['d_ppl']):+.2f}% "
                    f"| {100 * statistics.fmean(row['d_miss']):+.1f}% |"
                )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="the study file whose runs and analysis the pilot uses")
    parser.add_argument("--out", required=True, help="pilot run folders (e.g. /tmp/pilot)")
    parser.add_argument("--steps", default="300", help="comma-separated step budgets")
    parser.add_argument("--arms", default="", help="comma-separated arms (default: all)")
    parser.add_argument("--seeds", default="1000,1001,1002", help="pilot seeds (not the study's)")
    parser.add_argument(
        "--small-eval", default="32,8,128", help="batches,batch size,seq len (0: none)"
    )
    parser.add_argument(
        "--candidate", action="append", default=[], help="NAME=OVERRIDES: an arm to try"
    )
    parser.add_argument(
        "--bias-grid", default="", help="cache-aware biases tried on the baseline's runs"
    )
    parser.add_argument("--json", default="", help="write the summary here (and per budget)")
    parser.add_argument("--plot", default="", help="draw the arms' trade-off into this PNG")
    parser.add_argument("--check-pairing", action="store_true", help="check paired seeds first")
    parser.add_argument(
        "--collect", action="store_true", help="train nothing: summarise the finished runs only"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # the study's threads=1; the runs set it again themselves

    spec = with_candidates(load(args.study), args.candidate)
    arms = args.arms.split(",") if args.arms else list(spec.arms)
    # without the baseline nothing pairs: such a call only trains (and evaluates) its arms,
    # beside another pilot process that trains the baseline; --collect summarises them all
    train_only = spec.baseline not in arms
    if train_only:
        log.info("%s is not in --arms: training only; summarise with --collect", spec.baseline)
    seeds = [int(s) for s in args.seeds.split(",")]
    clash = sorted(set(seeds) & set(spec.seeds))
    if clash:
        raise SystemExit(f"pilot seeds {clash} are study seeds; use seeds the study does not run")
    small = None
    if args.small_eval != "0":
        nb, bs, sl = (int(v) for v in args.small_eval.split(","))
        small = dataclasses.replace(
            pilot_analysis(spec), eval_batches=nb, eval_batch_size=bs, eval_seq_len=sl
        )
    summary: dict[str, Any] = {"study": spec.study, "file": str(args.study), "seeds": seeds}
    summary["arms"] = arms
    if args.check_pairing:
        summary["pairing"] = check_pairing(spec, seeds[:1])
    summary["budgets"] = {}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    corpora: dict = {}
    for steps in (int(s) for s in args.steps.split(",")):
        runs = out_runs(Path(args.out), steps)
        records = pilot_records(spec, args, steps, arms, seeds, small, corpora)
        if not records or train_only:
            continue
        budget = summarise(spec, steps, arms, records, small is not None)
        if args.bias_grid:
            grid = tuple(float(b) for b in args.bias_grid.split(","))
            budget["bias_grid"] = bias_grid(spec, runs, seeds, grid, corpora)
        summary["budgets"][str(steps)] = budget
        if args.json:
            path = Path(args.json).with_name(f"pilot_steps{steps}.json")
            doc = {"study": spec.study, "pilot": True, "steps": steps, "runs": records}
            path.write_text(json.dumps(doc, indent=2) + "\n")
    table = markdown(summary)
    summary["table"] = table
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(table)
    if args.plot and summary["budgets"]:
        plot_tradeoff(summary, Path(args.plot))
    if "pairing" in summary:
        print(json.dumps(summary["pairing"], indent=2))


def plot_tradeoff(summary: dict[str, Any], path: Path) -> None:
    """One panel per budget: each arm's paired perplexity change against its change of LRU
    misses per token (seed means, bars from the seeds' extremes), the +1% budget dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = summary["budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 4.2), squeeze=False)
    for ax, (steps, budget) in zip(axes[0], budgets.items(), strict=True):
        for arm, row in budget["study_eval"]["arms"].items():
            x = [100 * v for v in row["d_miss"]]
            y = [100 * v for v in row["d_ppl"]]
            mx, my = statistics.fmean(x), statistics.fmean(y)
            ax.errorbar(mx, my, xerr=[[mx - min(x)], [max(x) - mx]],
                        yerr=[[my - min(y)], [max(y) - my]], fmt="o", capsize=3, label=arm)  # fmt: skip
            ax.annotate(arm, (mx, my), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(1.0, color="grey", ls="--", lw=1, label="+1% perplexity")
        ax.axhline(0.0, color="black", lw=0.5)
        ax.set_xlabel("change of LRU misses per token, smallest capacity (%)")
        ax.set_ylabel("paired perplexity change (%)")
        windows = budget.get("eval_windows", [0.0, 1.0])
        ax.set_title(f"{steps} steps; validation windows {windows[0]:g}-{windows[1]:g}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def out_runs(out: Path, steps: int) -> Path:
    """The folder of a budget's pilot runs (``<out>/steps<N>/runs/<arm>-s<seed>``)."""
    return out / f"steps{steps}" / "runs"


def pilot_records(
    spec: Prereg,
    args: argparse.Namespace,
    steps: int,
    arms: list[str],
    seeds: list[int],
    small: Analysis | None,
    corpora: dict,
) -> list[dict[str, Any]]:
    """Train (or reuse) and evaluate every pilot run of one budget; one record each."""
    records = []
    for seed in seeds:  # seed by seed, as the runner: a cut-short pilot keeps full seeds
        for arm in arms:
            run_dir = out_runs(Path(args.out), steps) / f"{arm}-s{seed}"
            if args.collect and not (run_dir / TIMING_FILE).is_file():
                continue  # not trained (or unfinished): left out of the pairs
            timing = train_one(spec, arm, seed, steps, run_dir)
            result = evaluate_one(spec, small, (arm, seed), run_dir, corpora)
            record = {"run": f"{arm}-s{seed}", "arm": arm, "seed": seed, "status": "done"}
            record.update({k: v for k, v in result.items() if k != "router"}, **timing)
            records.append(record)
    return records


def summarise(
    spec: Prereg, steps: int, arms: list[str], records: list[dict[str, Any]], small: bool
) -> dict[str, Any]:
    """One budget's spreads (study evaluation, and the small one when it ran) and costs."""
    names = cache_metrics(spec)
    first = records[0]
    budget = {
        "steps": steps,
        "train_tokens": steps * spec_batch_tokens(spec),
        "study_tokens": first["eval_tokens"],
        "eval_windows": first.get("eval_windows", [0.0, 1.0]),
        "train_cpu_s": {r["run"]: r["train_cpu_s"] for r in records},
        "eval_cpu_s": {r["run"]: r["eval_cpu_s"] for r in records},
        "study_eval": spread(records, arms, spec.baseline, "metrics", names),
    }
    if small:
        budget["small_tokens"] = first["small_eval_tokens"]
        budget["small_eval"] = spread(records, arms, spec.baseline, SMALL_EVAL, names)
    budget["mean_train_cpu_s"] = statistics.fmean(budget["train_cpu_s"].values())
    budget["mean_eval_cpu_s"] = statistics.fmean(budget["eval_cpu_s"].values())
    return budget


def bias_grid(
    spec: Prereg, runs: Path, seeds: list[int], grid: tuple[float, ...], corpora: dict
) -> dict[str, Any]:
    """The baseline's finished pilot runs evaluated on the tuning split with each cache-aware
    bias of ``grid`` (steered one stream at the study's steer capacity): per bias, the seeds'
    perplexity change and misses-per-token change against the same run unsteered. Cached in
    each run folder (``pilot_bias.json``)."""
    analysis = dataclasses.replace(
        pilot_analysis(spec), cache_biases=grid, steer_capacities=spec.analysis.steer_capacities
    )
    cap = analysis.steered()[0][1]
    plain = f"lru/cap{cap}/misses_per_token"
    out: dict[str, Any] = {"capacity": cap, "biases": {}}
    for seed in seeds:
        run_dir = runs / f"{spec.baseline}-s{seed}"
        if not (run_dir / TIMING_FILE).is_file():
            continue
        cached = run_dir / BIAS_FILE
        key = analysis_key(SimpleNamespace(analysis=analysis))
        record = json.loads(cached.read_text()) if cached.is_file() else {}
        if record.get("analysis_key") != key:
            record = {"analysis_key": key, **evaluate_run(run_dir, analysis, corpora)}
            cached.write_text(json.dumps(record, indent=2))
        m = record["metrics"]
        for label, c, _, bias in analysis.steered():
            row = out["biases"].setdefault(str(bias), {"d_ppl": [], "d_miss": []})
            row["d_ppl"].append(m[f"{label}/cap{c}/perplexity"] / m["perplexity"] - 1)
            row["d_miss"].append(m[f"{label}/cap{c}/misses_per_token"] / m[plain] - 1)
    return out


def spec_batch_tokens(spec: Prereg) -> int:
    """Training tokens per step of the study's runs (batch_size x grad_accum x seq_len)."""
    cfg = compose_config(spec.overrides(spec.baseline, spec.seeds[0]))
    return cfg.batch_size * cfg.grad_accum * cfg.data.seq_len


if __name__ == "__main__":
    main()
