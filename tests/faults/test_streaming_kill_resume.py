"""Fault injection for training with streamed experts: kill -9 a run with
offload_experts=disk at random steps and resume it as a user would; its losses, final
weights and cache metrics' presence must be the uninterrupted run's."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moestack.metrics import read_metrics

pytestmark = pytest.mark.faults

STEPS = 8
OVERRIDES = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
    "model.moe.num_experts=4", "model.moe.d_ff=32", "data.seq_len=32", "data.max_bytes=2000000",
    f"steps={STEPS}", "batch_size=4", "log_every=1", "ckpt_every=2", "keep_last=2",
    "eval_every=0", "eval_batches=2", "progress=false", "wandb_mode=disabled", "threads=1",
    "trainable=lora", "lora.rank=4", "lora.dropout=0.1", "offload_experts=disk",
    "cache.capacity=2",
]  # fmt: skip
KILLS = 3


def command(out_dir: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "moestack.train", *OVERRIDES, f"out_dir={out_dir}",
            f"resume={str(resume).lower()}"]  # fmt: skip


def records(run: Path) -> dict[int, dict]:
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    return {r["step"]: r for r in rows if "loss/train" in r}


def final_weights(run: Path) -> str:
    path = run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_kill_9_then_resume_gives_the_uninterrupted_run(tmp_path: Path):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    reference = tmp_path / "reference"
    subprocess.run(command(reference, False), env=env, check=True, capture_output=True)
    run = tmp_path / "killed"
    rng = random.Random(56)
    for _ in range(KILLS):
        resume = (run / "checkpoints").is_dir()
        proc = subprocess.Popen(command(run, resume), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        after = max(records(run), default=0) + rng.randrange(1, 3)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if max(records(run), default=0) >= after:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        proc.wait()
    subprocess.run(command(run, True), env=env, check=True, capture_output=True)
    want, got = records(reference), records(run)
    assert {s: r["loss/train"] for s, r in got.items()} == {
        s: r["loss/train"] for s, r in want.items()
    }
    assert final_weights(run) == final_weights(reference)
    for name in ("cache/bytes_moved", "cache/loads", "cache/hit_rate", "cache/stall_s"):
        assert all(name in r for r in got.values()), name
    assert (run / "experts" / "index.json").is_file()  # the run's store, written once
