"""Training-free rerouting: a token's pick that is not in the cache goes to a resident expert
that scores almost as well.

The rule of the published locality study this project answers: for each token, every
picked expert that is not resident is replaced by the best-scoring resident expert not yet
picked whose score is at least ``(1 - tau) * p_top`` (``p_top``: the token's highest score);
the token's non-resident picks are served in their pick order, each taking the best
candidate left; a pick with no candidate stays (a miss). ``tau = 0`` never reroutes,
``tau = 1`` takes any resident expert. Selection only: the combine weights are the chosen
experts' own scores (``Router.weights_of``). Applied when a layer is reached, with the cache's
resident set at that moment (``cache.offload.offloaded(..., reroute_tau=)``).
"""

from __future__ import annotations

import torch


def reroute(
    scores_TE: torch.Tensor, experts_TK: torch.Tensor, resident_E: torch.Tensor, tau: float
) -> torch.Tensor:
    """``experts_TK`` with each non-resident pick replaced by the rule above (``resident_E``:
    a bool mask of the resident experts)."""
    if not 0 <= tau <= 1:
        raise ValueError(f"reroute tau={tau} must be in [0, 1]")
    if tau == 0 or experts_TK.numel() == 0:
        return experts_TK
    resident_E = resident_E.to(device=scores_TE.device, dtype=torch.bool)
    picked_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(1, experts_TK, True)
    floor_T1 = (1 - tau) * scores_TE.max(dim=-1, keepdim=True).values
    eligible_TE = resident_E & ~picked_TE & (scores_TE >= floor_T1)
    k = experts_TK.shape[1]
    ranked = torch.where(eligible_TE, scores_TE, torch.full_like(scores_TE, -torch.inf))
    best_TK = ranked.topk(k, dim=-1).indices  # the candidates, best first
    missing_TK = ~resident_E[experts_TK]
    nth_TK = missing_TK.long().cumsum(dim=-1) - 1  # which of the token's missing picks
    served_TK = missing_TK & (nth_TK < eligible_TE.sum(dim=-1, keepdim=True))
    replacement_TK = best_TK.gather(1, nth_TK.clamp(min=0))
    return torch.where(served_TK, replacement_TK, experts_TK)
