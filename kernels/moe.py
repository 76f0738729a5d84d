"""Fused dropless MoE experts (SwiGLU) on the Triton grouped GEMM, with autograd.

Forward, for the T*k (token, slot) pairs sorted by expert (R = T*k sorted rows):
  1. ``h = silu(x[tok] @ W1[e][:, :F]) * (x[tok] @ W1[e][:, F:])``: one grouped GEMM that
     gathers x rows through the sorted token index (no permuted copy of x) and applies
     SwiGLU in its epilogue; it also stores the pre-activations ``z = [gate | up]`` when a
     gradient is needed.
  2. ``ys[pair] = weight[pair] * h @ W2[e]``: a grouped GEMM whose epilogue applies the
     router weight and scatters each row to its (token, slot) position; then
     ``y = ys.view(T, k, D).sum(1)``, a fixed-order reduce (deterministic, no atomics).

Saved for backward: x, W1, W2 (inputs), ``z`` [R, 2F] and the int32 sort bookkeeping.
``h`` (needed for dW2 and the router-weight gradient) is recomputed from ``z`` by an
elementwise kernel (or, where the tuned table says so, by the epilogue of G's GEMM, which
then never stores G), so the GEMM outputs h [R, F] and ys [R, D] are freed after forward.
Either works in place: ``dz`` overwrites the saved ``z`` and ``weight * h`` takes G's
[R, F] buffer, so the backward's largest live buffers are ``z``, one [R, F] and the [R, D] copy of
dy's rows (2F + F + D elements a row, against 2F + F + 2F + F + D had dz and weight * h
each their own buffer: 1.3 GiB less at Mixtral's shape and 8k tokens). Only a backward
that frees the graph when it ends works in place; with
``retain_graph``/``create_graph``, and in traced code (torch.compile), a functional twin of
the op gives dz and weight * h buffers of their own, so z is still z for a later backward.

Backward, with ``G = dy[tok] @ W2[e]^T`` (dy's rows gathered once into expert order, a
contiguous [R, D] copy that G and dW2 share):
  ``dweight[pair] = <dy[tok], h @ W2[e]> = <G, h>``; ``dz = SwiGLU'(z, weight * G)``;
  ``dW2[e] = (weight * h)_e^T @ dy[tok]_e`` (the elementwise kernel writes weight * h, so
  the GEMM's main loop only loads and multiplies); ``dx = sum_slots dz @ W1[e]^T``;
  ``dW1[e] = x[tok]_e^T @ dz_e`` (x's rows gathered into expert order just before it).
Both weight gradients thus read contiguous rows, by moestack's kernel or torch._grouped_mm
(the tuned table's choice per shape, ``kernels/tuning.py``). The GEMMs without SwiGLU
(h @ W2, G, dx) run the classic grouped-GEMM kernel or, where the table says so, the
persistent one (``kernels/_persistent.py``), whose tile table is built once per call and
tile height and shared by the call's GEMMs (G and dx in the backward), without a host sync. Each gathered copy is freed
as soon as its GEMMs ran: the backward's largest live set is z, G and dy's copy
(2F + F + D elements a row), then z with dx's per-slot rows or x's copy.

Forward and backward are the torch custom ops ``moestack::triton_moe_experts`` and
``moestack::triton_moe_experts_bwd_`` (in place; ``moestack::triton_moe_experts_bwd`` when
traced or the graph is retained), with fake implementations for tracing; the backward is
the forward's registered autograd formula, not differentiable itself. So torch.compile keeps
the experts in its graph as opaque calls instead of breaking it at the kernel launches.
Eager calls go through the same ops and run the same kernels.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from . import _launch
from ._tiles import TileTables


def dispatch(
    experts_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert without a host sync.

    Returns ``pair_R`` (int32 flat pair index t*k + j per sorted row, stable within an
    expert), ``token_R`` (int32 token of each sorted row) and ``offsets_E`` (int32
    cumulative row ends per expert).
    """
    k = experts_TK.shape[1]
    flat = experts_TK.reshape(-1)
    sorted_e, order = torch.sort(flat, stable=True)
    ids = torch.arange(num_experts, device=flat.device, dtype=sorted_e.dtype)
    offsets_E = torch.searchsorted(sorted_e, ids, right=True, out_int32=True)
    pair_R = order.to(torch.int32)
    token_R = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    return pair_R, token_R, offsets_E


