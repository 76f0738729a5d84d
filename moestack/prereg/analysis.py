"""Evaluating each run's final checkpoint, and the paired-seed statistics of the hypotheses."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg import decision as rules
from moestack.prereg.runner import is_finished, plan
from moestack.prereg.spec import Analysis, Prereg

log = logging.getLogger(__name__)

EVAL_FILE = "prereg_eval.json"
# Analysis fields that decide verdicts but do not change a run's evaluation: left out of the
# evaluation's cache key (so adding them kept the key of every earlier study).
_NOT_EVALUATED = ("correction", "decision_reason")


def analysis_key(spec: Prereg) -> str:
    """Hash of the analysis settings: a cached per-run evaluation is reused only if it matches."""
    fields = dataclasses.asdict(spec.analysis)
    for name in _NOT_EVALUATED:
        fields.pop(name)
    blob = json.dumps(fields, sort_keys=True, default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def evaluate_run(
    run_dir: Path, analysis: Analysis, corpora: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Perplexity and cache hit rates of a run's final checkpoint on the pre-registered batches.

    One eval-mode pass over the batches gives the cross-entropy and, through telemetry, the
    routing trace; each policy x capacity replays that trace with ``analysis.warmup``.
    ``corpora`` caches loaded corpora between runs (keyed by the data config and, for a
    transformers model folder, its path: its own tokenizer reads the text, as in training).
    """
    import torch

    from moestack.data import eval_batches
    from moestack.evaluation import evaluate, resolve_device
    from moestack.runs import load_run, run_corpus
    from moestack.telemetry import attach, simulate

    run = load_run(run_dir)
    cfg, ckpt, step = run.cfg, run.checkpoint, run.step
    if step != cfg.steps:
        raise MoestackError(
            f"{ckpt} is step {step}, not the final step {cfg.steps}; finish the run first"
        )
    device = resolve_device(analysis.device if analysis.device != "auto" else cfg.device)
    model = run.model.to(device)
    corpora = {} if corpora is None else corpora
    key = repr((cfg.data, cfg.model.path, cfg.model.doc_separator))
    if key not in corpora:  # read as the run's model reads text (a model.path: its tokenizer)
        corpora[key] = run_corpus(cfg)
    batch_size = analysis.eval_batch_size or cfg.batch_size
    seq_len = analysis.eval_seq_len or cfg.data.seq_len
    batches = eval_batches(corpora[key].val, batch_size, seq_len, analysis.eval_batches)
    tokens = batch_size * seq_len * analysis.eval_batches
    tel = attach(
        model,
        policies=analysis.policies,
        capacities=analysis.capacities,
        max_memory_tokens=tokens + 1,
        entropy=False,
    )
    with tel, torch.no_grad():
        result = evaluate(model, batches, device)
    trace = tel.trace
    metrics: dict[str, float] = {
        "perplexity": result["eval/perplexity"],
        "val_loss": result["loss/val"],
    }
    for policy in analysis.policies:
        for cap in analysis.capacities:
            stats = simulate(trace, policy, cap, warmup=analysis.warmup, reuse=False)
            metrics[f"{policy}/cap{cap}/hit_rate"] = stats.hit_rate
            metrics[f"{policy}/cap{cap}/miss_rate"] = 1.0 - stats.hit_rate
            metrics[f"{policy}/cap{cap}/misses_per_token"] = stats.misses_per_token
    return {
        "checkpoint": str(ckpt),
        "model_sha256": _model_sha256(ckpt),  # which weights: a retrained run is evaluated anew
        "step": step,
        "eval_tokens": tokens,
        "router": dataclasses.asdict(cfg.router),  # as trained (config.yaml), for provenance
        "top_k": cfg.model.moe.top_k,
        "num_experts": cfg.model.moe.num_experts,
        "metrics": metrics,
    }


def collect(
    spec: Prereg, out_dir: Path | str | None = None, *, evaluate: bool = True
) -> list[dict[str, Any]]:
    """One record per planned run: its arm, seed, status and metrics (evaluated, or cached).

    A finished run's evaluation is stored in ``<run>/prereg_eval.json`` with the analysis
    hash, and reused while the analysis settings are unchanged.
    """
    key = analysis_key(spec)
    corpora: dict[str, Any] = {}
    records = []
    for item in plan(spec, out_dir):
        record: dict[str, Any] = {"run": item.name, "arm": item.arm, "seed": item.seed}
        record["run_dir"] = str(item.run_dir)
        cached = cached_evaluation(item.run_dir, key)
        if not is_finished(item.run_dir):
            record["status"] = "missing"
        elif cached is not None:
            record.update(cached, status="done")
        elif evaluate:
            record.update(_evaluate(item, spec, key, corpora), status="done")
        else:
            record["status"] = "not evaluated"
        records.append(record)
    return records


