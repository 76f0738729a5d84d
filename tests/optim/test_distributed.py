"""OffloadAdamW sharded over 2 gloo processes on the CPU, against 1-process torch AdamW."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _optim_testlib import (
    IDLE,
    LR,
    MAX_NORM,
    STEPS,
    TinyMoE,
    assert_rel_close,
    delayed_run,
    dist_worker,
    groups,
    lr_lambda,
    micro_step,
    reference_run,
)
from helpers.multiprocess import file_rendezvous, spawn_ranks

from moestack.optim import OffloadAdamW

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

# Relative error bound against the 1-process torch.optim.AdamW run (max|a-b| / max|b|).
DIST_TOL = 1e-6


@pytest.fixture(scope="module")
def ref() -> list:
    return reference_run()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every DIST_CONFIGS run on 2 gloo ranks, once for the module (a store of its own)."""
    out = tmp_path_factory.mktemp("dist")
    what = "the 2 gloo ranks of _optim_testlib.dist_worker (shard, replicate and skip runs)"
    spawn_ranks(dist_worker, (2, file_rendezvous(out), str(out)), 2, what)
    return out


def _runs(out: Path, config: str) -> list[dict]:
    return [torch.load(out / f"{config}{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("config", ["shard", "replicate"])
def test_two_ranks_match_one_process(two_rank_run: Path, ref: list, config: str) -> None:
    runs = _runs(two_rank_run, config)
    for run in runs:
        assert run["shards"] == (2 if config == "shard" else 1)
        for step in range(STEPS):
            got = run["history"][step]
            # the norm of the rank-averaged gradients, before clipping
            assert got["norm"] == pytest.approx(ref[step]["norm"], rel=1e-5), step
            for n, p in got["params"].items():
                assert_rel_close(p, ref[step]["params"][n], f"step {step} {n}", DIST_TOL)
    last = [run["history"][-1]["params"] for run in runs]
    for n, p in last[0].items():  # the ranks hold the same weights
        assert torch.equal(p, last[1][n])


def test_each_rank_holds_half_the_state(two_rank_run: Path) -> None:
    numel = sum(p.numel() for p in TinyMoE().parameters())
    full = 12 * numel  # fp32 master + exp_avg + exp_avg_sq
    sizes = [run["state_bytes"] for run in _runs(two_rank_run, "shard")]
    assert sum(sizes) == full
    for size in sizes:
        assert 0.4 * full <= size <= 0.6 * full, (sizes, full)


def test_two_rank_checkpoint_resumes_on_one_rank(two_rank_run: Path, ref: list) -> None:
    ckpt = torch.load(two_rank_run / "ckpt.pt", weights_only=True)
    assert "moe.w1/expert0" in ckpt["optim"]["state"]
    model = TinyMoE()
    model.load_state_dict(ckpt["model"])
    opt = OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    sched.load_state_dict(ckpt["sched"])
    opt.load_state_dict(ckpt["optim"])
    for step in range(STEPS // 2, STEPS):
        micro_step(model, step)
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            assert_rel_close(p.detach(), ref[step]["params"][n], f"step {step} {n}", DIST_TOL)


def test_two_ranks_skip_idle_expert(two_rank_run: Path, ref: list) -> None:
    """Sharded skipping: the idle expert never moves, every other weight is torch AdamW's."""
    init = dict(TinyMoE().named_parameters())
    for run in _runs(two_rank_run, "skip"):
        last = run["history"][-1]["params"]
        for n, p in last.items():
            if n.startswith("moe."):
                assert torch.equal(p[IDLE], init[n].detach()[IDLE])
                busy = [e for e in range(p.shape[0]) if e != IDLE]
                assert_rel_close(p[busy], ref[-1]["params"][n][busy], n, DIST_TOL)
            else:
                assert_rel_close(p, ref[-1]["params"][n], n, DIST_TOL)


def test_two_ranks_delayed_match_one_process_and_hold_half(two_rank_run: Path) -> None:
    """update_delay=1 on 2 gloo ranks (state sharded) is the 1-process delayed run; each rank
    holds half the state and a spare gradient buffer of its own shard only."""
    want = delayed_run(warmup=1, clip=True)
    runs = _runs(two_rank_run, "delayed")
    numel = sum(p.numel() for p in TinyMoE().parameters())
    for run in runs:
        assert run["shards"] == 2
        assert len(run["history"]) == STEPS + 1
        for step, got in enumerate(run["history"]):
            for n, p in got["params"].items():
                assert_rel_close(p, want[step][n], f"after step {step} {n}", DIST_TOL)
        assert 0.4 * 12 * numel <= run["state_bytes"] <= 0.6 * 12 * numel
        assert 0.4 * 4 * numel <= run["spare_bytes"] <= 0.6 * 4 * numel
    assert sum(run["state_bytes"] for run in runs) == 12 * numel


@pytest.mark.parametrize("device, host", [("device", "shard"), ("device_delayed", "delayed")])
def test_device_collectives_are_the_host_collectives(two_rank_run: Path, device, host) -> None:
    """Reduce-scatter and all-gather over the optimizer's own group (here gloo on CPU
    tensors: the logic of the NCCL path): with fp32 gradients the same sums as the host's,
    and the mean taken as the step's scale 1/2 (exact), so every weight and norm is the
    host collectives' bit for bit, exact and delayed."""
    for got, want in zip(_runs(two_rank_run, device), _runs(two_rank_run, host), strict=True):
        for step, (a, b) in enumerate(zip(got["history"], want["history"], strict=True)):
            assert a.get("norm") == b.get("norm"), step
            for n, p in a["params"].items():
                assert torch.equal(p, b["params"][n]), (step, n)


def test_device_collectives_keep_one_gradient_shard_on_the_host(two_rank_run: Path) -> None:
    """Counted: a rank holds its own gradient shard on the host (the host collectives hold
    every shard's slot too), and the device holds every shard's slot and one shard."""
    numel = sum(p.numel() for p in TinyMoE().parameters())
    for run, host_run in zip(
        _runs(two_rank_run, "device"), _runs(two_rank_run, "shard"), strict=True
    ):
        stride = run["stride"]
        assert "grad_comm" not in run["host_bytes"]
        assert run["host_bytes"]["grad_shard"] == 4 * stride
        assert host_run["host_bytes"]["grad_comm"] == 4 * 2 * stride
        assert sum(run["host_bytes"].values()) == sum(host_run["host_bytes"].values()) - 8 * stride
        assert stride <= 0.6 * numel
        assert run["device_bytes"] == {
            "device_comm/full": 4 * 2 * stride,
            "device_comm/shard": 4 * stride,
        }


def test_bf16_device_collectives_hold_what_they_plan_and_track_the_host_ones(tmp_path) -> None:
    """bf16 gradients summed on the "devices" (gloo here) in bf16, as DDP's bf16 all-reduce
    sums them: each rank holds exactly the host buffers its plan lists (its bf16 gradient
    shard, a bf16 staging shard for the way back, no buffer of every shard), the ranks hold
    the same weights, within two bf16 ulps of the host collectives' fp32 sums."""
    from _optim_testlib import bf16_device_worker

    what = "the 2 gloo ranks of _optim_testlib.bf16_device_worker"
    spawn_ranks(bf16_device_worker, (2, file_rendezvous(tmp_path), str(tmp_path)), 2, what)
    runs = [torch.load(tmp_path / f"bf16_{r}.pt", weights_only=True) for r in range(2)]
    for run in runs:
        device, host = run["True"], run["False"]
        assert device["held"] == device["planned"]
        assert host["held"] == host["planned"]
        assert device["held"]["grad_shard"][1] == torch.bfloat16
        assert device["held"]["weight_staging"][1] == torch.bfloat16
        assert "grad_comm" not in device["held"] and "grad_comm" in host["held"]
        for a, b in zip(device["history"], host["history"], strict=True):
            for n, p in a.items():
                ulp = 2**-7 * b[n].float().abs().max()
                assert float((p.float() - b[n].float()).abs().max()) <= 2 * ulp, n
    for a, b in zip(runs[0]["True"]["history"], runs[1]["True"]["history"], strict=True):
        for n, p in a.items():
            assert torch.equal(p, b[n]), n


def test_own_state_with_an_update_in_flight_issues_no_collective(tmp_path) -> None:
    """own_expert_state and own_shard_state are not collective (expert parallelism's ranks
    call them for the state they own): with a delayed update in flight on 2 sharded ranks,
    host or "device" collectives, they issue none (the update's weights go back at the next
    synchronize or step); their expert entries are state_dict's, and the run trains on as
    one that never called them."""
    from _optim_testlib import own_state_worker

    what = "the 2 gloo ranks of _optim_testlib.own_state_worker"
    spawn_ranks(own_state_worker, (2, file_rendezvous(tmp_path), str(tmp_path)), 2, what)
    for rank in range(2):
        runs = torch.load(tmp_path / f"own_{rank}.pt", weights_only=True)
        for config, run in runs.items():
            assert run["shards"] == 2, config
            assert run["collectives"] == [], (rank, config)
            assert run["entries"] > 0 and run["shard_pieces"] > 0, (rank, config)
            assert run["entries_match_state_dict"], (rank, config)
            assert run["weights_match"], (rank, config)
