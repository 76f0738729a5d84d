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
hypothesis's arms (a missing arm counts, so the family is the pre-registered one). The tests
themselves (one-sided p-values, bounds, Holm) are ``stats``'s; this module applies them to a
study's hypotheses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.fields import ONE_SIDED, is_quality_metric
from moestack.prereg.parts import Hypothesis
from moestack.prereg.spec import Prereg
from moestack.prereg.stats import bound, holm

__all__ = ["ONE_SIDED", "check_rules", "decide", "is_budget", "rule", "state", "verdict"]


def rule(spec: Prereg, hyp: Hypothesis) -> str:
    """The decision rule of ``hyp``: its own ``decision``, else the study's."""
    return hyp.decision or spec.analysis.decision


def is_budget(hyp: Hypothesis) -> bool:
    """A non-inferiority hypothesis: a quality metric (perplexity, val_loss) may rise by at
    most the threshold against the baseline (relative_change, difference or gap_fraction,
    op "<=")."""
    return (
        hyp.comparison in ("relative_change", "difference", "gap_fraction")
        and hyp.op == "<="
        and is_quality_metric(hyp.metric)
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
