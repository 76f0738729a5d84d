"""The expert-parallel MoE layer (gloo, 2 and 4 CPU processes) against the single-process
layer on the same weights and tokens: outputs, input gradients and every parameter gradient
(after averaging over the ranks that share it), fp32.

Every layout runs in one start of 4 processes (each start imports torch and runs the Triton
interpreter once per process): a world of 4 at ep=4, then at ep=2, then ranks 0 and 1 in a
world of 2 of their own (a new default group, the first one closed) at ep=2."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.multiprocess import file_rendezvous, run_gloo_rank, spawn_ranks
from torch import nn

from moestack import MoE, MoEConfig, RouterConfig
from moestack.parallel import average_gradients, build_mesh, shard_experts

D_MODEL, D_FF = 12, 10
LAYOUTS = [(2, 2), (4, 4), (4, 2)]  # (world, ep)

# name -> (num_experts, top_k, tokens of each rank (by world size), experts never chosen,
# expert impl: the triton kernels run in the interpreter on the CPU, conftest.py)
CASES = {
    "random": (8, 2, {2: [7, 9], 4: [7, 9, 5, 6]}, (), "torch"),
    "one_token": (8, 3, {2: [1, 1], 4: [1, 1, 1, 1]}, (), "torch"),
    "empty_rank": (8, 2, {2: [0, 6], 4: [5, 0, 3, 0]}, (), "torch"),
    "idle_expert_and_rank": (8, 2, {2: [7, 9], 4: [7, 9, 5, 6]}, (1, 6, 7), "torch"),
    "top_k_all": (4, 4, {2: [5, 4], 4: [5, 4, 3, 2]}, (), "torch"),
    "triton": (8, 2, {2: [7, 0], 4: [7, 9, 0, 6]}, (), "triton"),
}


class OneLayer(nn.Module):
    """The smallest model ``shard_experts`` accepts: one MoE layer."""

    def __init__(self, num_experts: int, top_k: int, idle: tuple[int, ...], impl: str) -> None:
        super().__init__()
        router = RouterConfig(bias_update_rate=0.01 if idle else 0.0, load_balance=0.0)
        self.moe = MoE(D_MODEL, MoEConfig(num_experts, top_k, D_FF, impl=impl), router)
        with torch.no_grad():
            self.moe.router.weight.normal_(std=0.5)  # spread the routing
            for e in idle:  # the selection bias keeps these experts out of every top-k
                self.moe.router.expert_bias[e] = -1e4

    @property
    def moe_layers(self) -> list[MoE]:
        return [self.moe]


def build_case(name: str, world: int) -> tuple[OneLayer, list[torch.Tensor], list[torch.Tensor]]:
    """The layer, and each rank's tokens and output cotangents (seeded)."""
    num_experts, top_k, tokens, idle, impl = CASES[name]
    torch.manual_seed(len(name))
    model = OneLayer(num_experts, top_k, idle, impl)
    xs = [torch.randn(t, D_MODEL) for t in tokens[world]]
    gs = [torch.randn(t, D_MODEL) for t in tokens[world]]
    return model, xs, gs


def _worker(rank: int, inits: dict[int, str], out: str) -> None:
    """Rank ``rank`` of a world of 4 at each EP degree, then (ranks 0 and 1) of a world of 2."""
    for world, init_method in inits.items():
        if rank < world:
            eps = [ep for w, ep in LAYOUTS if w == world]
            run_gloo_rank(rank, world, init_method, _run_cases, rank, world, eps, out)


def _run_cases(rank: int, world: int, eps: list[int], out: str) -> None:
    for ep in eps:
        mesh = build_mesh(world, rank, ep)
        results = {}
        for name in CASES:
            model, xs, gs = build_case(name, world)
            shard_experts(model, mesh)
            x = xs[rank].clone().requires_grad_()
            y = model.moe(x)
            (y * gs[rank]).sum().backward()
            average_gradients(model)
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results[name] = {"y": y.detach(), "x_grad": x.grad, "grads": grads}
        torch.save(results, f"{out}/world{world}_ep{ep}_rank{rank}.pt")


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], list[dict]]:
    """(world, ep) -> every rank's results of every case, from one start of 4 ranks."""
    out = tmp_path_factory.mktemp("ep_layer")
    inits = {world: file_rendezvous(out) for world in (4, 2)}  # a store for each world
    what = "4 gloo ranks of the EP layer at ep=4 and ep=2, then 2 of them at ep=2"
    spawn_ranks(_worker, (inits, str(out)), 4, what)
    return {
        (world, ep): [
            torch.load(out / f"world{world}_ep{ep}_rank{r}.pt", weights_only=True)
            for r in range(world)
        ]
        for world, ep in LAYOUTS
    }


def reference(name: str, world: int) -> dict:
    """The single-process layer over every rank's tokens at once, with the plain-torch
    experts whatever the case's impl."""
    model, xs, gs = build_case(name, world)
    model.moe.cfg = dataclasses.replace(model.moe.cfg, impl="torch")
    x = torch.cat(xs).requires_grad_()
    y = model.moe(x)
    (y * torch.cat(gs)).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "model": model, "sizes": [len(t) for t in xs]}


@pytest.mark.parametrize("world, ep", LAYOUTS)
def test_ep_layer_matches_single_process(rank_results, world, ep):
    got = rank_results[world, ep]
    for name in CASES:
        ref = reference(name, world)
        ys, x_grads = ref["y"].split(ref["sizes"]), ref["x_grad"].split(ref["sizes"])
        num_experts = CASES[name][0]
        for rank in range(world):
            mine = got[rank][name]
            where = f"{name}, rank {rank} of {world}, ep={ep}"
            torch.testing.assert_close(mine["y"], ys[rank], rtol=1e-5, atol=1e-6, msg=where)
            torch.testing.assert_close(mine["x_grad"], x_grads[rank], rtol=1e-5, atol=1e-6)
            local = num_experts // ep
            lo = (rank % ep) * local
            for pname, p in ref["model"].named_parameters():
                want = p.grad / world  # the mean over ranks of each rank's loss
                if pname.endswith(("w1", "w2")):
                    want = want[lo : lo + local]
                torch.testing.assert_close(
                    mine["grads"][pname], want, rtol=1e-5, atol=1e-7, msg=f"{where}: {pname}"
                )


def test_idle_case_really_leaves_an_expert_and_a_rank_without_tokens():
    """The edge the idle case claims: expert 1 gets no token; with ep = 4, the last EP rank
    (experts 6 and 7) receives none; with ep = 2, rank 0 of top_k_all gets every expert."""
    model, xs, _ = build_case("idle_expert_and_rank", 4)
    with torch.no_grad():
        chosen = model.moe.router(torch.cat(xs)).experts
    assert not {1, 6, 7} & set(chosen.reshape(-1).tolist())
    assert len(set(chosen.reshape(-1).tolist())) >= 3