def evaluate_shard(
    path: str, out_dir: str | None, shard: int, shards: int, threads: int = 0
) -> int:
    """Evaluate and cache the finished, not yet evaluated runs ``shard::shards`` of the study
    (a worker of ``analyze(jobs=N)`` and ``evaluate``; nothing is aggregated or shown), each
    checked against the lock first, with ``threads`` torch threads (0: every core). Returns
    how many."""
    import os

    import torch

    from moestack.prereg.locking import verify
    from moestack.prereg.provenance import check_run
    from moestack.prereg.spec import load

    torch.set_num_threads(threads or os.cpu_count() or 1)
    lock_info = verify(path)
    spec = load(path)
    key = analysis_key(spec)
    corpora: dict[str, Any] = {}
    done = 0
    for item in plan(spec, out_dir)[shard::shards]:
        if is_finished(item.run_dir) and cached_evaluation(item.run_dir, key) is None:
            check_run(item.run_dir, lock_info)  # a run finished since the caller checked
            _evaluate(item, spec, key, corpora)
            done += 1
    return done


def _model_sha256(ckpt: Path) -> str | None:
    """sha256 of a checkpoint's weights file, from its meta.json (None: none recorded)."""
    from moestack import checkpoint

    try:
        return checkpoint.model_sha256(ckpt)
    except MoestackError:
        return None


def _final_model_sha256(run_dir: Path) -> str | None:
    from moestack import checkpoint

    ckpt = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    return None if ckpt is None else _model_sha256(ckpt)


