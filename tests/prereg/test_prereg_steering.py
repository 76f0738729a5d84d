"""Steered evaluations in a study (analysis.reroute_taus, cache_biases, steer_capacities):
their metrics' names, the analysis key, the values refused, hypotheses on their metrics, and
the metrics of a model, checked against the plain evaluation of the same batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cache import batches, tiny_model
from helpers.prereg import study

from moestack import prereg
from moestack.errors import MoestackError
from moestack.prereg.analysis import analysis_key, metric_names, steered_metrics


def steered_study(**analysis) -> dict:
    data = study()
    data["analysis"].update(analysis)
    return data


def test_steered_metrics_are_named_and_keyed_apart(tmp_path: Path) -> None:
    plain = prereg.parse(study(), tmp_path / "s.yaml")
    spec = prereg.parse(
        steered_study(reroute_taus=[0.25], cache_biases=[0.1], steer_capacities=[2, 4]),
        tmp_path / "s.yaml",
    )
    assert spec.analysis.steered() == (
        ("reroute0.25", 2, 0.25, 0.0),
        ("reroute0.25", 4, 0.25, 0.0),
        ("bias0.1", 2, 0.0, 0.1),
        ("bias0.1", 4, 0.0, 0.1),
    )
    stats = ("perplexity", "val_loss", *prereg.CACHE_STATS)
    assert set(metric_names(spec.analysis)) - set(metric_names(plain.analysis)) == {
        f"{label}/cap{c}/{s}" for label in ("reroute0.25", "bias0.1") for c in (2, 4)
        for s in stats
    }  # fmt: skip
    default_cap = prereg.parse(steered_study(reroute_taus=[0.5]), tmp_path / "s.yaml")
    assert default_cap.analysis.steered() == (("reroute0.5", 2, 0.5, 0.0),)  # the smallest
    empty = steered_study(reroute_taus=[], cache_biases=[], steer_capacities=[])
    assert analysis_key(prereg.parse(empty, tmp_path / "s.yaml")) == analysis_key(plain)
    assert analysis_key(spec) != analysis_key(plain)


@pytest.mark.parametrize(
    ("analysis", "named"),
    [
        ({"reroute_taus": [0]}, r"analysis\.reroute_taus\[0\]: 0\.0 not in \(0, 1\]"),
        ({"reroute_taus": [1.5]}, r"analysis\.reroute_taus\[0\]: 1\.5"),
        ({"reroute_taus": [0.25, 0.25]}, r"analysis\.reroute_taus: .* repeats"),
        ({"reroute_taus": 0.25}, r"analysis\.reroute_taus: 0\.25 is not a list"),
        ({"cache_biases": [0]}, r"analysis\.cache_biases\[0\]: 0\.0 <= 0"),
        ({"steer_capacities": [3]}, r"analysis\.steer_capacities\[0\]: 3 is not in"),
        ({"steer_capacities": [2.5]}, r"analysis\.steer_capacities\[0\]: expected a whole"),
    ],
)
def test_bad_steering_is_refused_naming_the_field(tmp_path, analysis, named) -> None:
    with pytest.raises(MoestackError, match=named):
        prereg.parse(steered_study(**analysis), tmp_path / "s.yaml")


def hypothesis_on(metric: str) -> dict:
    return {
        "id": "H9",
        "statement": "rerouting keeps misses down",
        "metric": metric,
        "comparison": "relative_change",
        "op": "<=",
        "threshold": -0.3,
        "arms": ["a"],
    }


def test_a_hypothesis_may_test_a_steered_metric(tmp_path: Path) -> None:
    data = steered_study(reroute_taus=[0.25], steer_capacities=[4])
    data["hypotheses"].append(hypothesis_on("reroute0.25/cap4/misses_per_token"))
    assert prereg.parse(data, tmp_path / "s.yaml").hypotheses[-1].metric.startswith("reroute")
    for metric, named in (
        ("reroute0.5/cap4/misses_per_token", "reroute0.5 at capacity 4 is not a steered"),
        ("reroute0.25/cap2/misses_per_token", "reroute0.25 at capacity 2 is not a steered"),
        ("reroute0.25/cap4/entropy", "statistic 'entropy' is unknown"),
    ):
        data["hypotheses"][-1] = hypothesis_on(metric)
        with pytest.raises(MoestackError, match=named):
            prereg.parse(data, tmp_path / "s.yaml")


def test_steered_metrics_of_a_model(tmp_path: Path) -> None:
    """Every steered name metric_names lists, a perplexity of exp(val loss), misses that
    rerouting to any resident expert (tau 1) cuts, and the model's plain evaluation after it
    unchanged (the hooks are gone)."""
    from moestack.evaluation import evaluate
    from moestack.telemetry import attach, simulate

    spec = prereg.parse(
        steered_study(reroute_taus=[1.0], cache_biases=[0.5], steer_capacities=[2]),
        tmp_path / "s.yaml",
    )
    model, data, cpu = tiny_model(num_experts=8, top_k=2), batches(n=2, batch=2, seq=12), "cpu"
    tel = attach(model, policies=("lru",), capacities=(2,), entropy=False)
    with tel, torch.no_grad():
        before = evaluate(model, data, torch.device(cpu))
    plain = simulate(tel.trace, "lru", 2, warmup=spec.analysis.warmup, reuse=False)
    metrics = steered_metrics(model, data, torch.device(cpu), spec.analysis, 48)
    steered = {n for n in metric_names(spec.analysis) if n.startswith(("reroute", "bias"))}
    assert set(metrics) == steered
    for label in ("reroute1", "bias0.5"):
        assert metrics[f"{label}/cap2/perplexity"] == pytest.approx(
            torch.tensor(metrics[f"{label}/cap2/val_loss"]).exp().item(), rel=1e-6
        )
        assert metrics[f"{label}/cap2/misses_per_token"] < plain.misses_per_token
        assert metrics[f"{label}/cap2/perplexity"] != before["eval/perplexity"]
    with torch.no_grad():
        assert evaluate(model, data, torch.device(cpu))["loss/val"] == before["loss/val"]


def test_steered_rows_against_hand_worked_numbers(tmp_path: Path) -> None:
    """Arm a at seeds 0 and 1 (seed 2 not finished); the baseline at every seed."""
    from moestack.prereg.verdicts import steered_rows

    spec = prereg.parse(steered_study(reroute_taus=[0.25]), tmp_path / "s.yaml")

    def metrics(ppl: float, misses: float, s_ppl: float, s_misses: float) -> dict:
        return {"perplexity": ppl, "lru/cap2/misses_per_token": misses,
                "reroute0.25/cap2/perplexity": s_ppl,
                "reroute0.25/cap2/misses_per_token": s_misses}  # fmt: skip

    records = [
        {"arm": "baseline", "seed": 0, "status": "done", "metrics": metrics(10, 2.0, 10.5, 1.0)},
        {"arm": "baseline", "seed": 1, "status": "done", "metrics": metrics(20, 4.0, 22, 1.0)},
        {"arm": "a", "seed": 0, "status": "done", "metrics": metrics(11, 1.0, 12.1, 0.5)},
        {"arm": "a", "seed": 1, "status": "done", "metrics": metrics(20, 2.0, 21, 1.0)},
        {"arm": "a", "seed": 2, "status": "missing"},
    ]
    rows = {r["arm"]: r for r in steered_rows(spec, records)}
    assert set(rows) == {"baseline", "a"}
    a = rows["a"]
    assert (a["steering"], a["capacity"], a["n"]) == ("reroute0.25", 2, 2)
    assert a["misses_per_token"] == pytest.approx(0.75)
    assert a["perplexity"] == pytest.approx(16.55)
    assert a["misses_vs_unsteered"] == pytest.approx(-0.5)  # 0.5/1 and 1/2
    assert a["perplexity_vs_unsteered"] == pytest.approx((0.1 + 0.05) / 2)
    assert a["misses_vs_baseline"] == pytest.approx((0.25 - 1 + 0.25 - 1) / 2)
    assert a["perplexity_vs_baseline"] == pytest.approx((0.21 + 0.05) / 2)
    assert rows["baseline"]["misses_vs_unsteered"] == pytest.approx((-0.5 - 0.75) / 2)
    text = "\n".join(prereg.report_tables.steered_lines(steered_rows(spec, records)))
    assert "| a | reroute0.25 | 2 | 2 | 0.75 | -50.0% | -75.0% |" in text


def test_the_shipped_studies_keep_their_evaluation_keys() -> None:
    """Keys computed before steered evaluations existed (prereg_cpu_v2's is in its pilot's
    records): a study that uses none of the new fields reuses its cached evaluations. The
    two locked v3 studies' keys are those their runs' cached evaluations were written under
    (computed when they were pinned): a change would evaluate every run again."""
    from helpers.paths import EXPERIMENTS

    for name, key in (("prereg_cpu", "8aef0d7b1fcde549"), ("prereg_cpu_v2", "656cce0565adb2c0"),
                      ("prereg_hf_finetune", "a9c504d71d94d25e"),
                      ("prereg_cpu_v3", "1938da3dc8b8c4af"),
                      ("prereg_cpu_v3_e16", "06d95e82038dfc3d")):  # fmt: skip
        assert analysis_key(prereg.load(EXPERIMENTS / f"{name}.yaml")) == key


@pytest.mark.parametrize(
    ("analysis", "named"),
    [
        ({"steer_capacities": [2]}, r"analysis\.steer_capacities: \[2\] without reroute_taus"),
        ({"reroute_taus": [0.5], "policies": ["static"]}, r"analysis\.policies: .* without lru"),
        ({"reroute_taus": [0.1, 0.1000001]}, r"analysis\.reroute_taus: values whose metrics"),
        ({"cache_biases": [0.2, 0.20000001]}, r"analysis\.cache_biases: values whose metrics"),
    ],
)
def test_steering_that_could_not_be_reported_is_refused(tmp_path, analysis, named) -> None:
    with pytest.raises(MoestackError, match=named):
        prereg.parse(steered_study(**analysis), tmp_path / "s.yaml")


def test_a_steered_perplexity_is_a_budget(tmp_path: Path) -> None:
    """A budget on the steered perplexity needs a one-sided rule (or a reason for the mean)
    as the plain perplexity's does; the refusal of an unknown label lists the known ones."""
    from moestack.prereg.decision import check_rules, is_budget

    data = steered_study(reroute_taus=[0.25])
    data["hypotheses"] = [{**hypothesis_on("reroute0.25/cap2/perplexity"), "op": "<=",
                           "threshold": 0.01}]  # fmt: skip
    spec = prereg.parse(data, tmp_path / "s.yaml")
    assert is_budget(spec.hypotheses[0])
    with pytest.raises(MoestackError, match="mean"):
        check_rules(spec)
    data["hypotheses"] = [hypothesis_on("bias0.5/cap2/perplexity")]
    with pytest.raises(MoestackError, match=r"the analysis has \['reroute0\.25/cap2'\]"):
        prereg.parse(data, tmp_path / "s.yaml")
