"""Controls in a study (runs.controls) and the gap_fraction comparison: an arm's perplexity
change in units of the baseline-to-control gap, tested against hand-worked numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers.prereg import finished_run, full_metrics, study, write

from moestack import prereg
from moestack.errors import MoestackError

# seed -> perplexity; the baseline 10 at every seed
PERPLEXITY = {
    "baseline": [10.0, 10.0, 10.0],
    "fewer": [12.0, 12.2, 11.8],  # gaps +20%, +22%, +18% (mean +20%)
    "dense": [13.0, 13.5, 12.5],  # +30%, +35%, +25%
    "a": [10.4, 10.5, 10.45],  # +4%, +5%, +4.5%: 0.225 of the fewer-experts gap
    "b": [10.1, 10.12, 10.08],  # +1%, +1.2%, +0.8%: 0.05 of it
}
GAP_HYPOTHESIS = {
    "id": "H5",
    "statement": "perplexity within a quarter of the baseline-to-fewer-experts gap",
    "metric": "perplexity",
    "comparison": "gap_fraction",
    "control": "fewer",
    "op": "<=",
    "threshold": 0.25,
    "arms": ["a", "b"],
    "require": "all",
    "decision": "noninferiority",
}


def controlled(**hypothesis: Any) -> dict[str, Any]:
    """The helper study with two controls (as few experts as 4 slots hold; a dense model of
    the same active size) and a gap_fraction hypothesis (``hypothesis`` changes it)."""
    data = study()
    data["runs"]["arms"]["fewer"] = ["router=baseline", "model.moe.num_experts=4"]
    data["runs"]["arms"]["dense"] = [
        "router=baseline", "model.moe.num_experts=1", "model.moe.top_k=1", "model.moe.d_ff=512"
    ]  # fmt: skip
    data["runs"]["controls"] = ["fewer", "dense"]
    data["analysis"]["decision"] = "noninferiority"
    data["hypotheses"].append({**GAP_HYPOTHESIS, **hypothesis})
    return data


def records(spec: prereg.Prereg) -> list[dict[str, Any]]:
    return [
        {"arm": arm, "seed": seed, "status": "done",
         "metrics": full_metrics({"perplexity": PERPLEXITY[arm][seed]})}
        for arm in spec.arms for seed in spec.seeds
    ]  # fmt: skip


def test_a_gap_fraction_is_tested_as_a_linear_form_of_the_paired_changes(tmp_path) -> None:
    """Per seed (arm/base - 1) - 0.25 (fewer/base - 1), worked by hand: a gives -0.01,
    -0.005, 0 (mean -0.005, sd 0.005: the one-sided 95% upper bound, t(0.95, 2) = 2.920,
    is +0.0034, the lower -0.0134: inconclusive); b gives -0.04, -0.043, -0.037 (upper
    bound -0.0349: passes, Holm-adjusted p below 0.05)."""
    spec = prereg.parse(controlled(), tmp_path / "s.yaml")
    hyp = {h["id"]: h for h in prereg.evaluate_hypotheses(spec, records(spec))}["H5"]
    a, b = hyp["rows"]
    assert a["per_seed"] == pytest.approx([-0.01, -0.005, 0.0], abs=1e-12)
    assert b["per_seed"] == pytest.approx([-0.04, -0.043, -0.037], abs=1e-12)
    t = 2.919986
    assert a["bound"] == pytest.approx(-0.005 + t * 0.005 / math.sqrt(3), rel=1e-5)
    assert a["other_bound"] == pytest.approx(-0.005 - t * 0.005 / math.sqrt(3), rel=1e-5)
    assert a["outcome"] == "inconclusive" and b["outcome"] == "pass"
    assert b["bound"] == pytest.approx(-0.04 + t * 0.003 / math.sqrt(3), rel=1e-5)
    assert a["fraction"] == pytest.approx(0.225) and b["fraction"] == pytest.approx(0.05)
    assert a["gap"] == pytest.approx(0.20) and a["change"] == pytest.approx(0.045)
    assert hyp["verdict"] == "inconclusive"


def test_the_report_states_each_arm_in_units_of_each_controls_gap(tmp_path) -> None:
    path = write(tmp_path, controlled())
    prereg.lock(path)
    spec = prereg.load(path)
    key, lock = prereg.analysis_key(spec), prereg.verify(spec.path)
    for item in prereg.plan(spec, tmp_path / "out"):
        metrics = full_metrics({"perplexity": PERPLEXITY[item.arm][item.seed]})
        finished_run(item, lock, key, metrics)
    report = prereg.analyze(path, tmp_path / "out", evaluate=False)
    results = json.loads((report.parent / "results.json").read_text())
    fewer, dense = results["controls"]
    assert fewer["control"] == "fewer" and fewer["gap"] == pytest.approx(0.20)
    assert dense["gap"] == pytest.approx(0.30)
    assert fewer["arms"]["a"]["fraction"] == pytest.approx(0.225)
    assert dense["arms"]["a"]["fraction"] == pytest.approx(0.045 / 0.30)
    assert set(fewer["arms"]) == {"a", "b"}  # neither the baseline nor a control
    text = report.read_text()
    assert "## Controls" in text and "| a | 3 | +4.5% | 0.225 |" in text
    assert "a quarter" in text and "0.225 of the gap" in text


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"control": ""}, r"hypotheses\[4\] \(H5\)\.control"),
        ({"comparison": "relative_change"}, r"hypotheses\[4\] \(H5\)\.control"),
        ({"control": "a"}, r"is not a control outside"),
        ({"control": "baseline"}, r"is not a control"),
    ],
)
def test_a_gap_hypothesis_names_a_control_outside_its_arms(tmp_path, change, named) -> None:
    with pytest.raises(MoestackError, match=named):
        prereg.parse(controlled(**change), tmp_path / "s.yaml")


def test_controls_are_arms_other_than_the_baseline(tmp_path: Path) -> None:
    for bad in (["baseline"], ["nowhere"]):
        data = controlled()
        data["runs"]["controls"] = bad
        with pytest.raises(MoestackError, match=r"runs\.controls\[0\]"):
            prereg.parse(data, tmp_path / "s.yaml")


def test_batched_replay_metrics_are_named_and_keyed_apart(tmp_path) -> None:
    """serve_batches adds <policy>/cap<c>/b<b>/<stat> metrics; the default (one stream)
    keeps the analysis key of studies analysed before batches existed."""
    from moestack.prereg.analysis import analysis_key, metric_names

    plain = prereg.parse(study(), tmp_path / "s.yaml")
    data = study()
    data["analysis"]["serve_batches"] = [1, 8]
    batched = prereg.parse(data, tmp_path / "s.yaml")
    names = metric_names(batched.analysis)
    assert set(names) - set(metric_names(plain.analysis)) == {
        f"{p}/cap{c}/b8/{s}" for p in ("lru", "static") for c in (2, 4)
        for s in prereg.CACHE_STATS
    }  # fmt: skip
    explicit = study()
    explicit["analysis"]["serve_batches"] = [1]
    assert analysis_key(prereg.parse(explicit, tmp_path / "s.yaml")) == analysis_key(plain)
    assert analysis_key(batched) != analysis_key(plain)


def test_power_of_a_gap_hypothesis_uses_the_per_seed_linear_form(tmp_path: Path) -> None:
    """The power table's spread of H5 is that of (arm/base - 1) - 0.25 x (control/base - 1)
    per seed, worked by hand from PERPLEXITY, not the spread of the arm's perplexity."""
    import statistics

    from moestack.prereg.power import analyse

    spec = prereg.parse(controlled(), tmp_path / "s.yaml")
    rows = {(r["hypothesis"], r["arm"]): r for r in analyse(spec, records(spec), 0.005, 0.95)}
    base = PERPLEXITY["baseline"]
    for arm in ("a", "b"):
        per_seed = [
            (a / b - 1) - 0.25 * (c / b - 1)
            for a, b, c in zip(PERPLEXITY[arm], base, PERPLEXITY["fewer"], strict=True)
        ]
        assert rows[("H5", arm)]["sd"] == pytest.approx(statistics.stdev(per_seed))
        assert rows[("H5", arm)]["budget"] and rows[("H5", arm)]["pilot_seeds"] == 3
