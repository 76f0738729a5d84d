"""The paired-seed verdicts of a study's hypotheses and the tables beside them: each arm's
estimate against the baseline, seed by seed (``evaluate_hypotheses``), the controls' gaps
(``control_rows``), misses per token by capacity and serving batch (``misses_rows``) and the
steered evaluations (``steered_rows``). The statistics they compute with are ``stats``'s, the
decision rules ``decision``'s; the metrics come from ``analysis`` (the runs' evaluations)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from moestack.prereg import decision as rules
from moestack.prereg.analysis import metric_names
from moestack.prereg.spec import Prereg
from moestack.prereg.stats import (
    compare,
    gap_form,
    margin,
    mean,
    mean_ci,
    one_sided,
    passes,
    sample_sd,
)


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
    """Seed-paired comparison of one arm with the baseline: estimate, interval, pass.

    A gap_fraction hypothesis compares per seed ``(arm/base - 1) - threshold x
    (control/base - 1)`` with 0 (a linear form, so the paired t machinery tests the ratio
    exactly); its row also holds the arm's change, the control's (the gap, with its interval)
    and their ratio, the fraction of the gap the arm spent: None, with ``fraction_note``
    saying why, where the gap is not clearly above 0 (``gap_note``).

    A non-finite metric (inf, NaN: a diverged model or a broken evaluation) never passes,
    and no statistic sees it (``stats`` refuses one). In the arm's own run it fails the row
    (``pass`` False, outcome "fail", under every rule): the run is a result of the arm's
    training, and leaving it out would test only the seeds that survived. In the baseline's
    or the control's run the comparison is undefined: the row has no estimate (missing, so
    the hypothesis is at best incomplete). ``nonfinite`` names the seeds, runs and values.
    A per-seed value that is not finite from finite metrics (a zero baseline) is missing too.
    """
    pairs = _pair_seeds(spec, hyp, arm, values)
    per_seed = pairs.per_seed
    row: dict[str, Any] = {"arm": arm, "n": len(per_seed), "per_seed": per_seed}
    if pairs.broken:
        own = any(x["role"] == "arm" for x in pairs.broken)
        row.update({"estimate": None, "ci": [None, None], "margin": None, "pass": None})
        row["nonfinite"] = pairs.broken
        if own:  # the arm's own run: a failure, whatever the rule
            row.update({"pass": False, "outcome": "fail"})
        return row
    if not per_seed or not all(math.isfinite(v) for v in per_seed):
        row.update({"estimate": None, "ci": [None, None], "margin": None, "pass": None})
        return row
    threshold = tested_against(hyp)
    est, lo, hi = mean_ci(per_seed, spec.analysis.confidence)
    ok = _decide_row(spec, hyp, row, per_seed, (est, lo, hi), threshold)
    row.update(
        baseline_mean=mean(pairs.base_vals) if pairs.base_vals else None,
        arm_mean=mean(pairs.arm_vals),
        estimate=est,
        ci=[None if math.isnan(lo) else lo, None if math.isnan(hi) else hi],
        margin=margin(est, hyp.op, threshold),
        ci_verdict=_ci_verdict(lo, hi, hyp.op, threshold),
    )
    if hyp.comparison == "gap_fraction":
        row.update(_gap_fields(pairs, spec.analysis.confidence))
    row["pass"] = ok
    return row


@dataclasses.dataclass
class _Pairs:
    """One arm's seed-paired values for a hypothesis (``_pair_seeds``)."""

    per_seed: list[float] = dataclasses.field(default_factory=list)  # what is tested
    base_vals: list[float] = dataclasses.field(default_factory=list)  # the baseline's metric
    arm_vals: list[float] = dataclasses.field(default_factory=list)  # the arm's metric
    changes: list[float] = dataclasses.field(default_factory=list)  # gap_fraction: arm/base - 1
    gaps: list[float] = dataclasses.field(default_factory=list)  # gap_fraction: control/base - 1
    broken: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # non-finite runs


