"""One-sided decision rules (non-inferiority, superiority) and Holm's correction across arms.

The seed mean ("mean") can pass a budget that noise alone satisfies, and the two-sided "ci"
rule has no third answer. The one-sided rules give pass, fail or "inconclusive" from the
paired per-seed comparisons of one arm with the baseline:

- pass: the one-sided ``confidence`` bound on the failing side is on the passing side of the
  threshold (op "<=": the upper bound <= threshold), i.e. the test of "the arm fails" rejects;
- fail: the bound on the other side is beyond the threshold (op "<=": the lower bound >
  threshold), i.e. the mirror test of "the arm passes" rejects;
- inconclusive: neither, the interval straddles the threshold.

Non-inferiority (a budget: perplexity within +1%) and superiority (misses down by 30%) are
computed the same way; the name says which claim the threshold is. With ``correction: holm``
the arms of one hypothesis are a family: each test's p-value is Holm-adjusted over the
hypothesis's arms (a missing arm counts, so the family is the pre-registered one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.spec import SCALAR_METRICS, Hypothesis, Prereg

ONE_SIDED = ("noninferiority", "superiority")
_SIMPSON = 2000  # even; the integrand below is smooth and bounded on [0, pi/2]


def t_sf(x: float, df: int) -> float:
    """P(T > x) for Student's t with ``df`` degrees of freedom.

    Integrates over u = arctan(t / sqrt(df)), where the density becomes c * cos(u)^(df-1)
    on a bounded interval, so the tail is accurate for any x (the two-sided quantiles of
    ``analysis.t_quantile`` integrate in t and are kept as they were for old reports).
    """
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if math.isinf(x):
        return 0.0 if x > 0 else 1.0
    if x < 0:
        return 1.0 - t_sf(-x, df)
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    lo, hi = math.atan(x / math.sqrt(df)), math.pi / 2
    h = (hi - lo) / _SIMPSON
    total = 0.0
    for i in range(_SIMPSON + 1):
        weight = 1 if i in (0, _SIMPSON) else (4 if i % 2 else 2)
        total += weight * math.cos(lo + i * h) ** (df - 1)
    return min(1.0, max(0.0, const * total * h / 3))


def rule(spec: Prereg, hyp: Hypothesis) -> str:
    """The decision rule of ``hyp``: its own ``decision``, else the study's."""
    return hyp.decision or spec.analysis.decision


def is_budget(hyp: Hypothesis) -> bool:
    """A non-inferiority hypothesis: a quality metric (perplexity, val_loss) may rise by at
    most the threshold against the baseline (relative_change or difference, op "<=")."""
    return (
        hyp.comparison in ("relative_change", "difference")
        and hyp.op == "<="
        and hyp.metric in SCALAR_METRICS
    )


def check_rules(spec: Prereg) -> None:
    """Refuse a budget hypothesis decided by the "mean" rule (stated or the default) unless
    ``analysis.decision_reason`` says why: the seed mean passes a budget that seed noise
    alone can satisfy. ``moestack prereg lock`` applies it to every new lock."""
    if spec.analysis.decision_reason:
        return
    for i, hyp in enumerate(spec.hypotheses):
        if is_budget(hyp) and rule(spec, hyp) == "mean":
            field = f"hypotheses[{i}] ({hyp.id}).decision" if hyp.decision else "analysis.decision"
            raise MoestackError(
                f"{spec.path}: {field}: 'mean' decides the non-inferiority hypothesis {hyp.id} "
                f"({hyp.metric} {hyp.op} {hyp.threshold}) by the seed mean, which noise alone "
                "can pass; use decision: noninferiority, or say why in analysis.decision_reason"
            )


