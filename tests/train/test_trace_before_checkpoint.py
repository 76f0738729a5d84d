"""The routing trace is on disk before a checkpoint is: a run killed right after a
checkpoint is committed, then resumed, has the uninterrupted run's whole trace."""

import pytest
from helpers.runs import small_config

from moestack import checkpoint
from moestack.config import TelemetryConfig
from moestack.telemetry.run_trace import load_run_trace
from moestack.trainer import train

CFG = dict(steps=8, ckpt_every=4, log_every=2, telemetry=TelemetryConfig(enabled=True))


def tokens(run) -> int:
    return load_run_trace(run / "trace").trace.num_tokens


def test_a_kill_right_after_a_checkpoint_keeps_the_trace_it_covers(tmp_path):
    reference = tmp_path / "reference"
    train(small_config(**CFG), reference)

    crashed = tmp_path / "crashed"
    real_save = checkpoint.save_checkpoint

    def save_then_kill(*args, **kwargs):  # killed the instant checkpoint 4 is committed
        path = real_save(*args, **kwargs)
        if path.name == "step_000004":
            raise KeyboardInterrupt("simulated kill")
        return path

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "save_checkpoint", save_then_kill)
        with pytest.raises(KeyboardInterrupt):
            train(small_config(**CFG), crashed)
    train(small_config(resume=True, **CFG), crashed)
    assert tokens(reference) == 8 * 4 * 32  # steps x batch x sequence, every token once
    assert tokens(crashed) == tokens(reference)
