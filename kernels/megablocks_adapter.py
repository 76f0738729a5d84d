"""The MoE experts through megablocks' dropless grouped path, as a comparison baseline.

megablocks is an optional extra (``pip install moestack[megablocks]``; it needs CUDA to
build and to import) and this is the only module that imports it, lazily, inside the call.
The computation is the one of ``moe_experts``: megablocks' gather / scatter ops do the
permutation and the weighted combine, and its grouped GEMM (``grouped_gemm.ops.gmm``, the
kernel behind dMoE's ``mlp_impl="grouped"``) runs the two expert matmuls on our stacked
weights, so the parameters stay the MoE layer's own.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

_HINT = (
    "impl='megablocks' needs megablocks and grouped_gemm: pip install moestack[megablocks] "
    "on a CUDA machine (megablocks pins its torch version; install it with --no-deps "
    "--no-build-isolation next to your torch)"
)


def _import_megablocks() -> tuple[ModuleType, ModuleType]:
    """megablocks.ops and the grouped GEMM ops, or a clear ImportError."""
    try:
        import megablocks.ops as mb_ops
        from megablocks import grouped_gemm_util as gg
    except ImportError as exc:
        raise ImportError(_HINT) from exc
    if getattr(gg, "ops", None) is None:
        raise ImportError(_HINT + " (megablocks is installed but grouped_gemm is not)")
    return mb_ops, gg.ops


def moe_experts_megablocks(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """Same contract as :func:`moestack.kernels.moe_experts`, computed by megablocks (CUDA)."""
    mb_ops, gmm_ops = _import_megablocks()
    T, D = x_TD.shape
    E, _, F2 = w1_EDF2.shape
    k = experts_TK.shape[1]
    if T == 0:
        return x_TD.new_zeros((0, D))
    top_experts = experts_TK.reshape(-1).int()
    with torch.no_grad():
        end_bit = max(math.ceil(math.log2(E)), 1)
        bin_ids, indices = mb_ops.sort(top_experts, end_bit)
        tokens_per_expert = mb_ops.histogram(top_experts, E)
        bins = mb_ops.inclusive_cumsum(tokens_per_expert, 0).view(-1)
    batch_sizes = tokens_per_expert.cpu().to(torch.long)
    x_sorted = mb_ops.gather(x_TD, indices, bin_ids, bins, k)
    z = gmm_ops.gmm(x_sorted, w1_EDF2.contiguous(), batch_sizes)
    h = F.silu(z[:, : F2 // 2]) * z[:, F2 // 2 :]
    out = gmm_ops.gmm(h, w2_EFD.contiguous(), batch_sizes)
    weights = weights_TK.reshape(-1).to(x_TD.dtype)
    return mb_ops.scatter(out, indices, bin_ids, weights, bins, k).view(T, D)
