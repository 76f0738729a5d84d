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


def _in_backward(**overrides: object):  # noqa: ANN202
    """The run of ``_config`` with each tensor stepped in backward (no global clip)."""
    cfg = _config(**overrides)
    cfg.optim = OptimConfig(name="tiered", lr=3e-3, warmup_steps=2, grad_clip=0.0,
                            update_in_backward=True)  # fmt: skip
    return cfg


@pytest.mark.parametrize(
    "extra",
    [{}, {"trainable": "routers+lora", "model_checkpointing": "block"}, {"in_backward": True}],
    ids=["all", "routers+lora-block", "all-update-in-backward"],
)
def test_killed_and_resumed_equals_uninterrupted(tmp_path: Path, extra: dict) -> None:
    overrides = dict(extra)
    mode = overrides.pop("model_checkpointing", None)
    cfg = _in_backward() if overrides.pop("in_backward", False) else _config(**overrides)
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


@pytest.mark.parametrize("mode", ["none", "block"])
def test_update_in_backward_trains_as_the_step_after_it(
    tmp_path: Path, monkeypatch, mode: str
) -> None:
    """optim.update_in_backward=true: the run's losses, weights and optimizer metrics are those
    of the step after backward, bit for bit, a step with a NaN loss skipped in both (nothing
    stepped in its backward); also with each block's activations recomputed in backward."""
    from moestack.model import MoETransformer

    original = MoETransformer.forward
    calls = {"n": 0}

    def poisoned(self, tokens, targets=None):  # noqa: ANN001, ANN202
        out = original(self, tokens, targets)
        calls["n"] += 1
        if calls["n"] == 3:  # the third step's forward
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(MoETransformer, "forward", poisoned)
    hooked = _in_backward()
    plain = _in_backward()
    plain.optim.update_in_backward = False
    hooked.model.checkpointing = plain.model.checkpointing = mode
    for cfg, run in ((hooked, "hooked"), (plain, "plain")):
        calls["n"] = 0
        train(cfg, tmp_path / run)
    a, b = _final_weights(tmp_path / "plain"), _final_weights(tmp_path / "hooked")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(tmp_path / "plain") == losses(tmp_path / "hooked")
    records = [read_metrics(tmp_path / run / "metrics.jsonl") for run in ("plain", "hooked")]
    bad = [max(r.get("perf/bad_steps", 0) for r in rs) for rs in records]
    assert bad == [1, 1]
    optim = [{k: v for r in rs for k, v in r.items() if k.startswith("optim/")} for rs in records]
    assert optim[0] == optim[1] and "optim/experts/update_rms" in optim[0]
