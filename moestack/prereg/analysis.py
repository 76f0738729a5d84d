"""Evaluating each run's final checkpoint: the metrics of a run (``evaluate_run``), cached
beside it and sealed (``cached_evaluation``, ``store_evaluation``), collected for a study
(``collect``) and evaluated again to check them (``recheck``). The hypotheses' verdicts on
these metrics are ``verdicts``'s."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.fields import CACHE_STATS, STEERED_STATS
from moestack.prereg.locking import verify
from moestack.prereg.parts import Analysis
from moestack.prereg.provenance import check_identities, check_identity, check_run, is_kept
from moestack.prereg.records import is_sealed, write_sealed
from moestack.prereg.runner import is_finished, plan
from moestack.prereg.sources import EVALUATED_BY, check_run_code, this_code
from moestack.prereg.spec import Prereg, load

log = logging.getLogger(__name__)

EVAL_FILE = "prereg_eval.json"
EVAL_SEAL = "eval_sha256"  # the cached evaluation's digest of its other fields
# What a cached evaluation records of the run it scored (as its identity record names them).
EVAL_IDENTITY = ("run", "arm", "seed", "study_sha256", "model_sha256", "step")
# A recomputed metric matches its cached value within this (evaluation is deterministic
# under the same torch, threads, host and device: float noise only).
RECHECK_RTOL = 1e-6
RECHECK_ATOL = 1e-12
# Analysis fields that decide verdicts but do not change a run's evaluation: left out of the
# evaluation's cache key (so adding them kept the key of every earlier study).
_NOT_EVALUATED = ("correction", "decision_reason")


def analysis_key(spec: Prereg) -> str:
    """Hash of the analysis settings: a cached per-run evaluation is reused only if it matches."""
    fields = dataclasses.asdict(spec.analysis)
    for name in _NOT_EVALUATED:
        fields.pop(name)
    if tuple(fields["eval_windows"]) == (0.0, 1.0):  # the whole split: keys as before it
        fields.pop("eval_windows")
    if tuple(fields["serve_batches"]) == (1,):  # one stream: keys as before batches
        fields.pop("serve_batches")
    if not spec.analysis.steered():  # no steered evaluation: keys as before them
        for name in ("reroute_taus", "cache_biases", "steer_capacities"):
            fields.pop(name)
    blob = json.dumps(fields, sort_keys=True, default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def windows_of(tokens: Any, shares: tuple[float, float], seq_len: int) -> Any:
    """The part ``[lo, hi)`` (shares of its length) of a validation split, from which the
    evaluation's windows are drawn; refused, naming the shares, when no window fits."""
    lo, hi = (int(share * len(tokens)) for share in shares)
    part = tokens[lo:hi]
    if len(part) < seq_len + 1:
        raise MoestackError(
            f"analysis.eval_windows {list(shares)} holds {len(part)} tokens of the validation "
            f"split, fewer than one window of {seq_len + 1}: widen it or raise data.max_bytes"
        )
    return part


