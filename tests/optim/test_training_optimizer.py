"""build_training_optimizer: one factory call builds the optimizer of every layout (one
process, data parallel, expert parallel; torch AdamW and OffloadAdamW), and one loop drives
each through the same methods (forward_model, no_sync, clip_grad_norm, step, zero_grad,
state_dict, load_state_dict) to what torch AdamW computes in one process over the global
batch: the same weights, gradient norms and moments, the moments saved in one format at every
layout, and a state loaded back that steps on as the reference does."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
from helpers.multiprocess import file_rendezvous, run_gloo_rank, spawn_ranks
from torch import nn

from moestack import MoE, MoEConfig, RouterConfig, parallel
from moestack.config import OptimConfig
from moestack.optim import TrainingOptimizer, build_training_optimizer

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

D, F, E, TOP_K = 8, 6, 4, 2
STEPS, ACCUM, BATCH = 4, 2, 8  # optimizer steps (one more after the reload), micro-batches
LR, WEIGHT_DECAY = 1e-2, 0.1
MAX_NORMS = [1e-4, 0.0, 1e-4, 0.0, 1e-4]  # clipping on, off (0: no norm, 0.0 reported), ...
LAYOUTS = [("adamw", 1), ("offload_adamw", 1), ("adamw", 2), ("offload_adamw", 2)]  # (name, ep)
TOL = 1e-5  # relative: fp32 sums over ranks and OffloadAdamW's host step against torch's


class Tiny(nn.Module):
    """Linear -> scale -> one MoE layer (stacked experts ``moe.w1``, ``moe.w2``); the loss is
    the mean squared error against the targets, as ``forward_model(inputs, targets)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D))
        router = RouterConfig(load_balance=0.0, z_loss=0.0)
        self.moe = MoE(D, MoEConfig(num_experts=E, top_k=TOP_K, d_ff=F, impl="torch"), router)

    @property
    def moe_layers(self) -> list[MoE]:
        return [self.moe]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.moe(self.inp(x) * self.scale) - y).square().mean()


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def lr_lambda(step: int) -> float:
    return min(1.0, (step + 1) / 2) * (0.5 + 0.5 * math.cos(step / STEPS))


def reference() -> list[dict]:
    """torch AdamW in one process over the global batch, torch's clip: after each step the
    weights, the norm and the state (positional, as torch saves it)."""
    model = Tiny()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": vectors}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    out = []
    for step in range(STEPS + 1):
        for micro in range(ACCUM):
            (model(*batch(step, micro)) / ACCUM).backward()
        norm = 0.0
        if MAX_NORMS[step] > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORMS[step]))
        opt.step()
        sched.step()
        opt.zero_grad()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        # a copy: state_dict() holds the live moments, which later steps update in place
        out.append({"weights": weights, "norm": norm, "state": copy.deepcopy(opt.state_dict())})
    return out


def train_steps(
    opt: TrainingOptimizer, sched, steps: range, rows: slice, model: nn.Module, mesh
) -> list[dict]:
    """The loop every layout runs: this rank's rows, no_sync on all but the last micro-batch,
    clip, step, schedule, zero_grad; the whole weights and the norm after each step."""
    out = []
    for step in steps:
        for micro in range(ACCUM):
            x, y = batch(step, micro)
            with contextlib.nullcontext() if micro == ACCUM - 1 else opt.no_sync():
                (opt.forward_model(x[rows], y[rows]) / ACCUM).backward()
        norm = opt.clip_grad_norm(MAX_NORMS[step])
        opt.step()
        sched.step()
        opt.zero_grad()
        whole = parallel.whole_experts(model) if mesh is not None else contextlib.nullcontext()
        with whole:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"weights": weights, "norm": norm})
    return out


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
               "broadcast", "broadcast_object_list", "gather", "reduce_scatter_tensor")  # fmt: skip


