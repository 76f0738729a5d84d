"""Belady's offline-optimal misses per token beside LRU's, for the trained runs of a study.

Belady (evict the expert needed furthest in the future) is the fewest misses any cache
policy could have with a run's routing: how much of a router's miss cut a better policy
could also have had. Exploratory: the locked studies pre-registered LRU and static pins, so
these figures sit apart from their verdicts (docs/prereg.md).

Each run's pre-registered evaluation pass is repeated from its final checkpoint (the same
test windows, batches and thread count) to record its routing trace; LRU is replayed again
and must equal the run's evaluation (prereg_eval.json) bit for bit, so the bound is computed
on the very routing the verdicts were computed from; then Belady at each capacity and batch.

    python scripts/study_belady.py prereg_cpu_v3_e16 --seeds 2,3,4

Writes docs/STUDY/belady.json (one entry per run, written after each run, so a cut-off
sweep resumes: a run already there with the same weights is skipped), docs/STUDY/belady.md
(seed means per arm) and docs/STUDY/belady.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moestack.atomic import write_text
from moestack.errors import MoestackError
from moestack.prereg.analysis import EVAL_FILE, eval_device, test_batches, traced_evaluation
from moestack.prereg.parts import Analysis
from moestack.prereg.provenance import is_finished, is_kept
from moestack.prereg.runner import RunSpec, plan
from moestack.prereg.spec import Prereg, load

log = logging.getLogger("study_belady")

POLICIES = ("lru", "belady")


def serve_batches(analysis: Analysis) -> list[int]:
    """The batch sizes the study replays (batch 1 always)."""
    return sorted({1, *analysis.serve_batches})


def metric_name(policy: str, capacity: int, batch: int) -> str:
    """A replay's misses-per-token name, as the study's evaluation names it."""
    served = f"/b{batch}" if batch > 1 else ""
    return f"{policy}/cap{capacity}{served}/misses_per_token"


def runs_to_bound(spec: Prereg, runs_dir: Path, seeds: set[int] | None) -> list[RunSpec]:
    """The study's finished, evaluated runs under ``runs_dir`` that hold their checkpoints
    (of ``seeds`` if given); those restored from kept records alone are named in a log line."""
    picked, records_only = [], []
    for run in plan(spec, runs_dir):
        if seeds is not None and run.seed not in seeds:
            continue
        if not (is_finished(run.run_dir) and (run.run_dir / EVAL_FILE).is_file()):
            continue
        (records_only if is_kept(run.run_dir) else picked).append(run)
    if records_only:
        names = ", ".join(r.name for r in records_only)
        log.info("left out, their checkpoints are not on this machine: %s", names)
    return picked


def bound_run(run: RunSpec, analysis: Analysis, evaluated: dict[str, Any]) -> dict[str, Any]:
    """LRU (checked against ``evaluated``, the run's cached evaluation) and Belady misses per
    token of one run."""
    from moestack.prereg.provenance import final_checkpoint
    from moestack.runs import load_run
    from moestack.telemetry import simulate

    _, _, sha = final_checkpoint(run.run_dir)
    if sha != evaluated["model_sha256"]:
        raise MoestackError(
            f"{run.run_dir}: the final checkpoint's weights ({sha[:12]}) are not the ones "
            f"{EVAL_FILE} scored ({evaluated['model_sha256'][:12]}): evaluate the run again"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(evaluated["torch_threads"])  # the trace bit for bit as evaluated
    try:
        loaded = load_run(run.run_dir)
        device = eval_device(loaded.cfg, analysis)
        batches, tokens = test_batches(loaded.cfg, analysis)
        _, trace = traced_evaluation(loaded.model.to(device), batches, device, ("lru",),
                                     analysis.capacities, tokens)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    misses: dict[str, float] = {}
    for cap in analysis.capacities:
        for batch in serve_batches(analysis):
            for policy in POLICIES:
                stats = simulate(trace, policy, cap, warmup=analysis.warmup, reuse=False,
                                 batch_size=batch)  # fmt: skip
                misses[metric_name(policy, cap, batch)] = stats.misses_per_token
            name = metric_name("lru", cap, batch)
            if misses[name] != evaluated["metrics"][name]:
                raise MoestackError(
                    f"{run.run_dir}: {name} replayed again is {misses[name]!r}, its "
                    f"evaluation says {evaluated['metrics'][name]!r}: the routing trace "
                    "differs from the evaluated one (other code, torch or threads)"
                )
    return {"arm": run.arm, "seed": run.seed, "model_sha256": sha, "misses_per_token": misses}


def arm_means(spec: Prereg, runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each arm's seed mean of every figure, over the seeds bounded."""
    means: dict[str, dict[str, float]] = {}
    for arm in spec.arms:
        rows = [r["misses_per_token"] for r in runs.values() if r["arm"] == arm]
        if rows:
            means[arm] = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    return means


def render(spec: Prereg, runs: dict[str, Any]) -> str:
    """belady.md: per batch, each arm's LRU and Belady misses per token at every capacity."""
    a = spec.analysis
    means = arm_means(spec, runs)
    seeds = sorted({r["seed"] for r in runs.values()})
    lines = [
        f"# {spec.study}: Belady's bound beside LRU (exploratory)",
        "",
        "Not pre-registered: the study's verdicts use LRU and static pins only. Belady "
        "(evict the expert needed furthest ahead) is the fewest misses any cache policy could "
        "have with each run's routing; each run's LRU replay was recomputed from its "
        "checkpoint and matched its evaluation bit for bit. Written by "
        f"`python scripts/study_belady.py {spec.study}`.",
        "",
        f"Seed means over seeds {', '.join(map(str, seeds))} ({len(runs)} runs); misses per "
        f"token after a warmup of {a.warmup:g} of each layer's requests; cells: LRU / Belady "
        "(LRU's excess over the bound).",
        "",
    ]
    for batch in serve_batches(a):
        head = "| arm | " + " | ".join(f"{c} slots" for c in a.capacities) + " |"
        title = f"{batch} sequences served together" if batch > 1 else "One stream"
        lines += [f"## {title}", "", head]
        lines.append("|---|" + "---|" * len(a.capacities))
        for arm, m in means.items():
            cells = []
            for cap in a.capacities:
                lru, opt = m[metric_name("lru", cap, batch)], m[metric_name("belady", cap, batch)]
                excess = f"{lru / opt - 1:+.0%}" if opt > 0 else "n/a"
                cells.append(f"{lru:.3f} / {opt:.3f} ({excess})")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(spec: Prereg, runs: dict[str, Any], path: Path) -> None:
    """belady.png: misses per token against capacity, LRU solid and Belady dashed, a panel per
    served batch size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    a = spec.analysis
    means = arm_means(spec, runs)
    batches = serve_batches(a)
    fig = Figure(figsize=(4.2 * len(batches), 3.6), dpi=110)
    FigureCanvasAgg(fig)
    for i, batch in enumerate(batches):
        ax = fig.add_subplot(1, len(batches), i + 1)
        for j, (arm, m) in enumerate(means.items()):
            color = f"C{j % 10}"
            for policy, style in (("lru", "-"), ("belady", "--")):
                ys = [m[metric_name(policy, c, batch)] for c in a.capacities]
                label = arm if policy == "lru" else None
                ax.plot(a.capacities, ys, style, marker="o", color=color, label=label)
        ax.set_xticks(list(a.capacities))
        ax.set_xlabel("cache slots per layer")
        ax.set_ylabel("misses per token")
        ax.set_title(f"batch {batch} (solid LRU, dashed Belady)", fontsize=9)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="a study's name (experiments/STUDY.yaml) or its file")
    p.add_argument("--runs", type=Path, help="its runs folder (default: runs/prereg/STUDY)")
    p.add_argument("--seeds", help="comma-separated seeds (default: every evaluated run)")
    p.add_argument("--out", type=Path, help="folder of the outputs (default: docs/STUDY)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(args.study)
    spec = load(path if path.suffix == ".yaml" else Path("experiments") / f"{args.study}.yaml")
    runs_dir = args.runs or Path("runs/prereg") / spec.study
    out = args.out or Path("docs") / spec.study
    seeds = {int(s) for s in args.seeds.split(",")} if args.seeds else None
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "belady.json"
    done = json.loads(results_path.read_text())["runs"] if results_path.is_file() else {}
    todo = runs_to_bound(spec, runs_dir, seeds)
    if not todo and not done:
        raise SystemExit(f"no evaluated run with a final checkpoint under {runs_dir}")
    for run in tqdm(todo, desc="belady", unit="run"):
        evaluated = json.loads((run.run_dir / EVAL_FILE).read_text())
        if done.get(run.name, {}).get("model_sha256") == evaluated["model_sha256"]:
            continue
        done[run.name] = bound_run(run, spec.analysis, evaluated)
        record = {"study": spec.study, "exploratory": True, "runs": dict(sorted(done.items()))}
        write_text(results_path, json.dumps(record, indent=1) + "\n")
    write_text(out / "belady.md", render(spec, done))
    plot(spec, done, out / "belady.png")
    log.info("wrote %s, belady.md and belady.png (%d runs)", results_path, len(done))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MoestackError as err:
        sys.exit(f"study_belady: {err}")
