"""Every candidate tile config of every kernel kind against the float64 reference, forced
with ``tuning.forced_config``, in the interpreter: the tile shapes, the row-group swizzle and
the masks of each config compute the right numbers. Case i forces candidate i (modulo the
list's length) of every kind at once, so that the longest list sets the number of cases.
test_kernels_gpu.py runs the same check in bf16 on a GPU, one kind at a time, where the
pipelining and warps of each config are real too."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

pytest.importorskip("triton")

from moestack.kernels import _launch, grouped_gemm, moe_experts, tuning  # noqa: E402
from moestack.kernels.reference import (  # noqa: E402
    grouped_gemm_reference,
    moe_experts_reference,
)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter's run; test_kernels_gpu.py checks every candidate on CUDA",
)
TOL = 5e-6  # float32, normwise: max|err| / max|ref|
CASES = range(max(len(c) for c in tuning.CANDIDATES.values()))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "non-finite values (unwritten output?)"
    err = (actual.double() - expected).abs().max().item()
    return err / max(expected.abs().max().item(), 1e-6)


@pytest.fixture
def poisoned_buffers(monkeypatch):
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_launch, "new_empty", poisoned)


def forced(index: int) -> contextlib.ExitStack:
    """Candidate ``index`` (modulo the list's length) of every kind, forced together."""
    stack = contextlib.ExitStack()
    for kind, cands in tuning.CANDIDATES.items():
        stack.enter_context(tuning.forced_config(kind, cands[index % len(cands)]))
    return stack


@pytest.mark.parametrize("index", CASES)
def test_candidates_match_float64(index, poisoned_buffers):
    g = torch.Generator().manual_seed(index)
    T, D, F, E, k = 24, 40, 48, 5, 2
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, D, 2 * F, generator=g, dtype=torch.float64) / math.sqrt(D)
    w2 = torch.randn(E, F, D, generator=g, dtype=torch.float64) / math.sqrt(F)
    scores = torch.rand(T, E, generator=g, dtype=torch.float64)
    scores[:, 2] = -1.0  # an expert without tokens
    weights, experts = scores.topk(k, dim=1)
    dy = torch.randn(T, D, generator=g, dtype=torch.float64)
    ins = [t.float().requires_grad_() for t in (x, w1, w2, weights)]
    with forced(index):
        y = moe_experts(ins[0], ins[1], ins[2], experts, ins[3])
        y.backward(dy.float())
        counts = [0, 33, 1, 0, 60]  # ragged groups for the plain grouped GEMM
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
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
