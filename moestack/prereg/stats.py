"""The statistics of a study: Student's t, seed means and their intervals, the paired
comparison, one-sided tests and their bounds, and Holm's correction.

Plain functions of numbers, no study and no file: the analysis, the decision rules, the
power analysis and the report all compute with these, so each formula is written once.
Nothing here imports the rest of ``moestack.prereg``.

Two integrations of the t density are kept as they were, so that every committed report and
power analysis reproduces to the last digit: ``t_quantile`` (two-sided intervals, one-sided
bounds, seed counts) integrates the density in t from 0, ``t_sf`` (one-sided p-values) in
u = arctan(t / sqrt(df)), where the tail is accurate for any x.

A NaN (or, where a value is averaged, an infinity) is refused, naming it: ``max(0, nan)`` is
0, so a NaN statistic would read as p = 0, a pass. The analysis decides what a run with a
non-finite metric means before anything reaches these (``verdicts._arm_row``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

_SIMPSON = 2000  # even; the integrand of t_sf is smooth and bounded on [0, pi/2]
_SIMPSON_CDF = 4000  # even; t_quantile's integration from 0


# --------------------------------------------------------------------------- Student's t
def t_sf(x: float, df: int) -> float:
    """P(T > x) for Student's t with ``df`` degrees of freedom.

    Integrates over u = arctan(t / sqrt(df)), where the density becomes c * cos(u)^(df-1)
    on a bounded interval, so the tail is accurate for any x.
    """
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if math.isnan(x):
        raise ValueError(
            f"t_sf: x={x!r} is not a number (a non-finite per-seed value reached the test); "
            "decide what the run means before testing (the analysis fails or leaves out the row)"
        )
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


def _t_cdf(x: float, df: int) -> float:
    """Student t CDF by Simpson integration of the density from 0 (x >= 0)."""
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    h = x / _SIMPSON_CDF
    total = 0.0
    for i in range(_SIMPSON_CDF + 1):
        t = i * h
        weight = 1 if i in (0, _SIMPSON_CDF) else (4 if i % 2 else 2)
        total += weight * (1 + t * t / df) ** (-(df + 1) / 2)
    return 0.5 + const * total * h / 3


@functools.cache  # 60 bisection steps of a 4,000-point integral; a study asks a few (p, df)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if math.isnan(p):
        raise ValueError(f"t_quantile: p={p!r} is not a number; give a level in (0.5, 1)")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


# --------------------------------------------------------------------------- seed means
def mean(values: Sequence[float]) -> float:
    """The arithmetic mean of ``values`` (at least one)."""
    return sum(values) / len(values)


def sample_sd(values: Sequence[float]) -> float:
    """The sample standard deviation (n - 1 in the denominator) of ``values`` (at least two)."""
    centre = mean(values)
    return math.sqrt(sum((v - centre) ** 2 for v in values) / (len(values) - 1))


def half_width(sd: float, n: int, confidence: float = 0.95) -> float:
    """Half-width of the two-sided ``confidence`` t interval of a mean of ``n`` values."""
    if n < 2:
        return math.inf
    return t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)


def finite(values: Sequence[float], what: str) -> None:
    """Refuse ``values`` holding a NaN or an infinity, naming the first and where it is."""
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(
                f"{what}[{i}] = {value!r} is not a finite number: a broken run's metric; "
                "decide what it means (fail or leave out the row) before the statistics"
            )


def mean_ci(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Mean and two-sided t interval; with one value the interval is (nan, nan). A
    non-finite value is refused (``finite``)."""
    finite(values, "mean_ci: values")
    centre = mean(values)
    if len(values) < 2:
        return centre, math.nan, math.nan
    half = half_width(sample_sd(values), len(values), confidence)
    return centre, centre - half, centre + half


# --------------------------------------------------------------------------- a threshold
def compare(comparison: str, arm: float, base: float) -> float:
    """One seed's comparison of an arm's metric with the baseline's: ``relative_change``
    (arm / base - 1; nan for a zero base), ``difference`` (arm - base) or ``value`` (arm)."""
    if comparison == "relative_change":
        return arm / base - 1.0 if base else math.nan
    if comparison == "difference":
        return arm - base
    return arm


def gap_form(arm: float, base: float, control: float, fraction: float) -> float:
    """One seed's gap_fraction comparison: ``(arm/base - 1) - fraction x (control/base - 1)``,
    tested against 0 (the arm's change is at most ``fraction`` of the control's gap)."""
    change = compare("relative_change", arm, base)
    return change - fraction * compare("relative_change", control, base)


def passes(value: float, op: str, threshold: float) -> bool:
    """Whether ``value`` is on the passing side of ``threshold`` (op "<=" or ">=")."""
    return value <= threshold if op == "<=" else value >= threshold


def margin(value: float, op: str, threshold: float) -> float:
    """The distance of ``value`` from ``threshold`` on the passing side (negative: fails)."""
    return threshold - value if op == "<=" else value - threshold


# --------------------------------------------------------------------------- one-sided tests
def one_sided(per_seed: Sequence[float], op: str, threshold: float) -> dict[str, Any]:
    """Mean, standard error and the two one-sided p-values of one arm's paired comparisons.

    ``p_pass`` tests "the arm fails" (small: it passes), ``p_fail`` tests "the arm passes"
    (small: it fails). With a zero spread the sign of the margin decides (p = 0 or 1). A
    non-finite value is refused (``finite``): its spread would be NaN and its p-value 0.
    """
    finite(per_seed, "one_sided: per_seed")
    n = len(per_seed)
    centre = mean(per_seed)
    sd = sample_sd(per_seed)
    gap = margin(centre, op, threshold)
    se = sd / math.sqrt(n)
    if se == 0:
        p_pass = 0.0 if gap >= 0 else 1.0
        p_fail = 0.0 if gap < 0 else 1.0
    else:
        p_pass = t_sf(gap / se, n - 1)
        p_fail = t_sf(-gap / se, n - 1)
    return {"mean": centre, "sd": sd, "se": se, "df": n - 1, "p_pass": p_pass, "p_fail": p_fail}


def bound(mean: float, se: float, df: int, level: float, op: str, side: str) -> float:
    """The one-sided ``level`` bound: on the failing side ("upper" for op "<=") or the other."""
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
