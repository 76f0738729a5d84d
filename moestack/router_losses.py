"""Router auxiliary losses: pure functions of a ``Routing`` and the token layout.

Each loss takes ``(routing, shape)`` where ``shape`` is the leading shape of the tokens the
router saw (``(B, S)`` for a batch of sequences, ``(T,)`` for a flat list) and returns a
scalar tensor. ``aux_loss`` sums the losses with their weights from a ``RouterConfig``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moestack.config import RouterConfig
from moestack.router import Routing


def load_balance(routing: Routing, shape: Sequence[int]) -> torch.Tensor:
    """Switch-Transformer balance loss: E * sum_e f_e * P_e (1.0 when perfectly uniform).

    f_e is the fraction of (token, slot) assignments that went to expert e (no gradient),
    P_e the mean routing probability of e; minimising it spreads tokens over experts.
    """
    num_experts = routing.scores.shape[-1]
    if routing.experts.numel() == 0:
        return routing.scores.sum() * 0.0
    counts_E = torch.bincount(routing.experts.reshape(-1), minlength=num_experts)
    fraction_E = counts_E.float() / routing.experts.numel()
    probs_TE = routing.scores / routing.scores.sum(-1, keepdim=True).clamp_min(1e-20)
    return num_experts * (fraction_E * probs_TE.mean(0)).sum()


def z_loss(routing: Routing, shape: Sequence[int]) -> torch.Tensor:
    """ST-MoE router z-loss: mean squared logsumexp of the logits; keeps logits small."""
    if routing.logits.shape[0] == 0:
        return routing.logits.sum() * 0.0
    return torch.logsumexp(routing.logits, dim=-1).square().mean()


def aux_loss(
    routing: Routing,
    shape: Sequence[int],
    cfg: RouterConfig,
    segment_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every enabled loss by name, already multiplied by its weight from ``cfg``.

    ``segment_ids`` (shaped like ``shape``) gives each token's document in a packed batch;
    locality losses must not give credit across a document boundary.
    """
    losses: dict[str, torch.Tensor] = {}
    if cfg.load_balance > 0:
        losses["load_balance"] = cfg.load_balance * load_balance(routing, shape)
    if cfg.z_loss > 0:
        losses["z_loss"] = cfg.z_loss * z_loss(routing, shape)
    return losses
