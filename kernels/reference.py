"""Plain-torch twins of the Triton kernels: simple loops, any dtype (float64 included).

They are the independent reference in tests, so they favour obviousness over speed and
share no code with the kernels. Gradients come from torch autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_gemm_reference(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e]`` with a Python loop over experts."""
    ends = [int(v) for v in offsets_E.tolist()]
    parts = []
    start = 0
    for e, end in enumerate(ends):
        parts.append(x_NK[start:end] @ w_EKM[e])
        start = end
    if not parts:
        return x_NK.new_zeros((x_NK.shape[0], w_EKM.shape[2]))
    return torch.cat(parts, dim=0)


def moe_experts_reference(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """``y[t] = sum_j weights[t,j] * (silu(x W1[e][:, :F]) * (x W1[e][:, F:])) @ W2[e]``.

    Loops over experts; each expert processes the tokens routed to it in any slot.
    Computes in x's dtype (the router weights are cast to it).
    """
    T, D = x_TD.shape
    F2 = w1_EDF2.shape[2]
    F_ = F2 // 2
    y_TD = x_TD.new_zeros((T, D))
    for e in range(w1_EDF2.shape[0]):
        token_idx, slot_idx = torch.nonzero(experts_TK == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        z = x_TD[token_idx] @ w1_EDF2[e]
        h = F.silu(z[:, :F_]) * z[:, F_:]
        out = h @ w2_EFD[e]
        scale = weights_TK[token_idx, slot_idx].to(x_TD.dtype)
        y_TD = y_TD.index_add(0, token_idx, out * scale[:, None])
    return y_TD
