"""A persistent grouped GEMM: about one program per SM walks an exact tile list.

``out[c_row(r)] = scale[r] * a[a_row(r)] @ b[e(r)]`` for the sorted rows r, as
``_triton.grouped_mm_kernel`` computes it (without its SwiGLU epilogue), but scheduled
differently: the row tiles come from a table built once per call (``kernels/_tiles.py``),
and a grid of ``min(programs, tiles)`` programs walks the output tiles ``pid, pid + P, ...``
instead of one program per tile of an oversized grid searching the expert offsets.

Operands that are neither gathered nor oddly strided are read through host-side tensor
descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``: TMA on Hopper and later).
Host-side descriptors need no ``triton.set_allocator`` (only descriptors made inside a
kernel need device scratch), so this module sets no global triton state. Each operand is
read through descriptors or pointers by a compile-time switch, chosen on the host from
capabilities (``descriptor_layout``, ``tma_supported``), never by catching a failure:
- ``a`` [R, K]: a descriptor over its ``rows`` rows. A row tile may run past its expert's
  last row into the next expert's rows (in bounds, so the hardware does not zero them).
  That is harmless: output row i depends on input row i only, and the rows past the expert
  are never stored. So no per-expert descriptor is needed (a descriptor made per tile inside
  the kernel costs a global write and a fence each). Rows past R and columns past K are
  zero-filled by the hardware.
- ``b`` [E, K, N]: a rank-3 descriptor, one expert per box (block ``[1, BK, BN]``), so the
  K edge is zero-filled per expert instead of reading the next expert's first rows. A
  transposed view (``b.stride(1) == 1``, e.g. ``W^T`` in the backward) is read as the
  [E, N, K] tensor it views and transposed in registers.
- ``out``: always through pointers, masked to the expert's rows: a descriptor store would
  write whole tiles over the next expert's rows, which another program owns.

Triton is imported at the top: this module, like ``_triton``, is imported at the first
launch, after a test suite had its chance to set ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from typing import Any

import torch
import triton
import triton.language as tl

from . import tuning
from ._guards import refuse_unlaunchable
from ._tiles import TileTable, capacity, tile_table
from .tuned_table import KernelConfig

# Programs of the grid under the interpreter when none are asked for: few, so that each
# walks several tiles (the interpreter pays per program and per tile alike).
INTERPRET_PROGRAMS = 4
# The largest box side a TMA descriptor takes.
_MAX_BOX = 256


@triton.jit
def persistent_grouped_mm_kernel(
    a,
    b,
    c_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_count_ptr,
    a_rows_ptr,
    c_rows_ptr,
    scale_ptr,
    K,
    N,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    A_DESC: tl.constexpr,
    B_DESC: tl.constexpr,
    B_TRANS: tl.constexpr,
    GATHER_A: tl.constexpr,
    SCATTER_C: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[c_row(r)] = scale[r] * A[a_row(r)] @ B[e(r)], one output tile per loop turn.

    ``a`` and ``b`` are pointers, or tensor descriptors where A_DESC / B_DESC (see the
    module docstring for their shapes; B_TRANS: ``b`` describes [E, N, K]). The strides of
    an operand read through a descriptor are not used. The tile list is row tile (from the
    table, ``tile_count`` valid entries) x column tile, swizzled in groups of GROUP_M row
    tiles so that programs running side by side share rows of A and columns of B in L2.
    EVEN_K: K is a multiple of BLOCK_K, so the pointer loads of A need no mask at all
    (rows past the expert are clamped to its last row, see below).
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.load(tile_count_ptr)
    total = num_m * num_n
    tiles_per_group = GROUP_M * num_n
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, BLOCK_K)
    out_ty = c_ptr.dtype.element_ty
    for tile_id in range(pid, total, num_programs):
        first_m = (tile_id // tiles_per_group) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile_id % tiles_per_group) % group_size
        pid_n = (tile_id % tiles_per_group) // group_size
        expert = tl.load(tile_expert_ptr + pid_m)
        row_start = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(offsets_ptr + expert)
        offs_m = row_start + arange_m
        m_mask = offs_m < row_end
        n0 = pid_n * BLOCK_N
        offs_n = n0 + arange_n
        n_mask = offs_n < N
        # Rows past the expert's end read its last row instead (their results are never
        # stored), so the pointer loads of A need no row mask. (Columns keep their mask:
        # clamped column offsets would hide B's contiguity from the vectorizer.)
        safe_m = tl.minimum(offs_m, row_end - 1)
        a_rows = tl.load(a_rows_ptr + safe_m).to(tl.int64) if GATHER_A else safe_m.to(tl.int64)
        b_off = expert.to(tl.int64) * stride_be

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + arange_k
            k_mask = offs_k < K
            if A_DESC:
                a_tile = a.load([row_start, k0])
            else:
                a_ptrs = a + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
                if EVEN_K:
                    a_tile = tl.load(a_ptrs)
                else:
                    a_tile = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            if B_DESC:
                if B_TRANS:
                    b_nk = tl.reshape(b.load([expert, n0, k0]), [BLOCK_N, BLOCK_K])
                    b_tile = tl.trans(b_nk)
                else:
                    b_tile = tl.reshape(b.load([expert, k0, n0]), [BLOCK_K, BLOCK_N])
            else:
                b_ptrs = (
                    b
                    + b_off
                    + offs_k[:, None] * stride_bk
                    + offs_n[None, :].to(tl.int64) * stride_bn
                )
                if EVEN_K:
                    b_tile = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
                else:
                    b_tile = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a_tile, b_tile, acc, input_precision=DOT_PRECISION)

        if SCATTER_C:
            c_rows = tl.load(c_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        else:
            c_rows = offs_m.to(tl.int64)
        out = acc
        if HAS_SCALE:
            scale = tl.load(scale_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
            out = out * scale[:, None]
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, out.to(out_ty), mask=m_mask[:, None] & n_mask[None, :])


def interpreted() -> bool:
    """True when the kernel was decorated under ``TRITON_INTERPRET=1`` (it runs on CPU)."""
    return type(persistent_grouped_mm_kernel).__name__ == "InterpretedFunction"


@functools.cache
def descriptors_available() -> bool:
    """This triton has host-side tensor descriptors and the stable descriptor API (both
    since triton 3.4; 3.3 had them only as ``_experimental_*``)."""
    has_host = importlib.util.find_spec("triton.tools.tensor_descriptor") is not None
    return has_host and hasattr(tl, "make_tensor_descriptor")


def _device_has_tma(t: torch.Tensor) -> bool:
    """The interpreter, or a CUDA (not ROCm) GPU of compute capability 9.0 or above."""
    if interpreted():
        return True
    if not t.is_cuda or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def descriptor_layout(t: torch.Tensor) -> str | None:
    """How a descriptor can read ``t`` (rank 2 or 3) as it lies in memory, or None.

    "rows": unit stride in the last dim; "cols": unit stride in the second-to-last (a
    transposed view, read as the tensor it views). Either way the base address and every
    other stride must be multiples of 16 bytes, as TMA requires. Only the layout: whether
    triton and the device have descriptors at all is ``tma_supported``.
    """
    if t.dim() not in (2, 3) or t.numel() == 0 or t.data_ptr() % 16:
        return None
    size = 1 if _interpreter_counts_elements() else t.element_size()
    strides = t.stride()
    for layout, unit in (("rows", t.dim() - 1), ("cols", t.dim() - 2)):
        others = [s for i, s in enumerate(strides) if i != unit]
        if strides[unit] == 1 and all((s * size) % 16 == 0 for s in others):
            return layout
    return None


@functools.cache
def _interpreter_counts_elements() -> bool:
    """The interpreter of triton < 3.6 checks a descriptor's strides as multiples of 16
    *elements* (compiled launches, and later interpreters, of 16 bytes): stricter, so the
    layout check follows it there."""
    if not interpreted():
        return False
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) < (3, 6)


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Descriptors can read every tensor given: triton has them (>= 3.4), the device has
    TMA (compute capability >= 9, or the interpreter) and each tensor has a
    ``descriptor_layout``. Checked on the host, from shapes and addresses only."""
    if not descriptors_available():
        return False
    return all(_device_has_tma(t) and descriptor_layout(t) is not None for t in tensors)


