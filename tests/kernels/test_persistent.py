"""The persistent grouped GEMM and its tile table: the table against a brute-force loop, the
kernel (pointer and tensor-descriptor loads) against a float64 loop, in the interpreter on
the CPU (float32, float16) or on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.kernels import interpreter_only, layer_inputs, needs_kernels, rel_err

from moestack.kernels import tuning
from moestack.kernels._tiles import capacity, tile_table

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Normwise relative error bounds: max|err| / max|ref|.
TOL = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _persistent():
    pytest.importorskip("triton")
    from moestack.kernels import _persistent

    return _persistent


# ---- the tile table ---------------------------------------------------------------------


def brute_tiles(counts: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(expert, first row) of every row tile, by walking the experts' rows."""
    experts, starts, row = [], [], 0
    for e, c in enumerate(counts):
        for r in range(row, row + c, block_m):
            experts.append(e)
            starts.append(r)
        row += c
    return experts, starts


TABLE_CASES = [
    [0, 5, 0, 1, 70, 0],  # ragged, empty first/middle/last
    [1],  # one row
    [0, 1, 0],  # one row in the middle expert
    [0, 0, 100, 0],  # every row in one expert
    [32, 32, 64],  # exact multiples of the tile
    [33, 31, 0, 65],  # one past and one short of a tile
]


