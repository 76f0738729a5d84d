"""Power analysis, the one-sided decision rules, Holm's correction and the lock's rule check."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from helpers.paths import EXPERIMENTS, REPO
from helpers.prereg import finished_run, full_metrics, write

from moestack import cli, prereg
from moestack.errors import MoestackError

SEEDS = [0, 1, 2, 3, 4]
T95_DF4 = 2.131847  # one-sided 95% t quantile, 4 degrees of freedom (tables)

# Per-seed relative changes against the baseline (perplexity 10, LRU miss rate 0.5).
PPL = {
    "good": [-0.002, 0.0, 0.002, -0.001, 0.001],  # upper bound +0.15% <= +1%: pass
    "bad": [0.03, 0.032, 0.028, 0.031, 0.029],  # lower bound +2.8% > +1%: fail
    "unsure": [-0.012, 0.028, 0.0, 0.02, 0.004],  # mean +0.8%, interval straddles +1%
}
MISS = {
    "good": [-0.41, -0.38, -0.35, -0.32, -0.29],  # mean -35%: t = 2.36, p = 0.039 one-sided
    "bad": [-0.11, -0.10, -0.09, -0.10, -0.10],  # far above -30%: fail
    "unsure": [-0.35] * 5,
}


def noninferiority_study(**analysis: Any) -> dict[str, Any]:
    """Baseline and three arms over five seeds; a budget, a superiority claim and a joint one."""
    ppl = {"metric": "perplexity", "comparison": "relative_change", "op": "<=", "threshold": 0.01}
    return {
        "study": "ni",
        "model": ["model=tiny"],
        "budget": {"steps": 3},
        "runs": {
            "baseline": "baseline",
            "arms": {a: ["router=baseline"] for a in ("baseline", "good", "bad", "unsure")},
            "seeds": SEEDS,
        },
        "analysis": {
            "eval_batches": 1,
            "policies": ["lru", "static"],
            "capacities": [2, 4],
            "decision": "noninferiority",
            **analysis,
        },
        "hypotheses": [
            {
                "id": "N1",
                "statement": "all within budget",
                **ppl,
                "arms": ["good", "bad", "unsure"],
            },
            {"id": "N2", "statement": "good and unsure", **ppl, "arms": ["good", "unsure"]},
            {"id": "N3", "statement": "good alone", **ppl, "arms": ["good"]},
            {
                "id": "S1",
                "statement": "misses down 30%",
                "metric": "lru/cap4/miss_rate",
                "comparison": "relative_change",
                "op": "<=",
                "threshold": -0.30,
                "arms": ["good", "bad"],
                "require": "any",
                "decision": "superiority",
            },
            {
                "id": "J1",
                "statement": "N1 and N2 together",
                "comparison": "joint",
                "of": ["N1", "N2"],
                "arms": ["unsure"],
            },
        ],
    }


def synthetic_runs(path: Path, out: Path) -> None:
    """Run folders as a finished study leaves them, with the metrics above."""
    spec = prereg.load(path)
    key, lock = prereg.analysis_key(spec), prereg.verify(path)
    for item in prereg.plan(spec, out):
        i = SEEDS.index(item.seed)
        ppl, miss = 10.0, 0.5
        if item.arm != "baseline":
            ppl, miss = 10.0 * (1 + PPL[item.arm][i]), 0.5 * (1 + MISS[item.arm][i])
        finished_run(item, lock, key, full_metrics({"perplexity": ppl, "lru/cap4/miss_rate": miss}))


def analysed(tmp_path: Path, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Lock ``data`` (with the rule check), fake its runs, analyze: hypotheses by id, report."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write(tmp_path, data)
    prereg.lock(path, rules=True)
    synthetic_runs(path, tmp_path / "out")
    report = prereg.analyze(path, tmp_path / "out", evaluate=False)
    results = json.loads((report.parent / "results.json").read_text())
    return {h["id"]: h for h in results["hypotheses"]}, report.read_text()


# ------------------------------------------------------------------ the power calculation
def test_seeds_needed_worked_example() -> None:
    # sd = 1% and a half-width of 0.5% at 95% two-sided: t(0.975, 17) = 2.110 and
    # 2.110 / sqrt(18) = 0.497 <= 0.5, while t(0.975, 16) = 2.120 and 2.120 / sqrt(17) = 0.514.
    assert prereg.seeds_needed(0.01, 0.005, 0.95) == 18
    assert prereg.half_width(0.01, 18) == pytest.approx(2.1098 * 0.01 / math.sqrt(18), rel=1e-3)
    assert prereg.half_width(0.01, 17) > 0.005 >= prereg.half_width(0.01, 18)
    # sd = 2%: by hand t(0.975, n-1) * 2 / sqrt(n) <= 0.5 first at n = 64 (t(63) = 1.998).
    assert prereg.seeds_needed(0.02, 0.005) == 64
    assert prereg.seeds_needed(0.0, 0.005) == 2
    with pytest.raises(MoestackError, match="half-width"):
        prereg.seeds_needed(0.01, 0.0)


def test_power_from_a_pilot_folder_and_the_spec_block(tmp_path: Path, capsys) -> None:
    data = noninferiority_study()
    data["power"] = {"pilot": "out", "seeds": 5, "reason": "the pilot's sd"}
    path = write(tmp_path, data)
    prereg.lock(path)
    synthetic_runs(path, tmp_path / "out")
    with pytest.raises(MoestackError, match="analyze the pilot study first"):
        prereg.power(path)  # per-run evaluations are no pilot before the analysis
    prereg.analyze(path, tmp_path / "out", evaluate=False)  # out/report/results.json
    result = prereg.power(path)  # the pilot named in the file, relative to it
    rows = {(r["hypothesis"], r["arm"]): r for r in result["rows"]}
    sd = math.sqrt(sum(v * v for v in PPL["good"]) / 4)  # the mean is 0
    assert rows["N1", "good"]["sd"] == pytest.approx(sd, rel=1e-6)
    assert rows["N1", "good"]["seeds_needed"] == prereg.seeds_needed(sd, 0.005)
    needed = max(r["seeds_needed"] for r in result["rows"] if r["metric"] == "perplexity")
    assert result["needed"] == needed and result["chosen"]["seeds"] == 5
    cli.main(["prereg", "power", str(path), "--half-width", "0.01"])
    out = capsys.readouterr().out
    assert "| N1 | unsure | perplexity | 5 |" in out and "why: the pilot's sd" in out


def test_power_on_the_committed_pilot() -> None:
    pilot = REPO / "docs" / "prereg_cpu" / "results.json"
    result = prereg.power(EXPERIMENTS / "prereg_cpu.yaml", pilot)
    h2 = [r for r in result["rows"] if r["hypothesis"] == "H2"]
    assert [r["pilot_seeds"] for r in h2] == [2, 2, 2] and result["needed"] > 2


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"power": {"pilot": "p", "seeds": 3, "reason": "r"}}, "power.seeds"),
        ({"power": {"pilot": "p", "seeds": 5}}, "power.reason"),
        ({"power": {"pilot": "p", "seeds": 5, "reason": "r", "half_width": 0}}, "power.half_width"),
        ({"analysis": {"decision": "mean", "correction": "holm"}}, "analysis.correction"),
        ({"analysis": {"decision": "median"}}, "analysis.decision"),
    ],
)
def test_new_fields_are_validated(change: dict[str, Any], named: str) -> None:
    data = noninferiority_study()
    for key, value in change.items():
        data[key] = value if key == "power" else {**data[key], **value}
    with pytest.raises(MoestackError, match=named.replace(".", r"\.")):
        prereg.parse(data)


# ------------------------------------------------------------------ the decision rules
def test_holm_and_t_tail() -> None:
    assert prereg.holm([0.01, 0.04, 0.03], 3) == pytest.approx([0.03, 0.06, 0.06])
    assert prereg.holm([0.01, None], 2) == [0.02, None]
    assert prereg.t_sf(12.7062, 1) == pytest.approx(0.025, abs=1e-5)
    assert prereg.t_sf(2.1098, 17) == pytest.approx(0.025, abs=1e-4)
    assert prereg.t_sf(-T95_DF4, 4) == pytest.approx(0.95, abs=1e-5)
    assert prereg.t_sf(1e9, 3) == pytest.approx(0.0, abs=1e-12)


def test_noninferiority_pass_fail_and_inconclusive(tmp_path: Path) -> None:
    hyp, text = analysed(tmp_path, noninferiority_study())
    good, bad, unsure = hyp["N1"]["rows"]
    se = math.sqrt(sum(v * v for v in PPL["good"]) / 4) / math.sqrt(5)
    assert good["bound"] == pytest.approx(T95_DF4 * se, rel=1e-4)  # the mean is 0
    assert (good["outcome"], bad["outcome"], unsure["outcome"]) == ("pass", "fail", "inconclusive")
    assert bad["other_bound"] > 0.01 and unsure["other_bound"] < 0.01 < unsure["bound"]
    assert unsure["pass"] is None and unsure["estimate"] == pytest.approx(0.008)
    verdicts = {k: h["verdict"] for k, h in hyp.items()}
    assert verdicts == {
        "N1": "fail", "N2": "inconclusive", "N3": "pass", "S1": "pass", "J1": "inconclusive"
    }  # fmt: skip
    assert "| N2 | good and unsure | **inconclusive** |" in text
    assert "| unsure | 5 | +0.8% |" in text and "one-sided upper bound" in text
    assert "| unsure | inconclusive | inconclusive | 0.002 | inconclusive |" in text


def test_holm_turns_a_marginal_pass_inconclusive(tmp_path: Path) -> None:
    plain, _ = analysed(tmp_path / "plain", noninferiority_study())
    good, bad = plain["S1"]["rows"]
    assert 0.025 < good["p"]["pass"] < 0.05 and good["outcome"] == "pass"  # alone: passes
    holm, text = analysed(tmp_path / "holm", noninferiority_study(correction="holm"))
    good, bad = holm["S1"]["rows"]
    assert good["p_adjusted"]["pass"] == pytest.approx(2 * good["p"]["pass"])  # 2 arms
    assert good["outcome"] == "inconclusive" and bad["outcome"] == "fail"
    assert holm["S1"]["verdict"] == "inconclusive" and holm["N3"]["verdict"] == "pass"
    assert "Holm correction across the arms of each hypothesis" in text
    assert "one-sided 95% bounds: mean +- 2.13 x sd / sqrt(n)" in text


# ------------------------------------------------------------------ the lock's rule check
def test_mean_rule_on_a_budget_is_refused_at_lock(tmp_path: Path, capsys) -> None:
    data = noninferiority_study(decision="mean")
    data["hypotheses"][3]["decision"] = "ci"
    path = write(tmp_path, data)
    with pytest.raises(SystemExit) as code:
        cli.main(["prereg", "lock", str(path)])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1, err
    assert "analysis.decision: 'mean' decides the non-inferiority hypothesis N1" in err
    assert "decision_reason" in err and not prereg.lock_path(path).exists()
    reasoned = copy.deepcopy(data)
    reasoned["analysis"]["decision_reason"] = "a pilot: the mean is all we report"
    cli.main(["prereg", "lock", str(write(tmp_path, reasoned))])
    assert "locked:" in capsys.readouterr().out
    prereg.lock(write(tmp_path, data, "api.yaml"))  # the Python API checks only with rules=True


def test_committed_study_still_verifies_and_analyses_as_before() -> None:
    path = EXPERIMENTS / "prereg_cpu.yaml"
    lock = prereg.verify(path)
    spec = prereg.load(path)
    committed = json.loads((REPO / "docs" / "prereg_cpu" / "results.json").read_text())
    runs = [r for r in committed["runs"] if r["status"] == "done"]
    now = prereg.evaluate_hypotheses(spec, runs)
    assert [h["verdict"] for h in now] == [h["verdict"] for h in committed["hypotheses"]]
    for new, old in zip(now, committed["hypotheses"], strict=True):
        assert [r["pass"] for r in new["rows"]] == [r["pass"] for r in old["rows"]]
    md = prereg.render_markdown(spec, lock, runs, now, [])
    report = (REPO / "docs" / "prereg_cpu" / "report.md").read_text()
    section = report[report.index("## Verdicts") : report.index("## Per-run results")]
    for line in section.splitlines():
        assert line in md, line


def test_an_interim_analysis_is_no_pilot(tmp_path: Path) -> None:
    pilot = tmp_path / "results.json"
    pilot.write_text(json.dumps({"interim": {"finished": 3, "registered": 8}, "runs": []}))
    with pytest.raises(MoestackError, match="interim analysis"):
        prereg.load_pilot(pilot)
