"""A run killed after its final checkpoint but before summary.json, then resumed: it trains
nothing, saves nothing again, and its metrics.jsonl and summary.json are the uninterrupted
run's (timings apart)."""

import json

import pytest
from helpers.runs import small_config

from moestack import callbacks, trainer
from moestack.metrics import read_metrics
from moestack.trainer import train

CFG = dict(steps=8, ckpt_every=4, log_every=2)
TIMINGS = ("perf/train_s", "perf/eval_s", "perf/tokens_per_s", "out_dir")


def records(run) -> list[dict]:
    """metrics.jsonl without its timing fields."""
    rows = read_metrics(run / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def kill_after_the_final_save(patch) -> None:
    """Killed once the final checkpoint is written, before the final evaluation is logged."""
    real_save = callbacks.save

    def save_then_kill(run, step):
        real_save(run, step)
        if step == run.cfg.steps:
            raise KeyboardInterrupt("simulated kill")

    patch.setattr(callbacks, "save", save_then_kill)


def kill_before_the_summary(patch) -> None:
    """Killed once everything is logged, before summary.json is written."""

    def kill(*args, **kwargs):
        raise KeyboardInterrupt("simulated kill")

    patch.setattr(trainer.Trainer, "summary", kill)


@pytest.mark.parametrize("kill", [kill_after_the_final_save, kill_before_the_summary])
def test_a_resume_at_the_last_step_gives_the_uninterrupted_runs_records(tmp_path, kill):
    reference = tmp_path / "reference"
    train(small_config(**CFG), reference)

    crashed = tmp_path / "crashed"
    with pytest.MonkeyPatch.context() as patch:
        kill(patch)
        with pytest.raises(KeyboardInterrupt):
            train(small_config(**CFG), crashed)
    assert not (crashed / "summary.json").exists()
    final = crashed / "checkpoints/step_000008/meta.json"
    written = final.stat().st_mtime_ns
    train(small_config(resume=True, **CFG), crashed)

    assert [r["step"] for r in records(crashed)] == [r["step"] for r in records(reference)]
    assert records(crashed) == records(reference)
    want = json.loads((reference / "summary.json").read_text())
    got = json.loads((crashed / "summary.json").read_text())
    assert {k: v for k, v in got.items() if k not in TIMINGS} == {
        k: v for k, v in want.items() if k not in TIMINGS
    }
    assert any(k.endswith("/imbalance") for k in got)
    assert got["perf/tokens_per_s"] > 0
    assert final.stat().st_mtime_ns == written  # the final checkpoint is not saved again
