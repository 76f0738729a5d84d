"""Expert parallelism on a transformers model (Qwen3-MoE architecture, 6 experts): two gloo
ranks at parallel.ep=2 train with the same losses as one process."""

from __future__ import annotations

import sys

import pytest
from helpers.multiprocess import run_launch

pytest.importorskip("transformers")

from moestack.metrics import read_metrics  # noqa: E402


def train(tmp_path, model_dir, out_dir, nproc, *overrides) -> list[float]:
    launcher = [sys.executable, "-m", "moestack.train"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    "--standalone", "-m", "moestack.train"]  # fmt: skip
    args = [
        "model=hf", f"model.path={model_dir}", "data.seq_len=32", "data.max_bytes=300000",
        "telemetry=off", "steps=4", "batch_size=4", "log_every=1", "eval_every=0",
        "eval_batches=1", "ckpt_every=0", "progress=false", "wandb_mode=disabled", "threads=1",
        "router.load_balance=0", f"out_dir={out_dir}",
    ]  # fmt: skip
    what = f"moestack.train (model=hf) on {nproc} process(es) into {out_dir.name}"
    result = run_launch([*launcher, *args, *overrides], what, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [r["loss/train"] for r in read_metrics(out_dir / "metrics.jsonl") if "loss/train" in r]


def test_transformers_model_trains_expert_parallel_as_one_process(tmp_path, hf_dir):
    model_dir = hf_dir("qwen3_moe")
    one = train(tmp_path, model_dir, tmp_path / "one", 1)
    ep2 = train(tmp_path, model_dir, tmp_path / "ep2", 2, "parallel.ep=2")
    assert len(one) == len(ep2) == 4
    assert ep2 == pytest.approx(one, rel=2e-5)
    records = read_metrics(tmp_path / "ep2" / "metrics.jsonl")
    sent = [r["ep/rank0/tokens_sent"] for r in records if "ep/rank0/tokens_sent" in r]
    assert len(sent) == 4 and min(sent) > 0  # tokens really crossed ranks
