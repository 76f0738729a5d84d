"""Routing steered toward a cache one token at a time (moestack.cache.steering) against a
plain loop written from the rule: an LRU list, the vectorised rerouting rule and
``Router.select`` with the cache's bias, token by token; in a model, telemetry records the
served experts and steering with neither tau nor bias changes nothing."""

from __future__ import annotations

import pytest
import torch
from helpers.cache import batches, tiny_model

from moestack.cache.replacement import LRUPolicy
from moestack.cache.rerouting import reroute
from moestack.cache.steering import (
    Steering,
    biased_picks,
    rerouted_picks,
    steer_stream,
    stream_steered,
)
from moestack.config import RouterConfig
from moestack.evaluation import evaluate
from moestack.router import Router, Routing
from moestack.telemetry import attach, simulate


def routing_of(router: Router, T: int, seed: int) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, router.weight.shape[1], generator=gen)
    with torch.no_grad():
        return router(x)


def make_router(
    E: int = 16, k: int = 4, *, aux_bias: bool = False, seed: int = 0, scale: float = 60.0
) -> Router:
    """Scores skewed by ``scale`` (60: reroute candidates near the floor; a mild one keeps
    them apart, so no two tie)."""
    torch.manual_seed(seed)
    cfg = RouterConfig(bias_update_rate=0.01 if aux_bias else 0.0)
    router = Router(24, E, k, cfg)
    with torch.no_grad():
        router.weight.mul_(scale)
        if aux_bias:
            router.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(9)))
    return router


def steer_loop(router: Router, routing: Routing, capacity: int, tau: float, bias: float):
    """Token by token: the resident set of an LRU list; a token with a pick not resident is
    selected again by Router.select with ``bias`` on the resident experts, then rerouted by
    the vectorised rule; its served experts then enter the list in slot order."""
    lru: list[int] = []  # oldest first
    served = routing.experts.clone()
    E = routing.scores.shape[1]
    for t in range(served.shape[0]):
        picks = served[t : t + 1]
        if any(e not in lru for e in picks[0].tolist()):
            resident_E = torch.zeros(E, dtype=torch.bool)
            resident_E[lru] = True
            if bias:
                picks = router.select(routing.scores[t : t + 1], bias * resident_E.float())[1]
            picks = reroute(routing.scores[t : t + 1], picks, resident_E, tau)
            served[t] = picks[0]
        for e in served[t].tolist():
            if e in lru:
                lru.remove(e)
            elif len(lru) >= capacity:
                lru.pop(0)
            lru.append(e)
    return served, sorted(lru)


@pytest.mark.parametrize("tau", [0.1, 0.25, 0.5, 1.0])
def test_one_token_rule_is_the_vectorised_rule(tau: float) -> None:
    router = make_router(scale=2.0)
    routing = routing_of(router, 300, seed=1)
    gen = torch.Generator().manual_seed(2)
    changed = 0
    for t in range(300):
        resident = torch.randperm(16, generator=gen)[
            : int(torch.randint(0, 12, (1,), generator=gen))
        ]
        mask = torch.zeros(16, dtype=torch.bool)
        mask[resident] = True
        want = reroute(routing.scores[t : t + 1], routing.experts[t : t + 1], mask, tau)
        got = rerouted_picks(
            routing.experts[t].tolist(), routing.scores[t].numpy(), sorted(resident.tolist()), tau
        )
        assert got == want[0].tolist()
        changed += got != routing.experts[t].tolist()
    assert changed > 0


@pytest.mark.parametrize("aux_bias", [False, True])
def test_biased_picks_are_router_select_with_the_resident_bias(aux_bias: bool) -> None:
    router = make_router(aux_bias=aux_bias, scale=5.0)
    routing = routing_of(router, 300, seed=3)
    rank = router.selection_scores(routing.scores).numpy()
    gen = torch.Generator().manual_seed(4)
    for t in range(300):
        resident = torch.randperm(16, generator=gen)[
            : int(torch.randint(0, 10, (1,), generator=gen))
        ]
        bias = float(torch.rand(1, generator=gen)) * 0.3
        bias_E = torch.zeros(16)
        bias_E[resident] = bias
        want = router.select(routing.scores[t : t + 1], bias_E)[1][0].tolist()
        got = biased_picks(routing.experts[t].tolist(), rank[t], sorted(resident.tolist()), bias)
        assert got == want


