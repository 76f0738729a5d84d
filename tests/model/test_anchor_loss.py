"""The anchor loss: KL from a frozen reference router's distribution to the current one."""

import math

import pytest
import torch

from moestack import MoETransformer, router_losses
from moestack.config import ModelConfig, MoEConfig, RouterConfig
from moestack.moe import MoE
from moestack.router import Routing


def brute_force_kl(ref_scores, scores):
    """Mean over tokens of sum_e q_e (log q_e - log p_e), in float64 with Python loops."""
    total = 0.0
    for q_row, p_row in zip(ref_scores.double().tolist(), scores.double().tolist(), strict=True):
        q_sum, p_sum = sum(q_row), sum(p_row)
        total += sum(
            (q / q_sum) * (math.log(q / q_sum) - math.log(p / p_sum))
            for q, p in zip(q_row, p_row, strict=True)
        )
    return total / len(ref_scores)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_anchor_kl_matches_a_brute_force_kl(score, tokens):
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 5, generator=gen)
    ref_logits = logits + 0.5 * torch.randn(tokens, 5, generator=gen)
    act = (lambda x: torch.softmax(x, -1)) if score == "softmax" else torch.sigmoid
    scores, ref = act(logits), act(ref_logits)
    routing = Routing(logits, scores[:, :2], torch.zeros(tokens, 2, dtype=torch.long), scores)
    got = router_losses.anchor_kl(routing, (tokens,), ref)
    assert got.item() == pytest.approx(brute_force_kl(ref, scores), rel=1e-5, abs=1e-7)
    same = router_losses.anchor_kl(routing, (tokens,), scores)
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    empty = Routing(logits[:0], scores[:0, :2], torch.zeros(0, 2, dtype=torch.long), scores[:0])
    assert router_losses.anchor_kl(empty, (0,), ref[:0]).item() == 0.0


def test_anchor_pulls_a_drifted_router_back_to_its_reference():
    torch.manual_seed(0)
    moe = MoE(16, MoEConfig(num_experts=6, top_k=2, d_ff=8), RouterConfig(
        load_balance=0.0, z_loss=0.0, anchor=1.0))  # fmt: skip
    moe.router.weight.data.normal_(0, 1.0)
    moe.router.reset_anchor()  # the "pretrained" routing
    x = torch.randn(4, 12, 16)
    moe.train()
    moe(x)
    assert moe.metrics["anchor"].item() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        moe.router.weight.add_(0.5 * torch.randn_like(moe.router.weight))  # drift
    opt = torch.optim.SGD([moe.router.weight], lr=0.5)
    losses = []
    for _ in range(20):
        moe(x)
        losses.append(moe.aux_loss.item())
        opt.zero_grad()
        moe.aux_loss.backward()
        opt.step()
    assert losses[0] > 0.01 and losses[-1] < 0.5 * losses[0]
    # The reference is a checkpointed buffer, untouched by the optimizer.
    assert "router.anchor_weight" in moe.state_dict()
    assert not moe.router.anchor_weight.requires_grad


@pytest.mark.parametrize("build", ["constructor", "config"])
def test_a_new_model_starts_at_its_anchor(build):
    """Built either way, a model's anchor reference is the router weights it starts with (those
    of the same model without the anchor loss): its anchor loss is 0 before any step."""
    cfg = ModelConfig(n_layers=2, router=RouterConfig(anchor=1.0, load_balance=0, z_loss=0))
    plain = MoETransformer(ModelConfig(n_layers=2, router=RouterConfig(load_balance=0, z_loss=0)),
                           seed=3)  # fmt: skip
    model = MoETransformer(cfg, seed=3) if build == "constructor" else cfg.build(seed=3)
    for layer, reference in zip(model.moe_layers, plain.moe_layers, strict=True):
        assert torch.equal(layer.router.weight, reference.router.weight)
        assert torch.equal(layer.router.anchor_weight, reference.router.weight)
    tokens = torch.randint(1, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out = model.train()(tokens[:, :-1], tokens[:, 1:])
    for i in range(2):
        assert out.metrics[f"router/layer{i}/anchor"].item() == pytest.approx(0.0, abs=1e-7)