def _box_fits(outer: int, inner: int, elem_bytes: int) -> bool:
    """A TMA box takes at most 256 elements a side, and its inner side whole 16 bytes."""
    return outer <= _MAX_BOX and inner <= _MAX_BOX and (inner * elem_bytes) % 16 == 0


def _host_descriptor(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, shape, strides, block)


def default_config(K: int, N: int, dtype: torch.dtype) -> KernelConfig:
    """The tile when none is given: the interpreter's fixed one, else the first GEMM
    candidate fitted to the problem (``tuning.fit``)."""
    if interpreted():
        return tuning.INTERPRET_CONFIG
    return tuning.fit(tuning.CANDIDATES["mm"][0], "mm", K, N, dtype)


def default_programs(device: torch.device) -> int:
    """One program per SM on a GPU; ``INTERPRET_PROGRAMS`` under the interpreter."""
    if interpreted() or device.type != "cuda":
        return INTERPRET_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(
    a: torch.Tensor, b_EKN: torch.Tensor, out: torch.Tensor, rows: int, gather: bool, scatter: bool
) -> None:
    if a.dtype != b_EKN.dtype:
        raise TypeError(f"dtype mismatch: {a.dtype} activations with {b_EKN.dtype} weights")
    if a.dim() != 2 or b_EKN.dim() != 3 or out.dim() != 2:
        raise ValueError(
            f"shapes must be a [R, K], b [E, K, N], out [R, N]; got {tuple(a.shape)}, "
            f"{tuple(b_EKN.shape)}, {tuple(out.shape)}"
        )
    if a.shape[1] != b_EKN.shape[1] or out.shape[1] != b_EKN.shape[2]:
        raise ValueError(
            f"a is [*, {a.shape[1]}] and out [*, {out.shape[1]}] but b is "
            f"{tuple(b_EKN.shape)}: K and N must match"
        )
    if rows < 0:
        raise ValueError(f"rows = {rows} must be >= 0")
    if (not gather and rows > a.shape[0]) or (not scatter and rows > out.shape[0]):
        raise ValueError(
            f"rows = {rows} but a has {a.shape[0]} and out {out.shape[0]} rows; without "
            "a_rows / c_rows, row r of the sorted order is row r of a and of out"
        )
    refuse_unlaunchable((a, b_EKN, out), interpreted())


