"""grouped_gemm (Triton; the interpreter on CPU) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import needs_kernels, rel_err

pytest.importorskip("triton")

from moestack.kernels import grouped_gemm  # noqa: E402
from moestack.kernels.reference import grouped_gemm_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = needs_kernels()
# Normwise relative error bounds: max|err| / max|ref|.
TOL = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    assert actual.dtype == dtype, what
    assert rel_err(actual, expected) <= TOL[dtype], what


def run_case(counts: list[int], K: int, M: int, dtype: torch.dtype, seed: int = 0, w=None):
    """Forward and both gradients of grouped_gemm vs the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    E, N = len(counts), sum(counts)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x64 = torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype).double()
    w64 = w if w is not None else torch.randn(E, K, M, generator=g, dtype=torch.float64)
    w64 = w64.to(dtype).double()
    dy64 = torch.randn(N, M, generator=g, dtype=torch.float64).to(dtype).double()

    x = x64.to(DEVICE, dtype).requires_grad_()
    w_dev = w64.to(DEVICE, dtype).requires_grad_()
    y = grouped_gemm(x, w_dev, offsets.to(DEVICE))
    y.backward(dy64.to(DEVICE, dtype))

    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    yr = grouped_gemm_reference(xr, wr, offsets)
    yr.backward(dy64)
    assert_close(y.cpu(), yr.detach(), dtype, "y")
    assert_close(x.grad.cpu(), xr.grad, dtype, "dx")
    assert_close(w_dev.grad.cpu(), wr.grad, dtype, "dw")
    for e, c in enumerate(counts):
        if c == 0:  # written as exact zeros, not left uninitialised
            assert torch.equal(w_dev.grad[e].cpu(), torch.zeros(K, M, dtype=dtype))
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_groups(dtype):
    # Empty groups (first, middle, last), a one-row group, a group spanning several row
    # tiles, K and M not multiples of the tile (the interpreter uses 32x32x32 tiles).
    run_case([0, 5, 0, 1, 70, 0], K=45, M=50, dtype=dtype)


def test_single_group_small_dims():
    run_case([3], K=7, M=5, dtype=torch.float32, seed=1)


def test_transposed_weight_view():
    """w may be any strided view (no contiguity requirement, no copy)."""
    g = torch.Generator().manual_seed(2)
    w_EMK = torch.randn(3, 33, 40, generator=g, dtype=torch.float64)
    run_case([10, 0, 9], K=40, M=33, dtype=torch.float32, seed=2, w=w_EMK.transpose(1, 2))


def test_int64_offsets_and_no_grad():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 20, generator=g).to(DEVICE)
    w = torch.randn(2, 20, 17, generator=g).to(DEVICE)
    offsets = torch.tensor([4, 9])
    with torch.no_grad():
        y = grouped_gemm(x, w, offsets.to(DEVICE))
    ref = grouped_gemm_reference(x.double().cpu(), w.double().cpu(), offsets)
    assert_close(y.cpu(), ref, torch.float32, "y")


def test_zero_rows():
    x = torch.zeros(0, 12, device=DEVICE, requires_grad=True)
    w = torch.randn(3, 12, 8, device=DEVICE, requires_grad=True)
    y = grouped_gemm(x, w, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 12)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_bad_arguments():
    x = torch.randn(4, 8)
    w = torch.randn(2, 8, 3)
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm(torch.randn(4, 7), w, torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets"):
        grouped_gemm(x, w, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="must equal N"):
        grouped_gemm(x, w, torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="dtype"):
        grouped_gemm(x, w.half(), torch.tensor([2, 4], dtype=torch.int32))


def test_expanded_upstream_gradient():
    """``y.sum().backward()`` hands the kernels a stride-0 gradient; it must be read right."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 19, generator=g, dtype=torch.float64)
    w = torch.randn(2, 19, 6, generator=g, dtype=torch.float64)
    offsets = torch.tensor([3, 10], dtype=torch.int32)
    xd, wd = x.float().to(DEVICE).requires_grad_(), w.float().to(DEVICE).requires_grad_()
    grouped_gemm(xd, wd, offsets.to(DEVICE)).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    grouped_gemm_reference(xr, wr, offsets).sum().backward()
    assert_close(xd.grad.cpu(), xr.grad, torch.float32, "dx")
    assert_close(wd.grad.cpu(), wr.grad, torch.float32, "dw")
