"""Differentiable grouped GEMM: y[rows of e] = x[rows of e] @ w[e], in Triton.

The forward and the backward are the torch custom ops ``moestack::triton_grouped_gemm`` and
``moestack::triton_grouped_gemm_bwd`` (fake implementations for tracing, the backward
registered as the forward's autograd formula), so torch.compile keeps them in its graph as
opaque calls instead of breaking it at the kernel launches. Eager calls run the same kernels.
"""

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


def _check_host_offsets(offsets_E: torch.Tensor, rows: int) -> None:
    """CPU offsets are checked on the host (no device sync): rows past offsets[-1] would
    never be written, and decreasing offsets would address rows outside x."""
    if offsets_E.numel() == 0:
        return
    if int(offsets_E[-1]) != rows:
        raise ValueError(f"offsets[-1] = {int(offsets_E[-1])} must equal N = {rows}")
    if int(offsets_E[0]) < 0:
        raise ValueError(f"offsets[0] = {int(offsets_E[0])} must be >= 0 (cumulative row ends)")
    drops = (offsets_E.diff() < 0).nonzero()
    if len(drops):
        i = int(drops[0]) + 1
        raise ValueError(
            f"offsets must be non-decreasing (cumulative row ends): offsets[{i}] = "
            f"{int(offsets_E[i])} < offsets[{i - 1}] = {int(offsets_E[i - 1])}"
        )


@torch.library.custom_op("moestack::triton_grouped_gemm", mutates_args=())
def _gemm_op(x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y = the grouped GEMM; offsets int32 on x's device (device offsets checked there)."""
    N, M = x_NK.shape[0], w_EKM.shape[2]
    if offsets_E.device.type != "cpu" and offsets_E.numel():  # no host sync
        _launch.assert_offsets(offsets_E, N)
    y_NM = _launch.new_empty((N, M), x_NK.dtype, x_NK.device)
    if N:
        _launch.grouped_mm(x_NK, w_EKM, offsets_E, y_NM, N)
    return y_NM


@_gemm_op.register_fake
def _(x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return x_NK.new_empty((x_NK.shape[0], w_EKM.shape[2]))


@torch.library.custom_op("moestack::triton_grouped_gemm_bwd", mutates_args=())
def _gemm_bwd_op(
    dy_NM: torch.Tensor,
    x_NK: torch.Tensor,
    w_EKM: torch.Tensor,
    offsets_E: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the grouped GEMM; a gradient not asked for is an empty [0] tensor."""
    N, K = x_NK.shape
    dy_NM = dy_NM.to(x_NK.dtype)
    dx_NK = dw_EKM = x_NK.new_empty((0,))
    if need_dx:
        dx_NK = _launch.new_empty((N, K), x_NK.dtype, x_NK.device)
        if N:  # dX_e = dY_e @ W[e]^T through a transposed view of w (no copy)
            _launch.grouped_mm(dy_NM, w_EKM.transpose(1, 2), offsets_E, dx_NK, N)
    if need_dw:
        if N:  # dW[e] = X_e^T @ dY_e, zeros for experts without rows
            dw_EKM = _launch.grouped_wgrad(x_NK, dy_NM, offsets_E)
        else:
            dw_EKM = torch.zeros_like(w_EKM, memory_format=torch.contiguous_format)
    return dx_NK, dw_EKM


@_gemm_bwd_op.register_fake
def _(
    dy_NM: torch.Tensor,
    x_NK: torch.Tensor,
    w_EKM: torch.Tensor,
    offsets_E: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx_NK = x_NK.new_empty(tuple(x_NK.shape) if need_dx else (0,))
    dw_EKM = w_EKM.new_empty(tuple(w_EKM.shape) if need_dw else (0,))
    return dx_NK, dw_EKM


def _gemm_setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    ctx.save_for_backward(*inputs)


def _gemm_backward(ctx, dy_NM):  # noqa: ANN001, ANN202
    x_NK, w_EKM, offsets_E = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx_NK, dw_EKM = torch.ops.moestack.triton_grouped_gemm_bwd(
        dy_NM, x_NK, w_EKM, offsets_E, need_dx, need_dw
    )
    return (dx_NK if need_dx else None), (dw_EKM if need_dw else None), None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


def grouped_gemm(x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Grouped matmul over rows sorted by expert: ``y[s_e:o_e] = x[s_e:o_e] @ w[e]``.

    x [N, K] with the rows of expert e at ``[offsets[e-1], offsets[e])`` (offsets [E] are
    int32 cumulative ends, ``offsets[-1] == N``; empty groups allowed); w [E, K, M]; returns
    y [N, M] in x's dtype. Differentiable in x and w (both backward GEMMs run in Triton).
    CPU offsets are checked on the host (a ValueError; not while torch.compile traces, when
    their values are unknown); offsets on the GPU are checked there (``torch._assert_async``:
    no host sync; a bad value fails the next synchronising call and ends the CUDA context).
    Runs on CUDA (fp32/fp16/bf16) or, under ``TRITON_INTERPRET=1``, on the CPU (fp32/fp16).
    torch.compile traces it as one opaque custom op (no graph break).
    """
    _check(x_NK, w_EKM, offsets_E)
    if offsets_E.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_host_offsets(offsets_E, x_NK.shape[0])
    offsets_E = offsets_E.to(device=x_NK.device, dtype=torch.int32).contiguous()
    return torch.ops.moestack.triton_grouped_gemm(x_NK, w_EKM, offsets_E)