@pytest.mark.parametrize("counts", TABLE_CASES)
@pytest.mark.parametrize("block_m", [1, 16, 32, 64])
def test_tile_table_matches_brute_force(counts, block_m):
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    R, E = sum(counts), len(counts)
    table = tile_table(offsets, R, block_m)
    experts, starts = brute_tiles(counts, block_m)
    n = len(experts)
    assert table.expert_T.dtype == table.row_start_T.dtype == table.count.dtype == torch.int32
    assert table.capacity == capacity(R, E, block_m) == -(-R // block_m) + E >= n
    assert table.count.tolist() == [n]
    assert table.expert_T[:n].tolist() == experts
    assert table.row_start_T[:n].tolist() == starts
    # Entries past the count are zeros (never read by the kernel).
    assert not table.expert_T[n:].any() and not table.row_start_T[n:].any()


def test_tile_table_random_ragged():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        E = int(torch.randint(1, 12, (1,), generator=g))
        counts = torch.randint(0, 50, (E,), generator=g)
        counts[torch.rand(E, generator=g) < 0.3] = 0  # empty experts
        counts = counts.tolist()
        block_m = [16, 32, 64, 128][trial % 4]
        table = tile_table(torch.tensor(counts).cumsum(0).int(), sum(counts), block_m)
        experts, starts = brute_tiles(counts, block_m)
        n = int(table.count)
        assert (n, table.expert_T[:n].tolist(), table.row_start_T[:n].tolist()) == (
            len(experts),
            experts,
            starts,
        ), counts


def test_tile_table_all_empty_and_bad_arguments():
    table = tile_table(torch.zeros(3, dtype=torch.int32), 0, 32)
    assert table.count.tolist() == [0] and table.capacity == 3
    with pytest.raises(ValueError, match="block_m"):
        tile_table(torch.tensor([4], dtype=torch.int32), 4, 0)
    with pytest.raises(ValueError, match="offsets_E"):
        tile_table(torch.zeros(0, dtype=torch.int32), 0, 32)


@pytest.mark.skipif(not CUDA, reason="host syncs exist only with a CUDA device")
def test_tile_table_never_syncs():
    offsets = torch.tensor([0, 5, 0, 1, 70, 0], device="cuda").cumsum(0).int()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        table = tile_table(offsets, 76, 32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert table.count.tolist() == [len(brute_tiles([0, 5, 0, 1, 70, 0], 32)[0])]


# ---- the kernel -------------------------------------------------------------------------


def run_case(
    counts: list[int],
    K: int,
    N: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    gather: bool = False,
    scatter: bool = False,
    scale: bool = False,
    transposed: bool = False,
    use_tma: bool | None = None,
    num_programs: int | None = 3,
    cfg: tuning.KernelConfig | None = None,
    extra_rows: int = 5,
):
    """One launch against a float64 loop; ``out`` has ``extra_rows`` rows the kernel must
    leave alone (poisoned with NaN, as every row before the launch). Returns the table."""
    pt = _persistent()
    g = torch.Generator().manual_seed(seed)
    E, R = len(counts), sum(counts)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    T = R + 7 if gather else R
    x64 = torch.randn(T, K, generator=g, dtype=torch.float64).to(dtype).double()
    if transposed:  # w is a transposed view of an [E, N, K] tensor
        w64 = torch.randn(E, N, K, generator=g, dtype=torch.float64).to(dtype).double()
        w_dev = w64.to(DEVICE, dtype).transpose(1, 2)
        w64 = w64.transpose(1, 2)
    else:
        w64 = torch.randn(E, K, N, generator=g, dtype=torch.float64).to(dtype).double()
        w_dev = w64.to(DEVICE, dtype)
    a_rows = torch.randint(0, T, (R,), generator=g).int() if gather else None
    c_rows = torch.randperm(R + extra_rows, generator=g)[:R].int() if scatter else None
    s64 = torch.rand(R, generator=g, dtype=torch.float64).to(dtype).double() if scale else None

    expected = torch.full((R + extra_rows, N), float("nan"), dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        rows = torch.arange(start, end)
        src = x64[a_rows[rows].long()] if gather else x64[rows]
        y = src @ w64[e]
        if scale:
            y = y * s64[rows, None]
        expected[c_rows[rows].long() if scatter else rows] = y
        start = end

    out = torch.full((R + extra_rows, N), float("nan"), dtype=dtype, device=DEVICE)

    def dev(t):
        return None if t is None else t.to(DEVICE)

    table = pt.persistent_grouped_mm(
        x64.to(DEVICE, dtype),
        w_dev,
        offsets.to(DEVICE),
        out,
        R,
        a_rows=dev(a_rows),
        c_rows=dev(c_rows),
        scale=dev(s64.to(dtype)) if scale else None,
        cfg=cfg,
        num_programs=num_programs,
        use_tma=use_tma,
    )
    out = out.cpu()
    written = ~torch.isnan(expected[:, 0])
    assert torch.isnan(out[~written]).all(), "a row outside the experts' rows was written"
    assert rel_err(out[written], expected[written]) <= TOL[dtype], f"{counts}, K={K}, N={N}"
    return table


@pytest.fixture
def descriptor_calls(monkeypatch):
    """The shapes of the tensor descriptors each launch builds (the real ones are built)."""
    pt = _persistent()
    calls: list[list[int]] = []
    real = pt._host_descriptor

    def spy(t, shape, strides, block):
        calls.append(list(shape))
        return real(t, shape, strides, block)

    monkeypatch.setattr(pt, "_host_descriptor", spy)
    return calls


def needs_descriptors():
    pt = _persistent()
    if not pt.descriptors_available():
        import triton

        pytest.skip(f"triton {triton.__version__} has no host-side tensor descriptors")
    if CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors (TMA) need compute capability >= 9.0")


@needs_kernels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pointer_path_ragged_odd_sizes(dtype, descriptor_calls):
    # K, N not multiples of the tile nor of 16 bytes: no descriptor can read a or w.
    run_case([0, 5, 0, 1, 70, 0], K=45, N=50, dtype=dtype)
    assert descriptor_calls == []


@needs_kernels()
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_descriptor_path_ragged(dtype, descriptor_calls):
    needs_descriptors()
    # Row tiles of 32 cross from expert 1 (5 rows) into expert 3's rows: the descriptor
    # reads them, the store must not write them.
    run_case([0, 5, 0, 1, 70, 0], K=64, N=48, dtype=dtype, use_tma=True)
    assert descriptor_calls == [[76, 64], [6, 64, 48]]


@needs_kernels()
def test_descriptor_transposed_weight(descriptor_calls):
    needs_descriptors()
    if _persistent()._interpreter_counts_elements():
        pytest.skip("this interpreter wants strides of 16 elements; K = 40 has 40")
    run_case([9, 0, 30], K=40, N=32, dtype=torch.float16, transposed=True, use_tma=True)
    assert descriptor_calls == [[39, 40], [3, 32, 40]]  # w read as the [E, N, K] it views


@needs_kernels()
def test_descriptor_weight_with_odd_k(descriptor_calls):
    # a [R, 45] fp16 has 90-byte rows: pointers; w [E, 45, 48] is aligned: a descriptor,
    # whose K edge is zero-filled per expert (rank 3), not read from the next expert.
    run_case([7, 0, 40], K=45, N=48, dtype=torch.float16)
    if _persistent().tma_supported(torch.empty(1, 8, 8, device=DEVICE)):
        assert descriptor_calls == [[3, 45, 48]]


@needs_kernels()
@pytest.mark.parametrize("use_tma", [None, False])
def test_gather_scatter_scale(use_tma, descriptor_calls):
    """The forward's and backward's operand shapes: gathered a, scattered rows of out,
    a per-row scale; a gathered operand is always read through pointers."""
    run_case(
        [3, 0, 41, 1],
        K=32,
        N=64,
        dtype=torch.float32,
        gather=True,
        scatter=True,
        scale=True,
        use_tma=use_tma,
    )
    assert all(len(shape) == 3 for shape in descriptor_calls)  # w only, never a
    if use_tma is False:
        assert descriptor_calls == []


@needs_kernels()
@pytest.mark.parametrize(
    "counts", [[1], [0, 1, 0], [0, 0, 70, 0]], ids=["one-row", "one-row-middle", "one-expert"]
)
def test_edges(counts):
    run_case(counts, K=32, N=48, dtype=torch.float32, num_programs=2)


@needs_kernels()
@pytest.mark.parametrize("num_programs", [1, 2, 64])
def test_programs_walk_several_tiles(num_programs):
    # 5 row tiles x 3 column tiles: one program walks all 15, or 2 walk 7-8 each, or the
    # grid is clipped to the tile bound.
    cfg = tuning.KernelConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=1)
    run_case([20, 0, 33], K=16, N=40, dtype=torch.float32, num_programs=num_programs, cfg=cfg)


@needs_kernels()
@pytest.mark.parametrize("use_tma", [None, False])
def test_partial_tile_leaves_next_expert_rows(use_tma):
    """Expert 1's only tile (5 rows of 32) spans 27 rows of expert 2, which a descriptor
    reads. With 2 programs, one column tile and no swizzle, program 0 writes expert 2's
    first tile before program 1 computes expert 1's: a store past expert 1's rows would
    overwrite it (the interpreter runs programs in order, so this is deterministic)."""
    cfg = tuning.KernelConfig(32, 32, 32, group_m=1, num_warps=4, num_stages=1)
    run_case([32, 5, 40], K=32, N=32, dtype=torch.float32, num_programs=2, cfg=cfg, use_tma=use_tma)


@needs_kernels()
def test_table_reused_when_tiles_match():
    pt = _persistent()
    cfg = tuning.KernelConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1)
    table = run_case([3, 0, 18], K=16, N=16, dtype=torch.float32, cfg=cfg)
    offsets = torch.tensor([3, 3, 21], dtype=torch.int32, device=DEVICE)
    x = torch.randn(21, 16, device=DEVICE)
    w = torch.randn(3, 16, 16, device=DEVICE)
    out = torch.empty(21, 16, device=DEVICE)
    same = pt.persistent_grouped_mm(x, w, offsets, out, 21, cfg=cfg, tiles=table)
    assert same is table
    other = replace_block_m(cfg, 32)
    rebuilt = pt.persistent_grouped_mm(x, w, offsets, out, 21, cfg=other, tiles=table)
    assert rebuilt is not table and rebuilt.block_m == 32


def replace_block_m(cfg: tuning.KernelConfig, block_m: int) -> tuning.KernelConfig:
    from dataclasses import replace

    return replace(cfg, block_m=block_m)


def check_candidate_bf16(index: int, variant: str, use_tma: bool | None) -> None:
    """Persistent candidate ``index``, fitted as the tuner launches it, in bfloat16
    (descriptors where this GPU has TMA, else pointers either way); a few programs walk many
    tiles."""
    cfg = tuning.fit(tuning.PERSISTENT_CANDIDATES[index], "mm", 256, 384, torch.bfloat16)
    run_case(
        [0, 130, 0, 1, 300, 77],
        K=256,
        N=384,
        dtype=torch.bfloat16,
        cfg=cfg,
        num_programs=7,
        use_tma=use_tma,
        transposed=variant == "transposed",
        gather=variant == "gather-scatter-scale",
        scatter=variant == "gather-scatter-scale",
        scale=variant == "gather-scatter-scale",
    )


# gpu_check's kernel_tests phase runs the trimmed GPU check (the default persistent
# candidate and the large tile, both load paths, every operand layout) and the layer test
# below; the other candidates run with the whole file.
TRIMMED = (0, 1)
OTHERS = tuple(i for i in range(len(tuning.PERSISTENT_CANDIDATES)) if i not in TRIMMED)
VARIANTS = ["plain", "transposed", "gather-scatter-scale"]
on_gpu = pytest.mark.skipif(not CUDA, reason="bfloat16 and the real tile configs need CUDA")


@on_gpu
@pytest.mark.parametrize("use_tma", [None, False], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("index", TRIMMED, ids=[f"cand{i}" for i in TRIMMED])
def test_gpu_default_and_large_tile_bf16(index, variant, use_tma):
    check_candidate_bf16(index, variant, use_tma)


@on_gpu
@pytest.mark.parametrize("use_tma", [None, False], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("index", OTHERS, ids=[f"cand{i}" for i in OTHERS])
def test_gpu_other_candidates_bf16(index, variant, use_tma):
    check_candidate_bf16(index, variant, use_tma)


@on_gpu
def test_gpu_layer_bf16(monkeypatch, poisoned_buffers):
    """The layer and the plain grouped GEMM with the default persistent candidate forced
    (h @ W2, G, dx, and grouped_gemm's y and dx), bf16 against float64: ragged groups, empty
    experts, outputs poisoned with NaN; 300 columns of bf16 are no 16-byte rows, so the
    plain GEMM's weight is read through pointers, the layer's through descriptors (sm90+)."""
    from moestack.kernels import _launch, grouped_gemm, moe_experts
    from moestack.kernels.reference import grouped_gemm_reference, moe_experts_reference

    # The other kinds at their untimed defaults, whatever the caller's environment says.
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", "/nonexistent.json")
    monkeypatch.setattr(tuning, "_CACHE", {})  # an empty cache, the caller's kept
    launched = []
    real = _launch.persistent_mm
    monkeypatch.setattr(
        _launch, "persistent_mm", lambda *a, **kw: (launched.append(1), real(*a, **kw))[1]
    )

    x, w1, w2, experts, weights, dy = layer_inputs(
        257, 192, 160, 8, 2, seed=0, empty=5, dtype=torch.bfloat16, weights_dtype=torch.float32
    )
    g = torch.Generator().manual_seed(1)
    counts = [0, 130, 1, 0, 257, 64, 0, 3]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), 200, generator=g, dtype=torch.float64).bfloat16().double()
    w = torch.randn(len(counts), 200, 300, generator=g, dtype=torch.float64).bfloat16().double()
    ins = [t.cuda().bfloat16().requires_grad_() for t in (x, w1, w2)]
    ins.append(weights.cuda().float().requires_grad_())
    a_dev, w_dev = a.cuda().bfloat16().requires_grad_(), w.cuda().bfloat16().requires_grad_()
    with tuning.forced_config("mm", tuning.PERSISTENT_CANDIDATES[0]):
        y = moe_experts(ins[0], ins[1], ins[2], experts.cuda(), ins[3])
        y.backward(dy.cuda().bfloat16())
        out = grouped_gemm(a_dev, w_dev, offsets.cuda())
        out.backward(torch.ones_like(out))
    assert len(launched) == 5, "h @ W2, G, dx and grouped_gemm's y and dx"
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    yr = moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3])
    yr.backward(dy)
    ar, wr = a.clone().requires_grad_(), w.clone().requires_grad_()
    outr = grouped_gemm_reference(ar, wr, offsets)
    outr.backward(torch.ones_like(outr))
    got = [y, *(t.grad for t in ins), out, a_dev.grad]
    want = [yr, *(t.grad for t in refs), outr, ar.grad]
    names = ("y", "dx", "dw1", "dw2", "dweights", "gemm y", "gemm dx")
    for name, a_, b_ in zip(names, got, want, strict=True):
        assert rel_err(a_.detach(), b_.detach()) <= 3e-2, name


