"""The token router: scores experts per token and picks the top k.

The router owns its metrics (tokens per expert, entropy) so the MoE layer and telemetry read
them from one place, and an optional per-expert selection bias for aux-loss-free balancing
(DeepSeek-V3 style): the bias shifts which experts are selected but not the combine weights,
and it is updated outside the gradient from token counts. Counting tokens per expert
(``tokens_per_expert``) never waits for the host, so a training step on a GPU does not stall
in the router. Its config, ``RouterConfig``, sits here beside it (moestack.config assembles
the configs of every part).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moestack.checks import check

ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass
class RouterConfig:
    """How tokens pick experts, and the weights of the router's auxiliary losses."""

    score: str = "softmax"  # "softmax" or "sigmoid" over the router logits
    renormalize: bool = True  # rescale the top-k scores to sum to 1 per token
    load_balance: float = 0.01  # weight of the switch-style load-balance loss (0 = off)
    z_loss: float = 1e-3  # weight of the router z-loss, mean logsumexp(logits)^2 (0 = off)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: bias step per update (0 = off)
    temporal: float = 0.0  # weight of the temporal-consistency locality loss (0 = off)
    # weight of the published study's locality loss, mean 1 - <p_t, p_{t-1}> (0 = off)
    consistency: float = 0.0
    window: float = 0.0  # weight of the working-set (window entropy) locality loss (0 = off)
    window_size: int = 16  # tokens per window for the working-set loss
    pin: float = 0.0  # weight of the pin-affinity locality loss (0 = off)
    pin_experts: int = 2  # how many experts per layer form the pinned set (experts 0..n-1)
    pin_share: float = 0.5  # target share of routing mass on the pinned set
    # weight of the anchor loss: KL from the routing of the router as it was when the model
    # was loaded (a pretrained model's) to the current one, per token (0 = off)
    anchor: float = 0.0

    def __post_init__(self) -> None:
        check(
            self.score in ROUTER_SCORES,
            f"router.score={self.score!r} is unknown; use one of {ROUTER_SCORES}",
        )
        for name in (
            "load_balance", "z_loss", "bias_update_rate", "temporal", "consistency", "window",
            "pin", "anchor",
        ):  # fmt: skip
            value = getattr(self, name)
            check(value >= 0, f"router.{name}={value} must be >= 0 (0 turns it off)")
        check(self.window_size >= 2, f"router.window_size={self.window_size} must be >= 2")
        check(self.pin_experts >= 1, f"router.pin_experts={self.pin_experts} must be >= 1")
        check(0 < self.pin_share <= 1, f"router.pin_share={self.pin_share} must be in (0, 1]")


