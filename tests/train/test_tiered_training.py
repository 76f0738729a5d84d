"""optim=tiered through the training loop: it trains, logs each population's metrics, and a
run killed and resumed ends on the weights of the uninterrupted run, bit for bit (bf16
weights, stochastic rounding keyed by the step); with LoRA and a checkpointing mode too."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.runs import killed_at, losses, small_config

from moestack.config import OptimConfig
from moestack.metrics import read_metrics
from moestack.trainer import train


def _config(**overrides: object):  # noqa: ANN202
    optim = OptimConfig(name="tiered", lr=3e-3, warmup_steps=2)
    return small_config(optim=optim, steps=6, ckpt_every=3, **overrides)


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    last = sorted((out / "checkpoints").glob("step_*"))[-1]
    return safetensors.torch.load_file(last / "model.safetensors")


@pytest.mark.parametrize(
    "extra",
    [{}, {"trainable": "routers+lora", "model_checkpointing": "block"}],
    ids=["all", "routers+lora-block"],
)
def test_killed_and_resumed_equals_uninterrupted(tmp_path: Path, extra: dict) -> None:
    overrides = dict(extra)
    mode = overrides.pop("model_checkpointing", None)
    cfg = _config(**overrides)
    if mode:
        cfg.model.checkpointing = mode
    straight = tmp_path / "straight"
    train(cfg, straight)
    resumed = tmp_path / "resumed"
    with killed_at(5):
        train(cfg, resumed)
    cfg.resume = True
    train(cfg, resumed)
    a, b = _final_weights(straight), _final_weights(resumed)
    assert a.keys() == b.keys()
    assert a["layers.0.moe.router.weight"].dtype == torch.bfloat16  # master=none: bf16 weights
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(straight) == losses(resumed)
    record = next(
        r for r in read_metrics(straight / "metrics.jsonl") if "optim/routers/clipped" in r
    )
    if "trainable" in extra:  # the experts are frozen: no expert state, adapters have theirs
        assert "optim/experts/state_bytes" not in record
        assert record["optim/adapters/state_bytes"] > 0
    else:
        assert record["optim/experts/state_bytes"] > 0
