"""Expert parallelism on a transformers model (Qwen3-MoE architecture, 6 experts): two gloo
ranks at parallel.ep=2 train with the same losses as one process, each reading only its own
experts from the folder, and their checkpoint (rank files) resumes in one process.

The runs are launched once for the module and the tests that only read them share them; the
two one-process launches run side by side (one alone would leave a core idle)."""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.multiprocess import run_launch

pytest.importorskip("transformers")

from moestack import checkpoint, checkpoint_load  # noqa: E402
from moestack.interop import hf_experts  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402
from moestack.metrics import read_metrics  # noqa: E402
from moestack.parallel import ExpertParallelMesh, shard_experts  # noqa: E402
from moestack.parallel import config as parallel_config  # noqa: E402


def train(tmp_path, model_dir, out_dir, nproc, *overrides) -> list[float]:
    launcher = [sys.executable, "-m", "moestack.train"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    "--standalone", "-m", "moestack.train"]  # fmt: skip
    args = [
        "model=hf", f"model.path={model_dir}", "data.seq_len=32", "data.max_bytes=300000",
        "telemetry=off", "steps=4", "batch_size=4", "log_every=1", "eval_every=0",
        "eval_batches=1", "ckpt_every=2", "progress=false", "wandb_mode=disabled", "threads=1",
        "router.load_balance=0", f"out_dir={out_dir}",
    ]  # fmt: skip
    what = f"moestack.train (model=hf) on {nproc} process(es) into {out_dir.name}"
    result = run_launch([*launcher, *args, *overrides], what, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [r["loss/train"] for r in read_metrics(out_dir / "metrics.jsonl") if "loss/train" in r]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory, hf_dir) -> tuple[Path, Path, dict[str, list[float]]]:
    """The 4-step model=hf run on 2 ranks at ep=2 ("ep2"), then side by side the same run in
    one process ("one") and ep2's step-2 checkpoint resumed in one process ("resumed"):
    (their folder, the transformers folder, each run's losses)."""
    tmp = tmp_path_factory.mktemp("hf_runs")
    model_dir = hf_dir("qwen3_moe")
    ep2 = train(tmp, model_dir, tmp / "ep2", 2, "parallel.ep=2")
    resumed = tmp / "resumed"
    shutil.copytree(tmp / "ep2", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(train, tmp, model_dir, tmp / "one", 1)
        after = pool.submit(train, tmp, model_dir, resumed, 1, "resume=true")
    return tmp, model_dir, {"one": one.result(), "ep2": ep2, "resumed": after.result()}


def test_transformers_model_trains_expert_parallel_as_one_process(hf_runs):
    run_dir, _, losses = hf_runs
    one, ep2 = losses["one"], losses["ep2"]
    assert len(one) == len(ep2) == 4
    assert ep2 == pytest.approx(one, rel=2e-5)
    records = read_metrics(run_dir / "ep2" / "metrics.jsonl")
    sent = [r["ep/rank0/tokens_sent"] for r in records if "ep/rank0/tokens_sent" in r]
    assert len(sent) == 4 and min(sent) > 0  # tokens really crossed ranks

    # its checkpoint: each rank's experts in its own file; step 2's resumes in one process
    assert "rank00001.experts.safetensors" in checkpoint.read_meta(
        checkpoint.latest_checkpoint(run_dir / "ep2" / "checkpoints"))["parts"]  # fmt: skip
    assert losses["resumed"][-2:] == pytest.approx(ep2[-2:], rel=2e-5)


def test_a_rank_reads_only_its_own_experts_from_the_folder(hf_dir, monkeypatch):
    """Built without experts and cut to rank 1 of ep=2, a model reads experts 3..5 of each
    layer and nothing else, and holds what transformers' own load holds for them."""
    model_dir = hf_dir("qwen3_moe")
    whole = load_hf_moe(model_dir)
    part = load_hf_moe(model_dir, experts=False)
    mesh = ExpertParallelMesh(world_size=2, ep=2, ep_rank=1, dp_rank=0, ep_group=None,
                              expert_dp_group=None)  # fmt: skip
    shard_experts(part, mesh)
    read = []
    original = hf_experts._read_expert
    monkeypatch.setattr(
        hf_experts, "_read_expert", lambda r, plan, e: read.append(e) or original(r, plan, e)
    )
    hf_experts.fill_expert_rows(part, model_dir)
    assert read == [3, 4, 5] * len(whole.moe_layers)
    for mine, theirs in zip(part.moe_layers, whole.moe_layers, strict=True):
        assert torch.equal(mine.w1, theirs.w1[3:]) and torch.equal(mine.w2, theirs.w2[3:])


@pytest.mark.parametrize("ep", [1, 2])
def test_a_resumed_build_reads_no_weight_of_the_folder(hf_runs, monkeypatch, ep):
    """A resumed model=hf run builds on meta and fills each tensor once, from its checkpoint
    (at ep=1 whole, at ep=2 rank 1's experts alone): no tensor of the transformers folder is
    read, and the weights are the checkpoint's."""
    from moestack import distributed, meta_load, runs, trainer
    from moestack.interop import hf_model

    runs_dir, model_dir, _ = hf_runs
    run_dir = runs_dir / "one"
    ckpt = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    cfg = runs.load_run_config(run_dir)
    cfg.parallel.ep = ep
    opened = []
    for module in (meta_load, checkpoint_load):  # every safetensors open of a build
        real = module.safe_open
        monkeypatch.setattr(
            module,
            "safe_open",
            lambda path, *a, real=real, **k: opened.append(str(path)) or real(path, *a, **k),
        )

    def no_whole_load(*args, **kwargs):
        raise AssertionError("the whole transformers model was loaded")

    monkeypatch.setattr(hf_model, "_from_pretrained", no_whole_load)
    if ep == 2:  # rank 1 of an EP group of 2, without collectives (the mesh alone)
        monkeypatch.setattr(
            parallel_config,  # where ParallelConfig.build, which the trainer calls, finds it
            "expert_parallel",
            lambda model, world, rank, ep: (_cut(model, ep), None),
        )
    model, _, _, step = trainer._build_model(cfg, distributed.DistInfo(0, 1, 0), ckpt)
    assert step == 4 and not [p for p in opened if p.startswith(str(model_dir))]
    saved = checkpoint.read_weights(ckpt)
    for name, tensor in model.state_dict().items():
        assert not tensor.is_meta, name
        if name in saved:
            rows = slice(3, 6) if (ep == 2 and ".moe.w" in name) else slice(None)
            assert torch.equal(tensor, saved[name][rows]), name


def _cut(model, ep: int):
    mesh = ExpertParallelMesh(world_size=ep, ep=ep, ep_rank=ep - 1, dp_rank=0, ep_group=None,
                              expert_dp_group=None)  # fmt: skip
    shard_experts(model, mesh)
    return mesh