def one_sided(per_seed: Sequence[float], op: str, threshold: float) -> dict[str, Any]:
    """Mean, standard error and the two one-sided p-values of one arm's paired comparisons.

    ``p_pass`` tests "the arm fails" (small: it passes), ``p_fail`` tests "the arm passes"
    (small: it fails). With a zero spread the sign of the margin decides (p = 0 or 1).
    """
    n = len(per_seed)
    mean = sum(per_seed) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / (n - 1))
    margin = threshold - mean if op == "<=" else mean - threshold
    se = sd / math.sqrt(n)
    if se == 0:
        p_pass = 0.0 if margin >= 0 else 1.0
        p_fail = 0.0 if margin < 0 else 1.0
    else:
        p_pass = t_sf(margin / se, n - 1)
        p_fail = t_sf(-margin / se, n - 1)
    return {"mean": mean, "sd": sd, "se": se, "df": n - 1, "p_pass": p_pass, "p_fail": p_fail}


def bound(mean: float, se: float, df: int, level: float, op: str, side: str) -> float:
    """The one-sided ``level`` bound: on the failing side ("upper" for op "<=") or the other."""
    from moestack.prereg.analysis import t_quantile

    upper = (op == "<=") == (side == "failing")
    half = t_quantile(level, df) * se
    return mean + half if upper else mean - half


def holm(pvalues: Sequence[float | None], family: int) -> list[float | None]:
    """Holm step-down adjusted p-values over a family of ``family`` tests (None: untested).

    Sorted ascending, the i-th (0-based) becomes max over j <= i of (family - j) * p_j,
    capped at 1; comparing it with alpha is Holm's procedure.
    """
    order = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    if len(order) > family:
        raise ValueError(f"{len(order)} p-values in a family of {family}")
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (family - rank) * p))
        out[i] = running
    return out


def decide(rows: list[dict[str, Any]], hyp: Hypothesis, confidence: float, correct: bool) -> None:
    """Set each computable row's ``pass``, ``outcome``, ``p``, ``p_adjusted`` and bounds in
    place: pass, fail or inconclusive at alpha = 1 - confidence (Holm-adjusted if
    ``correct``, over the hypothesis's arms)."""
    alpha = 1.0 - confidence
    tests = [row.get("_test") for row in rows]
    p_pass = [t["p_pass"] if t else None for t in tests]
    p_fail = [t["p_fail"] if t else None for t in tests]
    adj_pass = holm(p_pass, len(hyp.arms)) if correct else p_pass
    adj_fail = holm(p_fail, len(hyp.arms)) if correct else p_fail
    for row, test, pp, pf in zip(rows, tests, adj_pass, adj_fail, strict=True):
        row.pop("_test", None)
        if test is None:
            continue
        if pp is not None and pp <= alpha:
            row.update({"pass": True, "outcome": "pass"})
        elif pf is not None and pf <= alpha:
            row.update({"pass": False, "outcome": "fail"})
        else:
            row.update({"pass": None, "outcome": "inconclusive", "inconclusive": True})
        row.update(
            p={"pass": test["p_pass"], "fail": test["p_fail"]},
            p_adjusted={"pass": pp, "fail": pf} if correct else None,
            bound=bound(test["mean"], test["se"], test["df"], confidence, hyp.op, "failing"),
            other_bound=bound(test["mean"], test["se"], test["df"], confidence, hyp.op, "other"),
        )


def state(row: dict[str, Any]) -> str:
    """pass / fail / inconclusive / missing of one arm's row (a joint row's too)."""
    if row["pass"] is True:
        return "pass"
    if row["pass"] is False:
        return "fail"
    return "inconclusive" if row.get("inconclusive") else "missing"


def verdict(states: Sequence[str], require: str) -> str:
    """pass / fail / incomplete / inconclusive from the arms' states, for ``require``.

    Missing runs come first (incomplete), then an undecided arm makes the verdict
    inconclusive where it could still change it.
    """
    if require == "any":
        if "pass" in states:
            return "pass"
        if "missing" in states:
            return "incomplete"
        return "inconclusive" if "inconclusive" in states else "fail"
    if "fail" in states:
        return "fail"
    if "missing" in states:
        return "incomplete"
    return "inconclusive" if "inconclusive" in states else "pass"