@torch.library.custom_op("moestack::triton_moe_experts", mutates_args=())
def _experts_op(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward: ``(y, z, pair_R, token_R, offsets_E, weight_R)``; y [T, D] is the output,
    the rest is what backward needs (z [R, 2F] with ``keep``, else [0, 2F])."""
    T, D = x_TD.shape
    E, _, F2 = w1_EDF2.shape
    k = experts_TK.shape[1]
    R = T * k
    dev, dt = x_TD.device, x_TD.dtype
    if R == 0:
        return (
            x_TD.new_zeros((T, D)),
            x_TD.new_empty((0, F2)),
            torch.empty((0,), dtype=torch.int32, device=dev),
            torch.empty((0,), dtype=torch.int32, device=dev),
            torch.zeros((E,), dtype=torch.int32, device=dev),
            weights_TK.new_empty((0,)),
        )
    _launch.assert_expert_ids(experts_TK, E)  # on the device: no host sync
    pair_R, token_R, offsets_E = dispatch(experts_TK, E)
    weight_R = weights_TK.reshape(-1)[pair_R.long()]
    h_RF = _launch.new_empty((R, F2 // 2), dt, dev)
    z_RF2 = _launch.new_empty((R, F2), dt, dev) if keep else x_TD.new_empty((0, F2))
    _launch.grouped_mm(
        x_TD, w1_EDF2, offsets_E, h_RF, R, a_rows=token_R, swiglu=True, z=z_RF2 if keep else None
    )
    ys_RD = _launch.new_empty((R, D), dt, dev)
    tiles = TileTables(offsets_E, R)  # built only if a persistent config runs
    _launch.grouped_mm(
        h_RF, w2_EFD, offsets_E, ys_RD, R, c_rows=pair_R, scale=weight_R, tiles=tiles
    )
    del h_RF
    y_TD = ys_RD.view(T, k, D).sum(1) if k > 1 else ys_RD.view(T, D)
    return y_TD, z_RF2, pair_R, token_R, offsets_E, weight_R


@_experts_op.register_fake
def _(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, D = x_TD.shape
    E, _, F2 = w1_EDF2.shape
    R = T * experts_TK.shape[1]
    rows = x_TD.new_empty((R,), dtype=torch.int32)
    return (
        x_TD.new_empty((T, D)),
        x_TD.new_empty((R if keep else 0, F2)),
        rows,
        torch.empty_like(rows),
        x_TD.new_empty((E,), dtype=torch.int32),
        weights_TK.new_empty((R,)),
    )


def _backward_kernels(
    dy_TD: torch.Tensor,
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    z_RF2: torch.Tensor,
    pair_R: torch.Tensor,
    token_R: torch.Tensor,
    offsets_E: torch.Tensor,
    weight_R: torch.Tensor,
    top_k: int,
    needs: list[bool],
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw1, dw2, dweights)``, dweights [T, k] in float32; ``needs`` says which of the
    four are wanted (the others are empty [0] tensors). ``in_place`` overwrites ``z_RF2``
    with dz and G with weight * h (eager); else both get buffers of their own (traced)."""
    need_x, need_w1, need_w2, need_w = needs
    T, D = x_TD.shape
    E, _, F2 = w1_EDF2.shape
    R, F = T * top_k, F2 // 2
    dev, dt = x_TD.device, x_TD.dtype
    if R == 0:
        return _no_rows_grads(x_TD, w1_EDF2, w2_EFD, top_k, needs)
    dx_TD, dw1, dw2, dweights_TK = (x_TD.new_empty((0,)) for _ in range(4))
    dy_TD = dy_TD.to(dt)

    # dy's rows in expert order, gathered once (G and dW2 read them as contiguous tiles).
    # G = dy[tok] @ W2[e]^T and its SwiGLU backward (dz, the router-weight gradient, weight *
    # h for dW2): G's GEMM then an elementwise pass, or (tuned so) one GEMM with it in its
    # epilogue. G and dx share one tile table per tile height (persistent configs).
    tiles = TileTables(offsets_E, R)
    dys_RD = _launch.gather_rows(dy_TD, token_R)
    dweight_R = _launch.new_empty((R,), torch.float32, dev)
    dz_RF2 = z_RF2 if in_place else _launch.new_empty((R, F2), dt, dev)
    hw_RF = _launch.new_empty((R, F), dt, dev) if need_w2 else None
    _launch.grouped_mm_dswiglu(
        dys_RD, w2_EFD.transpose(1, 2), offsets_E, z_RF2, weight_R, dz_RF2, dweight_R, hw_RF, R,
        tiles=tiles,
    )  # fmt: skip

    if need_w:
        flat = _launch.new_empty((R,), torch.float32, dev)
        flat[pair_R.long()] = dweight_R  # pair_R is a permutation: every slot written
        dweights_TK = flat.view(T, top_k)
    if need_w2:
        dw2 = _launch.grouped_wgrad(hw_RF, dys_RD, offsets_E)
    del hw_RF, dys_RD  # before dx's [R, D] rows and x's gathered rows
    if need_x:
        dxs_RD = _launch.new_empty((R, D), dt, dev)
        _launch.grouped_mm(
            dz_RF2, w1_EDF2.transpose(1, 2), offsets_E, dxs_RD, R, c_rows=pair_R, tiles=tiles
        )
        dx_TD = dxs_RD.view(T, top_k, D).sum(1) if top_k > 1 else dxs_RD.view(T, D)
        del dxs_RD  # with k > 1 the sum is a new tensor: free the per-slot rows before dW1
    if need_w1:
        xs_RD = _launch.gather_rows(x_TD, token_R)
        dw1 = _launch.grouped_wgrad(xs_RD, dz_RF2, offsets_E)
        del xs_RD
    return dx_TD, dw1, dw2, dweights_TK


def _no_rows_grads(
    x_TD: torch.Tensor, w1_EDF2: torch.Tensor, w2_EFD: torch.Tensor, top_k: int, needs: list[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a call with no token: zero gradients where wanted, empty [0] ones
    elsewhere (no kernel is launched)."""
    need_x, need_w1, need_w2, need_w = needs
    empty = x_TD.new_empty((0,))
    return (
        x_TD.new_zeros(x_TD.shape) if need_x else empty,
        w1_EDF2.new_zeros(w1_EDF2.shape) if need_w1 else empty,
        w2_EFD.new_zeros(w2_EFD.shape) if need_w2 else empty,
        x_TD.new_zeros((x_TD.shape[0], top_k), dtype=torch.float32) if need_w else empty,
    )


def _backward_fake(
    dy_TD: torch.Tensor,
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    z_RF2: torch.Tensor,
    pair_R: torch.Tensor,
    token_R: torch.Tensor,
    offsets_E: torch.Tensor,
    weight_R: torch.Tensor,
    top_k: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    need_x, need_w1, need_w2, need_w = needs
    T = x_TD.shape[0]
    return (
        x_TD.new_empty(tuple(x_TD.shape) if need_x else (0,)),
        w1_EDF2.new_empty(tuple(w1_EDF2.shape) if need_w1 else (0,)),
        w2_EFD.new_empty(tuple(w2_EFD.shape) if need_w2 else (0,)),
        x_TD.new_empty((T, top_k) if need_w else (0,), dtype=torch.float32),
    )


# The backward as two ops over the same kernels. Eager autograd that frees the graph after
# this backward calls the in-place one (its schema declares z mutated). A retained graph
# (``retain_graph``, ``create_graph``) and traced code (torch.compile, AOT autograd) call the
# functional one: a later backward may read z again, and AOT autograd cannot partition a
# backward that mutates a tensor the forward saved (torch.library.opcheck fails on it).


@torch.library.custom_op("moestack::triton_moe_experts_bwd", mutates_args=())
def _experts_bwd_op(
    dy_TD: torch.Tensor,
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    z_RF2: torch.Tensor,
    pair_R: torch.Tensor,
    token_R: torch.Tensor,
    offsets_E: torch.Tensor,
    weight_R: torch.Tensor,
    top_k: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward, functional: dz and weight * h get buffers of their own."""
    args = (dy_TD, x_TD, w1_EDF2, w2_EFD, z_RF2, pair_R, token_R, offsets_E, weight_R)
    return _backward_kernels(*args, top_k, needs, in_place=False)


@torch.library.custom_op("moestack::triton_moe_experts_bwd_", mutates_args=("z_RF2",))
def _experts_bwd_inplace_op(
    dy_TD: torch.Tensor,
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    z_RF2: torch.Tensor,
    pair_R: torch.Tensor,
    token_R: torch.Tensor,
    offsets_E: torch.Tensor,
    weight_R: torch.Tensor,
    top_k: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward in place: dz is written over the saved ``z_RF2``, weight * h over G."""
    args = (dy_TD, x_TD, w1_EDF2, w2_EFD, z_RF2, pair_R, token_R, offsets_E, weight_R)
    return _backward_kernels(*args, top_k, needs, in_place=True)


_experts_bwd_op.register_fake(_backward_fake)
_experts_bwd_inplace_op.register_fake(_backward_fake)


def _may_overwrite_saved(dy_TD: torch.Tensor) -> bool:
    """Whether this backward may write dz over the saved z: eager autograd (not traced by
    dynamo, AOT autograd or opcheck) that frees the graph's saved tensors when it ends. With
    ``retain_graph`` (or ``create_graph``) a later backward reads them again, and a
    saved-tensors hook that unpacks the very tensor it packed (an identity hook,
    ``save_on_cpu`` on CPU tensors) skips autograd's version check: z must stay z."""
    if torch.compiler.is_compiling() or is_fake(dy_TD):
        return False
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and not keep_graph()


def _experts_setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    x_TD, w1_EDF2, w2_EFD, experts_TK, weights_TK, keep = inputs
    ctx.keep = keep
    ctx.top_k = experts_TK.shape[1]
    ctx.weights_dtype = weights_TK.dtype
    ctx.mark_non_differentiable(*output[1:])  # backward's bookkeeping, not results
    ctx.set_materialize_grads(False)  # no zero gradients for them either
    ctx.save_for_backward(x_TD, w1_EDF2, w2_EFD, *output[1:])


def _experts_backward(ctx, dy_TD, *_):  # noqa: ANN001, ANN202
    need_x, need_w1, need_w2, _, need_w, _ = ctx.needs_input_grad
    if dy_TD is None:  # y did not reach the loss
        return None, None, None, None, None, None
    if not ctx.keep:
        raise RuntimeError("triton_moe_experts ran with keep=False: nothing saved for backward")
    ops = torch.ops.moestack
    bwd = ops.triton_moe_experts_bwd_ if _may_overwrite_saved(dy_TD) else ops.triton_moe_experts_bwd
    dx_TD, dw1, dw2, dweights_TK = bwd(
        dy_TD, *ctx.saved_tensors, ctx.top_k, [need_x, need_w1, need_w2, need_w]
    )
    return (
        dx_TD if need_x else None,
        dw1 if need_w1 else None,
        dw2 if need_w2 else None,
        None,
        dweights_TK.to(ctx.weights_dtype) if need_w else None,
        None,
    )


_experts_op.register_autograd(_experts_backward, setup_context=_experts_setup)


def moe_experts(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """Dropless SwiGLU experts: ``y[t] = sum_j weights[t,j] * swiglu(x[t] @ W1[e]) @ W2[e]``.

    x [T, D]; w1 [E, D, 2F] (gate = first F columns, up = last F); w2 [E, F, D];
    experts [T, k] integer expert ids (e = experts[t, j]); weights [T, k] router weights in
    x's dtype or float32. Returns y [T, D] in x's dtype. Differentiable in x, w1, w2 and
    weights. Fused dispatch: no padded or permuted copy of x, deterministic combine.
    Expert ids outside [0, E) fail: at once on the CPU, on CUDA through a device-side
    assertion (no host sync) that surfaces at the next synchronising call.
    torch.compile traces it as one opaque custom op (no graph break; the checks below are on
    shapes and dtypes only).
    """
    if x_TD.dim() != 2 or w1_EDF2.dim() != 3 or w2_EFD.dim() != 3:
        raise ValueError("expected x [T, D], w1 [E, D, 2F], w2 [E, F, D]")
    T, D = x_TD.shape
    E, D1, F2 = w1_EDF2.shape
    if D1 != D or F2 % 2 or tuple(w2_EFD.shape) != (E, F2 // 2, D):
        raise ValueError(
            f"shape mismatch: x {tuple(x_TD.shape)}, w1 {tuple(w1_EDF2.shape)}, "
            f"w2 {tuple(w2_EFD.shape)}"
        )
    if experts_TK.dim() != 2 or experts_TK.shape[0] != T or weights_TK.shape != experts_TK.shape:
        raise ValueError(
            f"experts and weights must be [T={T}, k], got {tuple(experts_TK.shape)} and "
            f"{tuple(weights_TK.shape)}"
        )
    if experts_TK.dtype.is_floating_point or experts_TK.dtype == torch.bool:
        raise TypeError(f"experts must be integer ids, got {experts_TK.dtype}")
    if not (w1_EDF2.dtype == w2_EFD.dtype == x_TD.dtype):
        raise TypeError(f"dtype mismatch: x {x_TD.dtype}, w1 {w1_EDF2.dtype}, w2 {w2_EFD.dtype}")
    if weights_TK.dtype not in (x_TD.dtype, torch.float32):
        raise TypeError(f"weights must be {x_TD.dtype} or float32, got {weights_TK.dtype}")
    keep = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_TD, w1_EDF2, w2_EFD, weights_TK)
    )
    return torch.ops.moestack.triton_moe_experts(
        x_TD, w1_EDF2, w2_EFD, experts_TK, weights_TK, keep
    )[0]
