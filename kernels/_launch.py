"""Host-side launchers for the Triton kernels: argument checks, config choice, grids.

triton is imported lazily here (first launch), so that ``import moestack.kernels`` works on
machines without triton and so that ``TRITON_INTERPRET`` is honoured if it is set any time
before the first kernel call.
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType

import torch

from . import tuning
from ._guards import refuse_unlaunchable
from ._tiles import TileTable, TileTables, tile_table
from .tuned_table import KernelConfig

_INSTALL_HINT = (
    "moestack.kernels needs triton (Linux, `pip install triton>=3.4`, installed with CUDA "
    "builds of torch). Use impl='torch' where triton is unavailable."
)


@functools.cache
def kernels() -> ModuleType:
    """The module of decorated Triton kernels, imported on first use."""
    try:
        from . import _triton
    except ImportError as exc:  # no triton on this machine (e.g. macOS)
        raise ImportError(_INSTALL_HINT) from exc
    return _triton


@functools.cache
def persistent_kernels() -> ModuleType:
    """The module of the persistent grouped GEMM, imported on first use."""
    try:
        from . import _persistent
    except ImportError as exc:  # no triton on this machine
        raise ImportError(_INSTALL_HINT) from exc
    return _persistent


def interpreted() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1`` (they run on CPU)."""
    return type(kernels().grouped_mm_kernel).__name__ == "InterpretedFunction"


