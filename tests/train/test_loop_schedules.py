"""The loop's schedules: evaluation every ``eval_every`` steps whatever ``log_every`` is, and
skipped (non-finite) steps that still count for checkpoints, evaluation and the progress bar."""

import pytest
import torch
from helpers.runs import small_config

from moestack import callbacks, checkpoint
from moestack.data import eval_batches
from moestack.metrics import read_metrics
from moestack.model import MoETransformer
from moestack.runs import load_run, run_corpus
from moestack.trainer import train

EVAL_KEYS = {"step", "loss/val", "eval/perplexity"}


def validation_loss(run_dir, ckpt: str) -> float:
    """The mean cross-entropy of the run's validation batches under the weights of checkpoint
    ``ckpt``, by a plain loop over the model (not through the loop's evaluation)."""
    loaded = load_run(run_dir, run_dir / "checkpoints" / ckpt)
    cfg = loaded.cfg
    batches = eval_batches(run_corpus(cfg).val, cfg.batch_size, cfg.data.seq_len,
                           cfg.eval_batches)  # fmt: skip
    model = loaded.model.eval()
    with torch.no_grad():
        losses = [model(inputs, targets).ce_loss.item() for inputs, targets in batches]
    return sum(losses) / len(losses)


def test_eval_every_that_is_no_multiple_of_log_every_evaluates_on_its_own_steps(tmp_path):
    cfg = small_config(steps=12, log_every=4, eval_every=6, ckpt_every=6, keep_last=3)
    train(cfg, tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [(r["step"], "loss/train" in r, "loss/val" in r) for r in records]
    assert steps == [(4, True, False), (6, False, True), (8, True, False), (12, True, False),
                     (12, False, True)]  # fmt: skip
    at_6 = records[1]
    assert set(at_6) == EVAL_KEYS
    assert at_6["loss/val"] == pytest.approx(validation_loss(tmp_path, "step_000006"), rel=1e-6)
    assert records[-1]["loss/val"] == pytest.approx(
        validation_loss(tmp_path, "step_000012"), rel=1e-6
    )


def test_eval_every_a_multiple_of_log_every_evaluates_in_the_log_records(tmp_path):
    train(small_config(steps=12, log_every=3, eval_every=6, ckpt_every=0), tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [(r["step"], "loss/train" in r, "loss/val" in r) for r in records]
    assert steps == [(3, True, False), (6, True, True), (9, True, False), (12, True, False),
                     (12, False, True)]  # fmt: skip


def test_a_skipped_step_still_checkpoints_evaluates_and_moves_the_bar(tmp_path, monkeypatch):
    """Step 5 (a checkpoint, evaluation and log step) has a NaN loss: its update is skipped,
    but the checkpoint of step 5 is written, the evaluation of step 5 logged, and the progress
    bar ends at ``steps``."""
    original = MoETransformer.forward
    calls = {"train": 0}

    def poisoned(self, tokens, targets=None, **kwargs):
        out = original(self, tokens, targets, **kwargs)
        if self.training:
            calls["train"] += 1
            if calls["train"] == 5:
                out.loss = out.loss * float("nan")
        return out

    bars = []
    make_bar = callbacks._progress_bar

    def kept_bar(cfg, start_step):
        bars.append(make_bar(cfg, start_step))
        return bars[-1]

    monkeypatch.setattr(MoETransformer, "forward", poisoned)
    monkeypatch.setattr(callbacks, "_progress_bar", kept_bar)
    cfg = small_config(steps=8, log_every=5, eval_every=5, ckpt_every=5, progress=True)
    summary = train(cfg, tmp_path)
    assert summary["perf/bad_steps"] == 1
    saved = checkpoint.load_train_state(tmp_path / "checkpoints/step_000005")["train"]
    assert saved["step"] == 5 and saved["bad_steps"] == 1 and saved["consecutive_bad"] == 1
    assert saved["interval_steps"] == 4  # steps 1-4 trained; step 5 was skipped
    records = read_metrics(tmp_path / "metrics.jsonl")
    (at_5,) = [r for r in records if r["step"] == 5]
    assert set(at_5) == EVAL_KEYS  # no training record for the skipped step
    assert at_5["loss/val"] == pytest.approx(validation_loss(tmp_path, "step_000005"), rel=1e-6)
    (bar,) = bars
    assert bar.n == bar.total == 8
