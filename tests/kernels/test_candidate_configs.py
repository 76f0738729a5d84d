"""Every candidate tile config of every kernel kind against the float64 reference, forced
with ``tuning.forced_config``, in the interpreter: the tile shapes, the row-group swizzle and
the masks of each config compute the right numbers. Case i forces candidate i (modulo the
list's length) of every kind at once, so that the longest list sets the number of cases; the
persistent cases force persistent candidate j for the plain GEMM (kind "mm": the layer's
h @ W2, G and dx, and grouped_gemm) beside candidate j of the other kinds, G unfused (the
classic cases run G with the SwiGLU backward fused, each "mm_dswiglu" tile in turn).
test_kernels_gpu.py runs the same check in bf16 on a GPU, one kind at a time, where the
pipelining and warps of each config are real too (test_persistent.py the persistent ones)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.kernels import interpreter_only, layer_inputs, rel_err

pytest.importorskip("triton")

from moestack.kernels import _launch, grouped_gemm, moe_experts, tuning  # noqa: E402
from moestack.kernels.reference import (  # noqa: E402
    grouped_gemm_reference,
    moe_experts_reference,
)

pytestmark = interpreter_only(
    "the interpreter's run; test_kernels_gpu.py checks every candidate on CUDA"
)
TOL = 5e-6  # float32, normwise: max|err| / max|ref|
CASES = [("classic", i) for i in range(max(len(c) for c in tuning.CANDIDATES.values()))]
CASES += [("persistent", j) for j in range(len(tuning.PERSISTENT_CANDIDATES))]


def forced(index: int, persistent: bool) -> contextlib.ExitStack:
    """Candidate ``index`` (modulo the list's length) of every kind, forced together; the
    persistent candidate ``index`` for kind "mm" if ``persistent``."""
    stack = contextlib.ExitStack()
    for kind, cands in tuning.CANDIDATES.items():
        if persistent and kind == "mm":
            cands = tuning.PERSISTENT_CANDIDATES
        if persistent and kind == "mm_dswiglu":  # G by the (persistent) plain GEMM
            cands = (tuning.UNFUSED_DSWIGLU,)
        stack.enter_context(tuning.forced_config(kind, cands[index % len(cands)]))
    return stack


@pytest.fixture
def persistent_launches(monkeypatch):
    """The configs of the persistent GEMM's launches (each still runs)."""
    launched = []
    real = _launch.persistent_mm

    def spy(*args, **kw):
        launched.append(kw["cfg"])
        return real(*args, **kw)

    monkeypatch.setattr(_launch, "persistent_mm", spy)
    return launched


@pytest.mark.parametrize(("path", "index"), CASES, ids=[f"{p}-{i}" for p, i in CASES])
def test_candidates_match_float64(path, index, poisoned_buffers, persistent_launches):
    T, D, F, E, k = 24, 40, 48, 5, 2
    x, w1, w2, experts, weights, dy = layer_inputs(T, D, F, E, k, seed=index, empty=2)
    ins = [t.float().requires_grad_() for t in (x, w1, w2, weights)]
    with forced(index, persistent=path == "persistent"):
        y = moe_experts(ins[0], ins[1], ins[2], experts, ins[3])
        y.backward(dy.float())
        counts = [0, 33, 1, 0, 60]  # ragged groups for the plain grouped GEMM
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        g = torch.Generator().manual_seed(1000 + index)
        a = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
        a32, w32 = a.float().requires_grad_(), w1.float().requires_grad_()
        out = grouped_gemm(a32, w32, offsets)
        out.sum().backward()
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    yr = moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3])
    yr.backward(dy)
    got = [y.detach()] + [t.grad for t in ins]
    want = [yr.detach()] + [t.grad for t in refs]
    for name, a_, b_ in zip(("y", "dx", "dw1", "dw2", "dweights"), got, want, strict=True):
        assert rel_err(a_, b_) <= TOL, name
    ar, wr = a.clone().requires_grad_(), w1.clone().requires_grad_()
    grouped_gemm_reference(ar, wr, offsets).sum().backward()
    with torch.no_grad():
        out_ref = grouped_gemm_reference(a, w1, offsets)
    for name, a_, b_ in (("gemm y", out.detach(), out_ref), ("gemm dw", w32.grad, wr.grad)):
        assert rel_err(a_, b_) <= TOL, name
    assert rel_err(a32.grad, ar.grad) <= TOL, "gemm dx"
    # The forward's h @ W2, the backward's G and dx, grouped_gemm's y and dx: persistent
    # exactly when forced so (the SwiGLU GEMM and the weight gradients never are).
    want = tuning.PERSISTENT_CANDIDATES[index] if path == "persistent" else None
    assert len(persistent_launches) == (5 if want else 0)
    assert all(c.persistent and c.block_m == want.block_m for c in persistent_launches)
