"""A run's trace parts joined in training order: each cut before the next part's start step,
so the tokens a killed start recorded past its checkpoint are not counted twice."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from moestack import ModelConfig, MoEConfig, MoETransformer
from moestack.telemetry import RoutingTrace, TraceFormatError, attach
from moestack.telemetry.run_trace import intervals, load_history, load_run_trace, part_name

PER_STEP = 4  # token rows per training step of the hand-built parts
MARK = 7  # an expert only the rows past a part's cut use


def step_rows(step: int, past_cut: bool = False) -> np.ndarray:
    """Layer 0's expert ids [PER_STEP, 2] of one step, worked by hand from the step number;
    rows a killed start recorded past its checkpoint carry MARK instead."""
    return np.array([[step % 6, MARK if past_cut else (step + j) % 6] for j in range(PER_STEP)])


def write_part(root, start, stop, cut_at=None, meta=True, chunk_tokens=3, **extra):
    """A trace part of steps start..stop-1 (a sequence per step, ids from 0 as a new start
    gives them), written in chunks of ``chunk_tokens`` rows; steps from ``cut_at`` on are
    the ones the next part records again."""
    info = {"start_step": start, "tokens_per_step": PER_STEP} if meta else {}
    trace = RoutingTrace(
        ["layer0"], [2], [8], path=root / part_name(start), chunk_tokens=chunk_tokens,
        meta={**info, **extra},
    )  # fmt: skip
    for i, step in enumerate(range(start, stop)):
        past = cut_at is not None and step >= cut_at
        seq = np.full(PER_STEP, i, dtype=np.int64)
        trace.append(seq, np.arange(PER_STEP, dtype=np.int32), [step_rows(step, past)])
    trace.flush()
    return trace.path


def test_parts_are_joined_in_training_order_and_cut_before_the_next_start(tmp_path):
    # start 1: steps 0-6 (checkpoint at 5, killed at 7); start 2: steps 5-8 (checkpoint at 8,
    # killed at 9); start 3: steps 8-9.
    write_part(tmp_path, 0, 7, cut_at=5)
    write_part(tmp_path, 5, 9, cut_at=8)
    write_part(tmp_path, 8, 10)
    run = load_run_trace(tmp_path)
    assert run.num_tokens == 10 * PER_STEP  # 10 steps of 4 rows, each counted once
    expected = np.concatenate([step_rows(s) for s in range(10)])
    np.testing.assert_array_equal(run.trace.experts(0), expected)
    streamed = list(run.iter_chunks())  # what a resumed start replays, from the files
    np.testing.assert_array_equal(np.concatenate([c.experts[0] for c in streamed]), expected)
    seq = run.trace.sequence_ids()
    assert np.unique(seq).size == 10 and (np.diff(seq) >= 0).all()  # one sequence per step
    got = [(p.name, p.start_step, p.kept, p.cut) for p in run.parts]
    assert got == [
        ("from-0000000", 0, 5 * PER_STEP, 2 * PER_STEP),
        ("from-0000005", 5, 3 * PER_STEP, 1 * PER_STEP),
        ("from-0000008", 8, 2 * PER_STEP, 0),
    ]
    assert run.resume_steps == [5, 8] and run.exact and run.tokens_per_step == PER_STEP
    assert run.trace.path is None  # joined in memory, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "from-0000000", "from-0000005", "from-0000008"
    ]  # fmt: skip


def test_until_step_keeps_what_a_resumed_start_continues(tmp_path):
    write_part(tmp_path, 0, 7, cut_at=5)
    write_part(tmp_path, 5, 9)
    write_part(tmp_path, 9, 10)  # a part at or past until_step is not read
    run = load_run_trace(tmp_path, until_step=7)
    np.testing.assert_array_equal(
        run.trace.experts(0), np.concatenate([step_rows(s) for s in range(7)])
    )
    assert [(p.kept, p.cut) for p in run.parts] == [(20, 8), (8, 8)]
    assert load_history(tmp_path, 0) is None  # a start at step 0 continues nothing
    assert load_history(tmp_path, 5).num_tokens == 5 * PER_STEP


def test_old_parts_without_meta_are_joined_whole_with_one_warning(tmp_path, caplog):
    write_part(tmp_path, 0, 7, cut_at=5, meta=False)
    write_part(tmp_path, 5, 10, meta=False)
    with caplog.at_level(logging.WARNING):
        run = load_run_trace(tmp_path)
    assert run.num_tokens == (7 + 5) * PER_STEP and not run.exact
    assert len(caplog.records) == 1
    assert "counted twice" in caplog.text
    assert [p.start_step for p in run.parts] == [0, 5]  # from the folder names


def test_an_empty_part_is_skipped_and_one_folder_is_one_part(tmp_path, caplog):
    part = write_part(tmp_path, 0, 5)
    RoutingTrace(["layer0"], [2], [8], path=tmp_path / part_name(5))  # stopped before a flush
    with caplog.at_level(logging.WARNING):
        run = load_run_trace(tmp_path)
    assert "from-0000005 holds no tokens" in caplog.text
    assert [p.name for p in run.parts] == ["from-0000000"] and run.resume_steps == []
    alone = load_run_trace(part)
    assert alone.trace.path == part and alone.num_tokens == 5 * PER_STEP  # read as it is


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"start_step": "5"}, r"meta\.start_step"),
        ({"tokens_per_step": 0}, r"meta\.tokens_per_step"),
    ],
)
def test_bad_meta_is_refused_naming_the_file_and_field(tmp_path, meta, match):
    write_part(tmp_path, 0, 5)
    write_part(tmp_path, 5, 8, meta=False, **meta)
    with pytest.raises(TraceFormatError, match=rf"from-0000005/header.json: field '{match}"):
        load_run_trace(tmp_path)


def test_parts_of_another_model_are_refused(tmp_path):
    write_part(tmp_path, 0, 5)
    other = RoutingTrace(["layer0"], [2], [16], path=tmp_path / part_name(5))
    other.append(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int32), [np.array([[0, 9]])])
    other.flush()
    with pytest.raises(TraceFormatError, match="not one run's trace"):
        load_run_trace(tmp_path)
    with pytest.raises(TraceFormatError, match="no trace here"):
        load_run_trace(tmp_path / "nothing")


def test_intervals_split_chunks_at_exact_boundaries(tmp_path):
    trace = RoutingTrace.load(write_part(tmp_path, 0, 5, chunk_tokens=3))  # 20 rows
    groups = list(intervals(trace.iter_chunks(), 8))
    assert [sum(c.num_tokens for c in g) for g in groups] == [8, 8, 4]
    joined = np.concatenate([c.experts[0] for g in groups for c in g])
    np.testing.assert_array_equal(joined, trace.experts(0))
    assert [sum(c.num_tokens for c in g) for g in intervals(trace.iter_chunks(), None)] == [20]


def test_replayed_history_counts_as_if_recorded_live(tmp_path):
    """Two starts of one model: the second replays the first's trace, and its summary (hit
    rates, usage, routing entropy from recorded probabilities) equals one Telemetry that saw
    every forward."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(num_experts=8, top_k=2, d_ff=16))  # fmt: skip
    model = MoETransformer(cfg).eval()
    batches = [torch.randint(0, 64, (2, 16)) for _ in range(6)]
    kwargs = dict(policies=("lru", "lfu"), capacities=(2, 4), record_probs=True)
    with attach(model, **kwargs) as whole, torch.no_grad():
        for x in batches:
            model(x)
        reference = whole.summary()
    meta = {"start_step": 0, "tokens_per_step": 32}
    first = attach(model, trace_dir=str(tmp_path / part_name(0)), meta=meta, **kwargs)
    with first, torch.no_grad():
        for x in batches[:4]:
            model(x)
    second = attach(model, trace_dir=str(tmp_path / part_name(4)), **kwargs)
    assert second.replay_history(load_history(tmp_path, 4)) == 4 * 32
    with torch.no_grad():
        for x in batches[4:]:
            model(x)
    got = second.summary()
    second.close()
    assert got["tokens"] == reference["tokens"] == 6 * 32 and got["trace_tokens"] == 6 * 32
    assert got["expert_usage"] == reference["expert_usage"]
    for key, value in reference["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=2e-3), key  # fp16 probs on disk
    assert [p["name"] for p in got["parts"]] == ["from-0000000", "from-0000004"]
    with pytest.raises(ValueError, match="before the first recorded forward"):
        second.replay_history(load_history(tmp_path, 4))
