"""Training with expert parallelism under torchrun (gloo, CPU) against one process: the
same losses at (dp, ep) = (1, 4) and (2, 2) from step 0, and their checkpoints resumed at
another layout, (1, 2) and one without expert parallelism, with the losses they had; bad
layouts refused in one line.

Launches are what these tests cost (each process imports torch; gloo ranks share the cores),
so each layout runs once where the optimizer is not what it shows, and launches that do not
depend on each other run side by side."""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.multiprocess import run_launch

from moestack import checkpoint
from moestack.config import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moestack.errors import MoestackError
from moestack.metrics import read_metrics
from moestack.parallel import check_layout

STEPS, CKPT_EVERY = 8, 4  # a resumed run starts from the step-4 checkpoint: steps 5..8
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
    f"steps={STEPS}",
    "batch_size=8",
    "log_every=1",
    "eval_every=0",
    "eval_batches=1",
    f"ckpt_every={CKPT_EVERY}",
    "keep_last=5",
    "progress=false",
    "wandb_mode=disabled",
    "threads=1",
    # load_balance off: its batch statistics are per rank, so not comparable to one process
    "router.load_balance=0",
]
Losses = dict[int, tuple[float, float]]


def train(tmp_path: Path, out_dir: Path, nproc: int, *overrides: str) -> Losses:
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


