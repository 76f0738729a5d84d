"""The decision and report step of ``prereg analyze`` from the runs' records: a non-finite
metric never passes, the fraction of a control's gap is n/a where the gap is not clearly
above 0, the absolute misses table, and both shipped v3 studies end to end on synthetic
records with effects worked by hand (nothing is trained or evaluated)."""

from __future__ import annotations

import json
import math
import random
import re
import statistics
from typing import Any

import pytest
from helpers.paths import EXPERIMENTS
from helpers.prereg import full_metrics, study

from moestack import prereg
from moestack.prereg.analysis import metric_names
from moestack.prereg.decision import state
from moestack.prereg.report import _json_safe, decide_and_report, render_markdown
from moestack.prereg.stats import mean_ci, one_sided, t_quantile, t_sf
from moestack.prereg.verdicts import control_rows, misses_rows

LOCK = {"sha256": "0" * 64, "study_sha256": "1" * 64, "locked_at": "now", "history": []}


# ------------------------------------------------------------------ non-finite metrics
def test_the_statistics_refuse_nan_naming_it() -> None:
    """max(0, nan) is 0: a NaN t statistic read as p = 0, a pass."""
    with pytest.raises(ValueError, match=r"x=nan"):
        t_sf(math.nan, 3)
    with pytest.raises(ValueError, match=r"p=nan"):
        t_quantile(math.nan, 3)
    with pytest.raises(ValueError, match=r"per_seed\[1\] = inf"):
        one_sided([0.001, math.inf, 0.002], "<=", 0.01)
    with pytest.raises(ValueError, match=r"values\[0\] = nan"):
        mean_ci([math.nan, 1.0], 0.95)
    assert t_sf(math.inf, 3) == 0.0 and t_sf(-math.inf, 3) == 1.0  # still defined


def budget_study(decision: str = "noninferiority") -> dict[str, Any]:
    """Baseline, arm a and the control fewer over four seeds: a budget (B1), a gap budget
    (B2), a miss cut (B3) and B1 and B2 together (B4); ``decision`` rules B1."""
    data = study()
    data["runs"]["arms"] = {
        "baseline": ["router=baseline"],
        "a": ["router=temporal", "router.temporal=0.1"],
        "fewer": ["router=baseline", "model.moe.num_experts=4"],
    }
    data["runs"]["controls"] = ["fewer"]
    data["runs"]["seeds"] = [0, 1, 2, 3]
    data["analysis"]["decision"] = "noninferiority"
    data["analysis"]["decision_reason"] = "tests"
    common = {"arms": ["a"], "require": "all", "op": "<="}
    data["hypotheses"] = [
        {"id": "B1", "statement": "within +1%", "metric": "perplexity",
         "comparison": "relative_change", "threshold": 0.01, "decision": decision, **common},
        {"id": "B2", "statement": "a quarter of the gap", "metric": "perplexity",
         "comparison": "gap_fraction", "control": "fewer", "threshold": 0.25, **common},
        {"id": "B3", "statement": "misses down 30%", "metric": "lru/cap4/miss_rate",
         "comparison": "relative_change", "threshold": -0.30, "decision": "superiority",
         **common},
        {"id": "B4", "statement": "B1 and B2", "comparison": "joint", "of": ["B1", "B2"],
         "arms": ["a"], "require": "all"},
    ]  # fmt: skip
    return data


# a: +0.1%, +0.2%, 0, +0.1% of perplexity (well within both budgets: fewer costs +10%) and
# misses down 40%; one run made broken by the test.
BUDGET_PPL = {"baseline": [10.0] * 4, "a": [10.01, 10.02, 10.0, 10.01], "fewer": [11.0] * 4}


def budget_records(spec: prereg.Prereg, broken: tuple[str, int, float] | None) -> list[dict]:
    out = []
    for arm in spec.arms:
        for seed in spec.seeds:
            ppl = BUDGET_PPL[arm][seed]
            if broken and (arm, seed) == broken[:2]:
                ppl = broken[2]
            miss = 0.3 if arm == "a" else 0.5
            metrics = full_metrics({"perplexity": 10.0, "lru/cap4/miss_rate": miss})
            metrics["perplexity"] = ppl
            out.append({"run": f"{arm}-s{seed}", "arm": arm, "seed": seed, "status": "done",
                        "metrics": metrics})  # fmt: skip
    return out