# A fresh interpreter (no TRITON_INTERPRET) compiles the kernel for sm_90 without a GPU and
# reports, per variant, the TMA loads, cp.async copies and shared memory of the result.
_COMPILE_FOR_HOPPER = r"""
import json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moestack.kernels import _persistent as pt

fn = pt.persistent_grouped_mm_kernel
BM, BN, BK, dt = 128, 128, 64, "fp16"
out = {}
for name, a_desc, b_desc, b_trans, gather in json.loads(sys.argv[1]):
    unit = "stride_bk" if b_trans else "stride_bn"
    b_block = [1, BN, BK] if b_trans else [1, BK, BN]
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*i32" for n in fn.arg_names if n.endswith("_ptr")})
    sig.update(c_ptr=f"*{dt}", scale_ptr=f"*{dt}")
    sig["a"] = f"tensordesc<{dt}[{BM},{BK}]>" if a_desc else f"*{dt}"
    sig["b"] = f"tensordesc<{dt}{b_block}>" if b_desc else f"*{dt}"
    consts = dict(A_DESC=a_desc, B_DESC=b_desc, B_TRANS=b_trans, GATHER_A=gather,
                  SCATTER_C=gather, HAS_SCALE=gather, EVEN_K=True, DOT_PRECISION="tf32",
                  BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, stride_ak=1, stride_cn=1)
    consts[unit] = 1  # the launch specializes unit strides, so loads vectorize
    sig.update({n: "constexpr" for n in consts})
    idx = {n: (i,) for i, n in enumerate(fn.arg_names)}
    attrs = {idx[n]: [["tt.divisibility", 16]] for n, t in sig.items() if t[0] in "*i"}
    src = ASTSource(fn, sig, {idx[n]: v for n, v in consts.items()}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8, "num_stages": 3})
    ptx = k.asm["ptx"]
    out[name] = dict(tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                     cp_async=len(re.findall(r"cp\.async\.c[ga]", ptx)),
                     wgmma=len(re.findall(r"wgmma\.mma_async", ptx)), smem=k.metadata.shared)
print(json.dumps(out))
"""


