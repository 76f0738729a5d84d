"""The SwiGLU backward fused into the epilogue of G = dy @ W2^T (kind "mm_dswiglu"), in the
interpreter: the layer's gradients against the float64 reference, in place and through a
retained graph, the launcher's outputs against a float64 SwiGLU backward and the unfused
path, bitwise-repeatable router-weight gradients, and its selection by the tuner."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.kernels import interpreter_only, layer_inputs, rel_err

pytest.importorskip("triton")

from moestack.kernels import _launch, moe_experts, tuned_table, tuning  # noqa: E402
from moestack.kernels.reference import moe_experts_reference  # noqa: E402

pytestmark = interpreter_only(
    "the interpreter's run; test_kernels_gpu.py checks every candidate on CUDA"
)
TOL = {torch.float32: 5e-6, torch.float16: 3e-3}  # normwise: max|err| / max|ref|
NAMES = ("dx", "dw1", "dw2", "dweights")
FUSED = tuning.CANDIDATES["mm_dswiglu"]
# (T, D, F, E, k, expert without tokens): ragged groups with an empty expert, one token,
# top_k = E; F = 48 spans two 32-wide column tiles plus a partial one at block_n 16.
SHAPES = {
    "ragged-empty": (24, 40, 48, 5, 2, 2),
    "one-token": (1, 24, 40, 4, 2, None),
    "top_k=E": (7, 16, 24, 3, 3, None),
}


@pytest.fixture
def fused_launches(monkeypatch):
    """(z is dz, whether weight * h was stored) for each fused launch (each still runs)."""
    seen = []
    real = _launch.mm_dswiglu_fused

    def spy(a, b, offsets, z, scale, dz, dscale, h, rows, *, cfg):
        seen.append((dz.data_ptr() == z.data_ptr(), h is not None))
        return real(a, b, offsets, z, scale, dz, dscale, h, rows, cfg=cfg)

    monkeypatch.setattr(_launch, "mm_dswiglu_fused", spy)
    return seen


def reference_grads(x, w1, w2, experts, weights, dy) -> list[torch.Tensor]:
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    y = moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3])
    return list(torch.autograd.grad(y, refs, dy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("index", [0, 4], ids=["128x128", "64x64"])
def test_layer_backward_in_place_and_retained(
    shape, dtype, index, poisoned_buffers, fused_launches
):
    """In place (the graph freed: dz over z) and functional (retain_graph: a second backward
    reads z again), both against float64, with the fused config forced."""
    T, D, F, E, k, empty = SHAPES[shape]
    x, w1, w2, experts, weights, dy = layer_inputs(
        T, D, F, E, k, seed=index, empty=empty, dtype=dtype
    )
    want = reference_grads(x, w1, w2, experts, weights, dy)
    with tuning.forced_config("mm_dswiglu", FUSED[index]):
        ins = [t.to(dtype).requires_grad_() for t in (x, w1, w2, weights)]
        y = moe_experts(ins[0], ins[1], ins[2], experts, ins[3])
        first = torch.autograd.grad(y, ins, dy.to(dtype), retain_graph=True)
        second = torch.autograd.grad(y, ins, dy.to(dtype))
    for name, a, b, w in zip(NAMES, first, second, want, strict=True):
        assert rel_err(a, w) <= TOL[dtype], ("retained", name)
        assert rel_err(b, w) <= TOL[dtype], ("in place", name)
    if empty is not None:  # an expert without rows gets exact zero weight gradients
        assert not second[1][empty].any() and not second[2][empty].any()
    assert fused_launches == [(False, True), (True, True)]  # functional, then in place


def test_fused_matches_unfused_and_repeats_bitwise(fused_launches):
    """Same config twice: every gradient bitwise equal (no atomics). Against the unfused
    path: dW2 (from weight * h, which both compute elementwise from the same z) bitwise
    where both G GEMMs reduce in the same steps, the rest within rounding."""
    T, D, F, E, k, empty = SHAPES["ragged-empty"]
    x, w1, w2, experts, weights, dy = layer_inputs(
        T, D, F, E, k, seed=5, empty=empty, dtype=torch.float32
    )

    def grads(cfg: tuning.KernelConfig) -> list[torch.Tensor]:
        ins = [t.float().requires_grad_() for t in (x, w1, w2, weights)]
        with tuning.forced_config("mm_dswiglu", cfg):
            y = moe_experts(ins[0], ins[1], ins[2], experts, ins[3])
            return list(torch.autograd.grad(y, ins, dy.float()))

    # The interpreter's unfused G GEMM runs 32x32 tiles, 16 rows of K a step in fp32.
    same_steps = tuning.KernelConfig(32, 32, 32, group_m=2, fused=True)
    fused = grads(same_steps)
    again = grads(same_steps)
    unfused = grads(tuning.UNFUSED_DSWIGLU)
    assert all(torch.equal(a, b) for a, b in zip(fused, again, strict=True))
    assert torch.equal(fused[2], unfused[2])
    for name, a, b in zip(NAMES, fused, unfused, strict=True):
        assert rel_err(a, b.double()) <= 1e-6, name
    assert len(fused_launches) == 2


def swiglu_bwd_float64(g, z, scale):
    """dz, scale * h and <G, h> of the SwiGLU backward, by torch autograd in float64."""
    F = g.shape[1]
    zz = z.double().clone().requires_grad_()
    h = torch.nn.functional.silu(zz[:, :F]) * zz[:, F:]
    (dz,) = torch.autograd.grad(h, zz, g * scale[:, None])
    return dz, (h * scale[:, None]).detach(), (g * h).sum(1).detach()


@pytest.mark.parametrize("store_h", [True, False], ids=["with-h", "without-h"])
def test_launcher_outputs_against_float64(store_h, poisoned_buffers, fused_launches):
    """The launcher alone, dz over z in place: every row of ragged groups (an empty one,
    a one-row one) written; weight * h only when asked for."""
    g = torch.Generator().manual_seed(7)
    counts, D, F = [0, 19, 1, 0, 30], 24, 40
    R, E = sum(counts), len(counts)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    dys = torch.randn(R, D, generator=g)
    w2 = torch.randn(E, F, D, generator=g) / math.sqrt(F)
    z = torch.randn(R, 2 * F, generator=g)
    scale = torch.rand(R, generator=g)
    z0 = z.clone()
    dscale = torch.full((R,), float("nan"))
    h = torch.full((R, F), float("nan")) if store_h else None
    with tuning.forced_config("mm_dswiglu", FUSED[1]):
        _launch.grouped_mm_dswiglu(dys, w2.transpose(1, 2), offsets, z, scale, z, dscale, h, R)
    ends = offsets.tolist()
    expert = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    G = torch.einsum("rd,rfd->rf", dys.double(), w2.double()[expert])
    dz_want, h_want, ds_want = swiglu_bwd_float64(G, z0, scale.double())
    assert ends[-1] == R and fused_launches == [(True, store_h)]
    assert rel_err(z, dz_want) <= 5e-6
    assert rel_err(dscale, ds_want) <= 5e-6
    if store_h:
        assert rel_err(h, h_want) <= 5e-6


def test_tuner_times_fused_against_unfused_and_never_in_place(monkeypatch, fused_launches):
    """The candidates: the unfused pair first (the default), then the fused tiles. The
    tuner runs each candidate several times on buffers of its own, so the in-place call
    still reads the z it was given, and launches what it chose."""
    cands = tuning.candidates("mm_dswiglu", 24, 40, torch.float32)
    assert not cands[0].fused and all(c.fused for c in cands[1:])
    assert tuning.default_config("mm_dswiglu", 24, 40, torch.float32) == cands[0]
    choice = cands[2]

    def tuner(kind, key, device, K, M, dtype, run, interpret):
        if kind != "mm_dswiglu":
            return tuning.INTERPRET_CONFIG
        assert key.startswith("mm_dswiglu|E=5|K=24|M=40|float32|h1t1|")
        for cfg in cands + cands:
            run(cfg)
        return choice

    monkeypatch.setattr(tuning, "choose_config", tuner)
    g = torch.Generator().manual_seed(8)
    counts, D, F = [3, 0, 17, 1, 9], 24, 40
    R, E = sum(counts), len(counts)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    dys, z = torch.randn(R, D, generator=g), torch.randn(R, 2 * F, generator=g)
    w2, scale = torch.randn(E, F, D, generator=g) / math.sqrt(F), torch.rand(R, generator=g)
    z0, dscale, h = z.clone(), torch.empty(R), torch.empty(R, F)
    _launch.grouped_mm_dswiglu(dys, w2.transpose(1, 2), offsets, z, scale, z, dscale, h, R)
    expert = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    G = torch.einsum("rd,rfd->rf", dys.double(), w2.double()[expert])
    dz_want, h_want, ds_want = swiglu_bwd_float64(G, z0, scale.double())
    for a, b in ((z, dz_want), (h, h_want), (dscale, ds_want)):
        assert rel_err(a, b) <= 5e-6
    timed = 2 * (len(cands) - 1)  # the fused candidates, twice each, never in place
    assert fused_launches == [(False, True)] * timed + [(True, True)]


def test_fused_config_only_for_its_kind_and_table_entries():
    cfg = FUSED[0]
    assert tuned_table.table_entry(cfg)["fused"] is True
    assert "fused" not in tuned_table.table_entry(tuning.UNFUSED_DSWIGLU)
    assert tuning.KernelConfig(**tuned_table.table_entry(cfg)) == cfg
    for kind in ("mm", "mm_swiglu", "wgrad"):
        with (
            pytest.raises(ValueError, match="fused=True is for kind='mm_dswiglu' only"),
            tuning.forced_config(kind, cfg),
        ):
            pass
    with pytest.raises(ValueError, match="persistent=False"):
        tuning.KernelConfig(128, 128, 64, persistent=True, fused=True)
    with pytest.raises(ValueError, match="persistent=False"):
        tuning.KernelConfig(128, 128, 64, backend="torch", fused=True)


def test_table_entry_elsewhere_gives_the_default(tmp_path, monkeypatch):
    """A fused entry under another kind's key (an edited table) runs that kind's default;
    under its own key it is launched as recorded."""
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(tmp_path / "t.json"))
    entry = tuned_table.table_entry(FUSED[1])
    keys = {
        "mm": "mm|E=4|K=64|M=64|bfloat16|g0s0c0z0t1|R=128",
        "mm_dswiglu": "mm_dswiglu|E=4|K=64|M=64|bfloat16|h1t1|R=128",
    }
    data = {
        "format": tuned_table.TABLE_FORMAT,
        "gpus": {"Fancy GPU": {k: entry for k in keys.values()}},
    }
    (tmp_path / "t.json").write_text(json.dumps(data))
    tuning.clear_cache()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fancy GPU")

    def fail(cfg):
        raise AssertionError("a table entry is never timed")

    try:
        for kind, key in keys.items():
            got = tuning.choose_config(
                kind, key, torch.device("cpu"), 64, 64, torch.bfloat16, fail, False
            )
            want = (
                FUSED[1]
                if kind == "mm_dswiglu"
                else tuning.default_config(kind, 64, 64, torch.bfloat16)
            )
            assert got == want, kind
    finally:
        tuning.clear_cache()


def test_fused_backward_intermediates_stay_small(count_allocations):
    """In place, the fused backward keeps the unfused one's buffers: one [R, F] (weight * h;
    G never stored), dy's [R, D] rows, dx's [R, D] rows and [R] vectors, plus the
    [R, column tiles] fp32 partial sums of the router-weight gradient."""
    T, D, F, E, k = 16, 24, 40, 4, 3
    R = T * k
    x, w1, w2, experts, weights, dy = layer_inputs(T, D, F, E, k, seed=11, dtype=torch.float32)
    ins = [t.float().requires_grad_() for t in (x, w1, w2, weights)]
    with tuning.forced_config("mm_dswiglu", FUSED[4]):
        y = moe_experts(ins[0], ins[1], ins[2], experts, ins[3])
        counted = count_allocations(returned=((E, D, 2 * F), (E, F, D), (T, D)))
        y.backward(dy.float())
    num_n = -(-F // 64)
    sizes = counted.sizes
    assert (R, 2 * F) not in sizes and sizes.count((R, F)) == 1 and (R, num_n) in sizes
    assert counted.peak <= 4 * (R * F + R * D + 2 * R + R * num_n)