@pytest.mark.parametrize(
    ("E", "k", "capacity", "tau", "bias"),
    [
        (16, 4, 5, 0.25, 0.0),
        (16, 4, 5, 0.5, 0.0),
        (16, 4, 6, 0.0, 0.2),
        (16, 4, 6, 0.25, 0.05),
        (7, 3, 3, 1.0, 0.0),  # odd sizes, capacity = top_k
        (5, 5, 5, 0.5, 0.1),  # top_k = num_experts: nothing to steer once warm
        (16, 1, 1, 0.5, 0.0),  # one slot
    ],
)
def test_steered_stream_equals_the_plain_loop(E, k, capacity, tau, bias) -> None:
    router = make_router(E, k, aux_bias=bias > 0, seed=E + k, scale=8.0)
    routing = routing_of(router, 257, seed=capacity)
    want, resident = steer_loop(router, routing, capacity, tau, bias)
    cache = LRUPolicy(capacity)
    got = steer_stream(router, routing, cache, Steering(capacity, tau, bias))
    assert torch.equal(got, want)
    assert cache.resident() == resident
    if k < E:
        assert not torch.equal(got, routing.experts)  # something was steered


def test_no_tokens_are_steered_to_nothing() -> None:
    router = make_router()
    routing = routing_of(router, 0, seed=0)
    got = steer_stream(router, routing, LRUPolicy(4), Steering(4, reroute_tau=0.5))
    assert got.shape == (0, 4)


def test_telemetry_records_the_served_experts_and_misses_fall() -> None:
    model = tiny_model(num_experts=8, top_k=2)
    data = batches(n=2, batch=3, seq=12)
    served: list[list[torch.Tensor]] = [[] for _ in model.moe_layers]
    for layer, moe in enumerate(model.moe_layers):  # after the steering hook: what is served
        moe.router.register_forward_hook(lambda m, a, r, i=layer: served[i].append(r.experts))
    plain_tel = attach(model, policies=("lru",), capacities=(3,), entropy=False)
    with plain_tel, torch.no_grad():
        evaluate(model, data, torch.device("cpu"))
    for part in served:
        part.clear()
    tel = attach(model, policies=("lru",), capacities=(3,), entropy=False)
    with tel, stream_steered(model, Steering(3, reroute_tau=1.0)) as caches, torch.no_grad():
        evaluate(model, data, torch.device("cpu"))
    for layer in range(len(served)):
        flat = torch.cat(served[layer]).flatten().tolist()
        assert tel.trace.accesses(layer).tolist() == flat
        last_used = list(dict.fromkeys(reversed(flat)))[:3]  # LRU keeps the 3 last used
        assert caches[layer].resident() == sorted(last_used)
    steered = simulate(tel.trace, "lru", 3, warmup=0, reuse=False)
    plain = simulate(plain_tel.trace, "lru", 3, warmup=0, reuse=False)
    assert steered.misses_per_token < plain.misses_per_token


def test_steering_with_neither_changes_nothing_and_leaves_no_hook() -> None:
    model = tiny_model(num_experts=8, top_k=2)
    data = batches(n=2, batch=2, seq=10)
    with torch.no_grad():
        plain = evaluate(model, data, torch.device("cpu"))
        with stream_steered(model, Steering(3)):
            same = evaluate(model, data, torch.device("cpu"))
        with stream_steered(model, Steering(3, reroute_tau=1.0)):
            steered = evaluate(model, data, torch.device("cpu"))
        after = evaluate(model, data, torch.device("cpu"))
    assert same["loss/val"] == plain["loss/val"] == after["loss/val"]
    assert steered["loss/val"] != plain["loss/val"]


def test_bad_steering_is_refused() -> None:
    for kw, named in (
        ({"capacity": 0}, "capacity=0"),
        ({"capacity": 2, "reroute_tau": 1.5}, "reroute_tau=1.5"),
        ({"capacity": 2, "cache_aware_bias": -0.1}, "cache_aware_bias=-0.1"),
    ):
        with pytest.raises(ValueError, match=named):
            Steering(**kw)
    no_router = stream_steered(torch.nn.Linear(2, 2), Steering(2, reroute_tau=0.5))
    with pytest.raises(ValueError, match="no moestack Router"), no_router:
        pass


@pytest.mark.parametrize("kw", [{"reroute_tau": float("nan")}, {"cache_aware_bias": float("inf")},
                                {"cache_aware_bias": float("nan")}])  # fmt: skip
def test_non_finite_steering_is_refused(kw) -> None:
    with pytest.raises(ValueError, match="must be"):
        Steering(2, **kw)
