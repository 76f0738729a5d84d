"""scripts/pilot_prereg.py's parts that need no training: the pilot reads the study's tuning
split only, without its steered evaluations (under the study's own evaluation key
otherwise), tries candidate arms beside the study's, reports the smallest capacity's
misses, and pairs nothing without the baseline."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import ModuleType, SimpleNamespace

import pytest
from helpers.paths import EXPERIMENTS, SCRIPTS

from moestack import prereg
from moestack.prereg.analysis import analysis_key


@pytest.fixture(scope="module")
def pilot() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pilot_prereg", SCRIPTS / "pilot_prereg.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pilot_reads_the_tuning_split_without_steering(pilot) -> None:
    spec = prereg.load(EXPERIMENTS / "prereg_cpu_v3.yaml")
    analysis = pilot.pilot_analysis(spec)
    assert analysis.eval_windows == spec.selection.windows != spec.analysis.eval_windows
    assert analysis.steered() == () and spec.analysis.steered()
    # the pilot's key is the study's analysis on the tuning split, less the steering
    plain = dataclasses.replace(spec.analysis, reroute_taus=(), cache_biases=(),
                                steer_capacities=(), eval_windows=spec.selection.windows)  # fmt: skip
    key = analysis_key(SimpleNamespace(analysis=analysis))
    assert key == analysis_key(SimpleNamespace(analysis=plain))
    assert pilot.cache_metrics(spec) == ("lru/cap9/misses_per_token", "static/cap9/hit_rate")


def test_candidate_arms_join_the_study_and_bad_ones_are_refused(pilot) -> None:
    spec = prereg.load(EXPERIMENTS / "prereg_cpu_v3.yaml")
    tried = pilot.with_candidates(spec, ["t01=router=temporal,router.temporal=0.1"])
    assert tried.arms["t01"] == ("router=temporal", "router.temporal=0.1")
    assert set(tried.arms) - set(spec.arms) == {"t01"}
    for bad in ("baseline=router=baseline", "noequals", "empty="):
        with pytest.raises(SystemExit, match="--candidate"):
            pilot.with_candidates(spec, [bad])


def test_spread_pairs_each_arm_with_the_baseline_seed_by_seed(pilot) -> None:
    names = ("lru/cap9/misses_per_token", "static/cap9/hit_rate")

    def rec(arm: str, seed: int, ppl: float, miss: float, hit: float) -> dict:
        return {"arm": arm, "seed": seed, "metrics": {"perplexity": ppl, names[0]: miss,
                                                       names[1]: hit}}  # fmt: skip

    records = [rec("baseline", 1, 4.0, 20.0, 0.2), rec("baseline", 2, 5.0, 10.0, 0.3),
               rec("a", 1, 4.2, 10.0, 0.5), rec("a", 2, 5.0, 9.0, 0.4)]  # fmt: skip
    out = pilot.spread(records, ["baseline", "a"], "baseline", "metrics", names)
    a = out["arms"]["a"]
    assert a["d_ppl"] == pytest.approx([0.05, 0.0]) and a["d_miss"] == pytest.approx([-0.5, -0.1])
    assert a["d_static_hit"] == pytest.approx([0.3, 0.1])
    assert out["baseline_mean"] == 4.5 and a["ppl"] == [4.2, 5.0]