def train_side_by_side(tmp_path: Path, runs: list[tuple[Path, int, list[str]]]) -> list[Losses]:
    """``train(tmp_path, out_dir, nproc, *overrides)`` of every run, all launched at once (one
    thread each): a one-process run or torchrun's own start leaves a core idle that another
    launch uses. Each launch ends its own processes; the first failure is raised."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(train, tmp_path, out, nproc, *over) for out, nproc, over in runs]
    return [future.result() for future in futures]


def assert_same_losses(got: Losses, want: Losses, steps: range) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=2e-5), (step, got[step], want[step])


def resumable_copy(tmp_path: Path, source: str, name: str) -> Path:
    """A copy of run ``source`` whose newest checkpoint is the mid-run one (step 4)."""
    copy = tmp_path / name
    shutil.copytree(tmp_path / source, copy)
    shutil.rmtree(copy / "checkpoints" / f"step_{STEPS:06d}")
    assert checkpoint.latest_checkpoint(copy / "checkpoints").name == f"step_{CKPT_EVERY:06d}"
    return copy


# optimizer -> the (ranks, ep) it trains from step 0, the (ranks, ep) its step-4 checkpoint
# resumes at, and the expert rows of that checkpoint's rank files. One 4-rank layout each
# from step 0 (the layouts' initial weights and routing are the optimizer's concern of
# neither; tests/model/test_seeding.py draws every rank's rows at both): torch AdamW at
# (4, 4), one expert a rank, whose states two ranks join when they read them at (2, 2);
# OffloadAdamW at (4, 2) (dp = 2 with ep = 2), whose experts' state is split over their
# expert data-parallel group and its replicated state over 4 ranks, both cut again at
# (2, 2). Each checkpoint also resumes without expert parallelism: AdamW in one process (a
# data-parallel rank reads its state as one process does), OffloadAdamW on 2 ranks (whole
# experts' state, in 2 ZeRO shards). optim=tiered at (2, 2): each rank writes its 2 experts'
# entries, read back joined by one process; with an fp32 master (its weights fp32 on the
# CPU): without one they sit on the bf16 grid, where the last bits of another layout's
# gradient sums can round a weight to its other neighbour (tests/optim/test_tiered.py
# checks that layout bit for bit on equal gradients).
LAYOUTS = {
    "adamw": ((4, 4), [(2, 2), (1, 1)], [[0, 1], [1, 2], [2, 3], [3, 4]]),
    "offload_adamw": ((4, 2), [(2, 2), (2, 1)], [[0, 2], [2, 4]]),
    "tiered": ((2, 2), [(1, 1)], [[0, 2], [2, 4]]),  # each rank's experts' state its own file
}
SETTINGS = {"tiered": ["optim.master=float32"]}  # beside optim=<name>, in every launch


@pytest.mark.parametrize("optim", list(LAYOUTS))
def test_expert_parallel_training_matches_one_process_and_reshards(tmp_path, optim):
    """Every step's losses at the optimizer's 4-rank layout are one process's; its rank files
    hold what one process saves; its step-4 checkpoint resumes at the other layouts with the
    losses of steps 5..8 it had."""
    (nproc, ep), resumes, rows = LAYOUTS[optim]
    chosen = [f"optim={optim}", *SETTINGS.get(optim, [])]
    layout = [*chosen, f"parallel.ep={ep}"]
    launches = [(tmp_path / "single", 1, chosen), (tmp_path / "source", nproc, layout)]
    if optim == "offload_adamw":  # the collectives on the "devices" too (gloo on the CPU),
        # the experts' over their expert data-parallel group, the rest over the world
        launches.append((tmp_path / "on_device", nproc, [*layout, "optim.reduce_on_device=true"]))
    single, source, *on_device = train_side_by_side(tmp_path, launches)
    assert sorted(single) == list(range(1, STEPS + 1))
    for run in (source, *on_device):
        assert_same_losses(run, single, range(1, STEPS + 1))
    metrics = read_metrics(tmp_path / "source" / "metrics.jsonl")
    sent = [r["ep/rank0/tokens_sent"] for r in metrics if "ep/rank0/tokens_sent" in r]
    assert len(sent) == STEPS and all(s > 0 for s in sent)  # tokens really crossed ranks
    check_rank_files(tmp_path, "source", "single", rows, nproc)

    runs = [(resumable_copy(tmp_path, "source", f"resumed_{n}_{e}"), n, e) for n, e in resumes]
    resumed = train_side_by_side(
        tmp_path,
        [(out, n, [*chosen, f"parallel.ep={e}", "resume=true"]) for out, n, e in runs],
    )
    for after in resumed:
        assert_same_losses(after, source, range(CKPT_EVERY + 1, STEPS + 1))


def check_rank_files(
    tmp_path: Path, run: str, single: str, rows: list[list[int]], nproc: int
) -> None:
    """An expert-parallel checkpoint: each EP rank of the first replica wrote its own
    experts' weights (``rows``), every rank its optimizer state, and the shared weights file
    holds no expert; read whole, it has the one-process checkpoint's tensors. A flipped byte
    in a rank file is refused naming the file."""
    ckpt = checkpoint.latest_checkpoint(tmp_path / run / "checkpoints")
    parts = checkpoint.read_meta(ckpt)["parts"]
    assert {n: r["rows"] for n, r in parts.items() if r["kind"] == "experts"} == {
        f"rank{r:05d}.experts.safetensors": block for r, block in enumerate(rows)
    }
    assert sorted(n for n, r in parts.items() if r["kind"] == "optimizer") == [
        f"rank{r:05d}.optim.pt" for r in range(nproc)
    ]
    shared = safetensors.torch.load_file(ckpt / checkpoint.MODEL_FILE)
    assert shared and not [k for k in shared if ".moe.w" in k]
    one = checkpoint.read_weights(checkpoint.latest_checkpoint(tmp_path / single / "checkpoints"))
    whole = checkpoint.read_weights(ckpt)
    assert whole.keys() == one.keys()
    for name, tensor in one.items():
        torch.testing.assert_close(whole[name], tensor, rtol=1e-3, atol=1e-5)
    corrupt = tmp_path / f"{run}_corrupt"
    shutil.copytree(tmp_path / run / "checkpoints", corrupt)
    rank_file = corrupt / ckpt.name / "rank00001.experts.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-7] ^= 0x10
    rank_file.write_bytes(bytes(data))
    with pytest.raises(MoestackError, match=r"rank00001\.experts\.safetensors.*sha256"):
        checkpoint.verify_checkpoint(corrupt / ckpt.name)
    assert checkpoint.newest_verified(corrupt).name == f"step_{CKPT_EVERY:06d}"


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
    ep2 = train(tmp_path, tmp_path / "ep2", 2, *lora, "parallel.ep=2")
    resumed = resumable_copy(tmp_path, "ep2", "resumed")
    single, after = train_side_by_side(tmp_path, [
        (tmp_path / "single", 1, lora), (resumed, 1, [*lora, "resume=true"]),
    ])  # fmt: skip
    assert_same_losses(ep2, single, range(1, STEPS + 1))
    tensors = {
        name: checkpoint.read_weights(checkpoint.latest_checkpoint(tmp_path / name / "checkpoints"))
        for name in ("single", "ep2")
    }
    adapters = [k for k in tensors["single"] if "lora" in k]
    assert any(".moe.lora_w1_A" in k for k in adapters)
    assert tensors["ep2"].keys() == tensors["single"].keys()  # every expert's, whole
    for k in adapters:
        torch.testing.assert_close(tensors["ep2"][k], tensors["single"][k], rtol=1e-4, atol=1e-6)
    assert_same_losses(after, ep2, range(CKPT_EVERY + 1, STEPS + 1))