@contextlib.contextmanager
def recorded_groups():
    """The process group of every torch.distributed collective called inside (None: the
    default group), in a list."""
    groups: list = []

    def recording(fn):
        def call(*args, **kwargs):
            groups.append(kwargs.get("group"))
            return fn(*args, **kwargs)

        return call

    saved = {n: getattr(dist, n) for n in COLLECTIVES}
    for n, fn in saved.items():
        setattr(dist, n, recording(fn))
    try:
        yield groups
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def sharded_save(opt: TrainingOptimizer, mesh, world: int) -> dict:
    """``sharded_state_dict`` as a checkpoint takes it: the common part, every rank's part
    (exchanged here as the files would be), and whether the experts' groups were used by it
    and by the whole ``state_dict`` (which gathers them: the control)."""
    with recorded_groups() as by_parts:
        common, own = opt.sharded_state_dict()
    with recorded_groups() as by_whole:
        opt.state_dict()
    expert_groups = [] if mesh is None else [mesh.ep_group, mesh.expert_dp_group]
    parts = [own]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, own)
    return {
        "common": common,
        "parts": [part for rank_parts in parts for part in rank_parts],
        "parts_used_expert_groups": any(g in expert_groups for g in by_parts if g is not None),
        "parts_collectives": len(by_parts),
        "whole_used_expert_groups": any(g in expert_groups for g in by_whole if g is not None),
    }


def run_layout(name: str, ep: int, world: int, rank: int) -> dict:
    """``STEPS`` steps at one layout, its state saved whole and in parts; then a fresh
    optimizer loads the whole state and takes one more step, another loads the parts and
    saves them whole again."""
    cfg = OptimConfig(name=name, lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95), eps=1e-8)
    model = Tiny()
    mesh, _ = parallel.expert_parallel(model, world, rank, ep)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    opt = build_training_optimizer(model, cfg, world, mesh)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    history = train_steps(opt, sched, range(STEPS), rows, model, mesh)
    state = copy.deepcopy(opt.state_dict())  # collective; a copy, as a checkpoint is
    sharded = copy.deepcopy(sharded_save(opt, mesh, world))
    from_parts = build_training_optimizer(model, cfg, world, mesh)
    from_parts.load_sharded_state_dict(sharded["common"], sharded["parts"])
    sharded["reloaded"] = copy.deepcopy(from_parts.state_dict())
    fresh = build_training_optimizer(model, cfg, world, mesh)  # as a resumed run: the
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh, lr_lambda)  # schedule, then the
    fresh_sched.load_state_dict(sched.state_dict())  # state (whose groups hold the lr)
    fresh.load_state_dict(copy.deepcopy(state))  # torch's load keeps the tensors it gets
    history += train_steps(fresh, fresh_sched, range(STEPS, STEPS + 1), rows, model, mesh)
    return {"history": history, "state": state, "sharded": sharded}


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    run_gloo_rank(rank, world, init, _run_layouts, rank, world, out)


def _run_layouts(rank: int, world: int, out: str) -> None:
    results = {f"{name}_ep{ep}": run_layout(name, ep, world, rank) for name, ep in LAYOUTS}
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ref() -> list[dict]:
    return reference()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("training_optimizer")
    spawn_ranks(_worker, (2, file_rendezvous(out), str(out)), 2, "two-rank training optimizers")
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert err <= TOL, f"{what}: relative error {err:.3g} > {TOL:g}"


def check_against_reference(result: dict, ref: list[dict], where: str) -> None:
    """Weights and norms of every step, the reloaded step included, and the saved moments."""
    for step, (got, want) in enumerate(zip(result["history"], ref, strict=True)):
        if MAX_NORMS[step] > 0:
            assert got["norm"] == pytest.approx(want["norm"], rel=TOL), (where, step)
            assert want["norm"] > MAX_NORMS[step]  # the clip really scaled the gradients
        else:
            assert got["norm"] == 0.0, (where, step)
        for n, w in want["weights"].items():
            assert_close(got["weights"][n], w, f"{where} step {step} {n}")
    names = [n for n, p in Tiny().named_parameters() if p.ndim >= 2]
    names += [n for n, p in Tiny().named_parameters() if p.ndim < 2]
    want_state = ref[STEPS - 1]["state"]["state"]
    for i, n in enumerate(names):  # torch's positions: the groups' order
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(
                saved_moment(result["state"], i, n, key), want_state[i][key], f"{where} {n}"
            )


def saved_moment(state: dict, position: int, name: str, key: str) -> torch.Tensor:
    """One parameter's whole moment from a saved state: torch's format keys it by position,
    OffloadAdamW's by name, stacked experts one by one (``moe.w1/expert3``)."""
    entries = state["state"]
    if position in entries:
        return entries[position][key]
    if name in entries:
        return entries[name][key]
    return torch.stack([entries[f"{name}/expert{e}"][key] for e in range(E)])


@pytest.mark.parametrize("name", ["adamw", "offload_adamw"])
def test_one_process(ref: list[dict], name: str) -> None:
    check_against_reference(run_layout(name, 1, 1, 0), ref, f"{name} one process")