def _pair_seeds(
    spec: Prereg, hyp: Any, arm: str, values: dict[tuple[str, int], dict[str, float]]
) -> _Pairs:
    """Pair the arm's runs with the baseline's (and the control's) seed by seed; a seed whose
    partner is missing is left out, a non-finite metric is recorded in ``broken``."""
    out = _Pairs()
    gap_of = hyp.comparison == "gap_fraction"
    for seed in spec.seeds:
        a = values.get((arm, seed))
        b = values.get((spec.baseline, seed))
        c = values.get((hyp.control, seed)) if gap_of else None
        if a is not None and not math.isfinite(a[hyp.metric]):  # fails, partner or not
            out.broken.append({"seed": seed, "role": "arm", "arm": arm,
                               "value": repr(float(a[hyp.metric]))})  # fmt: skip
            continue
        if a is None or (b is None and hyp.comparison != "value") or (gap_of and c is None):
            continue
        # a value hypothesis never reads the baseline: its run cannot break the row
        runs = {"baseline": (spec.baseline, None if hyp.comparison == "value" else b),
                "control": (hyp.control, c)}  # fmt: skip
        bad = [
            {"seed": seed, "role": role, "arm": name, "value": repr(float(m[hyp.metric]))}
            for role, (name, m) in runs.items()
            if m is not None and not math.isfinite(m[hyp.metric])
        ]
        if bad:
            out.broken += bad
            continue
        out.arm_vals.append(a[hyp.metric])
        if b is not None and math.isfinite(b[hyp.metric]):
            out.base_vals.append(b[hyp.metric])
        base = b[hyp.metric] if b is not None else math.nan
        if gap_of:
            out.changes.append(compare("relative_change", a[hyp.metric], base))
            out.gaps.append(compare("relative_change", c[hyp.metric], base))
            out.per_seed.append(gap_form(a[hyp.metric], base, c[hyp.metric], hyp.threshold))
        else:
            out.per_seed.append(compare(hyp.comparison, a[hyp.metric], base))
    return out


def _decide_row(
    spec: Prereg,
    hyp: Any,
    row: dict[str, Any],
    per_seed: list[float],
    interval: tuple[float, float, float],
    threshold: float,
) -> bool | None:
    """The row's own verdict under the hypothesis's rule (None: decided with the other arms
    by Holm, whose test it leaves in ``row["_test"]``, or undecidable)."""
    est, lo, hi = interval
    rule = rules.rule(spec, hyp)
    if rule in rules.ONE_SIDED:  # decided with the hypothesis's other arms (Holm)
        if len(per_seed) > 1:
            row["_test"] = one_sided(per_seed, hyp.op, threshold)
        return None
    if rule == "ci":
        bound = hi if hyp.op == "<=" else lo
        return None if math.isnan(bound) else passes(bound, hyp.op, threshold)
    return passes(est, hyp.op, threshold)


def _gap_fields(pairs: _Pairs, confidence: float) -> dict[str, Any]:
    """A gap_fraction row's arm change, the control's gap (with its interval) and their ratio
    (None with ``fraction_note`` where the gap is not clearly above 0: ``gap_note``)."""
    change, (gap, gap_lo, gap_hi) = mean(pairs.changes), mean_ci(pairs.gaps, confidence)
    note = gap_note(gap, gap_lo)
    out: dict[str, Any] = {"change": change, "gap": gap, "fraction": None if note else change / gap}
    out["gap_ci"] = [None if math.isnan(gap_lo) else gap_lo,
                     None if math.isnan(gap_hi) else gap_hi]  # fmt: skip
    if note:
        out["fraction_note"] = note
    return out


def gap_note(gap: float, lo: float) -> str | None:
    """Why an arm's change is not shown as a fraction of a control's gap (None: it is).

    The ratio reads as "the share of what the experts bought that the arm spent" only where
    the control is clearly worse than the baseline: with a gap at or below 0 it flips sign
    (an arm costing +0.4% against a control 0.75% better reads "-0.53 of the gap"), and with
    an interval reaching 0 it can be any size. ``lo`` is the lower end of the gap's interval
    (NaN: one seed, no interval)."""
    if gap <= 0:
        return "the control is not worse than the baseline"
    if math.isnan(lo):
        return "one seed: the gap has no interval"
    if lo <= 0:
        return "the gap's interval includes 0"
    return None


