"""Small training runs for the tests: the config most tests train (a few seconds on two
cores), the losses a run logged, and a run killed at a chosen step."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import moestack.telemetry
import moestack.telemetry.config
from moestack.config import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from moestack.data import BatchLoader
from moestack.metrics import read_metrics
from moestack.trainer import train

TOKENS_PER_STEP = 4 * 32  # batch_size x seq_len of small_config, one rank


def small_model(**changes: Any) -> ModelConfig:
    """small_config's model: 2 layers of width 32, 2 heads, 4 experts (top-2) of width 32;
    ``changes`` replace its fields, ``moe={...}`` the given fields of its MoEConfig."""
    moe = {"num_experts": 4, "top_k": 2, "d_ff": 32, **changes.pop("moe", {})}
    fields = {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32, **changes}
    return ModelConfig(**fields, moe=MoEConfig(**moe))


def small_config(**overrides: Any) -> TrainConfig:
    """A 30-step run of small_model on the default corpus, checkpoints every 10 steps, no
    telemetry, no wandb, one thread; ``overrides`` replace its fields."""
    base: dict[str, Any] = dict(
        model=small_model(),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        data=DataConfig(seq_len=32, max_bytes=2_000_000),
        telemetry=TelemetryConfig(enabled=False),
        steps=30,
        batch_size=4,
        eval_every=0,
        eval_batches=2,
        log_every=1,
        ckpt_every=10,
        progress=False,
        wandb_mode="disabled",
        threads=1,
    )
    base.update(overrides)
    return TrainConfig(**base)


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss of every record of ``run_dir``/metrics.jsonl that holds one."""
    return {
        r["step"]: r["loss/train"]
        for r in read_metrics(run_dir / "metrics.jsonl")
        if "loss/train" in r
    }


@contextlib.contextmanager
def killed_at(position: int) -> Iterator[None]:
    """The training started inside is killed (KeyboardInterrupt "simulated kill") when it
    asks for batch ``position`` (BatchLoader.position: the batches drawn before it; with one
    batch a step, the kill comes after ``position`` steps). The block must end in that kill;
    afterwards batches load as before."""
    original_next = BatchLoader.next

    def kill(self: BatchLoader) -> Any:
        if self.position == position:
            raise KeyboardInterrupt("simulated kill")
        return original_next(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchLoader, "next", kill)
        with pytest.raises(KeyboardInterrupt):
            yield


def killed_and_resumed(out: Path) -> None:
    """A run of 10 steps (a checkpoint every 5) killed at step 8, its trace part holding
    steps 0-7 (a chunk is written at each step's log record: 3 steps past its checkpoint),
    then resumed from step 5 to the end; each start with its own overrides."""
    cfg = dict(steps=10, ckpt_every=5, telemetry=TelemetryConfig(enabled=True))
    one_step = functools.partial(moestack.telemetry.config.attach, chunk_tokens=TOKENS_PER_STEP)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moestack.telemetry.config, "attach", one_step)  # where the run calls it
        with killed_at(8):
            train(small_config(**cfg), out, launch={"overrides": ["steps=10", "ckpt_every=5"]})
        train(small_config(resume=True, **cfg), out, launch={"overrides": ["resume=true"]})
