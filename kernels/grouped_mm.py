"""The experts' grouped matmul in plain torch, and its custom ops ``moestack::grouped_mm``
and ``moestack::grouped_mm_wgrad`` (the layer's ``impl=torch`` path).

``grouped_mm_torch`` is ``torch._grouped_mm`` wherever the device and dtype allow (odd
widths padded with zeros to its 16-byte rows), else a loop over the sorted groups. Under
torch.compile it is the custom op ``moestack::grouped_mm`` (opaque to dynamo, with a fake
implementation and an autograd formula whose weight gradient is ``moestack::grouped_mm_wgrad``),
so the graph neither breaks at the loop's ``tolist`` nor fails in ``torch._grouped_mm``'s
bf16-only fake check. The Triton kernels' ops are in :mod:`moestack.kernels.gemm` and
:mod:`moestack.kernels.moe`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestack.kernels.tuning import grouped_mm_runs


def _grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs on ``x``'s device and dtype at all
    (:func:`moestack.kernels.tuning.grouped_mm_runs`, torch only); its other need, 16-byte
    rows, ``_padded_grouped_mm`` meets."""
    return grouped_mm_runs(x.device, x.dtype)


def _aligned(size: int, x: torch.Tensor) -> int:
    """``size`` rounded up to a whole number of 16-byte rows of ``x``'s dtype."""
    per_row = 16 // x.element_size()
    return -(-size // per_row) * per_row


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` with zero columns appended up to ``size`` in its last dim (``t`` if already)."""
    return t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1]))


def _padded_grouped_mm(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """torch._grouped_mm with K and M padded with zeros to 16-byte rows (rank-1 adapters, odd
    widths): zero columns of x meet zero rows of w and add exact zeros, and the zero columns
    of w give output columns that are sliced off, so the result is the unpadded product."""
    k, m = w_EKM.shape[1:]
    k_pad, m_pad = _aligned(k, x_NK), _aligned(m, x_NK)
    x_NK = _pad_last(x_NK, k_pad).contiguous()
    if (k_pad, m_pad) != (k, m):
        w_EKM = F.pad(w_EKM, (0, m_pad - m, 0, k_pad - k))
    y_NM = torch._grouped_mm(x_NK, w_EKM, offs=offsets_E)
    return y_NM if m_pad == m else y_NM[:, :m]


def _grouped_mm_loop(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """One matmul per non-empty group: where torch._grouped_mm cannot run (float64, CUDA
    other than bf16 on sm90+)."""
    parts, start = [], 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            parts.append(x_NK[start:end] @ w_EKM[e])
        start = end
    return torch.cat(parts) if parts else x_NK.new_empty(x_NK.shape[0], w_EKM.shape[-1])


def grouped_mm_torch(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """y rows of group e = x rows of group e @ w[e]; plain torch, differentiable.

    ``torch._grouped_mm`` wherever the device and dtype allow (any widths: padded to its
    16-byte rows), else a loop over the groups. Under torch.compile it is the custom op
    ``moestack::grouped_mm`` (opaque to dynamo, with a fake implementation), so the graph
    neither breaks at the loop's ``tolist`` nor fails in ``torch._grouped_mm``'s bf16-only
    fake check; eager runs keep the code below."""
    if torch.compiler.is_compiling():
        return torch.ops.moestack.grouped_mm(x_NK, w_EKM, offsets_E)
    if x_NK.shape[0] > 0 and _grouped_mm_runs(x_NK):
        if _half_on_cpu(x_NK):  # each group's rows bucketed: the matmuls' shapes repeat
            dest_N, source_P, padded_E = _bucketed(offsets_E)
            y_PM = _padded_grouped_mm(_spread(x_NK, source_P), w_EKM, padded_E)
            return y_PM.index_select(0, dest_N)
        return _padded_grouped_mm(x_NK, w_EKM, offsets_E)
    return _grouped_mm_loop(x_NK, w_EKM, offsets_E)


def _half_on_cpu(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs ``x``'s groups as oneDNN matmuls that compile a kernel
    for every new shape (bf16 and fp16 on the CPU: about 1.3 ms each, a few hundred a step as
    the routing moves, half of a bf16 training step of the default model) with rows enough
    to have many sizes (1024: below, as in decoding, a call's groups take few sizes, which
    oneDNN's cache keeps, and the bucketing's 0.1 ms would cost more than it saves), so that
    each group's rows are padded with zeros to a bucketed count (``_bucketed``): the shapes
    repeat and the compiled kernels are reused. Zero rows add exact zeros to a weight
    gradient, and their outputs are dropped."""
    half = x.dtype in (torch.bfloat16, torch.float16)
    return x.device.type == "cpu" and half and x.shape[0] >= 1024


def _bucketed(offsets_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dest_N, source_P, padded_E)``: where each row moves, the row each padded row takes
    (N: a zero row) and the groups' new offsets, each group's rows rounded up to a multiple
    of 16 (an AMX tile's rows), or above 128 rows of an eighth of the power of two below (at
    most 1/8 more): eight sizes an octave, whatever the routing (about a hundred a matmul's
    kind, within oneDNN's cache of 1024 kernels)."""
    starts_E = F.pad(offsets_E[:-1], (1, 0)).long()
    rows_E = offsets_E.long() - starts_E
    octave_E = torch.floor(torch.log2(rows_E.clamp(min=1).double()))
    step_E = torch.pow(2, octave_E - 3).clamp(min=16).long()
    sizes_E = (rows_E + step_E - 1) // step_E * step_E
    padded_E = torch.cumsum(sizes_E, 0)
    shift_E = padded_E - sizes_E - starts_E  # each group's first new row minus its old
    n = int(offsets_E[-1]) if len(offsets_E) else 0
    dest_N = torch.arange(n) + torch.repeat_interleave(shift_E, rows_E)
    rows = int(padded_E[-1]) if len(padded_E) else 0
    source_P = torch.full((rows,), n, dtype=torch.long).index_copy_(0, dest_N, torch.arange(n))
    return dest_N, source_P, padded_E.to(offsets_E.dtype)


def _spread(t_NK: torch.Tensor, source_P: torch.Tensor) -> torch.Tensor:
    """The padded groups' rows: a gather from ``t`` and one zero row (autograd saves only the
    index: a scatter into zeros would keep ``t`` too, beside the padded copy the matmul
    saves)."""
    return F.pad(t_NK, (0, 0, 0, 1)).index_select(0, source_P)


@torch.library.custom_op("moestack::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """``grouped_mm_torch`` as one opaque op for torch.compile (eager inside; contiguous, as
    its fake says, where padding left a view)."""
    return grouped_mm_torch(x_NK, w_EKM, offsets_E).contiguous()


@_grouped_mm_op.register_fake
def _(x_NK: torch.Tensor, w_EKM: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return x_NK.new_empty(x_NK.shape[0], w_EKM.shape[-1])


@torch.library.custom_op("moestack::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(
    x_NK: torch.Tensor, dy_NM: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """dw[e] = x rows of group e ^T @ dy rows of group e: the weight gradient of grouped_mm.

    torch._grouped_mm's 2D x 2D form (groups along the reduced dim) where it runs, widths
    padded with zeros as in ``_padded_grouped_mm``; a group without rows gets zeros (forced:
    some GPUs' kernels leave them undefined). Else a loop over the groups."""
    k, m = x_NK.shape[1], dy_NM.shape[1]
    if x_NK.shape[0] > 0 and _grouped_mm_runs(x_NK):
        if _half_on_cpu(x_NK):  # reduced over bucketed rows: the shapes repeat
            _, source_P, offsets_E = _bucketed(offsets_E)
            x_NK, dy_NM = _spread(x_NK, source_P), _spread(dy_NM, source_P)
        x_NK = _pad_last(x_NK, _aligned(k, x_NK)).contiguous()
        dy_NM = _pad_last(dy_NM, _aligned(m, dy_NM)).contiguous()
        dw_EKM = torch._grouped_mm(x_NK.t(), dy_NM, offs=offsets_E)[:, :k, :m]
        starts_E = F.pad(offsets_E[:-1], (1, 0))
        empty_E11 = (offsets_E == starts_E).view(-1, 1, 1)
        return torch.where(empty_E11, 0, dw_EKM)  # also a fresh tensor: no view of the pad
    return _grouped_mm_wgrad_loop(x_NK, dy_NM, offsets_E)


def _grouped_mm_wgrad_loop(
    x_NK: torch.Tensor, dy_NM: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """``grouped_mm_wgrad`` one group at a time (where torch._grouped_mm cannot run)."""
    dw_EKM = x_NK.new_zeros(offsets_E.shape[0], x_NK.shape[1], dy_NM.shape[1])
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            dw_EKM[e] = x_NK[start:end].t() @ dy_NM[start:end]
        start = end
    return dw_EKM


@_grouped_mm_wgrad_op.register_fake
def _(x_NK: torch.Tensor, dy_NM: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return x_NK.new_empty(offsets_E.shape[0], x_NK.shape[1], dy_NM.shape[1])


def _grouped_mm_setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    x_NK, w_EKM, offsets_E = inputs
    ctx.save_for_backward(x_NK, w_EKM, offsets_E)


def _grouped_mm_backward(ctx, dy_NM):  # noqa: ANN001, ANN202
    x_NK, w_EKM, offsets_E = ctx.saved_tensors
    dy_NM = dy_NM.contiguous()
    dx_NK = torch.ops.moestack.grouped_mm(dy_NM, w_EKM.transpose(1, 2).contiguous(), offsets_E)
    dw_EKM = torch.ops.moestack.grouped_mm_wgrad(x_NK, dy_NM, offsets_E)
    return dx_NK, dw_EKM, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)
