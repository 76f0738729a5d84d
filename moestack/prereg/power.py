"""Power analysis: how many seeds a study needs, from the seed-to-seed spread of a pilot.

A verdict is only as sharp as its interval: with n paired seeds of standard deviation sd,
the two-sided t interval of the mean change has half-width t_{(1+c)/2, n-1} * sd / sqrt(n).
``seeds_needed`` finds the smallest n whose half-width is at most a target (0.5 percentage
points of perplexity change by default: half the 1% budget). The sd comes from a pilot: the
per-run metrics of earlier seeds (a finished study's ``results.json``, or its report or study
folder holding one; never an interim analysis, nor a study's per-run evaluations before it
is analysed), paired seed by seed with the baseline exactly as the analysis pairs them
(``stats.compare``; the interval's half-width is ``stats.half_width``, the one the analysis's
intervals have).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.fields import is_quality_metric
from moestack.prereg.parts import Hypothesis
from moestack.prereg.spec import Prereg, load
from moestack.prereg.stats import compare, gap_form, half_width, sample_sd, t_quantile

DEFAULT_HALF_WIDTH = 0.005  # 0.5 pp of relative change: half the 1% perplexity budget
MAX_SEEDS = 100_000


def seeds_needed(sd: float, target: float, confidence: float = 0.95) -> int:
    """The smallest n >= 2 with t_{(1+c)/2, n-1} * sd / sqrt(n) <= ``target``.

    Starts at the normal approximation (a lower bound: t > z) and steps up, since the t
    quantile itself depends on n.
    """
    if not sd >= 0 or not target > 0:
        raise MoestackError(f"sd={sd}, half-width={target}: need sd >= 0 and half-width > 0")
    z = t_quantile(0.5 + confidence / 2, 10**6)
    n = max(2, math.ceil((z * sd / target) ** 2))
    while half_width(sd, n, confidence) > target:
        n += 1
        if n > MAX_SEEDS:
            raise MoestackError(
                f"sd={sd:.4g} needs more than {MAX_SEEDS} seeds for half-width {target}; "
                "lower the noise (a larger validation set, longer runs) or widen the target"
            )
    return n


def _records_file(path: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise MoestackError(
            f"{path}: not a readable results.json ({err}); give another pilot"
        ) from None
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, list):
        raise MoestackError(f"{path}: no 'runs' list; give an analyze results.json as the pilot")
    if doc.get("interim"):
        raise MoestackError(
            f"{path} is an interim analysis ({doc['interim']}): sizing or stopping a study on "
            "an interim look is optional stopping; give a finished study's results.json"
        )
    return [r for r in runs if isinstance(r, dict) and r.get("status", "done") == "done"]


def load_pilot(path: Path | str) -> list[dict[str, Any]]:
    """The pilot's per-run records (arm, seed, metrics) from a results.json or a folder holding
    one (or report/results.json); an interim analysis is refused."""
    path = Path(path)
    if path.is_file():
        records = _records_file(path)
    elif (path / "results.json").is_file():
        records = _records_file(path / "results.json")
    elif (path / "report" / "results.json").is_file():
        records = _records_file(path / "report" / "results.json")
    elif path.is_dir():
        raise MoestackError(
            f"pilot {path} holds no results.json (nor report/results.json): analyze the pilot "
            "study first (`moestack prereg analyze`); a study's cached per-run evaluations "
            "are no pilot until it is complete and analysed (interim numbers would size or "
            "stop a study on an interim look)"
        )
    else:
        raise MoestackError(f"pilot {path} not found; give a results.json or a study folder")
    records = [r for r in records if "arm" in r and "seed" in r and "metrics" in r]
    if not records:
        raise MoestackError(
            f"pilot {path}: no evaluated runs (arm, seed, metrics); analyze the pilot study first"
        )
    return records


def _paired(
    hyp: Hypothesis, arm: str, baseline: str, records: Sequence[dict[str, Any]]
) -> list[float]:
    """The per-seed comparisons of ``arm`` with ``baseline`` in the pilot (as the analysis;
    a gap_fraction one also needs the control's run of the seed)."""
    by = {(r["arm"], r["seed"]): r["metrics"] for r in records}
    out = []
    for (name, seed), metrics in sorted(by.items(), key=lambda kv: str(kv[0])):
        base = by.get((baseline, seed))
        if name != arm or hyp.metric not in metrics:
            continue
        if hyp.comparison != "value" and (base is None or hyp.metric not in base):
            continue
        base_value = base[hyp.metric] if base is not None else math.nan
        if hyp.comparison == "gap_fraction":
            control = by.get((hyp.control, seed))
            if control is None or hyp.metric not in control:
                continue
            value = gap_form(metrics[hyp.metric], base_value, control[hyp.metric], hyp.threshold)
        else:
            value = compare(hyp.comparison, metrics[hyp.metric], base_value)
        if not math.isnan(value):
            out.append(value)
    return out


def analyse(
    spec: Prereg, records: Sequence[dict[str, Any]], target: float, confidence: float
) -> list[dict[str, Any]]:
    """One row per hypothesis x arm: the pilot's paired sd, the seeds the target needs, and
    the half-width the study's own seed count gives. An arm the pilot lacks takes the pooled
    sd (root mean variance) of the hypothesis's arms the pilot has."""
    rows = []
    for hyp in spec.hypotheses:
        if hyp.comparison == "joint":
            continue
        found = {arm: _paired(hyp, arm, spec.baseline, records) for arm in hyp.arms}
        found = {arm: v for arm, v in found.items() if len(v) >= 2}
        pooled = None
        if found:
            pooled = math.sqrt(sum(sample_sd(v) ** 2 for v in found.values()) / len(found))
        for arm in hyp.arms:
            values = found.get(arm)
            sd = sample_sd(values) if values else pooled
            row = {
                "hypothesis": hyp.id,
                "arm": arm,
                "metric": hyp.metric,
                "comparison": hyp.comparison,
                "budget": is_quality_metric(hyp.metric),
                "pilot_seeds": len(values) if values else 0,
                "sd": sd,
                "source": "pilot" if values else ("pooled" if sd is not None else "none"),
            }
            if sd is not None:
                row["seeds_needed"] = seeds_needed(sd, target, confidence)
                row["half_width_at_study_seeds"] = half_width(sd, len(spec.seeds), confidence)
            rows.append(row)
    return rows


def power(
    path: Path | str,
    pilot: Path | str | None = None,
    target: float | None = None,
    confidence: float | None = None,
) -> dict[str, Any]:
    """The power analysis of the study file ``path`` against ``pilot`` (default: the spec's
    ``power.pilot``, relative to the study file when not found as given). ``needed`` is the
    largest seed count of the perplexity/val_loss rows (of all rows when there are none)."""
    spec = load(path)
    block = spec.power
    if pilot is None:
        if block is None:
            raise MoestackError(
                f"{path}: no pilot; pass --pilot (a results.json or study folder) or add "
                "power.pilot to the study file"
            )
        pilot = Path(block.pilot)
        if not pilot.exists():
            pilot = Path(path).parent / block.pilot
    target = target if target is not None else (block.half_width if block else DEFAULT_HALF_WIDTH)
    confidence = confidence if confidence is not None else (block.confidence if block else 0.95)
    rows = analyse(spec, load_pilot(pilot), target, confidence)
    counted = [r for r in rows if r["budget"] and "seeds_needed" in r]
    counted = counted or [r for r in rows if "seeds_needed" in r]
    return {
        "study": spec.study,
        "pilot": str(pilot),
        "half_width": target,
        "confidence": confidence,
        "study_seeds": len(spec.seeds),
        "chosen": None if block is None else {"seeds": block.seeds, "reason": block.reason},
        "needed": max((r["seeds_needed"] for r in counted), default=None),
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    """The power analysis as a markdown table and a one-line recommendation."""
    pct = f"{100 * result['half_width']:.2g} pp"
    lines = [
        f"Power analysis of {result['study']} from pilot {result['pilot']}: seeds for a "
        f"{result['confidence']:.0%} interval half-width <= {pct} (of a relative change; "
        "the metric's own unit for a difference).",
        "",
        "| hypothesis | arm | metric | pilot seeds | paired sd | seeds needed "
        f"| half-width at {result['study_seeds']} seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        sd = (
            "n/a"
            if r["sd"] is None
            else f"{r['sd']:.4g}" + (" (pooled)" * (r["source"] == "pooled"))
        )
        hw = r.get("half_width_at_study_seeds")
        hw_text = "n/a" if hw is None or math.isinf(hw) else f"{hw:.4g}"
        lines.append(
            f"| {r['hypothesis']} | {r['arm']} | {r['metric']} | {r['pilot_seeds']} | {sd} | "
            f"{r.get('seeds_needed', 'n/a')} | {hw_text} |"
        )
    lines += ["", f"Seeds needed: {result['needed']} (the study runs {result['study_seeds']})."]
    if result["chosen"]:
        chosen = result["chosen"]
        lines.append(f"Chosen in the study file: {chosen['seeds']} seeds; why: {chosen['reason']}")
    return "\n".join(lines)
