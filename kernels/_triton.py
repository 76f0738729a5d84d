"""Triton kernels for the grouped GEMM and the fused MoE experts.

This module imports triton at the top and is itself imported lazily, at the first kernel
call (see ``kernels/_launch.py``). Two reasons: ``moestack.kernels`` must import on machines
without triton, and triton decides between the compiler and the interpreter when a kernel
is *decorated* (``TRITON_INTERPRET`` is read by ``@triton.jit``), so decorating late lets a
test suite set that variable any time before the first call.

Conventions used by every kernel:
- Rows of an expert's group are contiguous in the *sorted* order: rows ``[offsets[e-1],
  offsets[e])`` belong to expert ``e`` (``offsets`` holds int32 cumulative ends).
- Row indices are widened to int64 before they are multiplied by a stride, so tensors with
  more than 2**31 elements are addressed correctly.
- Accumulation is in float32; results are rounded to the output dtype once, on store.
- Every tile that is inside the output is stored, including all-zero tiles of experts with
  no rows (the weight-gradient kernel writes zeros for them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _locate_tile(
    pid,
    offsets_ptr,
    E,
    num_n,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Map a flat program id to (expert, row tile, column tile) over variable-sized groups.

    Each expert owns ``cdiv(rows_e, BLOCK_M) * num_n`` consecutive program ids; inside an
    expert, tiles are swizzled in groups of GROUP_M row tiles so that neighbouring programs
    share both the rows of x and the columns of W[e] in L2. Programs past the last tile get
    ``valid == False``; the grid is an upper bound, so the host never has to read offsets.
    """
    e_idx = tl.arange(0, BLOCK_E)
    e_mask = e_idx < E
    ends = tl.load(offsets_ptr + e_idx, mask=e_mask, other=0)
    starts = tl.load(offsets_ptr + e_idx - 1, mask=e_mask & (e_idx > 0), other=0)
    m_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles = m_tiles * num_n
    cum = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    expert = tl.sum((cum <= pid).to(tl.int32), 0)
    sel = e_idx == expert
    tile_start = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    row_start = tl.sum(tl.where(sel, starts, 0), 0)
    row_end = tl.sum(tl.where(sel, ends, 0), 0)
    num_m = tl.sum(tl.where(sel, m_tiles, 0), 0)

    local = pid - tile_start
    tiles_per_group = GROUP_M * num_n
    first_m = (local // tiles_per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    group_size = tl.maximum(group_size, 1)
    pid_m = first_m + (local % tiles_per_group) % group_size
    pid_n = (local % tiles_per_group) // group_size
    valid = pid < total
    return expert, pid_m, pid_n, row_start, row_end, valid


@triton.jit
def grouped_mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    z_ptr,
    offsets_ptr,
    a_rows_ptr,
    c_rows_ptr,
    scale_ptr,
    E,
    K,
    M,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_zm,
    stride_zn,
    dz_ptr,
    dscale_part_ptr,
    stride_dzm,
    stride_dzn,
    stride_pm,
    GATHER_A: tl.constexpr,
    SCATTER_C: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SWIGLU: tl.constexpr,
    STORE_Z: tl.constexpr,
    DSWIGLU: tl.constexpr,
    STORE_H: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """C[c_row(r)] = scale[r] * A[a_row(r)] @ B[e(r)] for every sorted row r.

    A: [*, K] (rows read through ``a_rows`` when GATHER_A), B: [E, K, M] with any strides
    (a transposed view gives A @ B^T), C: [*, M] (rows written through ``c_rows`` when
    SCATTER_C), ``scale`` a per-sorted-row float (HAS_SCALE).
    SWIGLU: B is [E, K, 2M]; the tile computes gate = A @ B[:, :M] and up = A @ B[:, M:]
    together and stores C = silu(gate) * up (and the pre-activations into Z when STORE_Z).
    The gate/up values are rounded to the storage dtype before the activation, so the
    backward pass, which recomputes the activation from Z, sees the same numbers.
    DSWIGLU (the backward's G = dy @ W2^T, neither gathered nor scattered): the epilogue
    runs ``swiglu_bwd_kernel``'s math on the tile of G (rounded to C's dtype first, as the
    unfused path stores it) with the tile's columns of Z = [gate | up] ([*, 2M]) and the
    row's ``scale``: dZ = [scale * G * up * silu'(gate) | scale * G * silu(gate)] into
    ``dz``, scale * h into C (STORE_H), and <G, h> over the tile's columns into
    ``dscale_part[row, pid_n]`` (fp32; the host sums a row's partials: no atomics, the same
    sum every run). A program owns its rows x columns of both halves of Z, so dZ may be Z's
    memory: every element is read before it is written, by the same program.
    EVEN_K (BLOCK_K divides K, decided on the host): the main loop's loads carry no mask
    along K, only the row and column masks.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(M, BLOCK_N)
    expert, pid_m, pid_n, row_start, row_end, valid = _locate_tile(
        pid, offsets_ptr, E, num_n, BLOCK_M, BLOCK_E, GROUP_M
    )
    # Programs past the last tile run no loop iteration and store nothing (masked rather
    # than an early `return`, which keeps the control flow structured; both pipeline).
    k_end = tl.where(valid, K, 0)
    row_end = tl.where(valid, row_end, 0)

    offs_m = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < row_end
    if GATHER_A:
        a_rows = tl.load(a_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        a_rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < M
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    b_ptrs = b_base + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SWIGLU:
        b2_ptrs = b_ptrs + M * stride_bn
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a_mask = m_mask[:, None]
            b_mask = n_mask[None, :]
        else:
            k_mask = offs_k < K - k0
            a_mask = m_mask[:, None] & k_mask[None, :]
            b_mask = k_mask[:, None] & n_mask[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            b2 = tl.load(b2_ptrs, mask=b_mask, other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PRECISION)
            b2_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SCATTER_C:
        c_rows = tl.load(c_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        c_rows = offs_m.to(tl.int64)
    c_mask = m_mask[:, None] & n_mask[None, :]
    out_ty = c_ptr.dtype.element_ty
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if DSWIGLU:
        _dswiglu_epilogue(
            acc.to(out_ty).to(tl.float32), z_ptr, dz_ptr, c_ptrs, scale_ptr, dscale_part_ptr,
            c_rows, offs_m, offs_n, m_mask, c_mask, pid_n, M, stride_zm, stride_zn,
            stride_dzm, stride_dzn, stride_pm, STORE_H,
        )  # fmt: skip
    else:
        _forward_epilogue(
            acc, acc2 if SWIGLU else acc, z_ptr, c_ptrs, scale_ptr, c_rows, offs_m, offs_n,
            m_mask, c_mask, M, stride_zm, stride_zn, HAS_SCALE, SWIGLU, STORE_Z,
        )  # fmt: skip


@triton.jit
def _forward_epilogue(
    acc,
    acc2,
    z_ptr,
    c_ptrs,
    scale_ptr,
    c_rows,
    offs_m,
    offs_n,
    m_mask,
    c_mask,
    M,
    stride_zm,
    stride_zn,
    HAS_SCALE: tl.constexpr,
    SWIGLU: tl.constexpr,
    STORE_Z: tl.constexpr,
):
    """Store one tile of C (silu(gate) * up with SWIGLU, and Z when STORE_Z), each row
    times its ``scale`` when HAS_SCALE."""
    out_ty = c_ptrs.dtype.element_ty
    if SWIGLU:
        gate = acc.to(out_ty)
        up = acc2.to(out_ty)
        if STORE_Z:
            z_ptrs = z_ptr + c_rows[:, None] * stride_zm + offs_n[None, :] * stride_zn
            tl.store(z_ptrs, gate, mask=c_mask)
            tl.store(z_ptrs + M * stride_zn, up, mask=c_mask)
        gate_f = gate.to(tl.float32)
        out = gate_f * tl.sigmoid(gate_f) * up.to(tl.float32)
    else:
        out = acc
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
        out = out * scale[:, None]
    tl.store(c_ptrs, out.to(out_ty), mask=c_mask)


@triton.jit
def _dswiglu_epilogue(
    grad,
    z_ptr,
    dz_ptr,
    h_ptrs,
    scale_ptr,
    part_ptr,
    rows,
    offs_m,
    offs_n,
    m_mask,
    mask,
    pid_n,
    F,
    stride_zm,
    stride_zn,
    stride_dzm,
    stride_dzn,
    stride_pm,
    STORE_H: tl.constexpr,
):
    """``swiglu_bwd_kernel``'s math on one [rows, columns] tile of G (fp32 ``grad``): dZ for
    the tile's gate and up columns, scale * h (STORE_H) and the partial <G, h> of each row
    over these columns into ``part[row, pid_n]``."""
    z_ptrs = z_ptr + rows[:, None] * stride_zm + offs_n[None, :] * stride_zn
    gate = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(z_ptrs + F * stride_zn, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + offs_m, mask=m_mask, other=0.0).to(tl.float32)
    tl.debug_barrier()  # every load of the tile before any store (dZ over Z in place)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    tl.store(part_ptr + offs_m.to(tl.int64) * stride_pm + pid_n, tl.sum(grad * h, 1), mask=m_mask)
    dh = grad * scale[:, None]
    d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dh * silu
    dz_ptrs = dz_ptr + rows[:, None] * stride_dzm + offs_n[None, :] * stride_dzn
    tl.store(dz_ptrs, d_gate.to(dz_ptr.dtype.element_ty), mask=mask)
    tl.store(dz_ptrs + F * stride_dzn, d_up.to(dz_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        hw = h * scale[:, None]
        tl.store(h_ptrs, hw.to(h_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _wgrad_rows(
    acc,
    a_ptr,
    b_ptr,
    a_rows_ptr,
    b_rows_ptr,
    rows,
    row_end,
    offs_k,
    offs_n,
    k_mask,
    n_mask,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    EVEN_KM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc += A[rows]^T @ B[rows] for one block of sorted rows; the tile loads carry the row
    mask only where MASK_ROWS (the last, partial block of an expert), the K/M masks only
    unless EVEN_KM. The row index of a gathered operand is a few ints: always masked."""
    r_mask = rows < row_end
    if GATHER_A:
        a_rows = tl.load(a_rows_ptr + rows, mask=r_mask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    if GATHER_B:
        b_rows = tl.load(b_rows_ptr + rows, mask=r_mask, other=0).to(tl.int64)
    else:
        b_rows = rows.to(tl.int64)
    a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak
    b_ptrs = b_ptr + b_rows[:, None] * stride_bm + offs_n[None, :] * stride_bn
    if MASK_ROWS:
        if EVEN_KM:
            a = tl.load(a_ptrs, mask=r_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=r_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    elif EVEN_KM:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=k_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def grouped_wgrad_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    offsets_ptr,
    a_rows_ptr,
    b_rows_ptr,
    K,
    M,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_ce,
    stride_ck,
    stride_cn,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    EVEN_KM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[e] = A_e^T @ B_e over the sorted rows of expert e; C is [E, K, M].

    Grid: (tiles of the [K, M] output, E). BLOCK_M x BLOCK_N is the output tile (over K and
    M), BLOCK_K the chunk of rows reduced per step. A rows are read through ``a_rows``
    (GATHER_A) and B rows through ``b_rows`` (GATHER_B); the MoE backward passes contiguous
    operands (rows gathered once beforehand), the gathered forms stay for other callers.
    Both operands go to the matrix unit as loaded (a per-row scale belongs in the producer
    of A, see swiglu_bwd_kernel). The main loop runs over an expert's whole blocks of
    BLOCK_K rows without a row mask; its last, partial block runs once after it, masked.
    EVEN_KM (BLOCK_M divides K and BLOCK_N divides M, decided on the host): the loads carry
    no K/M mask either, so the main loop's loads are mask-free.
    An expert without rows stores a zero tile, so the gradient is always fully written.
    """
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    num_k = tl.cdiv(K, BLOCK_M)
    num_n = tl.cdiv(M, BLOCK_N)
    tiles_per_group = GROUP_M * num_n
    first_k = (pid // tiles_per_group) * GROUP_M
    group_size = tl.maximum(tl.minimum(num_k - first_k, GROUP_M), 1)
    pid_k = first_k + (pid % tiles_per_group) % group_size
    pid_n = (pid % tiles_per_group) // group_size

    prev = tl.load(offsets_ptr + tl.maximum(expert - 1, 0))
    row_start = tl.where(expert > 0, prev, 0)
    row_end = tl.load(offsets_ptr + expert)
    full_end = row_start + ((row_end - row_start) // BLOCK_K) * BLOCK_K

    offs_k = pid_k * BLOCK_M + tl.arange(0, BLOCK_M)
    k_mask = offs_k < K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < M
    offs_r = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, full_end, BLOCK_K):
        acc = _wgrad_rows(
            acc, a_ptr, b_ptr, a_rows_ptr, b_rows_ptr, r0 + offs_r, row_end,
            offs_k, offs_n, k_mask, n_mask, stride_am, stride_ak, stride_bm, stride_bn,
            GATHER_A, GATHER_B, False, EVEN_KM, DOT_PRECISION,
        )  # fmt: skip
    if full_end < row_end:
        acc = _wgrad_rows(
            acc, a_ptr, b_ptr, a_rows_ptr, b_rows_ptr, full_end + offs_r, row_end,
            offs_k, offs_n, k_mask, n_mask, stride_am, stride_ak, stride_bm, stride_bn,
            GATHER_A, GATHER_B, True, EVEN_KM, DOT_PRECISION,
        )  # fmt: skip

    c_ptrs = (
        c_ptr
        + expert.to(tl.int64) * stride_ce
        + offs_k[:, None].to(tl.int64) * stride_ck
        + offs_n[None, :] * stride_cn
    )
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


@triton.jit
def swiglu_bwd_kernel(
    z_ptr,
    g_ptr,
    scale_ptr,
    dz_ptr,
    h_ptr,
    dscale_ptr,
    F,
    stride_zm,
    stride_gm,
    stride_dzm,
    stride_hm,
    STORE_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Backward of ``y_r = scale_r * (silu(gate_r) * up_r) @ W2`` given ``G_r = dy_r @ W2^T``.

    One program per sorted row r. Recomputes h = silu(gate) * up from the saved
    pre-activations Z = [gate | up], and writes
    dZ = [scale * G * up * silu'(gate) | scale * G * silu(gate)],
    dscale_r = <G_r, h_r> (the router-weight gradient, in fp32), and, when STORE_H, the
    router-weighted activation scale * h: the weight gradient of W2 is
    sum_r (scale_r h_r)^T dy_r, so its GEMM then needs no scaling in its main loop. Rows of
    Z, G, dZ and h are contiguous (inner stride 1): moe.py allocates all of them.

    In place: dZ may be Z's memory and h G's (moe.py passes them so, to keep the backward's
    peak down). Every element is read before it is written, by the same program; the barrier
    between each block's loads and its stores keeps the compiler and the threads from
    reordering a store ahead of a load of the same address.
    """
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr + row).to(tl.float32)
    z_row = z_ptr + row * stride_zm
    dz_row = dz_ptr + row * stride_dzm
    g_row = g_ptr + row * stride_gm
    dot = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offs = f0 + tl.arange(0, BLOCK_F)
        mask = offs < F
        gate = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(z_row + F + offs, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every load of this block before any store (in-place calls)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        h = silu * up
        dot += grad * h
        dh = grad * scale
        d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = dh * silu
        tl.store(dz_row + offs, d_gate.to(dz_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_row + F + offs, d_up.to(dz_ptr.dtype.element_ty), mask=mask)
        if STORE_H:
            hw = h * scale
            tl.store(h_ptr + row * stride_hm + offs, hw.to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(dscale_ptr + row, tl.sum(dot, 0))