def evaluate_run(
    run_dir: Path, analysis: Analysis, corpora: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Perplexity and cache hit rates of a run's final checkpoint on the pre-registered batches.

    One eval-mode pass over the batches gives the cross-entropy and, through telemetry, the
    routing trace; each policy x capacity replays that trace with ``analysis.warmup``.
    ``corpora`` caches loaded corpora between runs (keyed by the data config and, for a
    transformers model folder, its path: its own tokenizer reads the text, as in training).
    """

    from moestack import checkpoint
    from moestack.runs import load_run
    from moestack.telemetry import simulate

    run = load_run(run_dir)
    cfg, ckpt, step = run.cfg, run.checkpoint, run.step
    if step != cfg.steps:
        raise MoestackError(
            f"{ckpt} is step {step}, not the final step {cfg.steps}; finish the run first"
        )
    device = eval_device(cfg, analysis)
    model = run.model.to(device)
    batches, tokens = test_batches(cfg, analysis, corpora)
    result, trace = traced_evaluation(model, batches, device, analysis.policies,
                                      analysis.capacities, tokens)  # fmt: skip
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
            for batch in _batches(analysis):
                served = simulate(trace, policy, cap, warmup=analysis.warmup, reuse=False,
                                  batch_size=batch)  # fmt: skip
                metrics[f"{policy}/cap{cap}/b{batch}/hit_rate"] = served.hit_rate
                metrics[f"{policy}/cap{cap}/b{batch}/miss_rate"] = 1.0 - served.hit_rate
                metrics[f"{policy}/cap{cap}/b{batch}/misses_per_token"] = served.misses_per_token
    metrics.update(steered_metrics(model, batches, device, analysis, tokens))
    return {
        "checkpoint": str(ckpt),
        "model_sha256": checkpoint.model_sha256(ckpt),  # the weights scored (verified on load)
        "step": step,
        "device": str(device),
        "eval_tokens": tokens,
        "router": dataclasses.asdict(cfg.router),  # as trained (config.yaml), for provenance
        "top_k": cfg.model.moe.top_k,
        "num_experts": cfg.model.moe.num_experts,
        "metrics": metrics,
    }


def eval_device(cfg: Any, analysis: Analysis) -> Any:
    """The torch device a run trained with ``cfg`` is evaluated on (``analysis.device``;
    "auto": the run's own)."""
    from moestack.device import resolve_device

    return resolve_device(analysis.device if analysis.device != "auto" else cfg.device)


def test_batches(
    cfg: Any, analysis: Analysis, corpora: dict[str, Any] | None = None
) -> tuple[list, int]:
    """The pre-registered evaluation batches of a run trained with ``cfg`` (its test windows,
    read as its model reads text) and the number of tokens they hold. ``corpora`` caches
    loaded corpora between runs (keyed by the data config and, for a transformers model
    folder, its path: its own tokenizer reads the text, as in training)."""
    from moestack.data import eval_batches
    from moestack.runs import run_corpus

    corpora = {} if corpora is None else corpora
    source = cfg.model.pretrained_path  # its tokenizer's folder ("" for bytes)
    key = repr((cfg.data, source, cfg.model.doc_separator))
    if key not in corpora:  # read as the run's model reads text (a model.path: its tokenizer)
        corpora[key] = run_corpus(cfg)
    batch_size = analysis.eval_batch_size or cfg.batch_size
    seq_len = analysis.eval_seq_len or cfg.data.seq_len
    val = windows_of(corpora[key].val, analysis.eval_windows, seq_len)
    batches = eval_batches(val, batch_size, seq_len, analysis.eval_batches)
    return batches, batch_size * seq_len * analysis.eval_batches


def traced_evaluation(
    model: Any,
    batches: list,
    device: Any,
    policies: Sequence[str],
    capacities: Sequence[int],
    tokens: int,
) -> tuple[dict[str, float], Any]:
    """One eval-mode pass over ``batches``: its loss and perplexity, and the routing trace
    telemetry recorded of its ``tokens`` tokens."""
    import torch

    from moestack.evaluation import evaluate
    from moestack.telemetry import attach

    tel = attach(model, policies=tuple(policies), capacities=tuple(capacities),
                 max_memory_tokens=tokens + 1, entropy=False)  # fmt: skip
    with tel, torch.no_grad():
        result = evaluate(model, batches, device)
    return result, tel.trace


def steered_metrics(
    model: Any, batches: list, device: Any, analysis: Analysis, tokens: int
) -> dict[str, float]:
    """Perplexity and LRU misses of each steered evaluation (``Analysis.steered``): one
    pass each, its tokens steered one at a time toward an LRU cache of its capacity
    (``moestack.cache.steering``), the served experts replayed with ``analysis.warmup``."""

    from moestack.cache.steering import Steering, stream_steered
    from moestack.telemetry import simulate

    metrics: dict[str, float] = {}
    for label, cap, tau, bias in analysis.steered():
        steering = Steering(cap, reroute_tau=tau, cache_aware_bias=bias)
        with stream_steered(model, steering):
            result, trace = traced_evaluation(model, batches, device, ("lru",), (cap,), tokens)
        stats = simulate(trace, "lru", cap, warmup=analysis.warmup, reuse=False)
        name = f"{label}/cap{cap}"
        metrics[f"{name}/perplexity"] = result["eval/perplexity"]
        metrics[f"{name}/val_loss"] = result["loss/val"]
        metrics[f"{name}/hit_rate"] = stats.hit_rate
        metrics[f"{name}/miss_rate"] = 1.0 - stats.hit_rate
        metrics[f"{name}/misses_per_token"] = stats.misses_per_token
    return metrics


def collect(
    spec: Prereg,
    out_dir: Path | str | None = None,
    *,
    evaluate: bool = True,
    identities: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One record per planned run: its arm, seed, status and metrics (evaluated, or cached).

    A finished run's evaluation is stored in ``<run>/prereg_eval.json`` with the analysis
    hash, the run's identity and the sha256 of the weights it scored, sealed, and reused
    while the analysis settings are unchanged (``cached_evaluation``). ``identities`` are
    the finished runs' checked identity records (``provenance.check_identities``; checked
    here when not given). ``source`` says where a run's metrics came from: "cache" or
    "evaluated" (now); ``kept`` that the run was restored from its kept records (no
    checkpoint: ``kept``).
    """
    runs = plan(spec, out_dir)
    if identities is None:
        identities = check_identities(runs, spec.study)
    key, names = analysis_key(spec), metric_names(spec.analysis)
    corpora: dict[str, Any] = {}
    records = []
    for item in runs:
        record: dict[str, Any] = {"run": item.name, "arm": item.arm, "seed": item.seed}
        record["run_dir"] = str(item.run_dir)
        identity = identities.get(item.name)  # None: not finished when the checks ran
        if identity is None:
            record["status"] = "missing"
        elif (cached := cached_evaluation(item.run_dir, key, identity, names)) is not None:
            record.update(cached, status="done", source="cache", kept=is_kept(item.run_dir))
        elif evaluate:
            fresh = _evaluate(item, spec, key, corpora, identity)
            record.update(fresh, status="done", source="evaluated")
        else:
            record["status"] = "not evaluated"
        records.append(record)
    return records


def evaluate_shard(
    path: str, out_dir: str | None, shard: int, shards: int, threads: int = 0
) -> list[str]:
    """Evaluate and cache the finished, not yet evaluated runs ``shard::shards`` of the study
    (a worker of ``analyze(jobs=N)`` and ``evaluate``; nothing is aggregated or shown), each
    checked against the lock and its identity first, with ``threads`` torch threads (0:
    every core). Returns the names of the runs evaluated."""
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
    lock_info = verify(path)
    spec = load(path)
    key = analysis_key(spec)
    corpora: dict[str, Any] = {}
    done = []
    for item in plan(spec, out_dir)[shard::shards]:
        if not is_finished(item.run_dir):
            continue
        check_run(item.run_dir, lock_info)  # a run finished since the caller checked
        identity = check_identity(item, spec.study)
        check_run_code(item, identity, lock_info)  # trained by the code its lock names
        if cached_evaluation(item.run_dir, key, identity, metric_names(spec.analysis)) is None:
            _evaluate(item, spec, key, corpora, identity)
            done.append(item.name)
    return done


def metric_names(analysis: Analysis) -> list[str]:
    """The metrics ``evaluate_run`` gives under ``analysis``, sorted."""
    names = ["perplexity", "val_loss"]
    names += [f"{p}/cap{c}/{s}" for p in analysis.policies for c in analysis.capacities
              for s in CACHE_STATS]  # fmt: skip
    names += [f"{p}/cap{c}/b{b}/{s}" for p in analysis.policies for c in analysis.capacities
              for b in _batches(analysis) for s in CACHE_STATS]  # fmt: skip
    names += [f"{label}/cap{c}/{s}" for label, c, _, _ in analysis.steered()
              for s in STEERED_STATS]  # fmt: skip
    return sorted(names)


def _batches(analysis: Analysis) -> list[int]:
    """The batch sizes replayed besides one stream, in order."""
    return sorted({b for b in analysis.serve_batches if b > 1})


def cached_evaluation(
    run_dir: Path, key: str, identity: dict[str, Any], names: Sequence[str] | None = None
) -> dict[str, Any] | None:
    """The run's cached evaluation under the analysis hash ``key``, or None: none, a file
    cut short, one written before evaluations were sealed, or one of other analysis
    settings (each evaluated again, from the checkpoint).

    Refused, naming the file: one whose fields do not match its digest (``eval_sha256``:
    edited after it was written), one that scored another run or other weights than
    ``identity`` (the run's checked identity record) names, or (given ``names``, the
    analysis's ``metric_names``) one whose metrics are not those names with numbers. No
    metric is interpreted here.
    """
    path = Path(run_dir) / EVAL_FILE
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or EVAL_SEAL not in cached:
        return None
    if not is_sealed(cached, EVAL_SEAL):
        raise MoestackError(
            f"{path} was edited after it was written: its {EVAL_SEAL} does not match its "
            "fields; delete it, and the run is evaluated again from its checkpoint"
        )
    if cached.get("analysis_key") != key:
        return None
    differs = [
        f"{k} {cached.get(k)!r} (the run: {identity.get(k)!r})"
        for k in EVAL_IDENTITY
        if cached.get(k) != identity.get(k)
    ]
    if differs:
        raise MoestackError(
            f"{path} is not an evaluation of this run's final weights ({'; '.join(differs)}): "
            "copied from another run, or left from before a retraining; delete it, and the "
            "run is evaluated again from its checkpoint"
        )
    if names is not None and not _metrics_are(cached.get("metrics"), names):
        raise MoestackError(
            f"{path}: 'metrics' is not one number for each of the analysis's {len(names)} "
            "metrics; delete it, and the run is evaluated again from its checkpoint"
        )
    return cached


def _metrics_are(metrics: Any, names: Sequence[str]) -> bool:
    """Whether ``metrics`` maps exactly ``names`` to numbers."""
    if not isinstance(metrics, dict) or sorted(metrics) != sorted(names):
        return False
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in metrics.values())


def store_evaluation(
    run_dir: Path, identity: dict[str, Any], key: str, result: dict[str, Any]
) -> dict[str, Any]:
    """Cache ``result`` (``evaluate_run``'s) as the evaluation of the run and weights that
    ``identity`` names, under the analysis hash ``key``, with this process's torch version,
    threads and host (what a recheck compares under) and the code that computed it
    (``evaluated_by``: code hash, git commit); sealed and written atomically.
    Returns the cached entry."""
    import socket

    import torch

    _check_scored(run_dir, identity, result)
    entry = {**result, **{k: identity[k] for k in EVAL_IDENTITY}, "analysis_key": key}
    entry.update(
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        host=socket.gethostname(),
    )
    entry[EVALUATED_BY] = this_code()  # which code (and commit) computed these numbers
    return write_sealed(Path(run_dir) / EVAL_FILE, entry, EVAL_SEAL)


def _check_scored(run_dir: Path, identity: dict[str, Any], result: dict[str, Any]) -> None:
    """Refuse an evaluation of other weights than the run's identity names (its checkpoint
    replaced after the identity was checked)."""
    scored = result.get("model_sha256", identity["model_sha256"])
    if scored != identity["model_sha256"]:
        raise MoestackError(
            f"{run_dir}: the evaluation scored weights sha256 {str(scored)[:12]}, the run "
            f"finished with {identity['model_sha256'][:12]}: its checkpoint changed while it "
            "was evaluated; restore it, or retrain the run"
        )


def _evaluate(
    item: Any, spec: Prereg, key: str, corpora: dict[str, Any], identity: dict[str, Any]
) -> dict[str, Any]:
    """Evaluate a run's final checkpoint and cache the result (``store_evaluation``)."""
    if is_kept(item.run_dir):
        raise MoestackError(
            f"{item.run_dir} is a kept run (restored from its records, no checkpoint) with no "
            f"evaluation under these analysis settings (key {key}): it cannot be evaluated "
            "again; train it again (delete the folder and its kept records)"
        )
    log.info("%s: evaluating the final checkpoint", item.name)
    import time

    cpu_start = time.process_time()
    result = evaluate_run(item.run_dir, spec.analysis, corpora)
    result["eval_cpu_s"] = time.process_time() - cpu_start  # core-seconds, for planning
    return store_evaluation(item.run_dir, identity, key, result)


# --------------------------------------------------------------------------- the recheck
def recheck(
    spec: Prereg,
    records: list[dict[str, Any]],
    identities: dict[str, dict[str, Any]],
    per_arm: int,
    *,
    rng: random.Random | None = None,
) -> list[dict[str, Any]]:
    """Evaluate again ``per_arm`` runs of every arm whose metrics came from the cache,
    picked at random (``rng``, default seeded from os.urandom: nobody knows beforehand
    which), and refuse when a recomputed metric differs from the cached one beyond float
    noise (relative ``RECHECK_RTOL``): a cache whose numbers were edited and its digest
    recomputed by hand. Evaluation is deterministic under the same torch version, thread
    count, host and device; the threads are set to the cached count, and a run cached
    under another torch version, host or device is evaluated again instead of compared
    (its fresh numbers replace the cached ones). Returns one entry per run rechecked:
    ``run`` and ``outcome`` ("matched" or "re-evaluated"). Kept runs (no checkpoint) are
    not picked: their audit is training them again (``kept``)."""
    if per_arm < 0:
        raise MoestackError(f"--recheck {per_arm}: give 0 (no recheck) or more runs per arm")
    rng = rng or random.Random(os.urandom(32))
    picked = []
    for arm in spec.arms:
        cached = [r for r in records if r["arm"] == arm and r.get("source") == "cache"
                  and not r.get("kept")]  # fmt: skip
        picked += rng.sample(cached, min(per_arm, len(cached)))
    corpora: dict[str, Any] = {}
    return [_recheck_one(spec, r, identities[r["run"]], corpora) for r in picked]


def _environment(record: dict[str, Any]) -> tuple[Any, ...]:
    return record.get("torch_version"), record.get("host"), record.get("device")


def _recheck_one(
    spec: Prereg, record: dict[str, Any], identity: dict[str, Any], corpora: dict[str, Any]
) -> dict[str, Any]:
    """Evaluate one cached run again (``recheck``) and compare, or replace its numbers."""
    import socket

    import torch

    run_dir = Path(record["run_dir"])
    log.info("%s: re-evaluating a cached evaluation, picked at random", record["run"])
    threads = torch.get_num_threads()
    if isinstance(record.get("torch_threads"), int) and record["torch_threads"] > 0:
        torch.set_num_threads(record["torch_threads"])
    try:
        fresh = evaluate_run(run_dir, spec.analysis, corpora)
        _check_scored(run_dir, identity, fresh)
        now = (torch.__version__, socket.gethostname(), fresh["device"])
        if now != _environment(record):
            entry = store_evaluation(run_dir, identity, analysis_key(spec), fresh)
            record.update(entry, source="evaluated")
            return {"run": record["run"], "outcome": "re-evaluated"}
    finally:
        torch.set_num_threads(threads)
    for name in sorted(set(record["metrics"]) | set(fresh["metrics"])):
        old, new = record["metrics"].get(name), fresh["metrics"].get(name)
        if not _same(old, new):
            raise MoestackError(
                f"{run_dir / EVAL_FILE}: {name} is {old!r} in the cache, {new!r} evaluated "
                f"again from the run's checkpoint (same torch, threads, host and device): the "
                "cached numbers were edited (its digest recomputed); delete every "
                f"{EVAL_FILE} of the study and analyze again"
            )
    return {"run": record["run"], "outcome": "matched"}


def _same(old: Any, new: Any) -> bool:
    """Equal up to float noise (``RECHECK_RTOL``); NaN equals NaN."""
    if not isinstance(old, (int, float)) or not isinstance(new, (int, float)):
        return False
    if math.isnan(old) or math.isnan(new):
        return math.isnan(old) and math.isnan(new)
    return math.isclose(old, new, rel_tol=RECHECK_RTOL, abs_tol=RECHECK_ATOL)
