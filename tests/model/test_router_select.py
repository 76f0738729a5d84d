"""Router.score / Router.select against a brute-force top-k in float64."""

import pytest
import torch

from moestack.config import RouterConfig
from moestack.router import Router


def brute_force_select(scores_TE, bias_TE, top_k, renormalize):
    """Per token: experts by descending (score + bias), ties to the smaller id; weights are
    the unbiased scores of the chosen experts."""
    experts, weights = [], []
    for scores, bias in zip(scores_TE.double(), bias_TE.double(), strict=True):
        ranked = sorted(range(len(scores)), key=lambda e: (-(scores[e] + bias[e]).item(), e))
        chosen = ranked[:top_k]
        w = scores[chosen]
        experts.append(chosen)
        weights.append(w / w.sum() if renormalize else w)
    return torch.tensor(experts), torch.stack(weights) if weights else torch.zeros(0, top_k)


@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize(
    ("num_experts", "top_k"), [(5, 1), (6, 2), (4, 4)]
)  # top_k = num_experts included
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias_update_rate", [0.0, 0.01])
def test_select_matches_brute_force_with_and_without_an_extra_bias(
    tokens, num_experts, top_k, score, bias_update_rate
):
    torch.manual_seed(tokens * 31 + num_experts)
    cfg = RouterConfig(score=score, bias_update_rate=bias_update_rate)
    router = Router(8, num_experts, top_k, cfg)
    router.expert_bias.normal_(0, 0.3)  # the aux-loss-free bias, counted only when enabled
    x_TD = torch.randn(tokens, 8)
    logits_TE, scores_TE = router.score(x_TD)
    logits = x_TD.double() @ router.weight.double().T
    expected_scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    torch.testing.assert_close(logits_TE.double(), logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores_TE.double(), expected_scores, rtol=1e-5, atol=1e-6)
    own_bias = router.expert_bias if bias_update_rate > 0 else torch.zeros(num_experts)
    extra_E = torch.zeros(num_experts)
    extra_E[torch.randperm(num_experts)[: max(1, num_experts // 2)]] = 0.5
    for extra in (None, extra_E):
        weights_TK, experts_TK = router.select(scores_TE, extra)
        bias = own_bias + (0 if extra is None else extra)
        want_e, want_w = brute_force_select(scores_TE, bias.expand(tokens, -1), top_k, True)
        assert experts_TK.shape == weights_TK.shape == (tokens, top_k)
        if tokens:
            assert torch.equal(experts_TK, want_e)
            torch.testing.assert_close(weights_TK.double(), want_w, rtol=1e-6, atol=1e-7)
    # forward = score then select; the extra bias never enters the router's own forward
    routing = router(x_TD)
    assert torch.equal(routing.experts, router.select(scores_TE)[1])


def test_select_without_renormalisation_keeps_raw_scores():
    torch.manual_seed(0)
    router = Router(8, 6, 3, RouterConfig(score="sigmoid", renormalize=False))
    _, scores_TE = router.score(torch.randn(5, 8))
    bias_TE = torch.randn(5, 6)  # a per-token bias [T, E]
    weights_TK, experts_TK = router.select(scores_TE, bias_TE)
    want_e, want_w = brute_force_select(scores_TE, bias_TE, 3, False)
    assert torch.equal(experts_TK, want_e)
    torch.testing.assert_close(weights_TK.double(), want_w)