@pytest.mark.skipif(CUDA, reason="on a GPU the launches above compile the kernel for real")
def test_compiles_for_hopper_with_tma_and_pipelined_loads():
    """The compiled kernel, not the interpreter: operands read through descriptors become
    TMA copies, pointer operands cp.async copies, both pipelined 3 stages deep (three
    128x64 + 64x128 fp16 tile pairs in shared memory), and the dot runs on wgmma."""
    import importlib.util

    import triton

    if not _persistent().descriptors_available():
        pytest.skip(f"triton {triton.__version__} has no host-side tensor descriptors")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    variants = [
        ["desc", True, True, False, False],
        ["desc-transposed-w", True, True, True, False],
        ["gathered-a", False, True, False, True],
        ["pointers", False, False, False, True],
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER, json.dumps(variants)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    stages = 3 * (128 * 64 + 64 * 128) * 2
    for name, a_desc, b_desc, _, _ in variants:
        info = got[name]
        assert info["wgmma"] > 0, (name, info)
        assert (info["tma"] > 0) == (a_desc or b_desc), (name, info)
        assert (info["cp_async"] > 0) == (not (a_desc and b_desc)), (name, info)
        assert info["smem"] >= stages, (name, info)


# ---- capabilities and refusals ----------------------------------------------------------


def test_descriptor_layout(monkeypatch):
    pt = _persistent()
    # the rule of compiled launches (and of the interpreter from triton 3.6): 16 bytes
    monkeypatch.setattr(pt, "_interpreter_counts_elements", lambda: False)
    w = torch.randn(2, 16, 8)
    assert pt.descriptor_layout(w) == "rows"
    assert pt.descriptor_layout(w.transpose(1, 2)) == "cols"
    assert pt.descriptor_layout(torch.randn(2, 15, 7)) is None  # 28-byte rows
    assert pt.descriptor_layout(w[:, :, ::2]) is None  # no unit stride
    assert pt.descriptor_layout(torch.randn(65)[1:].view(16, 4)) is None  # base off by 4 bytes
    assert pt.descriptor_layout(torch.randn(3)) is None  # rank 1


def test_descriptor_layout_under_an_interpreter_counting_elements(monkeypatch):
    # triton 3.4-3.5's interpreter wants strides of 16 elements: a [*, 8] fp32 tensor's
    # 32-byte rows are refused there, a [*, 16] one's taken
    pt = _persistent()
    monkeypatch.setattr(pt, "_interpreter_counts_elements", lambda: True)
    assert pt.descriptor_layout(torch.randn(2, 16, 8)) is None
    assert pt.descriptor_layout(torch.randn(2, 8, 16)) == "rows"
    assert pt.descriptor_layout(torch.randn(2, 8, 16).transpose(1, 2)) == "cols"


@needs_kernels()
def test_use_tma_refusals():
    pt = _persistent()
    offsets = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    x, w = torch.randn(4, 7, device=DEVICE), torch.randn(1, 7, 5, device=DEVICE)
    out = torch.empty(4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="use_tma=True"):
        pt.persistent_grouped_mm(x, w, offsets, out, 4, use_tma=True)
    with pytest.raises(TypeError, match="dtype mismatch"):
        pt.persistent_grouped_mm(x.half(), w, offsets, out, 4)
    with pytest.raises(ValueError, match="K and N must match"):
        pt.persistent_grouped_mm(x, w.transpose(1, 2), offsets, out, 4)
    with pytest.raises(ValueError, match="rows = 5"):
        pt.persistent_grouped_mm(x, w, offsets, out, 5)
    with pytest.raises(ValueError, match="num_programs"):
        pt.persistent_grouped_mm(x, w, offsets, out, 4, num_programs=0)
    assert pt.persistent_grouped_mm(x[:0], w, offsets[:1] * 0, out[:0], 0) is None


@interpreter_only("the interpreter's refusal; on a GPU the launches above run bfloat16")
def test_interpreter_refuses_bfloat16():
    pt = _persistent()
    x, w = torch.randn(4, 16).bfloat16(), torch.randn(1, 16, 16).bfloat16()
    with pytest.raises(TypeError, match="bfloat16"):
        pt.persistent_grouped_mm(
            x, w, torch.tensor([4], dtype=torch.int32), torch.empty(4, 16).bfloat16(), 4
        )
