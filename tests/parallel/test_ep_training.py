"""Training with expert parallelism under torchrun (gloo, CPU) against one process: the
same losses at (dp, ep) = (1, 2), (2, 2) and (1, 4), checkpoints that resume at another
layout, and bad layouts refused in one line."""

from __future__ import annotations

import shutil
import sys

import pytest
import safetensors.torch
import torch
from helpers.multiprocess import run_launch

from moestack import checkpoint
from moestack.config import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moestack.errors import MoestackError
from moestack.metrics import read_metrics
from moestack.parallel import check_layout

TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.max_seq_len=32",
    "model.moe.num_experts=4",
    "model.moe.d_ff=24",
    "data.seq_len=32",
    "data.max_bytes=1000000",
    "telemetry=off",
    "steps=20",
    "batch_size=8",
    "log_every=1",
    "eval_every=0",
    "eval_batches=1",
    "ckpt_every=10",
    "keep_last=5",
    "progress=false",
    "wandb_mode=disabled",
    "threads=1",
    # load_balance off: its batch statistics are per rank, so not comparable to one process
    "router.load_balance=0",
]


def train(tmp_path, out_dir, nproc, *overrides) -> dict[int, tuple[float, float]]:
    """Run moestack.train on ``nproc`` processes; the train and router (aux) losses of every
    step (the router losses see the same routing with experts sharded or not)."""
    launcher = [sys.executable, "-m", "moestack.train"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    "--standalone", "-m", "moestack.train"]  # fmt: skip
    what = f"moestack.train on {nproc} process(es) into {out_dir.name}"
    result = run_launch([*launcher, *TINY, f"out_dir={out_dir}", *overrides], what, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(out_dir / "metrics.jsonl")
    return {r["step"]: (r["loss/train"], r["loss/aux"]) for r in records if "loss/train" in r}


def assert_same_losses(got: dict, want: dict, steps: range) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=2e-5), (step, got[step], want[step])


@pytest.mark.parametrize("optim", ["adamw", "offload_adamw"])
def test_expert_parallel_training_matches_one_process_and_reshards(tmp_path, optim):
    single = train(tmp_path, tmp_path / "single", 1, f"optim={optim}")
    ep2 = train(tmp_path, tmp_path / "ep2", 2, f"optim={optim}", "parallel.ep=2")
    dp2_ep2 = train(tmp_path, tmp_path / "dp2_ep2", 4, f"optim={optim}", "parallel.ep=2")
    assert sorted(single) == list(range(1, 21))
    assert_same_losses(ep2, single, range(1, 21))
    assert_same_losses(dp2_ep2, single, range(1, 21))
    if optim == "offload_adamw":  # (ranks, ep) = (4, 4) from the start (once: the layout's
        # initial weights and routing are the optimizer's concern of neither)
        ep4 = train(tmp_path, tmp_path / "ep4", 4, f"optim={optim}", "parallel.ep=4", "steps=10")
        assert_same_losses(ep4, single, range(1, 11))
    metrics = read_metrics(tmp_path / "ep2" / "metrics.jsonl")
    sent = [r["ep/rank0/tokens_sent"] for r in metrics if "ep/rank0/tokens_sent" in r]
    assert len(sent) == 20 and all(s > 0 for s in sent)  # tokens really crossed ranks
    check_rank_files(tmp_path, "ep2", "single")

    # The (1, 2) run's step-10 checkpoint resumes at (2, 1), (1, 1) and (1, 4).
    for nproc, ep in [(2, 1), (1, 1), (4, 4)]:
        resumed = tmp_path / f"resumed_{nproc}_{ep}"
        shutil.copytree(tmp_path / "ep2", resumed)
        shutil.rmtree(resumed / "checkpoints" / "step_000020")
        assert checkpoint.latest_checkpoint(resumed / "checkpoints").name == "step_000010"
        after = train(
            tmp_path, resumed, nproc, f"optim={optim}", f"parallel.ep={ep}", "resume=true"
        )
        assert_same_losses(after, ep2, range(11, 21))