def persistent_grouped_mm(
    a: torch.Tensor,
    b_EKN: torch.Tensor,
    offsets_E: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    *,
    a_rows: torch.Tensor | None = None,
    c_rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    cfg: KernelConfig | None = None,
    num_programs: int | None = None,
    tiles: TileTable | None = None,
    use_tma: bool | None = None,
    precision: str | None = None,
) -> TileTable | None:
    """out[c_rows[r]] = scale[r] * a[a_rows[r]] @ b[e(r)] for the ``rows`` sorted rows.

    The arguments mean what they mean for ``_launch.grouped_mm`` (``b_EKN`` any strided
    view, ``offsets_E`` int32 cumulative row ends); in addition:
    ``cfg`` the tile (default ``default_config``), ``num_programs`` the grid's program
    count before clipping to the tile bound (default ``default_programs``), ``tiles`` a
    table to reuse (used when cut with ``cfg.block_m``, else a new one is built),
    ``use_tma`` None to read every operand it can through descriptors, False for pointers
    only, True to insist that every operand not gathered is read through one (ValueError
    naming what is missing otherwise), and ``precision`` the
    ``tl.dot`` input precision of float32 inputs (default "ieee").
    Returns the tile table used (None when there are no rows), for the next GEMM.
    """
    _check(a, b_EKN, out, rows, a_rows is not None, c_rows is not None)
    if rows == 0:
        return None
    E, K, N = b_EKN.shape
    cfg = cfg if cfg is not None else default_config(K, N, a.dtype)
    if tiles is None or tiles.block_m != cfg.block_m:
        tiles = tile_table(offsets_E, rows, cfg.block_m)
    programs = num_programs if num_programs is not None else default_programs(a.device)
    if programs < 1:
        raise ValueError(f"num_programs = {programs} must be >= 1")

    a_arg, b_arg, how = _operands(a, b_EKN, rows, a_rows, cfg, use_tma)
    grid = (max(1, min(programs, capacity(rows, E, cfg.block_m) * -(-N // cfg.block_n))),)
    _launch_kernel(grid, a, a_arg, b_arg, b_EKN, out, offsets_E, tiles, cfg, how, precision,
                   a_rows=a_rows, c_rows=c_rows, scale=scale)  # fmt: skip
    return tiles


def _launch_kernel(
    grid: tuple[int],
    a: torch.Tensor,
    a_arg: Any,
    b_arg: Any,
    b_EKN: torch.Tensor,
    out: torch.Tensor,
    offsets_E: torch.Tensor,
    tiles: TileTable,
    cfg: KernelConfig,
    how: _Reads,
    precision: str | None,
    *,
    a_rows: torch.Tensor | None,
    c_rows: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> None:
    """One launch of the persistent kernel on ``grid`` programs, on a's device: the operands
    as ``_operands`` prepared them (``a_arg``, ``b_arg``, read as ``how`` says), the tile
    table ``tiles`` cut with ``cfg.block_m``; arguments as ``persistent_grouped_mm``'s."""
    K, N = b_EKN.shape[1], b_EKN.shape[2]
    dummy = offsets_E
    on_device = torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext()
    with on_device:
        persistent_grouped_mm_kernel[grid](
            a_arg,
            b_arg,
            out,
            offsets_E,
            tiles.expert_T,
            tiles.row_start_T,
            tiles.count,
            a_rows if a_rows is not None else dummy,
            c_rows if c_rows is not None else dummy,
            scale if scale is not None else dummy,
            K,
            N,
            a.stride(0),
            a.stride(1),
            *b_EKN.stride(),
            out.stride(0),
            out.stride(1),
            A_DESC=how.a_desc,
            B_DESC=how.b_desc,
            B_TRANS=how.b_trans,
            GATHER_A=a_rows is not None,
            SCATTER_C=c_rows is not None,
            HAS_SCALE=scale is not None,
            EVEN_K=K % cfg.block_k == 0,
            DOT_PRECISION=precision or ("ieee" if a.dtype == torch.float32 else "tf32"),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )


@dataclasses.dataclass(frozen=True)
class _Reads:
    """How the kernel reads its operands: through descriptors or pointers."""

    a_desc: bool  # a (not gathered) through a descriptor
    b_desc: bool  # b through a descriptor
    b_trans: bool  # ... of the [E, N, K] tensor b is a transposed view of


def _operands(
    a: torch.Tensor,
    b_EKN: torch.Tensor,
    rows: int,
    a_rows: torch.Tensor | None,
    cfg: KernelConfig,
    use_tma: bool | None,
) -> tuple[object, object, _Reads]:
    """The kernel's a and b arguments (host descriptors where they can read the operand,
    the tensors otherwise) and how it reads them; ``use_tma`` as ``persistent_grouped_mm``."""
    E, K, N = b_EKN.shape
    a_view = a[:rows] if a_rows is None else a
    a_desc = a_rows is None and tma_supported(a_view) and descriptor_layout(a_view) == "rows"
    a_desc = a_desc and _box_fits(cfg.block_m, cfg.block_k, a.element_size())
    b_layout = descriptor_layout(b_EKN) if tma_supported(b_EKN) else None
    b_box = (cfg.block_k, cfg.block_n) if b_layout == "rows" else (cfg.block_n, cfg.block_k)
    b_desc = b_layout is not None and _box_fits(*b_box, a.element_size())
    if use_tma is False:
        a_desc = b_desc = False
    elif use_tma is True and not (b_desc and (a_desc or a_rows is not None)):
        raise ValueError(
            f"use_tma=True but descriptors cannot read these operands (triton "
            f"{triton.__version__} has them: {descriptors_available()}; a {a.dtype} "
            f"strides {a.stride()}, gathered: {a_rows is not None}; b strides "
            f"{b_EKN.stride()}; tile {cfg}); use use_tma=None to fall back to pointers"
        )
    a_arg: object = a
    if a_desc:
        a_arg = _host_descriptor(
            a_view, [rows, K], [a_view.stride(0), 1], [cfg.block_m, cfg.block_k]
        )
    b_arg: object = b_EKN
    s_e, s_k, s_n = b_EKN.stride()
    if b_desc and b_layout == "rows":
        b_arg = _host_descriptor(b_EKN, [E, K, N], [s_e, s_k, 1], [1, cfg.block_k, cfg.block_n])
    elif b_desc:
        b_arg = _host_descriptor(b_EKN, [E, N, K], [s_e, s_n, 1], [1, cfg.block_n, cfg.block_k])
    return a_arg, b_arg, _Reads(a_desc, b_desc, b_desc and b_layout == "cols")