def float32_routing(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off around the router's math, so that it runs in float32 as documented.

    Why: autocast casts ``F.linear``'s inputs to its low-precision dtype whatever they are,
    so ``.float()`` alone would not keep the logits in float32 (under CPU bf16 autocast
    about 3% of tokens changed their top-8 set). Without autocast nothing changes: no
    context is entered, and the computation is the same op for op."""
    if not torch.is_autocast_enabled(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How often each expert id occurs in ``experts`` (any shape): int64 ``[num_experts]``.

    ``torch.bincount`` without its host syncs: bincount sizes its output from the largest
    id, which on CUDA it reads back to the host (twice per call, a stall of the whole
    stream on the hot path). Here the output has the fixed size E and the ids are added in
    with ``scatter_add_``, which stays on the device. Integer addition is exact in any
    order, so the counts equal ``torch.bincount(experts.reshape(-1), minlength=E)``, dtype
    included. Ids must lie in [0, E) (the CPU raises on others, CUDA asserts on the device).
    """
    flat = experts.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class Routing(NamedTuple):
    """What the router decided for T tokens over E experts with k slots each."""

    logits: torch.Tensor  # [T, E] float32 router logits
    weights: torch.Tensor  # [T, k] float32 combine weights of the chosen experts
    experts: torch.Tensor  # [T, k] int64 chosen expert ids, in router (score) order
    scores: torch.Tensor  # [T, E] float32 softmax or sigmoid scores (before any bias)


class Router(nn.Module):
    """Linear router over ``num_experts`` with top-``top_k`` selection."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, cfg: RouterConfig) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        # Aux-loss-free balancing: added to the scores for selection only; not a parameter.
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        # Tokens per expert seen since the last bias update (training only).
        self.register_buffer("pending_counts", torch.zeros(num_experts), persistent=False)
        nn.init.normal_(self.weight, std=0.02)
        if cfg.anchor > 0:  # the reference router of the anchor loss: frozen, checkpointed
            self.register_buffer("anchor_weight", self.weight.detach().clone(), persistent=True)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        logits_TE, scores_TE = self.score(x_TD)
        weights_TK, experts_TK = self.select(scores_TE)
        if self.training and self.cfg.bias_update_rate > 0:
            counts = tokens_per_expert(experts_TK, self.num_experts)
            self.pending_counts += counts.to(self.pending_counts.dtype)
        return Routing(logits_TE, weights_TK, experts_TK, scores_TE)

    def score(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, E], scores [T, E])`` in float32: softmax or sigmoid of the logits,
        under autocast too (:func:`float32_routing`)."""
        with float32_routing(x_TD):
            logits_TE = F.linear(x_TD.float(), self.weight.float())
            return logits_TE, self._activate(logits_TE)

    def _activate(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.cfg.score == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)

    def select(
        self, scores_TE: torch.Tensor, extra_bias_TE: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])``: the top k by score plus the aux-loss-free bias
        and ``extra_bias_TE`` (``[E]`` or ``[T, E]``, e.g. a cache's resident experts). Biases
        steer selection only: the weights are the chosen experts' scores (renormalised when
        ``cfg.renormalize``)."""
        select_TE = self.selection_scores(scores_TE) if self.cfg.bias_update_rate > 0 else None
        if extra_bias_TE is not None:
            select_TE = (scores_TE if select_TE is None else select_TE) + extra_bias_TE
        if select_TE is None:
            weights_TK, experts_TK = torch.topk(scores_TE, self.top_k, dim=-1)
        else:
            experts_TK = torch.topk(select_TE, self.top_k, dim=-1).indices
            weights_TK = scores_TE.gather(-1, experts_TK)
        return self._renormalized(weights_TK), experts_TK

    def selection_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """What the top k is taken of: the scores plus the aux-loss-free bias when it is
        trained (``cfg.bias_update_rate > 0``), else the scores."""
        return scores_TE + self.expert_bias if self.cfg.bias_update_rate > 0 else scores_TE

    def weights_of(self, scores_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """The combine weights ``[T, k]`` of experts chosen by other means (rerouting): their
        scores, renormalised as ``select`` does."""
        return self._renormalized(scores_TE.gather(-1, experts_TK))

    def _renormalized(self, weights_TK: torch.Tensor) -> torch.Tensor:
        if self.cfg.renormalize:
            return weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return weights_TK

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Take the current weights as the anchor loss's reference (after loading a model)."""
        if hasattr(self, "anchor_weight"):
            self.anchor_weight.copy_(self.weight)

    @torch.no_grad()
    def anchor_scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Scores ``[T, E]`` of the reference router (``anchor_weight``) for the anchor loss,
        in float32 as :meth:`score` computes them."""
        with float32_routing(x_TD):
            return self._activate(F.linear(x_TD.float(), self.anchor_weight.float()))

    @torch.no_grad()
    def update_bias(self) -> None:
        """Nudge the selection bias toward balance: under-used experts up, over-used down.

        Without a host sync: with no pending counts every expert's load equals the mean, the
        sign is 0 and the bias stays as it was, so no "anything pending?" read is needed.
        """
        if self.cfg.bias_update_rate <= 0:
            return
        load_E = self.pending_counts
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)
        self.pending_counts.zero_()

    @staticmethod
    def metrics(routing: Routing, num_experts: int) -> dict[str, torch.Tensor]:
        """Detached per-layer routing statistics: load imbalance and score entropy."""
        with torch.no_grad():
            tokens_per_expert_E = tokens_per_expert(routing.experts, num_experts).float()
            mean = tokens_per_expert_E.mean().clamp_min(1e-9)
            probs_TE = routing.scores / routing.scores.sum(-1, keepdim=True).clamp_min(1e-20)
            entropy_T = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1)
            # no tokens: 0, as the imbalance is (the mean of nothing would be NaN)
            entropy = entropy_T.mean() if entropy_T.numel() else entropy_T.new_zeros(())
            return {
                "imbalance": tokens_per_expert_E.max() / mean,
                "entropy": entropy,
            }
