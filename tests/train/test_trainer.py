"""The loop's parts: TrainState in checkpoints, one router config, loading a run."""

import subprocess
import sys

import pytest
import torch
from helpers.runs import killed_at, losses, small_config

from moestack import checkpoint
from moestack.config import ModelConfig, RouterConfig, TrainConfig
from moestack.errors import MoestackError
from moestack.metrics import read_metrics
from moestack.runs import load_run
from moestack.trainer import TrainState, train


def test_train_state_round_trips_through_its_state_dict():
    state = TrainState(step=7, bad_steps=2, consecutive_bad=1, interval_loss=3.25,
                       interval_aux=0.5, interval_steps=3)  # fmt: skip
    copy = TrainState()
    copy.load_state_dict(state.state_dict())
    assert copy == state
    legacy = TrainState()  # a checkpoint from before TrainState held only bad_steps
    legacy.load_state_dict({"bad_steps": 4})
    assert legacy == TrainState(bad_steps=4)


def test_resume_mid_interval_logs_what_the_uninterrupted_run_logs(tmp_path):
    """Checkpoints at steps 5 and 10 fall inside log intervals of 4 steps: the interval sums
    travel in the checkpoint, so the resumed run's interval means equal the reference's."""
    cfg = dict(steps=12, log_every=4, ckpt_every=5)
    reference = tmp_path / "reference"
    train(small_config(**cfg), reference)

    crashed = tmp_path / "crashed"
    with killed_at(7):
        train(small_config(**cfg), crashed)
    saved = checkpoint.load_train_state(crashed / "checkpoints/step_000005")["train"]
    assert saved["step"] == 5 and saved["interval_steps"] == 1  # step 5 of the 5..8 interval
    train(small_config(resume=True, **cfg), crashed)
    assert sorted(losses(reference)) == [4, 8, 12]
    assert losses(crashed) == losses(reference)  # exact, the interval cut by the crash too


def test_router_is_configured_in_one_place():
    cfg = TrainConfig(router=RouterConfig(temporal=0.1))
    assert cfg.model.router == cfg.router  # model.router follows router
    with pytest.raises(ValueError, match=r"model\.router.*router\.FIELD"):
        TrainConfig(model=ModelConfig(router=RouterConfig(temporal=0.1)))


def test_cli_refuses_a_model_router_override(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moestack.train",
            "model.router.z_loss=0.5",
            f"out_dir={tmp_path}",
            "wandb_mode=disabled",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2
    assert "'router.z_loss=0.5'" in output and "Traceback" not in output
    assert not (tmp_path / "checkpoints").exists()


def test_load_run_gives_the_newest_or_the_named_checkpoint(tmp_path):
    cfg = small_config(steps=20, ckpt_every=10, log_every=10)
    train(cfg, tmp_path)
    newest = load_run(tmp_path)
    assert newest.step == 20 and newest.checkpoint.name == "step_000020"
    assert newest.cfg.model == cfg.model and newest.cfg.steps == 20
    named = load_run(tmp_path, tmp_path / "checkpoints/step_000010")
    assert named.step == 10
    # The weights are the checkpoint's, read independently with safetensors.
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoints/step_000010" / checkpoint.MODEL_FILE))
    params = dict(named.model.named_parameters())
    assert saved and all(torch.equal(params[k], v) for k, v in saved.items() if k in params)
    assert not torch.equal(params["layers.0.moe.w1"], newest.model.layers[0].moe.w1)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")][:2] == [10, 20]
    with pytest.raises(MoestackError, match="config.yaml not found"):
        load_run(tmp_path / "checkpoints")
