"""Fault injection: kill -9 a training run at random moments, mid-checkpoint included, and
resume it each time as a user would (rerun the command, with resume=true once a checkpoint
exists). The losses of every step and the final weights must equal an uninterrupted run's.

Outcomes are counted into the fault report (``conftest.FaultReport``, docs/reliability.md).
"""

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

STEPS = 18  # seed 1234 kills after step 15, then mid-checkpoint at 16, then at start-ups
OVERRIDES = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
    "model.moe.num_experts=4", "model.moe.d_ff=32", "data.seq_len=32", "data.max_bytes=2000000",
    f"steps={STEPS}", "batch_size=4", "log_every=1", "ckpt_every=2", "keep_last=2",
    "eval_every=0", "eval_batches=2", "progress=false", "wandb_mode=disabled", "threads=1",
]  # fmt: skip
KILLS = 10  # bounded: each kill costs a process start (~4 s)


def command(out_dir: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "moestack.train", *OVERRIDES, f"out_dir={out_dir}",
            f"resume={str(resume).lower()}"]  # fmt: skip


def step_losses(run: Path) -> dict[int, float]:
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    return {r["step"]: r["loss/train"] for r in rows if "loss/train" in r}


def final_weights(run: Path) -> str:
    path = run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kill_when(proc: subprocess.Popen, run: Path, rng: random.Random) -> str:
    """SIGKILL ``proc`` at a random moment: after a random step, or the instant a checkpoint
    is being written (its temporary .step_* folder exists). Returns where it was killed."""
    mid_checkpoint = rng.random() < 0.5
    after_step = rng.randrange(1, STEPS)
    ckpts = run / "checkpoints"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if (
            mid_checkpoint
            and ckpts.is_dir()
            and any(p.name.startswith(".step_") for p in ckpts.iterdir())
        ):
            proc.send_signal(signal.SIGKILL)
            return "mid-checkpoint"
        if not mid_checkpoint and max(step_losses(run), default=0) >= after_step:
            time.sleep(rng.random() * 0.05)
            proc.send_signal(signal.SIGKILL)
            return f"after step {after_step}"
        time.sleep(0.0005)
    return "finished first"


def test_kill_9_anywhere_then_resume_gives_the_uninterrupted_run(tmp_path, fault_report):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    reference = tmp_path / "reference"
    # The uninterrupted run goes on beside the killed ones, in its own folder: its start and
    # its checkpoints' writes overlap theirs.
    uninterrupted = subprocess.Popen(command(reference, False), env=env, text=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    rng = random.Random(1234)
    run = tmp_path / "killed"
    kills = []
    for _ in range(KILLS):
        resume = (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("step_*"))
        proc = subprocess.Popen(command(run, resume), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)  # fmt: skip
        where = kill_when(proc, run, rng)
        proc.wait(timeout=120)
        kills.append(where)
        if (run / "summary.json").exists():
            break
    resume = any((run / "checkpoints").glob("step_*"))
    done = subprocess.run(command(run, resume), env=env, capture_output=True, text=True)
    _, reference_err = uninterrupted.communicate(timeout=300)
    assert uninterrupted.returncode == 0, reference_err[-2000:]
    finished = done.returncode == 0
    equal = finished and step_losses(run) == step_losses(reference)
    same_weights = finished and final_weights(run) == final_weights(reference)
    injected = sum(k != "finished first" for k in kills)
    ok = equal and same_weights
    fault_report.add("kill -9 during training", injected=injected,
                     recovered=injected if ok else 0, lost=0 if finished else injected,
                     silent=injected if finished and not ok else 0,
                     mid_checkpoint=kills.count("mid-checkpoint"))  # fmt: skip
    assert finished, done.stderr[-2000:]
    assert any(k == "mid-checkpoint" for k in kills), kills
    assert equal, kills
    assert same_weights, kills
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []
