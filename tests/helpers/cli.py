"""The command lines the tests run: a tiny model and a run of a few seconds as overrides,
and ``python -m moestack.train`` (or another module) in a folder of the test's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# A tiny model (one layer of width 32, 4 experts) and a run of two steps on a slice of the
# corpus, evaluating and checkpointing nothing on the way.
TINY_MODEL = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
    "model.moe.num_experts=4", "model.moe.d_ff=32",
]  # fmt: skip
TINY_RUN = [
    "data.seq_len=32", "data.max_bytes=100000", "batch_size=2", "steps=2", "eval_every=0",
    "eval_batches=1", "log_every=1", "ckpt_every=0", "progress=false", "threads=1",
]  # fmt: skip
TINY_ARGS = [*TINY_MODEL, *TINY_RUN]


def run_module(
    *args: str, cwd: Path, env: dict | None = None, module: str = "moestack.train"
) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in ``cwd``, output captured; wandb off unless ``env`` (the
    whole environment when given) says otherwise."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env=env if env is not None else {**os.environ, "WANDB_MODE": "disabled"},
    )
