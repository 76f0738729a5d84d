"""torchrun data parallel on the CPU (gloo, 2 processes) against the single-process run."""

import shutil
import subprocess
import sys

import pytest

from moestack import checkpoint
from moestack.metrics import read_metrics

SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.max_seq_len=32",
    "model.moe.num_experts=4",
    "model.moe.d_ff=32",
    "router.load_balance=0",  # its batch statistics are per rank, so not bit-comparable
    "data.seq_len=32",
    "data.max_bytes=1000000",
    "telemetry=off",
    "steps=10",
    "batch_size=8",
    "log_every=1",
    "eval_every=0",
    "eval_batches=1",
    "ckpt_every=5",
    "keep_last=5",
    "progress=false",
    "wandb_mode=disabled",
    "threads=1",
]


def run(tmp_path, out_dir, nproc, *overrides):
    launcher = [sys.executable, "-m", "moestack.train"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    "--standalone", "-m", "moestack.train"]  # fmt: skip
    result = subprocess.run(
        [*launcher, *SMALL, f"out_dir={out_dir}", *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {
        r["step"]: r["loss/train"]
        for r in read_metrics(out_dir / "metrics.jsonl")
        if "loss/train" in r
    }


@pytest.mark.parametrize("optim", ["adamw", "offload_adamw"])
def test_two_gloo_ranks_match_one_process(tmp_path, optim):
    single = run(tmp_path, tmp_path / "single", 1, f"optim={optim}")
    double = run(tmp_path, tmp_path / "double", 2, f"optim={optim}")
    assert sorted(single) == sorted(double) == list(range(1, 11))
    for step in single:
        assert double[step] == pytest.approx(single[step], rel=2e-5), step

    if optim == "offload_adamw":  # a 2-rank checkpoint resumes on 1 rank
        resumed = tmp_path / "resumed"
        shutil.copytree(tmp_path / "double", resumed)
        shutil.rmtree(resumed / "checkpoints" / "step_000010")
        assert checkpoint.latest_checkpoint(resumed / "checkpoints").name == "step_000005"
        after = run(tmp_path, resumed, 1, f"optim={optim}", "resume=true")
        for step in range(6, 11):
            assert after[step] == pytest.approx(double[step], rel=2e-5), step
