"""Router losses: hand-worked values, gradchecks, document/sequence boundaries, errors, configs.

References are independent of the code under test: numbers worked by hand (the arithmetic is
in the comments), torch.autograd.gradcheck, and brute-force Python loops.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.paths import CONFIGS
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from moestack.config import RouterConfig, TrainConfig, register_configs
from moestack.router import Routing
from moestack.router_losses import (
    aux_loss,
    consistency,
    load_balance,
    pin_affinity,
    temporal_consistency,
    window_concentration,
    z_loss,
)

ROUTER_CONFIGS = sorted(p.stem for p in (CONFIGS / "router").glob("*.yaml"))


def routing_from_probs(probs_TE: list[list[float]] | torch.Tensor, k: int) -> Routing:
    """A Routing whose scores are the given probabilities (top-k by score, renormalised)."""
    probs_TE = torch.as_tensor(probs_TE, dtype=torch.float64)
    weights_TK, experts_TK = torch.topk(probs_TE, k, dim=-1)
    weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return Routing(probs_TE.log(), weights_TK, experts_TK, probs_TE)


def routing_from_logits(logits_TE: torch.Tensor, k: int) -> Routing:
    """What Router.forward does with softmax scores: softmax, then top-k, renormalise."""
    scores_TE = torch.softmax(logits_TE, dim=-1)
    weights_TK, experts_TK = torch.topk(scores_TE, k, dim=-1)
    weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return Routing(logits_TE, weights_TK, experts_TK, scores_TE)


def entropy2(p: float) -> float:
    """Entropy in bits of the two-expert distribution (p, 1 - p): H / log 2 with E = 2."""
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


# ---------------------------------------------------------------------- hand-worked values
TEMPORAL_PROBS = [[0.7, 0.2, 0.1], [0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]


def test_temporal_hand_values():
    routing = routing_from_probs(TEMPORAL_PROBS, k=1)
    # top-1: t0 -> {0}, t1 -> {0}. Pairs: (0,1): 1 - p1[0] = 0.5; (1,2): 1 - p2[0] = 0.9.
    assert temporal_consistency(routing, (3,)).item() == pytest.approx(0.7)  # (0.5 + 0.9) / 2
    # Documents [0, 0, 1]: only the pair (0, 1) counts.
    seg = torch.tensor([0, 0, 1])
    assert temporal_consistency(routing, (3,), segment_ids=seg).item() == pytest.approx(0.5)
    # Documents [0, 1, 2]: no pair counts -> 0.
    seg = torch.tensor([0, 1, 2])
    assert temporal_consistency(routing, (3,), segment_ids=seg).item() == 0.0
    # top-2: t0 -> {0, 1}: outside of p1 = 0.2; t1 -> {0, 1}: outside of p2 = 0.3; mean 0.25.
    routing2 = routing_from_probs(TEMPORAL_PROBS, k=2)
    assert temporal_consistency(routing2, (3,)).item() == pytest.approx(0.25)
    # As two rows (1, 3) + (1, 3) -> shape (2, 3): the pair (row0 t2, row1 t0) must not count.
    # Rows are identical, so the mean stays 0.25 (flat (6,) would add 1 - p0[{1, 2}] = 0.7).
    stacked = routing_from_probs(TEMPORAL_PROBS + TEMPORAL_PROBS, k=2)
    assert temporal_consistency(stacked, (2, 3)).item() == pytest.approx(0.25)
    # flat: pairs 0.2, 0.3, 0.7, 0.2, 0.3 -> 1.7 / 5 = 0.34
    assert temporal_consistency(stacked, (6,)).item() == pytest.approx(0.34)


WINDOW_PROBS = [[0.9, 0.1], [0.7, 0.3], [0.5, 0.5], [0.1, 0.9]]


def test_window_hand_values():
    routing = routing_from_probs(WINDOW_PROBS, k=1)
    # W = 2, one sequence: windows {0,1} mean (0.8, 0.2), {2,3} mean (0.3, 0.7); E = 2 so the
    # normalised entropy is in bits: H(0.8) = 0.721928, H(0.3) = 0.881291, mean 0.801609.
    expected = (entropy2(0.8) + entropy2(0.3)) / 2
    assert expected == pytest.approx(0.801609, abs=1e-6)
    loss = window_concentration(routing, (4,), window_size=2)
    assert loss.item() == pytest.approx(expected)
    # Documents [0, 0, 0, 1]: window {2,3} splits into {2} (0.5, 0.5) -> 1 bit and {3}
    # (0.1, 0.9) -> 0.468996 bits; token-weighted: (2*0.721928 + 1 + 0.468996) / 4 = 0.728213.
    expected_seg = (2 * entropy2(0.8) + 1.0 + entropy2(0.1)) / 4
    assert expected_seg == pytest.approx(0.728213, abs=1e-6)
    seg = torch.tensor([0, 0, 0, 1])
    loss = window_concentration(routing, (4,), window_size=2, segment_ids=seg)
    assert loss.item() == pytest.approx(expected_seg)
    # W = 3 over S = 4: windows {0,1,2} mean (0.7, 0.3) and the short tail {3}.
    loss = window_concentration(routing, (4,), window_size=3)
    assert loss.item() == pytest.approx((3 * entropy2(0.7) + entropy2(0.1)) / 4)
    # Identical one-hot-ish tokens in a window: entropy of the mean = entropy of each token;
    # E = 3, all mass on one expert -> 0.
    one_hot = routing_from_probs([[1.0, 1e-300, 1e-300]] * 4, k=1)
    assert window_concentration(one_hot, (2, 2), window_size=2).item() == pytest.approx(0.0)


def test_window_loss_reads_nothing_back_from_the_device(monkeypatch):
    """The window loss on a batch with documents, with every way of reading a tensor's value
    on the host refused (on CUDA each is a host sync: the number of pieces, a bincount):
    the hand-worked value of test_window_hand_values all the same, and a gradient."""
    probs = torch.tensor(WINDOW_PROBS, dtype=torch.float64, requires_grad=True)
    routing = routing_from_probs(WINDOW_PROBS, k=1)._replace(scores=probs)
    seg = torch.tensor([0, 0, 0, 1])

    def refused(*args, **kwargs):
        raise AssertionError("a device value read on the host in the window loss")

    for name in ("__int__", "__index__", "__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refused)
    monkeypatch.setattr(torch, "bincount", refused)
    loss = window_concentration(routing, (4,), window_size=2, segment_ids=seg)
    loss.backward()
    monkeypatch.undo()
    assert loss.item() == pytest.approx((2 * entropy2(0.8) + 1.0 + entropy2(0.1)) / 4)
    assert probs.grad is not None and torch.isfinite(probs.grad).all()


def test_pin_hand_values():
    routing = routing_from_probs([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]], k=1)
    # pinned {0}: shares 0.6, 0.2 -> mean 0.4; (0.4 - 0.5)^2 = 0.01
    assert pin_affinity(routing, (2,), pin_share=0.5, pinned=1).item() == pytest.approx(0.01)
    # pinned {0, 1}: shares 0.9, 0.7 -> 0.8; (0.8 - 0.5)^2 = 0.09
    assert pin_affinity(routing, (2,), pin_share=0.5, pinned=2).item() == pytest.approx(0.09)
    # pinned ids {2}: shares 0.1, 0.3 -> 0.2; (0.2 - 0.25)^2 = 0.0025
    loss = pin_affinity(routing, (1, 2), pin_share=0.25, pinned=[2])
    assert loss.item() == pytest.approx(0.0025)


def test_balance_hand_values():
    routing = routing_from_probs([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]], k=1)
    # top-1 picks experts 0 and 1: f = (1/2, 1/2, 0); P = (0.4, 0.4, 0.2)
    # E * sum f * P = 3 * (0.2 + 0.2) = 1.2
    assert load_balance(routing, (2,)).item() == pytest.approx(1.2)
    # logits = log p, so logsumexp = log(1) = 0 per token -> z-loss 0
    assert z_loss(routing, (2,)).item() == pytest.approx(0.0, abs=1e-12)


def _consistency_by_loop(probs_RSE: torch.Tensor, seg_RS: torch.Tensor | None) -> float:
    """1 - <p_t, p_{t-1}> averaged over every same-row, same-document pair, one by one."""
    total, pairs = 0.0, 0
    rows, seq_len, experts = probs_RSE.shape
    for r in range(rows):
        for t in range(1, seq_len):
            if seg_RS is not None and seg_RS[r, t] != seg_RS[r, t - 1]:
                continue
            total += 1.0 - sum(float(probs_RSE[r, t, e] * probs_RSE[r, t - 1, e])
                               for e in range(experts))  # fmt: skip
            pairs += 1
    return total / pairs if pairs else 0.0


@pytest.mark.parametrize("with_docs", [False, True])
def test_consistency_matches_a_loop_over_the_pairs(with_docs):
    gen = torch.Generator().manual_seed(4)
    probs_RSE = torch.randn(3, 7, 5, generator=gen, dtype=torch.float64).softmax(-1)
    seg_RS = torch.randint(0, 3, (3, 7), generator=gen).cummax(-1).values if with_docs else None
    routing = routing_from_probs(probs_RSE.reshape(21, 5), k=2)
    got = consistency(routing, (3, 7), segment_ids=seg_RS).item()
    assert got == pytest.approx(_consistency_by_loop(probs_RSE, seg_RS), rel=1e-12)
    one_token_docs = torch.arange(21).reshape(3, 7)  # no pair in one document: 0
    assert consistency(routing, (3, 7), segment_ids=one_token_docs).item() == 0.0
    one_hot = routing_from_probs(torch.eye(5, dtype=torch.float64)[[2, 2, 2]], k=1)
    assert consistency(one_hot, (3,)).item() == 0.0  # one shared expert: nothing to lose


def test_sigmoid_scores_are_normalised():
    # Sigmoid-style scores (not summing to 1) are rescaled per token: (0.6, 0.2) -> (0.75, 0.25)
    scores = torch.tensor([[0.6, 0.2], [0.6, 0.2]], dtype=torch.float64)
    routing = Routing(scores.logit(), scores, torch.tensor([[0], [0]]), scores)
    # pair (0, 1): outside the previous top-1 {0} is 0.25
    assert temporal_consistency(routing, (2,)).item() == pytest.approx(0.25)
    assert pin_affinity(routing, (2,), pin_share=0.5, pinned=1).item() == pytest.approx(0.0625)


# ---------------------------------------------------------------------- gradients
GRAD_CASES = {
    "temporal": lambda r, seg: temporal_consistency(r, (2, 5), segment_ids=seg),
    "consistency": lambda r, seg: consistency(r, (2, 5), segment_ids=seg),
    "window": lambda r, seg: window_concentration(r, (2, 5), window_size=3, segment_ids=seg),
    "pin": lambda r, seg: pin_affinity(r, (2, 5), pin_share=0.6, pinned=[1, 3]),
    "load_balance": lambda r, seg: load_balance(r, (2, 5)),
    "z_loss": lambda r, seg: z_loss(r, (2, 5)),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradcheck_wrt_logits(name):
    gen = torch.Generator().manual_seed(0)
    logits_TE = torch.randn(10, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    seg_BS = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    loss_fn = GRAD_CASES[name]

    def fn(logits: torch.Tensor) -> torch.Tensor:
        return loss_fn(routing_from_logits(logits, k=2), seg_BS)

    assert fn(logits_TE).requires_grad
    assert torch.autograd.gradcheck(fn, (logits_TE,), eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- boundaries
def brute_temporal(probs, experts, rows, seq, seg):
    """Python loops: mean over same-row, same-document pairs of mass outside K(t-1)."""
    total, pairs = 0.0, 0
    for b in range(rows):
        for s in range(1, seq):
            if seg[b][s] != seg[b][s - 1]:
                continue
            prev, cur = b * seq + s - 1, b * seq + s
            total += 1.0 - sum(probs[cur][e] for e in experts[prev])
            pairs += 1
    return total / pairs if pairs else 0.0


def brute_window(probs, rows, seq, seg, width):
    """Python loops: token-weighted normalised entropy of each (window, document) piece."""
    num_experts = len(probs[0])
    total = 0.0
    for b in range(rows):
        for w0 in range(0, seq, width):
            pieces: dict[int, list[int]] = {}
            for s in range(w0, min(w0 + width, seq)):
                pieces.setdefault(seg[b][s], []).append(b * seq + s)
            for toks in pieces.values():
                mean = [sum(probs[t][e] for t in toks) / len(toks) for e in range(num_experts)]
                ent = -sum(m * math.log(m) for m in mean if m > 0)
                total += len(toks) * ent / math.log(num_experts)
    return total / (rows * seq)


def random_routing(rows: int, seq: int, experts: int, k: int, seed: int) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    return routing_from_logits(torch.randn(rows * seq, experts, generator=gen).double() * 2, k)


def test_losses_match_brute_force_on_packed_batches():
    rows, seq = 3, 7
    routing = random_routing(rows, seq, experts=5, k=2, seed=1)
    seg = [[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 3, 3, 4]]
    seg_BS = torch.tensor(seg)
    probs, experts = routing.scores.tolist(), routing.experts.tolist()
    got = temporal_consistency(routing, (rows, seq), segment_ids=seg_BS).item()
    assert got == pytest.approx(brute_temporal(probs, experts, rows, seq, seg))
    for width in (2, 3, 7):
        got = window_concentration(routing, (rows, seq), window_size=width, segment_ids=seg_BS)
        assert got.item() == pytest.approx(brute_window(probs, rows, seq, seg, width))
    no_seg = [[0] * seq] * rows
    got = window_concentration(routing, (rows, seq), window_size=3).item()
    assert got == pytest.approx(brute_window(probs, rows, seq, no_seg, 3))


def _relabel_from(routing: Routing, start: int, perm: list[int]) -> Routing:
    """Rename the experts of tokens start.. by ``perm``: each document alone keeps its loss."""
    perm_t = torch.tensor(perm)
    inverse = torch.argsort(perm_t)  # new column j holds old column inverse[j]
    scores = routing.scores.clone()
    scores[start:] = scores[start:, inverse]
    experts = routing.experts.clone()
    experts[start:] = perm_t[experts[start:]]
    return Routing(scores.log(), routing.weights, experts, scores)


def test_no_locality_credit_across_documents():
    # One sequence of 8 tokens: document 0 = tokens 0..3, document 1 = tokens 4..7. Renaming
    # the experts of document 1 changes only the routing *across* the boundary.
    routing = random_routing(1, 8, experts=4, k=2, seed=2)
    relabelled = _relabel_from(routing, 4, [1, 2, 3, 0])
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    for loss_fn in (
        lambda r, s: temporal_consistency(r, (1, 8), segment_ids=s),
        lambda r, s: window_concentration(r, (1, 8), window_size=8, segment_ids=s),
    ):
        assert loss_fn(relabelled, seg).item() == pytest.approx(loss_fn(routing, seg).item())
        # Without document ids the boundary pair / window does count, and the loss moves.
        assert loss_fn(relabelled, None).item() != pytest.approx(loss_fn(routing, None).item())


def test_rows_of_a_batch_do_not_interact():
    # Relabelling row 1 changes the routing across the row boundary only: (2, 4) unchanged.
    routing = random_routing(2, 4, experts=4, k=2, seed=3)
    relabelled = _relabel_from(routing, 4, [1, 2, 3, 0])
    for loss_fn in (
        lambda r, shape: temporal_consistency(r, shape),
        lambda r, shape: window_concentration(r, shape, window_size=3),
    ):
        assert loss_fn(relabelled, (2, 4)).item() == pytest.approx(loss_fn(routing, (2, 4)).item())
        assert loss_fn(relabelled, (8,)).item() != pytest.approx(loss_fn(routing, (8,)).item())


# ---------------------------------------------------------------------- errors
def test_clear_errors_for_layouts_that_do_not_fit():
    routing = random_routing(2, 4, experts=4, k=2, seed=4)
    with pytest.raises(ValueError, match=r"window_size=5 exceeds the sequence length 4"):
        window_concentration(routing, (2, 4), window_size=5)
    with pytest.raises(ValueError, match=r"window_size=0 must be >= 1"):
        window_concentration(routing, (2, 4), window_size=0)
    with pytest.raises(ValueError, match=r"shape=\(3, 4\) holds 12 tokens .* has 8"):
        temporal_consistency(routing, (3, 4))
    with pytest.raises(ValueError, match=r"segment_ids has shape \(8,\), expected \(2, 4\)"):
        temporal_consistency(routing, (2, 4), segment_ids=torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"pin_experts=5 must be in \[1, num_experts=4\]"):
        pin_affinity(routing, (2, 4), pinned=5)
    with pytest.raises(ValueError, match=r"pinned=\[4\]"):
        pin_affinity(routing, (2, 4), pinned=[4])
    with pytest.raises(ValueError, match=r"window_size=9 exceeds"):
        aux_loss(routing, (2, 4), RouterConfig(window=1.0, window_size=9))


# ---------------------------------------------------------------------- aux_loss wiring
def test_aux_loss_includes_each_loss_only_when_its_weight_is_positive():
    routing = routing_from_probs(WINDOW_PROBS, k=1)
    off = dict(load_balance=0.0, z_loss=0.0, temporal=0.0, window=0.0, pin=0.0, consistency=0.0)
    assert aux_loss(routing, (4,), RouterConfig(**off)) == {}
    seg = torch.tensor([0, 0, 0, 1])
    # Hand values on WINDOW_PROBS (top-1 = 0, 0, 0, 1):
    # temporal, docs [0,0,0,1]: pairs (0,1): 1-0.7 = 0.3, (1,2): 1-0.5 = 0.5 -> 0.4
    # window W=2 with docs: 0.728213 (test_window_hand_values)
    # pin {0}, target 0.5: share (0.9+0.7+0.5+0.1)/4 = 0.55 -> 0.0025
    # load balance: f = (3/4, 1/4), P = (0.55, 0.45) -> 2 * (0.4125 + 0.1125) = 1.05
    # consistency: (0,1): 1 - (0.63 + 0.03) = 0.34, (1,2): 1 - (0.35 + 0.15) = 0.5 -> 0.42
    expected = {
        "temporal": 0.4,
        "consistency": 0.42,
        "window": (2 * entropy2(0.8) + 1.0 + entropy2(0.1)) / 4,
        "pin": 0.0025,
        "load_balance": 1.05,
    }
    extra = {"window": {"window_size": 2}, "pin": {"pin_experts": 1, "pin_share": 0.5}}
    for name, value in expected.items():
        cfg = RouterConfig(**{**off, name: 2.0, **extra.get(name, {})})
        losses = aux_loss(routing, (4,), cfg, segment_ids=seg)
        assert list(losses) == [name]
        assert losses[name].item() == pytest.approx(2.0 * value)
    everything = RouterConfig(temporal=1.0, consistency=1.0, window=1.0, pin=1.0, window_size=2)
    assert set(aux_loss(routing, (4,), everything, segment_ids=seg)) == {
        "load_balance", "z_loss", "temporal", "consistency", "window", "pin",
    }  # fmt: skip


# ---------------------------------------------------------------------- configs
@pytest.mark.parametrize("option", ROUTER_CONFIGS)
def test_router_configs_compose(option):
    register_configs()
    with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"router={option}"])
    train_cfg = OmegaConf.to_object(cfg)
    assert isinstance(train_cfg, TrainConfig)
    router = train_cfg.model.router
    assert isinstance(router, RouterConfig)
    if option == "aux_free":
        assert router.bias_update_rate > 0 and router.load_balance == 0
    else:
        assert router.load_balance > 0  # balance stays on beside every locality loss
    locality = {"temporal": router.temporal, "window": router.window, "pin": router.pin}
    if option in locality:
        assert locality[option] > 0
        assert all(v == 0 for k, v in locality.items() if k != option)


def test_router_configs_exist():
    assert {"baseline", "temporal", "window", "pin", "aux_free"} <= set(ROUTER_CONFIGS)
