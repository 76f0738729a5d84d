"""Differentiable grouped GEMM: y[rows of e] = x[rows of e] @ w[e], in Triton."""

from __future__ import annotations

import torch

from . import _launch


def _check(x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor) -> None:
    if x_NK.dim() != 2 or w_EKM.dim() != 3:
        raise ValueError(f"expected x [N, K] and w [E, K, M], got {x_NK.shape} and {w_EKM.shape}")
    if x_NK.shape[1] != w_EKM.shape[1]:
        raise ValueError(f"K mismatch: x {tuple(x_NK.shape)} vs w {tuple(w_EKM.shape)}")
    if offsets_E.shape != (w_EKM.shape[0],):
        raise ValueError(f"offsets must be [E={w_EKM.shape[0]}], got {tuple(offsets_E.shape)}")
    if x_NK.dtype != w_EKM.dtype:
        raise TypeError(f"dtype mismatch: x {x_NK.dtype}, w {w_EKM.dtype}")
    # Cheap on the CPU (no device sync): rows past offsets[-1] would never be written, and
    # decreasing offsets would address rows outside x. Device offsets: see grouped_gemm.
    on_cpu = offsets_E.device.type == "cpu" and offsets_E.numel() > 0
    if on_cpu and int(offsets_E[-1]) != x_NK.shape[0]:
        raise ValueError(f"offsets[-1] = {int(offsets_E[-1])} must equal N = {x_NK.shape[0]}")
    if on_cpu and int(offsets_E[0]) < 0:
        raise ValueError(f"offsets[0] = {int(offsets_E[0])} must be >= 0 (cumulative row ends)")
    drops = (offsets_E.diff() < 0).nonzero() if on_cpu else []
    if len(drops):
        i = int(drops[0]) + 1
        raise ValueError(
            f"offsets must be non-decreasing (cumulative row ends): offsets[{i}] = "
            f"{int(offsets_E[i])} < offsets[{i - 1}] = {int(offsets_E[i - 1])}"
        )


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK, w_EKM, offsets_E):  # noqa: D102
        N, M = x_NK.shape[0], w_EKM.shape[2]
        y_NM = _launch.new_empty((N, M), x_NK.dtype, x_NK.device)
        if N:
            _launch.grouped_mm(x_NK, w_EKM, offsets_E, y_NM, N)
        ctx.save_for_backward(x_NK, w_EKM, offsets_E)
        return y_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_NM):  # noqa: D102
        x_NK, w_EKM, offsets_E = ctx.saved_tensors
        N, K = x_NK.shape
        dy_NM = dy_NM.to(x_NK.dtype)
        dx_NK = dw_EKM = None
        if ctx.needs_input_grad[0]:
            dx_NK = _launch.new_empty((N, K), x_NK.dtype, x_NK.device)
            if N:  # dX_e = dY_e @ W[e]^T through a transposed view of w (no copy)
                _launch.grouped_mm(dy_NM, w_EKM.transpose(1, 2), offsets_E, dx_NK, N)
        if ctx.needs_input_grad[1]:
            if N:  # dW[e] = X_e^T @ dY_e, zeros for experts without rows
                dw_EKM = _launch.new_empty(tuple(w_EKM.shape), w_EKM.dtype, w_EKM.device)
                _launch.grouped_wgrad(x_NK, dy_NM, offsets_E, dw_EKM)
            else:
                dw_EKM = torch.zeros_like(w_EKM)
        return dx_NK, dw_EKM, None


def grouped_gemm(x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Grouped matmul over rows sorted by expert: ``y[s_e:o_e] = x[s_e:o_e] @ w[e]``.

    x [N, K] with the rows of expert e at ``[offsets[e-1], offsets[e])`` (offsets [E] are
    int32 cumulative ends, ``offsets[-1] == N``; empty groups allowed); w [E, K, M]; returns
    y [N, M] in x's dtype. Differentiable in x and w (both backward GEMMs run in Triton).
    Offsets on the GPU are checked there (``torch._assert_async``: no host sync; a bad
    value fails the next synchronising call and ends the CUDA context).
    Runs on CUDA (fp32/fp16/bf16) or, under ``TRITON_INTERPRET=1``, on the CPU (fp32/fp16).
    """
    _check(x_NK, w_EKM, offsets_E)
    on_device = offsets_E.device.type != "cpu"
    offsets_E = offsets_E.to(device=x_NK.device, dtype=torch.int32).contiguous()
    if on_device and offsets_E.numel():  # checked on the GPU, without a host sync
        _launch.assert_offsets(offsets_E, x_NK.shape[0])
    return _GroupedGemm.apply(x_NK, w_EKM, offsets_E)
