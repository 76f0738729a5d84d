"""Router auxiliary losses: pure functions of a ``Routing`` and the token layout.

Each loss takes ``(routing, shape, ..., segment_ids=None)`` where ``shape`` is the leading
shape of the tokens the router saw (``(B, S)`` for a batch of sequences, ``(T,)`` for one flat
sequence; tokens are flattened row-major, so token ``(b, s)`` is row ``b * S + s``) and
returns a scalar tensor. ``aux_loss`` sums the enabled losses with their weights from a
``RouterConfig``.

Two families:

- balance: ``load_balance`` (Switch Transformer) and ``z_loss`` (ST-MoE);
- locality, which shapes routing for an expert cache (LRU or static-pin):
  ``temporal_consistency`` (token t prefers the experts token t-1 used), ``consistency``
  (the published study's ``1 - <p_t, p_{t-1}>``),
  ``window_concentration`` (a window of W tokens uses few experts: a small working set) and
  ``pin_affinity`` (a pinned set of experts receives a target share of the routing mass);
- ``anchor_kl``: the KL divergence from a reference routing (the frozen router of a
  pretrained model) to the current one, so locality is bought near what the model did.

Locality losses never give credit across sequences (rows of ``shape``) or documents
(``segment_ids``, shaped like ``shape``: the document index of each token in a packed
batch). All losses work on ``probs_TE``, the router scores normalised to sum to 1 per token
(the softmax itself, or sigmoid scores rescaled), so they apply to both score functions.
See docs/router_losses.md for the formulas and the design choices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from einops import rearrange

from moestack.router import RouterConfig, Routing, tokens_per_expert


def _probs(routing: Routing) -> torch.Tensor:
    """Router scores normalised to a distribution over experts per token, [T, E]."""
    return routing.scores / routing.scores.sum(-1, keepdim=True).clamp_min(1e-20)


def _rows(
    routing: Routing, shape: Sequence[int], segment_ids: torch.Tensor | None
) -> tuple[int, int, torch.Tensor | None]:
    """Check the token layout; return (rows R, sequence length S, segment ids [R, S] or None).

    The last entry of ``shape`` is the sequence axis; every leading entry is a batch axis.
    """
    shape = tuple(int(n) for n in shape)
    num_tokens = routing.scores.shape[0]
    if math.prod(shape) != num_tokens:
        raise ValueError(
            f"shape={shape} holds {math.prod(shape)} tokens but the routing has {num_tokens}; "
            "pass the leading shape of the router input, e.g. (B, S) for x of shape [B, S, D]"
        )
    seq_len = shape[-1] if shape else 1
    rows = num_tokens // seq_len if seq_len else 0
    seg_RS = None
    if segment_ids is not None:
        if tuple(segment_ids.shape) != shape:
            raise ValueError(
                f"segment_ids has shape {tuple(segment_ids.shape)}, expected {shape} (one "
                "document id per token, shaped like the tokens); pass matching ids or None"
            )
        seg_RS = segment_ids.reshape(rows, seq_len).to(routing.scores.device)
    return rows, seq_len, seg_RS


def load_balance(routing: Routing, shape: Sequence[int]) -> torch.Tensor:
    """Switch-Transformer balance loss: E * sum_e f_e * P_e (1.0 when perfectly uniform).

    f_e is the fraction of (token, slot) assignments that went to expert e (no gradient),
    P_e the mean routing probability of e; minimising it spreads tokens over experts.
    """
    num_experts = routing.scores.shape[-1]
    if routing.experts.numel() == 0:
        return routing.scores.sum() * 0.0
    counts_E = tokens_per_expert(routing.experts, num_experts)
    fraction_E = counts_E.to(routing.scores.dtype) / routing.experts.numel()
    return num_experts * (fraction_E * _probs(routing).mean(0)).sum()


def z_loss(routing: Routing, shape: Sequence[int]) -> torch.Tensor:
    """ST-MoE router z-loss: mean squared logsumexp of the logits; keeps logits small."""
    if routing.logits.shape[0] == 0:
        return routing.logits.sum() * 0.0
    return torch.logsumexp(routing.logits, dim=-1).square().mean()


def temporal_consistency(
    routing: Routing,
    shape: Sequence[int],
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean routing mass a token puts outside the experts its predecessor chose.

    loss = mean over pairs (t-1, t) of 1 - sum_{e in K(t-1)} p_t[e], where K(t-1) are the
    top-k experts of token t-1 (a fixed set, no gradient) and p_t the token's probabilities.
    Only pairs in the same sequence and the same document count; 0 when there are none.
    In [0, 1]; 0 when every token keeps its predecessor's experts, which an LRU then holds.
    """
    rows, seq_len, seg_RS = _rows(routing, shape, segment_ids)
    probs_TE = _probs(routing)
    if rows == 0 or seq_len < 2:
        return probs_TE.sum() * 0.0
    probs_RSE = rearrange(probs_TE, "(r s) e -> r s e", r=rows)
    experts_RSK = rearrange(routing.experts, "(r s) k -> r s k", r=rows)
    kept_RP = probs_RSE[:, 1:].gather(-1, experts_RSK[:, :-1]).sum(-1)  # P = S - 1 pairs
    outside_RP = 1.0 - kept_RP
    if seg_RS is None:
        return outside_RP.mean()
    valid_RP = (seg_RS[:, 1:] == seg_RS[:, :-1]).to(outside_RP.dtype)
    return (outside_RP * valid_RP).sum() / valid_RP.sum().clamp_min(1.0)


