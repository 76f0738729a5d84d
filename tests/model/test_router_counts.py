"""tokens_per_expert (the router's sync-free count) against torch.bincount, bit for bit, and
the router's counts and metrics built on it (tests/model/test_no_host_sync_gpu.py: no syncs)."""

import math

import pytest
import torch

from moestack.config import MoEConfig, RouterConfig
from moestack.moe import MoE
from moestack.router import Router, Routing, tokens_per_expert


@pytest.mark.parametrize("num_experts", [1, 8, 129])
@pytest.mark.parametrize("shape", [(0, 2), (1, 1), (37, 2), (256, 8), (4, 16, 3)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_equals_bincount_exactly(num_experts, shape, dtype):
    g = torch.Generator().manual_seed(num_experts + len(shape))
    experts = torch.randint(0, num_experts, shape, generator=g).to(dtype)
    got = tokens_per_expert(experts, num_experts)
    want = torch.bincount(experts.reshape(-1), minlength=num_experts)
    assert got.dtype == want.dtype == torch.int64
    assert got.shape == (num_experts,) and torch.equal(got, want)


def test_skewed_routing_and_experts_without_tokens():
    experts = torch.tensor([[5, 5], [5, 0], [5, 5]])
    assert tokens_per_expert(experts, 7).tolist() == [1, 0, 0, 0, 0, 5, 0]


def test_ids_out_of_range_are_refused():
    for bad in (torch.tensor([[0, 4]]), torch.tensor([[-1, 0]])):
        with pytest.raises(RuntimeError):
            tokens_per_expert(bad, 4)


def test_router_counts_and_metrics_match_the_bincount_formulas():
    """The pending counts of aux-loss-free balancing and the imbalance metric are the same
    numbers as with bincount (the default training run's losses cannot move)."""
    torch.manual_seed(0)
    router = Router(16, 6, 2, RouterConfig(bias_update_rate=0.01)).train()
    x = torch.randn(3, 40, 16).reshape(-1, 16)
    routing = router(x)
    flat = routing.experts.reshape(-1)
    counts = torch.bincount(flat, minlength=6)
    assert torch.equal(router.pending_counts, counts.float())
    metrics = Router.metrics(routing, 6)
    want = counts.float().max() / counts.float().mean().clamp_min(1e-9)
    assert torch.equal(metrics["imbalance"], want)


def test_bias_update_without_pending_counts_leaves_the_bias_bitwise():
    """update_bias no longer asks "anything pending?" (a host sync): with nothing pending
    every expert sits at the mean, the step is 0 and the bias keeps every bit."""
    router = Router(8, 5, 2, RouterConfig(bias_update_rate=0.25))
    router.expert_bias.copy_(torch.tensor([0.5, -0.25, 0.0, 1e-30, -3.0]))
    before = router.expert_bias.clone()
    router.update_bias()
    assert torch.equal(router.expert_bias, before)
    assert torch.equal(router.expert_bias.view(torch.int32), before.view(torch.int32))
    router.pending_counts.copy_(torch.tensor([4.0, 0.0, 2.0, 2.0, 2.0]))  # mean 2
    router.update_bias()
    assert torch.equal(router.expert_bias - before, torch.tensor([-0.25, 0.25, 0.0, 0.0, 0.0]))
    assert torch.equal(router.pending_counts, torch.zeros(5))


def test_empty_routing_metrics():
    routing = Routing(
        torch.zeros(0, 4), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 4)
    )
    metrics = Router.metrics(routing, 4)
    assert metrics["imbalance"].item() == 0.0
    assert metrics["entropy"].item() == 0.0  # no tokens: 0, not the NaN of an empty mean


def test_entropy_metric_by_hand_and_of_an_empty_layer():
    """Uniform scores over 4 experts: entropy ln 4; one-hot: 0 (worked by hand). A layer
    given no tokens reports finite metrics."""
    uniform, one_hot = torch.full((3, 4), 0.25), torch.eye(4)[:3]
    for scores, want in ((uniform, math.log(4)), (one_hot, 0.0)):
        routing = Routing(scores, scores[:, :2], torch.zeros(3, 2, dtype=torch.long), scores)
        assert Router.metrics(routing, 4)["entropy"].item() == pytest.approx(want, abs=1e-6)
    moe = MoE(8, MoEConfig(num_experts=4, top_k=2, d_ff=4, impl="torch"), RouterConfig())
    moe(torch.randn(0, 8))
    assert all(math.isfinite(float(v)) for v in moe.metrics.values()), moe.metrics
    assert float(moe.metrics["entropy"]) == 0.0
