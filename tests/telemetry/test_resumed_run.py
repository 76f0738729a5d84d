"""A killed-and-resumed training run: its trace parts join to the uninterrupted run's trace,
and its live telemetry (telemetry_summary.json) covers every step, each once."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from helpers.runs import TOKENS_PER_STEP, killed_and_resumed, small_config

from moestack.config import TelemetryConfig
from moestack.telemetry import RoutingTrace, simulate
from moestack.telemetry.run_trace import load_run_trace
from moestack.trainer import train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the killed-and-resumed run, the same run trained without a break)."""
    resumed = tmp_path_factory.mktemp("resumed")
    killed_and_resumed(resumed)
    whole = tmp_path_factory.mktemp("whole")
    train(small_config(steps=10, ckpt_every=5, telemetry=TelemetryConfig(enabled=True)), whole)
    return resumed, whole


def lru_hits(requests: np.ndarray, capacity: int) -> int:
    """Hits of a plain LRU cache of ``capacity`` keys fed ``requests`` in order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in requests.tolist():
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def test_the_parts_join_to_every_step_once(runs):
    resumed, whole = runs
    first = RoutingTrace.load(resumed / "trace" / "from-0000000")
    second = RoutingTrace.load(resumed / "trace" / "from-0000005")
    assert first.num_tokens == 8 * TOKENS_PER_STEP  # steps 0-7: 3 past the checkpoint at 5
    assert second.num_tokens == 5 * TOKENS_PER_STEP  # steps 5-9
    run = load_run_trace(resumed / "trace")
    assert run.num_tokens == 10 * TOKENS_PER_STEP  # 5 steps from each part
    got = [(p.name, p.start_step, p.kept, p.cut) for p in run.parts]
    assert got == [
        ("from-0000000", 0, 5 * TOKENS_PER_STEP, 3 * TOKENS_PER_STEP),
        ("from-0000005", 5, 5 * TOKENS_PER_STEP, 0),
    ]
    reference = RoutingTrace.load(whole / "trace" / "from-0000000")  # no break: one part
    for layer in range(run.trace.num_layers):
        np.testing.assert_array_equal(run.trace.experts(layer), reference.experts(layer))
    seq = run.trace.sequence_ids()
    assert np.unique(seq).size == 10 * 4  # batch_size sequences a step, none shared


def test_the_summary_covers_the_whole_run_as_a_replay_from_scratch(runs):
    resumed, whole = runs
    summary = json.loads((resumed / "telemetry_summary.json").read_text())
    assert summary["tokens"] == summary["trace_tokens"] == 10 * TOKENS_PER_STEP
    assert summary["requests"] == 10 * TOKENS_PER_STEP * 2 * 2  # 2 layers, top-2
    assert [(p["name"], p["start_step"], p["tokens"]) for p in summary["parts"]] == [
        ("from-0000000", 0, 640),
        ("from-0000005", 5, 640),
    ]
    assert summary["parts_joined"] == "parts joined in training order"
    # every request of steps 0-9, concatenated by hand from the two parts
    first = RoutingTrace.load(resumed / "trace" / "from-0000000")
    second = RoutingTrace.load(resumed / "trace" / "from-0000005")
    cut = 5 * TOKENS_PER_STEP
    joined = load_run_trace(resumed / "trace").trace
    for cap in (2, 4):
        hits = requests = 0
        for layer in range(2):
            ids = np.concatenate([first.experts(layer)[:cut], second.experts(layer)])
            hits += lru_hits(ids.reshape(-1), cap)
            requests += ids.size
        rate = summary["metrics"][f"telemetry/lru/cap{cap}/hit_rate"]
        assert rate == pytest.approx(hits / requests, rel=1e-12)
        assert rate == pytest.approx(simulate(joined, "lru", cap, warmup=0).hit_rate, rel=1e-12)
    # and every number the uninterrupted run logged (static pins re-pinned step by step too),
    # but routing entropy: it needs router probabilities, which the trace does not hold
    reference = json.loads((whole / "telemetry_summary.json").read_text())
    assert summary["expert_usage"] == reference["expert_usage"]
    assert summary["reuse_distance_hist"] == reference["reuse_distance_hist"]
    for key, value in reference["metrics"].items():
        if "routing_entropy" not in key:
            assert summary["metrics"][key] == pytest.approx(value, rel=1e-12), key


def test_a_start_records_its_step_and_rank_0s_tokens_and_drops_what_it_redoes(
    runs, tmp_path, monkeypatch, caplog
):
    """A start from step 3 (as if the checkpoints past it did not verify), on 2 ranks: its
    part says where it starts and what rank 0 records a step; the part of the later start
    it redoes is removed; the history it replays is cut at step 3 of the first part."""
    import shutil

    import torch

    from moestack.callbacks import attach_telemetry

    resumed, _ = runs
    shutil.copytree(resumed / "trace", tmp_path / "trace")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    cfg = small_config(steps=10, ckpt_every=5, telemetry=TelemetryConfig(enabled=True))
    telemetry = attach_telemetry(cfg, cfg.model.build(), tmp_path, 3)
    assert "from-0000005: a later start this run abandons; removed" in caplog.text
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == [
        "from-0000000",
        "from-0000003",
    ]
    telemetry.close()
    header = json.loads((tmp_path / "trace" / "from-0000003" / "header.json").read_text())
    assert header["meta"]["start_step"] == 3
    assert header["meta"]["tokens_per_step"] == 2 * 32  # batch 4 over 2 ranks, 32 tokens each
    summary = telemetry.summary()
    assert summary["tokens"] == 3 * TOKENS_PER_STEP  # steps 0-2 of the first part
    assert [(p["name"], p["tokens"]) for p in summary["parts"]] == [
        ("from-0000000", 3 * TOKENS_PER_STEP),
        ("from-0000003", 0),
    ]
