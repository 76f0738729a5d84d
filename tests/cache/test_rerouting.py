"""Training-free rerouting (moestack.cache.rerouting) against a loop over each token written
from the rule's statement, and in offloaded evaluation: tau = 1 turns nearly every miss into
a hit, tau = 0 changes nothing, and the combine weights are the chosen experts' own scores."""

from __future__ import annotations

import pytest
import torch
from helpers.cache import batches, tiny_model

from moestack.cache import ExpertStore, evaluate_offloaded
from moestack.cache.rerouting import reroute
from moestack.config import CacheConfig, RouterConfig
from moestack.router import Router

CPU = torch.device("cpu")


def reroute_loop(scores, experts, resident, tau) -> torch.Tensor:
    """For each token: its picks in order; a pick not resident takes the best-scoring
    resident expert not picked yet (by the token or a replacement) scoring at least
    (1 - tau) times the token's best score, else stays."""
    out = experts.clone()
    for t in range(scores.shape[0]):
        p = scores[t].tolist()
        floor = (1 - tau) * max(p)
        taken = set(experts[t].tolist())
        for j, e in enumerate(experts[t].tolist()):
            if tau == 0 or resident[e]:
                continue
            candidates = [
                c for c in range(len(p)) if resident[c] and c not in taken and p[c] >= floor
            ]
            if candidates:
                best = max(candidates, key=lambda c: (p[c], -c))
                out[t, j] = best
                taken.add(best)
    return out


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 1), (8, 2), (8, 8), (64, 8), (5, 3)])
@pytest.mark.parametrize("tau", [0.0, 0.25, 0.5, 1.0])
def test_reroute_matches_the_rule_token_by_token(num_experts, top_k, tau) -> None:
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    for trial in range(6):
        scores = torch.softmax(torch.randn(37, num_experts, generator=gen) * 2, dim=-1)
        experts = scores.topk(top_k, dim=-1).indices
        share = [0.0, 1.0, 0.3, 0.5, 0.7, 0.2][trial]  # none, all, and some resident
        resident = torch.rand(num_experts, generator=gen) < share
        got = reroute(scores, experts, resident, tau)
        want = reroute_loop(scores, experts, resident, tau)
        assert torch.equal(got, want), (num_experts, top_k, tau, trial)
        assert all(len(set(row)) == top_k for row in got.tolist())  # no expert twice


def test_reroute_edges() -> None:
    scores = torch.tensor([[0.5, 0.3, 0.2]])
    resident = torch.tensor([False, True, True])
    top1 = torch.tensor([[0]])
    assert reroute(scores, top1, resident, 0.25).tolist() == [[0]]  # 0.3 < 0.75 * 0.5: stays
    assert reroute(scores, top1, resident, 0.5).tolist() == [[1]]  # 0.3 >= 0.25: the best
    assert reroute(scores, top1, resident, 1.0).tolist() == [[1]]
    empty = torch.empty(0, 1, dtype=torch.long)
    assert reroute(torch.empty(0, 3), empty, resident, 0.5).shape == (0, 1)  # no tokens
    with pytest.raises(ValueError, match="tau=1.5"):
        reroute(scores, top1, resident, 1.5)


@pytest.mark.parametrize("renormalize", [False, True])
def test_combine_weights_of_chosen_experts_are_their_scores(renormalize) -> None:
    router = Router(8, 4, 2, RouterConfig(renormalize=renormalize))
    gen = torch.Generator().manual_seed(1)
    scores = torch.softmax(torch.randn(6, 4, generator=gen), dim=-1)
    experts = torch.tensor([[0, 3], [1, 2], [3, 1], [2, 0], [0, 1], [3, 2]])
    chosen = scores.gather(1, experts)
    want = chosen / chosen.sum(1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(router.weights_of(scores, experts), want, rtol=0, atol=0)


def test_offloaded_rerouting_raises_hits_and_tau_zero_changes_nothing(tmp_path) -> None:
    data = batches()
    store = ExpertStore.write(tiny_model(), tmp_path / "store")
    lru2 = CacheConfig(policy="lru", capacity=2)
    base = evaluate_offloaded(tiny_model(), store, data, CPU, lru2)
    same = evaluate_offloaded(tiny_model(), store, data, CPU, lru2, reroute_tau=0.0)
    assert same["loss/val"] == base["loss/val"] and same["cache/hits"] == base["cache/hits"]
    anywhere = evaluate_offloaded(tiny_model(), store, data, CPU, lru2, reroute_tau=1.0)
    # tau = 1: a miss goes to any resident expert not picked, and at capacity top_k the two
    # resident experts of the layer serve nearly every later request
    assert anywhere["cache/hit_rate"] > base["cache/hit_rate"] + 0.2
    assert anywhere["loss/val"] != base["loss/val"]  # the routing really changed
    with pytest.raises(ValueError, match="reroute_tau=2"):
        evaluate_offloaded(tiny_model(), store, data, CPU, lru2, reroute_tau=2)
