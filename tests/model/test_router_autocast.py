"""The router's math stays float32 under autocast (CPU bf16 here), against a float64 reference;
without autocast it is the plain float32 computation, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from moestack.config import RouterConfig
from moestack.router import Router

E, D, T, K = 64, 256, 2048, 8


def router_and_tokens(score: str = "softmax", anchor: float = 0.0) -> tuple[Router, torch.Tensor]:
    torch.manual_seed(0)
    router = Router(D, E, K, RouterConfig(score=score, anchor=anchor))
    with torch.no_grad():
        router.weight.normal_(0, 0.05)  # logits of about unit scale, as a trained router's
    return router, torch.randn(T, D, generator=torch.Generator().manual_seed(1))


def float64_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T


def clear_top_k(logits_TE: torch.Tensor) -> torch.Tensor:
    """Tokens whose k-th and (k+1)-th float64 logits differ by more than float32 can blur."""
    top = logits_TE.topk(K + 1, dim=-1).values
    return (top[:, K - 1] - top[:, K]) > 1e-4


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_logits_and_top_k_under_autocast_are_float64s(score):
    router, x = router_and_tokens(score)
    want_TE = float64_logits(x, router.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
    assert routing.logits.dtype == routing.scores.dtype == routing.weights.dtype == torch.float32
    torch.testing.assert_close(routing.logits.double(), want_TE, rtol=0, atol=1e-5)
    clear = clear_top_k(want_TE)
    assert clear.float().mean() > 0.95  # the comparison covers nearly every token
    want_set = want_TE.topk(K, dim=-1).indices.sort(-1).values
    got_set = routing.experts.sort(-1).values
    assert torch.equal(got_set[clear], want_set[clear])
    activate = (lambda v: v.softmax(-1)) if score == "softmax" else torch.sigmoid
    want_weights = activate(want_TE).gather(-1, routing.experts)
    want_weights = want_weights / want_weights.sum(-1, keepdim=True)
    torch.testing.assert_close(routing.weights.double(), want_weights, rtol=0, atol=1e-6)


def test_anchor_scores_under_autocast_are_float64s():
    router, x = router_and_tokens(anchor=1.0)
    want = float64_logits(x, router.anchor_weight).softmax(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router.anchor_scores(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_without_autocast_the_plain_float32_computation_bit_for_bit():
    router, x = router_and_tokens(anchor=1.0)
    logits, scores = router.score(x)
    want = F.linear(x, router.weight)
    assert torch.equal(logits, want) and torch.equal(scores, torch.softmax(want, -1))
    assert torch.equal(
        router.anchor_scores(x), torch.softmax(F.linear(x, router.anchor_weight), -1)
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiles_in_one_graph_under_autocast(backend):
    router, x = router_and_tokens()
    torch._dynamo.reset()
    compiled = torch.compile(router.score, backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = compiled(x)
        eager, _ = router.score(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, eager)