def check_rank_files(tmp_path, ep2: str, single: str) -> None:
    """An ep=2 checkpoint: each rank wrote its own experts' weights and optimizer state, the
    shared weights file holds no expert; read whole, it has the one-process checkpoint's
    tensors. A flipped byte in a rank file is refused naming the file."""
    ckpt = checkpoint.latest_checkpoint(tmp_path / ep2 / "checkpoints")
    parts = checkpoint.read_meta(ckpt)["parts"]
    assert {n: r["rows"] for n, r in parts.items() if r["kind"] == "experts"} == {
        "rank00000.experts.safetensors": [0, 2],
        "rank00001.experts.safetensors": [2, 4],
    }
    assert sorted(n for n, r in parts.items() if r["kind"] == "optimizer") == [
        "rank00000.optim.pt", "rank00001.optim.pt"]  # fmt: skip
    shared = safetensors.torch.load_file(ckpt / checkpoint.MODEL_FILE)
    assert shared and not [k for k in shared if ".moe.w" in k]
    one = checkpoint.read_weights(checkpoint.latest_checkpoint(tmp_path / single / "checkpoints"))
    whole = checkpoint.read_weights(ckpt)
    assert whole.keys() == one.keys()
    for name, tensor in one.items():
        torch.testing.assert_close(whole[name], tensor, rtol=1e-3, atol=1e-5)
    corrupt = tmp_path / f"{ep2}_corrupt"
    shutil.copytree(tmp_path / ep2 / "checkpoints", corrupt)
    rank_file = corrupt / ckpt.name / "rank00001.experts.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-7] ^= 0x10
    rank_file.write_bytes(bytes(data))
    with pytest.raises(MoestackError, match=r"rank00001\.experts\.safetensors.*sha256"):
        checkpoint.verify_checkpoint(corrupt / ckpt.name)
    assert checkpoint.newest_verified(corrupt).name == "step_000010"


def test_bad_layouts_are_refused_naming_both_numbers(tmp_path):
    with pytest.raises(ValueError, match=r"parallel.ep=3 does not divide model.moe.num_experts=8"):
        TrainConfig(model=ModelConfig(moe=MoEConfig(num_experts=8)), parallel=ParallelConfig(ep=3))
    with pytest.raises(MoestackError, match=r"parallel.ep=4 does not divide the world size 2"):
        check_layout(2, 4)
    with pytest.raises(ValueError, match=r"parallel.ep=0 must be >= 1"):
        TrainConfig(parallel=ParallelConfig(ep=0))
    result = run_launch(
        [sys.executable, "-m", "moestack.train", *TINY, f"out_dir={tmp_path / 'bad'}",
         "parallel.ep=2"],
        "moestack.train with parallel.ep=2 on one process", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if "parallel.ep=2" in ln]
    assert lines and "world size 1" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_expert_parallel_lora_matches_one_process_and_resumes_on_one(tmp_path):
    """LoRA adapters on the experts shard with their experts: an ep=2 run trains as one
    process does, and its layout-free checkpoint (every expert's adapters) resumes there."""
    lora = ["trainable=routers+lora", "lora.rank=4", "lora.targets=both", "optim.lr=1e-2"]
    single = train(tmp_path, tmp_path / "single", 1, *lora)
    ep2 = train(tmp_path, tmp_path / "ep2", 2, *lora, "parallel.ep=2")
    assert_same_losses(ep2, single, range(1, 21))
    tensors = {
        name: checkpoint.read_weights(checkpoint.latest_checkpoint(tmp_path / name / "checkpoints"))
        for name in ("single", "ep2")
    }
    adapters = [k for k in tensors["single"] if "lora" in k]
    assert any(".moe.lora_w1_A" in k for k in adapters)
    assert tensors["ep2"].keys() == tensors["single"].keys()  # every expert's, whole
    for k in adapters:
        torch.testing.assert_close(tensors["ep2"][k], tensors["single"][k], rtol=1e-4, atol=1e-6)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ep2", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000020")
    after = train(tmp_path, resumed, 1, *lora, "resume=true")
    assert_same_losses(after, ep2, range(11, 21))