@pytest.mark.parametrize(("name", "ep"), LAYOUTS, ids=[f"{n}-ep{e}" for n, e in LAYOUTS])
def test_two_ranks(two_ranks: list[dict], ref: list[dict], name: str, ep: int) -> None:
    for rank, results in enumerate(two_ranks):
        check_against_reference(results[f"{name}_ep{ep}"], ref, f"{name} ep={ep} rank {rank}")


def test_every_layout_saves_the_same_format(two_ranks: list[dict]) -> None:
    """The state a layout saves names the same entries as one process's (layout-free)."""
    one = {name: run_layout(name, 1, 1, 0)["state"] for name in ("adamw", "offload_adamw")}
    for name, ep in LAYOUTS:
        state = two_ranks[0][f"{name}_ep{ep}"]["state"]
        assert set(state["state"]) == set(one[name]["state"]), (name, ep)
        for key, entry in state["state"].items():
            want = one[name]["state"][key]
            assert set(entry) == set(want), (name, ep, key)
            for field, value in entry.items():  # moments whole, steps as one process saves them
                assert type(value) is type(want[field]), (name, ep, key, field)
                assert torch.as_tensor(value).shape == torch.as_tensor(want[field]).shape


def assert_same_state(got: dict, want: dict, where: str) -> None:
    """The same entries, steps and tensors (bitwise), and the same groups."""
    assert got["param_groups"] == want["param_groups"], where
    assert set(got["state"]) == set(want["state"]), where
    for key, entry in want["state"].items():
        assert set(got["state"][key]) == set(entry), (where, key)
        for field, value in entry.items():
            assert torch.equal(torch.as_tensor(got["state"][key][field]), torch.as_tensor(value)), (
                where, key, field)  # fmt: skip


@pytest.mark.parametrize(("name", "ep"), LAYOUTS, ids=[f"{n}-ep{e}" for n, e in LAYOUTS])
def test_parts_are_written_without_the_expert_groups_and_load_back(
    two_ranks: list[dict], name: str, ep: int
) -> None:
    """Saved in parts, the state uses neither the EP group nor the experts' data-parallel
    group (no expert crosses ranks; the whole state_dict does use them at ep=2, the
    control), under expert parallelism no collective at all (the replicated parameters'
    OffloadAdamW shards are written by their ranks too), and loaded from its parts it is
    the whole state again, bitwise."""
    for rank, results in enumerate(two_ranks):
        result = results[f"{name}_ep{ep}"]
        where = f"{name} ep={ep} rank {rank}"
        assert not result["sharded"]["parts_used_expert_groups"], where
        if ep == 2:
            assert result["sharded"]["parts_collectives"] == 0, where
            kinds = sorted(part["kind"] for part in result["sharded"]["parts"])
            want = {"adamw": ["adamw", "adamw"], "offload_adamw": ["offload", "offload", "offload_shard",
                                                           "offload_shard"]}  # fmt: skip
            assert kinds == want[name], where
        assert result["sharded"]["whole_used_expert_groups"] == (ep == 2), where
        assert bool(result["sharded"]["parts"]) == (ep == 2), where  # experts' own files
        assert_same_state(result["sharded"]["reloaded"], result["state"], where)


@pytest.mark.parametrize("name", ["adamw", "offload_adamw"])
def test_parts_saved_at_ep2_load_in_one_process(two_ranks: list[dict], name: str) -> None:
    """The common part and both ranks' parts of an ep=2 state load into one process's
    optimizer, which then saves the state the ep=2 ranks saved whole."""
    saved = two_ranks[0][f"{name}_ep2"]
    cfg = OptimConfig(name=name, lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95), eps=1e-8)
    opt = build_training_optimizer(Tiny(), cfg, 1, None)
    opt.load_sharded_state_dict(copy.deepcopy(saved["sharded"]["common"]),
                                copy.deepcopy(saved["sharded"]["parts"]))  # fmt: skip
    assert_same_state(opt.state_dict(), saved["state"], f"{name}: ep=2 parts in one process")
    missing = {"adamw": "do not hold experts 2..3", "offload_adamw": "has only some experts"}
    with pytest.raises(ValueError, match=missing[name]):  # rank 1's part left out
        build_training_optimizer(Tiny(), cfg, 1, None).load_sharded_state_dict(
            copy.deepcopy(saved["sharded"]["common"]), copy.deepcopy(saved["sharded"]["parts"][:1])
        )