def by_id(hypotheses: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {h["id"]: h for h in hypotheses}


def test_every_budget_passes_without_a_broken_run(tmp_path) -> None:
    """The reference for the tests below: the same numbers, no broken run, pass."""
    spec = prereg.parse(budget_study(), tmp_path / "s.yaml")
    hyp = by_id(prereg.evaluate_hypotheses(spec, budget_records(spec, None)))
    assert {k: h["verdict"] for k, h in hyp.items()} == dict.fromkeys(hyp, "pass")


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("decision", ["noninferiority", "ci", "mean"])
def test_a_broken_run_of_the_arm_fails_it_under_every_rule(tmp_path, value, decision) -> None:
    """a's seed 1 at perplexity inf (a diverged model) or NaN: before, inf gave a NaN spread,
    t_sf(NaN) = 0 and a pass; now the arm fails both budgets and their joint, whatever the
    rule, and the miss cut (another metric, finite) still passes."""
    spec = prereg.parse(budget_study(decision), tmp_path / "s.yaml")
    records = budget_records(spec, ("a", 1, value))
    hyp = by_id(prereg.evaluate_hypotheses(spec, records))
    for name in ("B1", "B2", "B4"):
        (row,) = hyp[name]["rows"]
        assert row["pass"] is False and state(row) == "fail", name
        assert hyp[name]["verdict"] == "fail", name
    (row,) = hyp["B1"]["rows"]
    assert row["nonfinite"] == [{"seed": 1, "role": "arm", "arm": "a", "value": repr(value)}]
    assert row["estimate"] is None and "p" not in row  # no statistic saw it
    assert hyp["B3"]["verdict"] == "pass"
    text = render_markdown(spec, LOCK, records, list(hyp.values()), [])
    assert f"- a: perplexity is not finite in a seed 1 ({value!r}): counted as a fail" in text
    assert f"Left out of these means (perplexity not finite): a seed 1 ({value!r})." in text


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("broken", ["baseline", "fewer"])
def test_a_broken_reference_run_leaves_the_row_without_an_estimate(tmp_path, value, broken):
    """The baseline at inf made every arm's change -100% there (a pass before); a broken
    baseline or control run now leaves the rows that compare with it missing: incomplete,
    never pass."""
    spec = prereg.parse(budget_study(), tmp_path / "s.yaml")
    records = budget_records(spec, (broken, 2, value))
    results, text = decide_and_report(spec, LOCK, records)
    hyp = by_id(results["hypotheses"])
    affected = ("B1", "B2") if broken == "baseline" else ("B2",)
    for name in affected:
        (row,) = hyp[name]["rows"]
        assert row["pass"] is None and state(row) == "missing", name
        assert row["nonfinite"][0]["role"] == ("baseline" if broken == "baseline" else "control")
        assert hyp[name]["verdict"] == "incomplete"
    assert hyp["B4"]["verdict"] == "incomplete"
    if broken == "fewer":
        assert hyp["B1"]["verdict"] == "pass"
    assert "no estimate (the comparison with a broken baseline or control run" in text
    json.dumps(_json_safe(results), allow_nan=False)  # results.json holds no NaN or inf


# ------------------------------------------------------------------ the fraction of the gap
def gap_records(spec: prereg.Prereg, fewer: list[float], a: list[float]) -> list[dict]:
    """The baseline at perplexity 10 at every seed; fewer and a at 10 x (1 + change)."""
    ppl = {"baseline": [0.0] * 3, "fewer": fewer, "a": a, "b": a}
    return [
        {"run": f"{arm}-s{s}", "arm": arm, "seed": s, "status": "done",
         "metrics": full_metrics({"perplexity": 10.0 * (1 + ppl[arm][s])})}
        for arm in ("baseline", "fewer", "a", "b") for s in spec.seeds
    ]  # fmt: skip


def gap_study() -> dict[str, Any]:
    data = study()
    data["runs"]["arms"]["fewer"] = ["router=baseline", "model.moe.num_experts=4"]
    data["runs"]["controls"] = ["fewer"]
    data["analysis"]["decision"] = "noninferiority"
    data["hypotheses"] = [
        {"id": "H5", "statement": "a quarter of the gap", "metric": "perplexity",
         "comparison": "gap_fraction", "control": "fewer", "op": "<=", "threshold": 0.25,
         "arms": ["a"], "require": "all"},
    ]  # fmt: skip
    return data


def test_no_fraction_where_the_control_is_better_than_the_baseline(tmp_path) -> None:
    """fewer 0.8% better than the baseline, a +0.4%: the ratio would read "-0.5 of the gap".
    The test is unchanged: per seed 0.004 - 0.25 x (-0.008) = +0.006 > 0, so a fails (with
    no spread the sign decides)."""
    spec = prereg.parse(gap_study(), tmp_path / "s.yaml")
    records = gap_records(spec, [-0.008] * 3, [0.004] * 3)
    (hyp,) = prereg.evaluate_hypotheses(spec, records)
    (row,) = hyp["rows"]
    assert row["per_seed"] == pytest.approx([0.006] * 3)
    assert row["outcome"] == "fail" and hyp["verdict"] == "fail"
    assert row["fraction"] is None and row["gap"] == pytest.approx(-0.008)
    assert row["fraction_note"] == "the control is not worse than the baseline"
    (control,) = control_rows(spec, records)
    assert control["fraction_note"] == "the control is not worse than the baseline"
    assert control["arms"]["a"]["fraction"] is None
    text = render_markdown(spec, LOCK, records, [hyp], [])
    assert "-0.5 of the gap" not in text and "| -0.5 |" not in text
    assert (
        "- a: perplexity +0.4% against a baseline-to-fewer gap of -0.8% [-0.8%, -0.8%]: "
        "fraction of the gap n/a (the control is not worse than the baseline)"
    ) in text
    assert "read H5 from its test, which is unchanged" in text
    assert "With fewer no worse than the baseline that allows no rise at all" in text
    assert "| a | 3 | +0.4% | n/a |" in text
    assert "Fraction of the gap n/a: the control is not worse than the baseline." in text


def test_no_fraction_where_the_gaps_interval_includes_zero(tmp_path) -> None:
    """fewer +2%, -1%, +1.5%: mean +0.833%, sd 1.607 pp, the 95% interval's lower end
    0.00833 - 4.303 x 0.01607 / sqrt(3) = -0.0316 < 0: n/a, though the mean gap is > 0."""
    spec = prereg.parse(gap_study(), tmp_path / "s.yaml")
    fewer = [0.02, -0.01, 0.015]
    records = gap_records(spec, fewer, [0.001, 0.002, 0.0])
    (hyp,) = prereg.evaluate_hypotheses(spec, records)
    (row,) = hyp["rows"]
    sd = statistics.stdev(fewer)
    lo = statistics.mean(fewer) - 4.302653 * sd / math.sqrt(3)
    assert row["gap"] == pytest.approx(statistics.mean(fewer))
    assert row["gap_ci"][0] == pytest.approx(lo, rel=1e-5) and lo < 0
    assert row["fraction"] is None and row["fraction_note"] == "the gap's interval includes 0"
    assert control_rows(spec, records)[0]["fraction_note"] == "the gap's interval includes 0"
    text = render_markdown(spec, LOCK, records, [hyp], [])
    assert "fraction of the gap n/a (the gap's interval includes 0)" in text
    assert "Fraction of the gap n/a: the gap's interval includes 0." in text


def test_a_clear_gap_keeps_its_fraction(tmp_path) -> None:
    """fewer +20%, +22%, +18% (interval well above 0), a +4.5%: 0.225 of the gap."""
    spec = prereg.parse(gap_study(), tmp_path / "s.yaml")
    records = gap_records(spec, [0.20, 0.22, 0.18], [0.04, 0.05, 0.045])
    (row,) = prereg.evaluate_hypotheses(spec, records)[0]["rows"]
    assert row["fraction"] == pytest.approx(0.225) and "fraction_note" not in row
    assert control_rows(spec, records)[0]["arms"]["a"]["fraction"] == pytest.approx(0.225)


# ------------------------------------------------------------------ absolute misses
def test_the_misses_table_gives_seed_means_and_sds(tmp_path) -> None:
    """Capacities 2 and 4, batches 1 and 8: every lru misses-per-token metric the analysis
    names, each arm's seed mean and sample sd; an arm without them is named, not shown."""
    data = study()
    data["runs"]["arms"]["dense"] = ["router=baseline"]
    data["analysis"]["serve_batches"] = [1, 8]
    spec = prereg.parse(data, tmp_path / "s.yaml")
    names = [m for m in metric_names(spec.analysis) if m.startswith("lru/") and "misses" in m]
    assert sorted(names) == [f"lru/cap{c}{b}/misses_per_token" for c in (2, 4) for b in ("/b8", "")]
    values = {  # arm -> metric -> per seed
        "baseline": {m: [2.0, 2.0, 2.0] for m in names},
        "a": {**{m: [1.0, 2.0, 3.0] for m in names}, "lru/cap4/b8/misses_per_token":
              [0.5, 0.75, math.nan]},
        "b": {m: [1.5, 1.5, 1.5] for m in names},
    }  # fmt: skip
    records = []
    for arm in spec.arms:
        for s in spec.seeds:
            metrics = {"perplexity": 10.0}
            if arm != "dense":
                metrics.update({m: values[arm][m][s] for m in names})
            records.append({"arm": arm, "seed": s, "status": "done", "metrics": metrics})
    table = misses_rows(spec, records)
    assert table["batches"] == [1, 8] and table["capacities"] == [2, 4]
    assert table["skipped"] == [{"arm": "dense", "why": "no misses-per-token metric in its runs"}]
    a4 = next(r for r in table["rows"] if (r["arm"], r["capacity"]) == ("a", 4))
    one, eight = a4["cells"]
    assert (one["mean"], one["sd"], one["min"], one["max"]) == (2.0, 1.0, 1.0, 3.0)
    assert eight["mean"] == pytest.approx(0.625) and eight["n"] == 2 and eight["nonfinite"] == 1
    assert eight["sd"] == pytest.approx(statistics.stdev([0.5, 0.75]))
    lines = prereg.report_tables.misses_lines(table)
    text = "\n".join(lines)
    assert "| arm | capacity | seeds | batch 1 | batch 8 |\n|---|---|---|---|---|" in text
    assert "| a | 2 | 3 | 2 +- 1 | 2 +- 1 |" in text
    assert "| a | 4 | 3 | 2 +- 1 | 0.625 +- 0.18 (n = 2) |" in text
    assert "| b | 4 | 3 | 1.5 +- 0 | 1.5 +- 0 |" in text
    assert "Non-finite values left out (runs): a capacity 4 batch 8: 1." in text
    assert "Not shown: dense (no misses-per-token metric in its runs)." in text
    assert "| dense |" not in text


# ------------------------------------------------------------------ the shipped studies
# Per arm: (perplexity change, LRU misses change at one stream, at batches 8 and 32), each
# seed's value the baseline's x (1 + change + noise), noise uniform in +-0.001 (one arm and
# seed at a time), so each verdict below is far from its threshold and worked by hand.
# prereg_cpu_v3: fewer costs +8%. temporal passes everything (H2b: 0.002 - 0.25 x 0.08 =
# -0.018); consistency cuts misses (H1, H3) but costs +3% (H2a fails; H2b 0.03 - 0.02 > 0);
# pin fails everything (-10% misses; H2b 0.04 - 0.02 > 0).
V3 = {
    "baseline": (0.0, 0.0, 0.0),
    "temporal": (0.002, -0.50, -0.45),
    "consistency": (0.03, -0.40, -0.35),
    "pin": (0.04, -0.10, -0.05),
    "fewer": (0.08, -1.0, -1.0),
    "dense": (0.15, -1.0, -1.0),
}
V3_ROWS = {  # hypothesis -> (temporal, consistency, pin)
    "H1": ("pass", "pass", "fail"),
    "H2a": ("pass", "fail", "fail"),
    "H2b": ("pass", "fail", "fail"),
    "H2": ("pass", "fail", "fail"),
    "H3": ("pass", "pass", "fail"),
    "H4": ("pass", "fail", "fail"),
}
V3_VERDICTS = {"H1": "pass", "H2a": "fail", "H2b": "fail", "H2": "fail", "H3": "pass",
               "H4": "pass"}  # fmt: skip
# prereg_cpu_v3_e16: fewer 0.5% better than the baseline (no gap: the fraction n/a), so H2b
# asks change <= 0.25 x (-0.005) = -0.00125. temporal: -0.5% passes it, -20% at batch 8
# fails H3; consistency: +0.2% passes H2a, fails H2b; pin: +0.1% passes H2a, fails H2b, H1.
E16 = {
    "baseline": (0.0, 0.0, 0.0),
    "temporal": (-0.005, -0.50, -0.20),
    "consistency": (0.002, -0.35, -0.35),
    "pin": (0.001, -0.10, -0.05),
    "fewer": (-0.005, -1.0, -1.0),
    "dense": (0.10, -1.0, -1.0),
}
E16_ROWS = {
    "H1": ("pass", "pass", "fail"),
    "H2a": ("pass", "pass", "pass"),
    "H2b": ("pass", "fail", "fail"),
    "H2": ("pass", "fail", "fail"),
    "H3": ("fail", "pass", "fail"),
    "H4": ("pass", "fail", "fail"),
}
E16_VERDICTS = {"H1": "pass", "H2a": "pass", "H2b": "fail", "H2": "fail", "H3": "pass",
                "H4": "pass"}  # fmt: skip
_MISSES = re.compile(r"lru/cap(\d+)(?:/b(\d+))?/misses_per_token")


def shipped_records(spec: prereg.Prereg, effects: dict[str, tuple]) -> list[dict[str, Any]]:
    """A complete set of records: every metric ``metric_names`` gives, every arm and seed."""
    rng = random.Random(0)
    names = metric_names(spec.analysis)
    level = {s: (1 + 0.03 * rng.uniform(-1, 1), 1 + 0.05 * rng.uniform(-1, 1)) for s in spec.seeds}
    records = []
    for arm, (d_ppl, d_one, d_batch) in effects.items():
        for seed in spec.seeds:
            ppl = 10.0 * level[seed][0] * (1 + d_ppl + rng.uniform(-1e-3, 1e-3))
            metrics = dict.fromkeys(names, 0.5)
            metrics.update(perplexity=ppl, val_loss=math.log(ppl))
            for name in names:
                if match := _MISSES.fullmatch(name):
                    cap, batch = int(match[1]), int(match[2] or 1)
                    change = d_one if batch == 1 else d_batch
                    base = 8.0 / cap * (1 + 0.1 * math.log2(batch)) * level[seed][1]
                    noise = rng.uniform(-1e-3, 1e-3) if change > -1 else 0.0
                    metrics[name] = base * (1 + change + noise)
                elif name.endswith("/perplexity"):  # a steered evaluation's
                    metrics[name] = ppl * 1.01
                    metrics[name.replace("perplexity", "val_loss")] = math.log(ppl * 1.01)
            records.append({"run": f"{arm}-s{seed}", "arm": arm, "seed": seed,
                            "status": "done", "source": "cache", "metrics": metrics})  # fmt: skip
    return records


@pytest.mark.parametrize(
    ("name", "effects", "rows", "verdicts"),
    [
        ("prereg_cpu_v3", V3, V3_ROWS, V3_VERDICTS),
        ("prereg_cpu_v3_e16", E16, E16_ROWS, E16_VERDICTS),
    ],
)
def test_the_shipped_studies_decide_as_worked_by_hand(name, effects, rows, verdicts) -> None:
    path = EXPERIMENTS / f"{name}.yaml"
    spec, lock = prereg.load(path), prereg.verify(path)
    records = shipped_records(spec, effects)
    results, text = decide_and_report(spec, lock, records, checks=[])
    hyp = by_id(results["hypotheses"])
    assert {k: h["verdict"] for k, h in hyp.items()} == verdicts
    for hid, expected in rows.items():
        got = {r["arm"]: state(r) for r in hyp[hid]["rows"]}
        assert got == dict(zip(("temporal", "consistency", "pin"), expected, strict=True)), hid
    json.dumps(_json_safe(results), allow_nan=False)

    # The Controls table, in units of each control's gap (independently from the records).
    ppl = {(r["arm"], r["seed"]): r["metrics"]["perplexity"] for r in records}

    def change(arm: str) -> float:
        return statistics.mean(ppl[(arm, s)] / ppl[("baseline", s)] - 1 for s in spec.seeds)

    n = len(spec.seeds)
    assert "## Controls" in text
    assert "| arm | seeds | perplexity change | fraction of the gap |" in text
    for arm in ("temporal", "consistency", "pin"):
        shown = f"{100 * change(arm):+.1f}%"
        fraction = f"{change(arm) / change('fewer'):.3g}" if effects["fewer"][0] > 0 else "n/a"
        assert f"| {arm} | {n} | {shown} | {fraction} |" in text, arm
    if effects["fewer"][0] <= 0:
        assert "Fraction of the gap n/a: the control is not worse than the baseline." in text
        assert "read H2b from its test, which is unchanged" in text
        assert all(r["fraction"] is None for r in hyp["H2b"]["rows"])
    else:
        assert "Where the fraction is n/a" not in text

    # The misses table: every capacity x batch the analysis evaluates, each arm.
    caps, batches = spec.analysis.capacities, sorted(set(spec.analysis.serve_batches))
    assert "## LRU misses per token" in text
    header = "| arm | capacity | seeds | " + " | ".join(f"batch {b}" for b in batches) + " |"
    assert header in text
    table = results["misses"]
    assert [(r["arm"], r["capacity"]) for r in table["rows"]] == [
        (arm, cap) for arm in spec.arms for cap in caps
    ]
    assert table["skipped"] == []
    h1_cap = int(_MISSES.fullmatch(hyp["H1"]["metric"])[1])
    for arm in ("baseline", "temporal"):
        values = [
            r["metrics"][f"lru/cap{h1_cap}/b8/misses_per_token"] for r in records if r["arm"] == arm
        ]
        found = next(r for r in table["rows"] if (r["arm"], r["capacity"]) == (arm, h1_cap))
        cells = {c["batch"]: c for c in found["cells"]}
        assert cells[8]["mean"] == pytest.approx(statistics.mean(values))
        assert cells[8]["sd"] == pytest.approx(statistics.stdev(values))
        row = next(line for line in text.splitlines() if line.startswith(f"| {arm} | {h1_cap} |"))
        assert f"{statistics.mean(values):.4g} +- {statistics.stdev(values):.2g}" in row
    fewer = next(r for r in table["rows"] if r["arm"] == "fewer")
    assert all(c["mean"] == 0.0 for c in fewer["cells"])  # it never misses


def test_a_broken_run_of_the_arm_fails_it_even_where_its_partner_did_not_finish(tmp_path):
    """a's seed 3 at perplexity inf while the baseline's seed 3 failed (an interim analysis):
    the broken run still fails a's budgets instead of dropping out with its pair."""
    spec = prereg.parse(budget_study(), tmp_path / "s.yaml")
    records = budget_records(spec, ("a", 3, math.inf))
    for r in records:
        if (r["arm"], r["seed"]) == ("baseline", 3):
            r["status"] = "failed"
    hyp = by_id(prereg.evaluate_hypotheses(spec, records))
    for name in ("B1", "B2"):
        (row,) = hyp[name]["rows"]
        assert row["pass"] is False and state(row) == "fail", name


def test_a_value_hypothesis_ignores_a_broken_baseline(tmp_path):
    """A hypothesis on the arm's own value (miss rate <= 0.4) never reads the baseline: the
    baseline's seed 1 at NaN leaves a's row as it is (all four seeds at 0.3: a pass)."""
    data = budget_study()
    data["hypotheses"] = [
        {"id": "V1", "statement": "miss rate at most 0.4", "metric": "lru/cap4/miss_rate",
         "comparison": "value", "threshold": 0.4, "op": "<=", "arms": ["a"],
         "require": "all", "decision": "mean"},
    ]  # fmt: skip
    spec = prereg.parse(data, tmp_path / "s.yaml")
    records = budget_records(spec, None)
    for r in records:
        if (r["arm"], r["seed"]) == ("baseline", 1):
            r["metrics"]["lru/cap4/miss_rate"] = math.nan
    (row,) = by_id(prereg.evaluate_hypotheses(spec, records))["V1"]["rows"]
    assert row["n"] == 4 and "nonfinite" not in row
    assert row["estimate"] == pytest.approx(0.3) and row["pass"] is True


def test_steered_rows_leave_out_a_broken_baseline_run() -> None:
    """The baseline's seed 0 at perplexity inf: its pair leaves the steered rows' changes
    against the baseline (before, it added -100% to their mean); the others stay."""
    from moestack.prereg.verdicts import steered_rows

    spec = prereg.load(EXPERIMENTS / "prereg_cpu_v3.yaml")
    records = shipped_records(spec, V3)
    seed0 = spec.seeds[0]
    for r in records:
        if (r["arm"], r["seed"]) == ("baseline", seed0):
            r["metrics"]["perplexity"] = math.inf
    ppl = {(r["arm"], r["seed"]): r["metrics"] for r in records}
    row = next(r for r in steered_rows(spec, records) if r["arm"] == "temporal")
    name = f"{row['steering']}/cap{row['capacity']}/perplexity"
    want = statistics.mean(
        ppl[("temporal", s)][name] / ppl[("baseline", s)]["perplexity"] - 1 for s in spec.seeds[1:]
    )
    assert row["perplexity_vs_baseline"] == pytest.approx(want)
