"""Telemetry under generate(), failing forwards, long runs, decode steps and warm-ups."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from helpers.telemetry import small_moestack
from torch import nn

from moestack.telemetry import attach, tiny_model
from moestack.telemetry import hooks as tel_hooks
from moestack.telemetry.detect import RouterSpec
from moestack.telemetry.live import LiveReplay
from moestack.telemetry.trace import TraceChunk


def batches(n: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 6 + i % 3), generator=g) for i in range(n)]


# ------------------------------------------------------------------ 1: generate, post-hook
def test_generate_with_attention_mask_records_decode_steps() -> None:
    model = tiny_model("mixtral").eval()
    ids = torch.randint(2, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    tel = attach(model)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    tel.detach()
    assert out.shape == (2, 10)
    assert tel.summary()["hook_errors"] == 0
    trace = tel.trace
    assert trace.num_tokens == 2 * 6 + 3 * 2  # the prompt, then one token per row per step
    seq, pos = trace.sequence_ids(), trace.position_ids()
    np.testing.assert_array_equal(seq, np.r_[np.repeat([0, 1], 6), np.tile([0, 1], 3)])
    assert (pos[6:8] == -1).all() and (pos[8:12] >= 0).all()  # the pads only
    assert (pos[12:] >= 0).all()


def test_post_hook_failure_leaves_forward_intact(caplog, monkeypatch) -> None:
    model = small_moestack()
    x = batches(1)[0]
    with torch.no_grad():
        plain = model(x).logits
    tel = attach(model)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(tel, "_token_ids", broken)
    with caplog.at_level(logging.WARNING, logger="moestack.telemetry.hooks"), torch.no_grad():
        first = model(x).logits
        model(x)
    tel.detach()
    assert torch.equal(first, plain)
    failed = [r for r in caplog.records if "telemetry hook failed" in r.getMessage()]
    assert len(failed) == 1
    assert tel._hook_errors == 2 and tel.trace.num_tokens == 0


# ------------------------------------------------------------------ 2: memory bound
def run_metrics(model, monkeypatch, bound: int, policies, **kw) -> tuple[dict, dict, int]:
    monkeypatch.setattr(tel_hooks, "_MAX_RAW_TOKENS", 1)  # drain every forward
    monkeypatch.setattr(tel_hooks, "_MAX_UNREAD_TOKENS", bound)
    tel = attach(model, policies=policies, capacities=(2, 4), max_memory_tokens=0, **kw)
    most = 0
    with torch.no_grad():
        for i, x in enumerate(batches(12)):
            model(x)
            most = max(most, sum(c.num_tokens for c in tel._unread))
            if i == 5:
                first = tel.interval_metrics()
    second = tel.interval_metrics()
    summary = tel.summary()["metrics"]
    tel.close()
    for m in (first, second):
        m.pop("telemetry/replay_ms", None)
    return {"first": first, "second": second}, summary, most


def test_unread_chunks_are_bounded_with_the_same_metrics(monkeypatch) -> None:
    model = small_moestack()
    policies = ("lru", "static", "lru+static", "lfu")
    want, want_summary, most_unbounded = run_metrics(model, monkeypatch, 1 << 30, policies)
    got, got_summary, most = run_metrics(model, monkeypatch, 20, policies)
    assert most_unbounded >= 5 * 12  # held until interval_metrics without the bound
    assert most < 20 + 16  # at most the bound plus one forward's tokens
    assert "telemetry/static/cap2/hit_rate" in got["second"]
    assert got == want
    assert got_summary == want_summary


def test_raw_probs_capped_by_bytes(monkeypatch) -> None:
    model = small_moestack()
    monkeypatch.setattr(tel_hooks, "_MAX_RAW_BYTES", 1)
    tel = attach(model, record_probs=True)
    with torch.no_grad():
        for x in batches(3):
            model(x)
            assert not tel._raw  # drained after every forward: its probs exceed the cap
    tel.detach()
    assert tel.trace.num_tokens == sum(x.numel() for x in batches(3))


# ------------------------------------------------------------------ 3: failed forwards
class FailOnce:
    def __init__(self) -> None:
        self.armed = True

    def __call__(self, module, args, output):
        if self.armed:
            self.armed = False
            raise RuntimeError("failed forward")


@pytest.mark.parametrize("then", ["forward", "detach"])
def test_failed_forward_is_not_recorded(then: str) -> None:
    model = small_moestack()
    handle = model.moe_layers[1].register_forward_hook(FailOnce())  # after layer 0's router
    tel = attach(model)
    x, y = batches(2)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="failed forward"):
            model(x)
        if then == "forward":
            model(y)
    metrics = tel.interval_metrics()
    tel.detach()
    handle.remove()
    n = y.numel() if then == "forward" else 0
    assert tel.trace.num_tokens == n
    assert metrics.get("telemetry/tokens", 0.0) == n
    for layer in range(2):
        assert (tel.trace.experts(layer) >= 0).all()
    if n:
        np.testing.assert_array_equal(tel.trace.sequence_ids(), np.repeat([0, 1], y.shape[1]))


# ------------------------------------------------------------------ 4, 5: live replay
def spec(num_experts: int = 4, top_k: int = 1) -> RouterSpec:
    return RouterSpec("r", nn.Identity(), "explicit", top_k, num_experts)


def chunk(seq, pos, experts) -> TraceChunk:
    return TraceChunk(
        np.asarray(seq, np.int64), np.asarray(pos, np.int32), [np.asarray(experts, np.int16)]
    )


def brute_switch(rows) -> float:
    """Switch rate over consecutive rows (seq, pos, experts) of one long recording."""
    total, pairs = 0.0, 0
    for (s0, p0, e0), (s1, p1, e1) in zip(rows, rows[1:], strict=False):
        if s0 == s1 and p0 >= 0 and p1 == p0 + 1:
            total += 1 - len(set(e0) & set(e1)) / len(e0)
            pairs += 1
    return total / pairs


def test_switch_rate_counts_pairs_across_forward_calls() -> None:
    live = LiveReplay([spec(8, 2)], ("lru",), (2,))
    calls = [  # a prompt, two decode steps of the same sequence, then a new sequence
        ([0, 0, 0], [0, 1, 2], [[0, 1], [1, 2], [1, 2]]),
        ([0], [3], [[2, 3]]),
        ([0], [4], [[4, 5]]),
        ([1, 1], [0, 1], [[4, 6], [6, 7]]),
    ]
    live.replay([chunk(*c) for c in calls[:2]])
    live.replay([chunk(*c) for c in calls[2:]])  # the boundary between replays counts too
    out = live.end_interval()
    rows = [(s, p, tuple(e)) for c in calls for s, p, e in zip(*c, strict=True)]
    want = brute_switch(rows)  # pairs: 3 in the prompt... worked: (0.5+0+0.5+1) + 0.5 / 5
    assert want == pytest.approx((0.5 + 0.0 + 0.5 + 1.0 + 0.5) / 5)
    assert out["telemetry/switch_rate"] == pytest.approx(want)


def test_summary_misses_per_token_divides_by_scored_tokens() -> None:
    live = LiveReplay([spec()], ("lru", "static"), (1,))
    live.replay([chunk([0, 0, 0], [0, 1, 2], [[0], [0], [1]])])  # static: warm-up, pins {0}
    live.end_interval()
    live.replay([chunk([1, 1], [0, 1], [[0], [2]])])  # static: 0 hits, 2 misses
    live.end_interval()
    metrics = live.summary()["metrics"]
    assert metrics["telemetry/static/cap1/hit_rate"] == 0.5
    assert metrics["telemetry/static/cap1/misses_per_token"] == 0.5  # 1 miss / 2 tokens
    # lru cap 1 over 0 0 1 0 2: hits at the 2nd request only -> 4 misses over 5 tokens
    assert metrics["telemetry/lru/cap1/misses_per_token"] == pytest.approx(4 / 5)