def tested_against(hyp: Any) -> float:
    """What a hypothesis's per-seed values are tested against: its threshold, but 0 for a
    gap_fraction (whose threshold is inside the per-seed values)."""
    return 0.0 if hyp.comparison == "gap_fraction" else hyp.threshold


def control_rows(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per control and every other arm: the seed-paired relative perplexity change against
    the baseline (mean and interval) and, for each non-control arm, the fraction of the
    control's gap it spends (the ratio of the mean changes). The fraction is None where the
    gap is not clearly above 0, the control's ``fraction_note`` (``gap_note``) or the arm's
    saying why. A seed whose perplexity (the arm's or the baseline's) is not finite is left
    out of these display means; ``nonfinite`` lists the runs (the hypotheses fail or leave
    out their rows instead: ``_arm_row``)."""
    values = {(r["arm"], r["seed"]): r["metrics"] for r in records if r.get("status") == "done"}
    broken = [
        {"arm": arm, "seed": seed, "value": repr(float(m["perplexity"]))}
        for (arm, seed), m in sorted(values.items())
        if "perplexity" in m and not math.isfinite(m["perplexity"])
    ]

    def changes(arm: str) -> dict[int, float]:
        out = {}
        for seed in spec.seeds:
            a, b = values.get((arm, seed)), values.get((spec.baseline, seed))
            if a is None or b is None or not b.get("perplexity"):
                continue
            change = a["perplexity"] / b["perplexity"] - 1.0
            if math.isfinite(change) and math.isfinite(b["perplexity"]):
                out[seed] = change
        return out

    rows = []
    for control in spec.runs.controls:
        gap = changes(control)
        if not gap:
            rows.append({"control": control, "n": 0, "gap": None, "ci": [None, None], "arms": {},
                         "nonfinite": broken})  # fmt: skip
            continue
        centre, lo, hi = mean_ci(list(gap.values()), spec.analysis.confidence)
        note = gap_note(centre, lo)
        arms = {}
        for arm in spec.arms:
            if arm in (spec.baseline, *spec.runs.controls):
                continue
            change = changes(arm)
            seeds = sorted(set(change) & set(gap))
            if not seeds:
                continue
            c = mean([change[s] for s in seeds])
            g = mean([gap[s] for s in seeds])
            entry: dict[str, Any] = {"n": len(seeds), "change": c}
            why = note or (None if g > 0 else "the control is not worse on the arm's seeds")
            entry["fraction"] = None if why else c / g
            if why and not note:
                entry["fraction_note"] = why
            arms[arm] = entry
        row = {"control": control, "n": len(gap), "gap": centre,
               "ci": [None if math.isnan(lo) else lo, None if math.isnan(hi) else hi],
               "arms": arms, "nonfinite": broken}  # fmt: skip
        if note:
            row["fraction_note"] = note
        rows.append(row)
    return rows


_MISSES = re.compile(r"lru/cap(\d+)(?:/b(\d+))?/misses_per_token")


def misses_rows(spec: Prereg, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The absolute LRU misses per token (summed over layers) of each arm at every capacity
    and serving batch the analysis evaluates (``metric_names``: ``lru/cap{c}/misses_per_token``
    is batch 1, one stream; ``lru/cap{c}/b{b}/...`` batch b), beside the relative changes the
    hypotheses test.

    Returns ``batches``, ``capacities``, ``rows`` (per arm and capacity, one cell per batch:
    ``n``, the seed ``mean``, sample ``sd`` (None with one seed), ``min``, ``max`` over the
    arm's finished runs with a finite value, and ``nonfinite``, the runs left out) and
    ``skipped`` (arms with no finished run holding these metrics, and why)."""
    found = [(m, _MISSES.fullmatch(m)) for m in metric_names(spec.analysis)]
    cells = {(int(x[1]), int(x[2] or 1)): m for m, x in found if x}
    caps = sorted({c for c, _ in cells})
    batches = sorted({b for _, b in cells})
    out: dict[str, Any] = {"batches": batches, "capacities": caps, "rows": [], "skipped": []}
    if not cells:
        return out
    done = [r for r in records if r.get("status") == "done"]
    for arm in spec.arms:
        runs = [r["metrics"] for r in done if r["arm"] == arm]
        held = [m for m in runs if any(name in m for name in cells.values())]
        if not held:
            why = "no finished run" if not runs else "no misses-per-token metric in its runs"
            out["skipped"].append({"arm": arm, "why": why})
            continue
        for cap in caps:
            row: dict[str, Any] = {"arm": arm, "capacity": cap, "seeds": len(held), "cells": []}
            for batch in batches:
                name = cells.get((cap, batch))
                vals = [m[name] for m in held if name in m] if name else []
                good = [v for v in vals if math.isfinite(v)]
                row["cells"].append({
                    "batch": batch, "n": len(good), "nonfinite": len(vals) - len(good),
                    "mean": mean(good) if good else None,
                    "sd": sample_sd(good) if len(good) > 1 else None,
                    "min": min(good) if good else None, "max": max(good) if good else None,
                })  # fmt: skip
            out["rows"].append(row)
    return out


def steered_rows(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm and steered evaluation (``Analysis.steered``): the seed means of its misses
    per token and perplexity, and their seed-paired relative changes against the same
    run unsteered and against the baseline unsteered (the gain of steering stacked on an
    arm, as the published study reports rerouting on its trained model)."""
    values = {(r["arm"], r["seed"]): r["metrics"] for r in records if r.get("status") == "done"}
    rows = []
    for arm in spec.arms:
        for label, cap, _, _ in spec.analysis.steered():
            name, plain = f"{label}/cap{cap}", f"lru/cap{cap}/misses_per_token"
            seeds = [s for s in spec.seeds if f"{name}/perplexity" in values.get((arm, s), {})]
            if not seeds:
                continue
            run = [values[(arm, s)] for s in seeds]
            row: dict[str, Any] = {"arm": arm, "steering": label, "capacity": cap, "n": len(seeds)}
            row["misses_per_token"] = _mean_or_none([m[f"{name}/misses_per_token"] for m in run])
            row["perplexity"] = _mean_or_none([m[f"{name}/perplexity"] for m in run])
            row["misses_vs_unsteered"] = _mean_or_none(
                [m[f"{name}/misses_per_token"] / m[plain] - 1 for m in run if m[plain]]
            )
            row["perplexity_vs_unsteered"] = _mean_or_none(
                [m[f"{name}/perplexity"] / m["perplexity"] - 1 for m in run]
            )
            base = [(m, values.get((spec.baseline, s))) for m, s in zip(run, seeds, strict=True)]
            base = [
                (m, b)
                for m, b in base
                if b is not None and math.isfinite(b[plain]) and math.isfinite(b["perplexity"])
            ]
            row["misses_vs_baseline"] = _mean_or_none(
                [m[f"{name}/misses_per_token"] / b[plain] - 1 for m, b in base if b[plain]]
            )
            row["perplexity_vs_baseline"] = _mean_or_none(
                [m[f"{name}/perplexity"] / b["perplexity"] - 1 for m, b in base]
            )
            rows.append(row)
    return rows


def _mean_or_none(values: Sequence[float]) -> float | None:
    return mean(values) if values else None


def _ci_verdict(lo: float, hi: float, op: str, threshold: float) -> str:
    """What the interval alone says: supported, refuted, inconclusive (or n/a: one seed)."""
    if math.isnan(lo):
        return "n/a"
    if passes(hi if op == "<=" else lo, op, threshold):
        return "supported"
    if not passes(lo if op == "<=" else hi, op, threshold):
        return "refuted"
    return "inconclusive"