def consistency(
    routing: Routing,
    shape: Sequence[int],
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The published study's locality loss: mean over pairs (t-1, t) of 1 - <p_t, p_{t-1}>.

    Both distributions carry gradient (unlike ``temporal_consistency``, whose predecessor
    side is a fixed set of experts). Only pairs in the same sequence and the same document
    count; 0 when there are none. In [0, 1]; 0 only when consecutive tokens put all their
    mass on one shared expert.
    """
    rows, seq_len, seg_RS = _rows(routing, shape, segment_ids)
    probs_TE = _probs(routing)
    if rows == 0 or seq_len < 2:
        return probs_TE.sum() * 0.0
    probs_RSE = rearrange(probs_TE, "(r s) e -> r s e", r=rows)
    outside_RP = 1.0 - (probs_RSE[:, 1:] * probs_RSE[:, :-1]).sum(-1)  # P = S - 1 pairs
    if seg_RS is None:
        return outside_RP.mean()
    valid_RP = (seg_RS[:, 1:] == seg_RS[:, :-1]).to(outside_RP.dtype)
    return (outside_RP * valid_RP).sum() / valid_RP.sum().clamp_min(1.0)


def window_pieces(
    rows: int,
    seq_len: int,
    window_size: int,
    segment_ids_RS: torch.Tensor | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Piece index of each token, [R * S]: windows of ``window_size`` cut at documents.

    Each sequence is cut into consecutive windows ``[0, W), [W, 2W), ...`` (the last one
    shorter when W does not divide S); a window holding several documents is split into one
    piece per document. Pieces are numbered 0.. in token order.
    """
    starts_RS = torch.zeros(rows, seq_len, dtype=torch.bool, device=device)
    starts_RS[:, ::window_size] = True
    if segment_ids_RS is not None:
        starts_RS[:, 1:] |= segment_ids_RS[:, 1:] != segment_ids_RS[:, :-1]
    return torch.cumsum(starts_RS.reshape(-1).long(), 0) - 1


def window_concentration(
    routing: Routing,
    shape: Sequence[int],
    window_size: int = 16,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalised entropy of the mean routing distribution of each window of W tokens.

    loss = sum over pieces g of (n_g / T) * H(m_g) / log E, with m_g the mean of p_t over the
    n_g tokens of piece g (see ``window_pieces``: windows of W tokens of a sequence, split at
    document boundaries) and H the entropy in nats. In [0, 1]; low when each window routes
    to few experts, i.e. its working set fits a small LRU. Tokens weight pieces equally.
    """
    rows, seq_len, seg_RS = _rows(routing, shape, segment_ids)
    probs_TE = _probs(routing)
    num_experts = probs_TE.shape[-1]
    if window_size < 1:
        raise ValueError(f"window_size={window_size} must be >= 1; use router.window_size >= 2")
    if rows == 0 or num_experts < 2:
        return probs_TE.sum() * 0.0
    if window_size > seq_len:
        raise ValueError(
            f"window_size={window_size} exceeds the sequence length {seq_len} (shape="
            f"{tuple(shape)}); lower router.window_size to at most {seq_len} or use longer "
            "sequences"
        )
    piece_T = window_pieces(rows, seq_len, window_size, seg_RS, probs_TE.device)
    # at most a piece a token: sized on the host, so the loss never waits for the device
    # (the number of pieces, or a bincount, would); the pieces past the last stay empty
    tokens = probs_TE.shape[0]
    sums_GE = probs_TE.new_zeros(tokens, num_experts).index_add(0, piece_T, probs_TE)
    counts_G = probs_TE.new_zeros(tokens).index_add(0, piece_T, probs_TE.new_ones(tokens))
    mean_GE = sums_GE / counts_G.clamp_min(1.0)[:, None]  # an empty piece: 0, weight 0
    entropy_G = -(mean_GE * mean_GE.clamp_min(1e-30).log()).sum(-1)
    return (counts_G * entropy_G).sum() / (probs_TE.shape[0] * math.log(num_experts))


def pin_affinity(
    routing: Routing,
    shape: Sequence[int],
    pin_share: float = 0.5,
    pinned: int | Sequence[int] | torch.Tensor = 2,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared gap between the pinned experts' share of the routing mass and a target.

    loss = (s - pin_share)^2 with s = mean over tokens of sum_{e in pinned} p_t[e].
    ``pinned`` is a count n (experts 0..n-1) or explicit expert ids. The share is over the
    whole batch, so a static-pin cache of those experts serves ~s of the requests; order and
    documents do not matter (``segment_ids`` is accepted for a uniform signature and only
    checked).
    """
    _rows(routing, shape, segment_ids)
    probs_TE = _probs(routing)
    num_experts = probs_TE.shape[-1]
    if isinstance(pinned, int):
        if not 1 <= pinned <= num_experts:
            raise ValueError(
                f"pin_experts={pinned} must be in [1, num_experts={num_experts}]; "
                "lower router.pin_experts"
            )
        pinned_P = torch.arange(pinned, device=probs_TE.device)
    else:
        pinned_P = torch.as_tensor(pinned, dtype=torch.long, device=probs_TE.device).reshape(-1)
        bad = pinned_P[(pinned_P < 0) | (pinned_P >= num_experts)]
        if pinned_P.numel() == 0 or bad.numel() > 0:
            raise ValueError(
                f"pinned={pinned_P.tolist()} must be a non-empty set of expert ids in "
                f"[0, {num_experts}); pass valid ids"
            )
    if not 0.0 <= pin_share <= 1.0:
        raise ValueError(f"pin_share={pin_share} must be in [0, 1]; use a share of the mass")
    if probs_TE.shape[0] == 0:
        return probs_TE.sum() * 0.0
    share = probs_TE.index_select(-1, pinned_P).sum(-1).mean()
    return (share - pin_share).square()


def anchor_kl(
    routing: Routing, shape: Sequence[int], reference_scores: torch.Tensor
) -> torch.Tensor:
    """Mean over tokens of KL(q_t || p_t): q the reference router's distribution over experts
    (``reference_scores [T, E]``, normalised like ``p``; no gradient), p the current one.

    0 when the router routes as the reference does; in nats. The whole distribution is
    compared, not only the top k, so the router cannot drift below the selection boundary.
    """
    _rows(routing, shape, None)
    probs_TE = _probs(routing)
    if reference_scores.shape != probs_TE.shape:
        raise ValueError(
            f"reference_scores has shape {tuple(reference_scores.shape)}, the routing "
            f"{tuple(probs_TE.shape)}; pass the reference router's scores for the same tokens"
        )
    if probs_TE.shape[0] == 0:
        return probs_TE.sum() * 0.0
    ref_TE = reference_scores.detach().to(probs_TE.dtype)
    ref_TE = ref_TE / ref_TE.sum(-1, keepdim=True).clamp_min(1e-20)
    kl_T = (ref_TE * (ref_TE.clamp_min(1e-30).log() - probs_TE.clamp_min(1e-30).log())).sum(-1)
    return kl_T.mean()


def aux_loss(
    routing: Routing,
    shape: Sequence[int],
    cfg: RouterConfig,
    segment_ids: torch.Tensor | None = None,
    reference_scores: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every enabled loss by name (weight > 0), already multiplied by its weight from ``cfg``.

    ``segment_ids`` (shaped like ``shape``) gives each token's document in a packed batch;
    locality losses give no credit across a document boundary. ``reference_scores`` are the
    reference router's scores for the anchor loss (needed when ``cfg.anchor > 0``).
    """
    losses: dict[str, torch.Tensor] = {}
    if cfg.anchor > 0:
        if reference_scores is None:
            raise ValueError("router.anchor > 0 needs the reference router's scores")
        losses["anchor"] = cfg.anchor * anchor_kl(routing, shape, reference_scores)
    if cfg.load_balance > 0:
        losses["load_balance"] = cfg.load_balance * load_balance(routing, shape)
    if cfg.z_loss > 0:
        losses["z_loss"] = cfg.z_loss * z_loss(routing, shape)
    if cfg.temporal > 0:
        losses["temporal"] = cfg.temporal * temporal_consistency(
            routing, shape, segment_ids=segment_ids
        )
    if cfg.consistency > 0:
        losses["consistency"] = cfg.consistency * consistency(
            routing, shape, segment_ids=segment_ids
        )
    if cfg.window > 0:
        losses["window"] = cfg.window * window_concentration(
            routing, shape, window_size=cfg.window_size, segment_ids=segment_ids
        )
    if cfg.pin > 0:
        losses["pin"] = cfg.pin * pin_affinity(
            routing,
            shape,
            pin_share=cfg.pin_share,
            pinned=cfg.pin_experts,
            segment_ids=segment_ids,
        )
    return losses