def cached_evaluation(run_dir: Path, key: str) -> dict[str, Any] | None:
    """The run's cached evaluation under the analysis hash ``key`` and of the weights its
    newest checkpoint holds, or None (none, another hash, other weights: a run retrained
    since, or a file cut short: evaluated again). No metric is interpreted here."""
    try:
        cached = json.loads((run_dir / EVAL_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("analysis_key") != key:
        return None
    return cached if cached.get("model_sha256") == _final_model_sha256(run_dir) else None


def _evaluate(item: Any, spec: Prereg, key: str, corpora: dict[str, Any]) -> dict[str, Any]:
    """Evaluate a run's final checkpoint and cache the result (atomically)."""
    log.info("%s: evaluating the final checkpoint", item.name)
    import os
    import time

    import torch

    cpu_start = time.process_time()
    result = evaluate_run(item.run_dir, spec.analysis, corpora)
    result.update(run=item.name, arm=item.arm, seed=item.seed, analysis_key=key)
    result.update(torch_threads=torch.get_num_threads(), torch_version=torch.__version__)
    result["eval_cpu_s"] = time.process_time() - cpu_start  # core-seconds, for planning
    target = item.run_dir / EVAL_FILE
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # two evaluators never share
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(target)
    return result


# --------------------------------------------------------------------------- statistics
def _t_cdf(x: float, df: int) -> float:
    """Student t CDF by Simpson integration of the density from 0 (x >= 0)."""
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    n = 4000  # even
    h = x / n
    total = 0.0
    for i in range(n + 1):
        t = i * h
        weight = 1 if i in (0, n) else (4 if i % 2 else 2)
        total += weight * (1 + t * t / df) ** (-(df + 1) / 2)
    return 0.5 + const * total * h / 3


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Mean and two-sided t interval; with one value the interval is (nan, nan)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _compare(comparison: str, arm: float, base: float) -> float:
    if comparison == "relative_change":
        return arm / base - 1.0 if base else math.nan
    if comparison == "difference":
        return arm - base
    return arm


def _passes(value: float, op: str, threshold: float) -> bool:
    return value <= threshold if op == "<=" else value >= threshold


def evaluate_hypotheses(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hypothesis: one row per arm (estimate, CI, margin, pass) and the verdict.

    The comparison is computed per seed (arm and baseline share the seed), then averaged;
    ``margin`` is the distance from the threshold on the passing side (negative = fails).
    """
    values: dict[tuple[str, int], dict[str, float]] = {
        (r["arm"], r["seed"]): r["metrics"] for r in records if r.get("status") == "done"
    }
    results: dict[str, dict[str, Any]] = {}
    for hyp in spec.hypotheses:
        if hyp.comparison == "joint":
            rows = [_joint_row(hyp, arm, results) for arm in hyp.arms]
        else:
            rows = [_arm_row(spec, hyp, arm, values) for arm in hyp.arms]
            if rules.rule(spec, hyp) in rules.ONE_SIDED:
                holm = spec.analysis.correction == "holm"
                rules.decide(rows, hyp, spec.analysis.confidence, holm)
        verdict = rules.verdict([rules.state(r) for r in rows], hyp.require)
        results[hyp.id] = {**dataclasses.asdict(hyp), "rows": rows, "verdict": verdict}
    return list(results.values())


def _joint_row(hyp: Any, arm: str, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An arm of a joint hypothesis passes when it passes every hypothesis in ``hyp.of``."""
    parts = [next(row for row in results[ref]["rows"] if row["arm"] == arm) for ref in hyp.of]
    states = [rules.state(p) for p in parts]
    ok = False if "fail" in states else (True if set(states) == {"pass"} else None)
    margins = [p["margin"] for p in parts if p["margin"] is not None]
    row = {
        "arm": arm,
        "pass": ok,
        "margin": min(margins) if margins else None,
        "parts": {ref: p["pass"] for ref, p in zip(hyp.of, parts, strict=True)},
    }
    if ok is None and "missing" not in states:
        row["inconclusive"] = True  # no part failed or is missing, one is undecided
    if "inconclusive" in states:
        row["part_states"] = dict(zip(hyp.of, states, strict=True))
    return row


def _arm_row(
    spec: Prereg, hyp: Any, arm: str, values: dict[tuple[str, int], dict[str, float]]
) -> dict[str, Any]:
    """Seed-paired comparison of one arm with the baseline: estimate, interval, pass."""
    per_seed, base_vals, arm_vals = [], [], []
    for seed in spec.seeds:
        a = values.get((arm, seed))
        b = values.get((spec.baseline, seed))
        if a is None or (b is None and hyp.comparison != "value"):
            continue
        arm_vals.append(a[hyp.metric])
        if b is not None:
            base_vals.append(b[hyp.metric])
        base = b[hyp.metric] if b is not None else math.nan
        per_seed.append(_compare(hyp.comparison, a[hyp.metric], base))
    row: dict[str, Any] = {"arm": arm, "n": len(per_seed), "per_seed": per_seed}
    if not per_seed or any(math.isnan(v) for v in per_seed):
        row.update({"estimate": None, "ci": [None, None], "margin": None, "pass": None})
        return row
    est, lo, hi = mean_ci(per_seed, spec.analysis.confidence)
    rule = rules.rule(spec, hyp)
    if rule in rules.ONE_SIDED:  # decided with the hypothesis's other arms (Holm)
        ok = None
        if len(per_seed) > 1:
            row["_test"] = rules.one_sided(per_seed, hyp.op, hyp.threshold)
    elif rule == "ci":
        bound = hi if hyp.op == "<=" else lo
        ok = None if math.isnan(bound) else _passes(bound, hyp.op, hyp.threshold)
    else:
        ok = _passes(est, hyp.op, hyp.threshold)
    row.update(
        baseline_mean=sum(base_vals) / len(base_vals) if base_vals else None,
        arm_mean=sum(arm_vals) / len(arm_vals),
        estimate=est,
        ci=[None if math.isnan(lo) else lo, None if math.isnan(hi) else hi],
        margin=hyp.threshold - est if hyp.op == "<=" else est - hyp.threshold,
        ci_verdict=_ci_verdict(lo, hi, hyp.op, hyp.threshold),
    )
    row["pass"] = ok
    return row


def _ci_verdict(lo: float, hi: float, op: str, threshold: float) -> str:
    """What the interval alone says: supported, refuted, inconclusive (or n/a: one seed)."""
    if math.isnan(lo):
        return "n/a"
    if _passes(hi if op == "<=" else lo, op, threshold):
        return "supported"
    if not _passes(lo if op == "<=" else hi, op, threshold):
        return "refuted"
    return "inconclusive"