def new_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate an output buffer that the kernels fully overwrite (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_tensors(*tensors: torch.Tensor) -> bool:
    """Validate devices and dtypes for a launch; returns whether the interpreter is used."""
    interp = interpreted()
    refuse_unlaunchable(tensors, interp)
    return interp


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on the tensor's GPU (triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs follow torch's matmul setting: IEEE unless TF32 is allowed.

    torch >= 2.9 has ``fp32_precision`` ("ieee", "tf32", or "none": not set, fall back to
    the legacy flag); reading the legacy ``allow_tf32`` raises once TF32 was set through
    the new API, so the new setting is read first. Where even the legacy read fails (the
    two APIs mixed), IEEE: the accurate choice. 16-bit inputs ignore the precision.
    """
    if dtype != torch.float32:
        return "tf32"
    matmul = torch.backends.cuda.matmul
    try:
        new = matmul.fp32_precision
    except AttributeError:  # torch < 2.9: only the legacy flag exists
        new = "none"
    if new in ("ieee", "tf32"):
        return new
    try:
        return "tf32" if matmul.allow_tf32 else "ieee"
    except RuntimeError:
        return "ieee"


def assert_expert_ids(experts: torch.Tensor, num_experts: int) -> None:
    """Fail unless every id in ``experts`` (non-empty) lies in [0, num_experts), without a
    host sync: on CUDA a device-side assertion (reported at a later synchronising call,
    and fatal to the CUDA context, as an out-of-range read would be), on the CPU a
    RuntimeError now. Ids >= E would leave output rows unwritten and negative ids would
    compute with expert 0, silently."""
    lo, hi = torch.aminmax(experts.reshape(-1))
    torch._assert_async(
        (lo >= 0) & (hi < num_experts),
        f"expert ids must lie in [0, {num_experts}); fix the router output or num_experts",
    )


def assert_offsets(offsets_E: torch.Tensor, rows: int) -> None:
    """Fail unless ``offsets_E`` (non-empty) are non-decreasing cumulative ends in [0, rows]
    ending at ``rows``, without a host sync (see ``assert_expert_ids``): offsets past the
    rows would read and write outside the tensors."""
    ok = (offsets_E[0] >= 0) & (offsets_E[-1] == rows)
    if offsets_E.numel() > 1:
        ok = ok & (offsets_E[1:] >= offsets_E[:-1]).all()
    torch._assert_async(
        ok, f"offsets must be non-decreasing row ends from 0 up to N = {rows}; fix the offsets"
    )


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_e(num_experts: int) -> int:
    """Expert lanes of the tile-locating prologue: at least 128, so that layers with 8, 64 or
    128 experts share one compiled kernel (BLOCK_E is a compile-time constant); a 128-wide
    cumsum per program costs nothing next to a tile's GEMM."""
    return max(_next_pow2(num_experts), 128)


def persistent_mm(
    a: torch.Tensor,
    b_EKM: torch.Tensor,
    offsets_E: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    *,
    cfg: KernelConfig,
    table: TileTable,
    a_rows: torch.Tensor | None,
    c_rows: torch.Tensor | None,
    scale: torch.Tensor | None,
    precision: str,
) -> None:
    """One launch of the persistent grouped GEMM with a persistent ``cfg`` and its tile
    ``table``: each operand is read through a tensor descriptor or pointers as the tensors
    and the device allow (``_persistent.tma_supported``), decided before the launch."""
    persistent_kernels().persistent_grouped_mm(
        a,
        b_EKM,
        offsets_E,
        out,
        rows,
        a_rows=a_rows,
        c_rows=c_rows,
        scale=scale,
        cfg=cfg,
        num_programs=cfg.num_programs or None,  # 0: one program per SM
        tiles=table,
        use_tma=None,
        precision=precision,
    )


def classic_mm(
    cfg: KernelConfig,
    a: torch.Tensor,
    b_EKM: torch.Tensor,
    offsets_E: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    M: int,
    *,
    a_rows: torch.Tensor | None = None,
    c_rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    apply_scale: bool = True,
    swiglu: bool = False,
    z: torch.Tensor | None = None,
    store_z: bool = False,
    dz: torch.Tensor | None = None,
    part: torch.Tensor | None = None,
    store_h: bool = False,
) -> None:
    """One launch of the classic ``grouped_mm_kernel`` (a program per output tile of an
    oversized grid) with ``cfg``: the one place its arguments are laid out. ``scale`` scales
    the rows where ``apply_scale``; with ``dz`` (and ``part``, the per-tile partials of
    <G, h>) the epilogue is the SwiGLU backward over ``z`` (``out`` then takes weight * h
    where ``store_h``); else ``z`` receives the pre-activations where ``store_z``."""
    E, K = b_EKM.shape[0], b_EKM.shape[1]
    grid = ((-(-rows // cfg.block_m) + E) * -(-M // cfg.block_n),)
    dummy = offsets_E
    z_arg = z if z is not None else out
    z_strides = z.stride() if z is not None else (0, 0)
    dswiglu = dz is not None
    dz_arg, part_arg = (dz, part) if dswiglu else (out, out)
    dz_strides = (dz.stride(0), dz.stride(1), part.stride(0)) if dswiglu else (0, 0, 0)
    kernels().grouped_mm_kernel[grid](
        a, b_EKM, out, z_arg, offsets_E,
        a_rows if a_rows is not None else dummy,
        c_rows if c_rows is not None else dummy,
        scale if scale is not None else dummy,
        E, K, M,
        a.stride(0), a.stride(1), b_EKM.stride(0), b_EKM.stride(1), b_EKM.stride(2),
        out.stride(0), out.stride(1), z_strides[0], z_strides[1],
        dz_arg, part_arg, *dz_strides,
        GATHER_A=a_rows is not None,
        SCATTER_C=c_rows is not None,
        HAS_SCALE=scale is not None and apply_scale,
        SWIGLU=swiglu,
        STORE_Z=store_z,
        DSWIGLU=dswiglu,
        STORE_H=store_h,
        EVEN_K=K % cfg.block_k == 0,
        DOT_PRECISION=_dot_precision(a.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        BLOCK_E=_block_e(E),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


def _tile_tables(tiles: TileTables | None, offsets_E: torch.Tensor, rows: int) -> TileTables:
    """``tiles`` checked against the GEMM's rows, or new (lazy) tables for them."""
    if tiles is None:
        return TileTables(offsets_E, rows)  # built at the first persistent launch
    if tiles.offsets_E is not offsets_E or tiles.rows != rows:
        raise ValueError(
            f"tiles were built for other rows ({tiles.rows} rows, offsets of shape "
            f"{tuple(tiles.offsets_E.shape)}) than this GEMM's {rows}; build TileTables from "
            "the offsets_E tensor and row count the GEMM is called with"
        )
    return tiles


def _mm_flags(
    b_EKM: torch.Tensor,
    a_rows: torch.Tensor | None,
    c_rows: torch.Tensor | None,
    scale: torch.Tensor | None,
    z: torch.Tensor | None,
) -> str:
    """The kernel variant of a grouped GEMM, part of its tuning key: which of the gather,
    scatter, scale and pre-activation operands it has, and whether the weight is a
    transposed view (its K dimension of unit stride: another best tile)."""
    transposed = b_EKM.stride(2) != 1 and b_EKM.stride(1) == 1  # e.g. W^T in backward
    return (
        f"g{int(a_rows is not None)}s{int(c_rows is not None)}"
        f"c{int(scale is not None)}z{int(z is not None)}t{int(transposed)}"
    )


def grouped_mm(
    a: torch.Tensor,
    b_EKM: torch.Tensor,
    offsets_E: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    *,
    a_rows: torch.Tensor | None = None,
    c_rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    swiglu: bool = False,
    z: torch.Tensor | None = None,
    tiles: TileTables | None = None,
) -> None:
    """out[c_rows[r]] = scale[r] * a[a_rows[r]] @ b[e(r)] for the ``rows`` sorted rows.

    ``b_EKM`` may be any strided view (a transposed view computes a @ b[e]^T). With
    ``swiglu``, ``b`` is [E, K, 2M], ``out`` receives silu(gate) * up and ``z`` (if given)
    the pre-activations [gate | up]. Without ``swiglu`` the tuned config may name the
    persistent kernel; ``tiles`` (built for these ``offsets_E`` and ``rows``) then gives its
    tile table, shared with the other GEMMs of the call (else one is built for this GEMM).
    """
    interp = check_tensors(a, b_EKM, out)
    if a.dtype != b_EKM.dtype:
        raise TypeError(f"dtype mismatch: {a.dtype} activations with {b_EKM.dtype} weights")
    tables = _tile_tables(tiles, offsets_E, rows)
    E, K = b_EKM.shape[0], b_EKM.shape[1]
    M = b_EKM.shape[2] // 2 if swiglu else b_EKM.shape[2]
    flags = _mm_flags(b_EKM, a_rows, c_rows, scale, z)
    kind = "mm_swiglu" if swiglu else "mm"
    precision = _dot_precision(a.dtype)

    def run(cfg: KernelConfig, fresh_table: bool = False) -> None:
        if cfg.persistent:  # kind "mm" only (tuning refuses it for the others)
            if rows == 0:
                return
            # Timed with a table of its own: the tuner charges a persistent candidate the
            # table it needs (a launch in the layer shares it with the call's other GEMMs).
            if fresh_table:
                table = tile_table(offsets_E, rows, cfg.block_m)
            else:
                table = tables.get(cfg.block_m)
            persistent_mm(
                a, b_EKM, offsets_E, out, rows, cfg=cfg, table=table, a_rows=a_rows,
                c_rows=c_rows, scale=scale, precision=precision,
            )  # fmt: skip
            return
        classic_mm(
            cfg, a, b_EKM, offsets_E, out, rows, M, a_rows=a_rows, c_rows=c_rows,
            scale=scale, swiglu=swiglu, z=z, store_z=z is not None,
        )  # fmt: skip

    def timed(cfg: KernelConfig) -> None:
        run(cfg, fresh_table=True)

    key = tuning.make_key(kind, E, K, M, a.dtype, flags, rows)
    with _on_device(a):
        run(tuning.choose_config(kind, key, a.device, K, M, a.dtype, timed, interp))


def mm_dswiglu_fused(
    a: torch.Tensor,
    b_EKM: torch.Tensor,
    offsets_E: torch.Tensor,
    z_RF2: torch.Tensor,
    scale_R: torch.Tensor,
    dz_RF2: torch.Tensor,
    dscale_R: torch.Tensor,
    h_RF: torch.Tensor | None,
    rows: int,
    *,
    cfg: KernelConfig,
) -> None:
    """One launch of the classic grouped GEMM computing G = a @ b[e] tile by tile with the
    SwiGLU backward in its epilogue (``cfg.fused``), then the sum of each row's per-tile
    partials of <G, h> into ``dscale_R`` (a fixed-order sum: the same bits every run)."""
    F = b_EKM.shape[2]
    part_RN = new_empty((rows, -(-F // cfg.block_n)), torch.float32, a.device)
    h_arg = h_RF if h_RF is not None else dz_RF2  # G's dtype either way (C rounds G)
    classic_mm(
        cfg, a, b_EKM, offsets_E, h_arg, rows, F, scale=scale_R, apply_scale=False,
        z=z_RF2, dz=dz_RF2, part=part_RN, store_h=h_RF is not None,
    )  # fmt: skip
    torch.sum(part_RN, 1, out=dscale_R)


def grouped_mm_dswiglu(
    a: torch.Tensor,
    b_EKM: torch.Tensor,
    offsets_E: torch.Tensor,
    z_RF2: torch.Tensor,
    scale_R: torch.Tensor,
    dz_RF2: torch.Tensor,
    dscale_R: torch.Tensor,
    h_RF: torch.Tensor | None,
    rows: int,
    *,
    tiles: TileTables | None = None,
) -> None:
    """G = a @ b[e] (the backward's dy @ W2^T, unweighted) and the SwiGLU backward of it:
    ``swiglu_bwd``'s outputs (dz into ``dz_RF2``, which may be ``z_RF2``; <G, h> into
    ``dscale_R``; scale * h into ``h_RF`` if given), G itself never kept.

    Unfused (the default): G by ``grouped_mm`` (kind "mm", in ``h_RF``'s memory where given,
    sharing ``tiles``), then ``swiglu_bwd``. Fused (a ``fused`` config of kind
    "mm_dswiglu", where the table or autotuning chose it, or forced): one GEMM launch whose
    epilogue does the elementwise pass. Autotuning times both on buffers of its own, never
    in place: a candidate runs several times and must read the z it was given.
    """
    interp = check_tensors(a, b_EKM, z_RF2, dz_RF2)
    if a.dtype != b_EKM.dtype:
        raise TypeError(f"dtype mismatch: {a.dtype} activations with {b_EKM.dtype} weights")
    E, K, F = b_EKM.shape
    if tuple(z_RF2.shape) != (rows, 2 * F) or dz_RF2.shape != z_RF2.shape:
        raise ValueError(
            f"z and dz must be [rows={rows}, 2F={2 * F}], got {tuple(z_RF2.shape)} and "
            f"{tuple(dz_RF2.shape)}"
        )
    if rows == 0:
        return

    def run(cfg: KernelConfig, dz: torch.Tensor, dscale: torch.Tensor, h) -> None:
        if cfg.fused:
            mm_dswiglu_fused(a, b_EKM, offsets_E, z_RF2, scale_R, dz, dscale, h, rows, cfg=cfg)
            return
        g_RF = h if h is not None else new_empty((rows, F), a.dtype, a.device)
        grouped_mm(a, b_EKM, offsets_E, g_RF, rows, tiles=tiles)
        swiglu_bwd(z_RF2, g_RF, scale_R, dz, dscale, h)

    scratch: list[torch.Tensor] = []

    def timed(cfg: KernelConfig) -> None:
        if not scratch:  # allocated at the first candidate, shared by all
            scratch.append(torch.empty_like(dz_RF2))
            scratch.append(torch.empty_like(dscale_R))
            scratch.append(torch.empty((rows, F), dtype=a.dtype, device=a.device))
        dz, dscale, h = scratch
        run(cfg, dz, dscale, h if h_RF is not None else None)

    transposed = b_EKM.stride(2) != 1 and b_EKM.stride(1) == 1
    flags = f"h{int(h_RF is not None)}t{int(transposed)}"
    key = tuning.make_key("mm_dswiglu", E, K, F, a.dtype, flags, rows)
    with _on_device(a):
        cfg = tuning.choose_config("mm_dswiglu", key, a.device, K, F, a.dtype, timed, interp)
        run(cfg, dz_RF2, dscale_R, h_RF)


def gather_rows(src_ND: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
    """``src[rows]`` as a contiguous [R, D] buffer (int32 ``rows``): the expert-sorted copy
    of x or dy that the backward's GEMMs then read as plain contiguous tiles."""
    out_RD = new_empty((rows_R.numel(), src_ND.shape[1]), src_ND.dtype, src_ND.device)
    return torch.index_select(src_ND, 0, rows_R, out=out_RD)


def grouped_wgrad_torch(a_NK: torch.Tensor, b_NM: torch.Tensor, offsets_E: torch.Tensor):
    """out[e] = a[rows of e]^T @ b[rows of e] by ``torch._grouped_mm``'s 2D x 2D form (the
    groups along the reduced dim), where ``tuning.torch_wgrad_runs`` says it runs. A group
    without rows gets zeros, forced: some GPUs' kernels leave its output undefined."""
    out_EKM = torch._grouped_mm(a_NK.contiguous().t(), b_NM.contiguous(), offs=offsets_E)
    starts_E = torch.cat([offsets_E.new_zeros(1), offsets_E[:-1]])
    return out_EKM.masked_fill_((offsets_E == starts_E).view(-1, 1, 1), 0)


def _wgrad_triton(
    tk: ModuleType,
    cfg: KernelConfig,
    a: torch.Tensor,
    b: torch.Tensor,
    offsets_E: torch.Tensor,
    a_rows: torch.Tensor | None,
    b_rows: torch.Tensor | None,
    precision: str,
) -> torch.Tensor:
    """``grouped_wgrad`` by moestack's Triton kernels ``tk`` with tile config ``cfg``: a new
    [E, K, M] tensor (every element written)."""
    E, K, M = offsets_E.shape[0], a.shape[1], b.shape[1]
    dummy = offsets_E
    out_EKM = new_empty((E, K, M), a.dtype, a.device)
    grid = ((-(-K // cfg.block_m)) * (-(-M // cfg.block_n)), E)
    tk.grouped_wgrad_kernel[grid](
        a,
        b,
        out_EKM,
        offsets_E,
        a_rows if a_rows is not None else dummy,
        b_rows if b_rows is not None else dummy,
        K,
        M,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out_EKM.stride(0),
        out_EKM.stride(1),
        out_EKM.stride(2),
        GATHER_A=a_rows is not None,
        GATHER_B=b_rows is not None,
        EVEN_KM=K % cfg.block_m == 0 and M % cfg.block_n == 0,
        DOT_PRECISION=precision,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out_EKM


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    a_rows: torch.Tensor | None = None,
    b_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[e] = a[a_rows[r]]^T @ b[b_rows[r]] summed over the rows r of expert e: a new
    [E, K, M] tensor in a's dtype (E from ``offsets_E``, K = a's width, M = b's).

    Every element is written (zeros for experts without rows). The backend (moestack's
    kernel or ``torch._grouped_mm``) comes with the tile config: the table's entry, else
    autotuning among both where torch's runs, else moestack's kernel. Without gathers both
    read contiguous rows; a gathered operand goes to torch's backend as a gathered copy.
    """
    interp = check_tensors(a, b)
    if a.dtype != b.dtype:
        raise TypeError(f"dtype mismatch: {a.dtype} and {b.dtype}")
    tk = kernels()
    E, K, M = offsets_E.shape[0], a.shape[1], b.shape[1]
    flags = f"g{int(a_rows is not None)}{int(b_rows is not None)}"
    precision = _dot_precision(a.dtype)

    def run(cfg: KernelConfig) -> torch.Tensor:
        if cfg.backend == "torch":
            a_g = a if a_rows is None else gather_rows(a, a_rows)
            b_g = b if b_rows is None else gather_rows(b, b_rows)
            return grouped_wgrad_torch(a_g, b_g, offsets_E)
        return _wgrad_triton(tk, cfg, a, b, offsets_E, a_rows, b_rows, precision)

    rows = a_rows.numel() if a_rows is not None else a.shape[0]  # the sorted rows
    key = tuning.make_key("wgrad", E, K, M, a.dtype, flags, rows)
    with _on_device(a):
        return run(tuning.choose_config("wgrad", key, a.device, K, M, a.dtype, run, interp))


def swiglu_bwd(
    z_RF2: torch.Tensor,
    g_RF: torch.Tensor,
    scale_R: torch.Tensor,
    dz_RF2: torch.Tensor,
    dscale_R: torch.Tensor,
    h_RF: torch.Tensor | None,
) -> None:
    """Row-wise SwiGLU backward with the router-weight gradient; ``h_RF`` gets scale * h."""
    interp = check_tensors(z_RF2, g_RF, dz_RF2)
    R, F = g_RF.shape
    if R == 0:
        return
    block_f = min(_next_pow2(F), 32 if interp else 1024)
    h_arg = h_RF if h_RF is not None else dz_RF2
    with _on_device(z_RF2):
        kernels().swiglu_bwd_kernel[(R,)](
            z_RF2,
            g_RF,
            scale_R,
            dz_RF2,
            h_arg,
            dscale_R,
            F,
            z_RF2.stride(0),
            g_RF.stride(0),
            dz_RF2.stride(0),
            h_arg.stride(0),
            STORE_H=h_RF is not None,
            BLOCK_F=max(block_f, 16),
            num_warps=4,
        )
