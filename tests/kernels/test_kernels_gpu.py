"""CUDA-only kernel checks: bf16 accuracy of every candidate tile config, fully written
outputs, 64-bit indexing, the fp32 precision settings, device-side id checks, tuning."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.kernels import layer_inputs, rel_err

pytest.importorskip("triton")

from moestack.kernels import grouped_gemm, moe_experts, tuning  # noqa: E402
from moestack.kernels.reference import (  # noqa: E402
    grouped_gemm_reference,
    moe_experts_reference,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16_TOL = 3e-2  # normwise: max|err| / max|ref|


def check_grouped_gemm(dtype, device="cuda", tol=BF16_TOL, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = [0, 130, 1, 0, 257, 64, 0, 3]
    K, M = 200, 300
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), K, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(len(counts), K, M, generator=g, dtype=torch.float64).to(dtype)
    dy = torch.randn(sum(counts), M, generator=g, dtype=torch.float64).to(dtype)
    xd, wd = x.to(device).requires_grad_(), w.to(device).requires_grad_()
    y = grouped_gemm(xd, wd, offsets.to(device))
    y.backward(dy.to(device))
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = grouped_gemm_reference(xr, wr, offsets)
    yr.backward(dy.double())
    for name, a, b in (("y", y, yr), ("dx", xd.grad, xr.grad), ("dw", wd.grad, wr.grad)):
        assert rel_err(a.detach(), b.detach()) <= tol, name
    assert torch.equal(wd.grad[0], torch.zeros_like(wd.grad[0]))


def check_moe(
    dtype, device="cuda", tol=BF16_TOL, seed=0, T=257, D=192, F=160, E=8, k=2, empty=(5,)
):
    x, w1, w2, experts, weights, dy = layer_inputs(
        T, D, F, E, k, seed=seed, empty=empty, dtype=dtype, weights_dtype=torch.float32
    )
    ins = [
        t.to(device, dt).requires_grad_()
        for t, dt in ((x, dtype), (w1, dtype), (w2, dtype), (weights, torch.float32))
    ]
    y = moe_experts(ins[0], ins[1], ins[2], experts.to(device), ins[3])
    y.backward(dy.to(device, dtype))
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    yr = moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3])
    yr.backward(dy)
    pairs = [("y", y, yr)] + [
        (n, a.grad, b.grad) for n, a, b in zip(("dx", "dw1", "dw2", "dw"), ins, refs, strict=True)
    ]
    for name, a, b in pairs:
        assert rel_err(a.detach(), b.detach()) <= tol, name


# The slowest tests first (each compiles every kernel variant of one config: 60-90 s on the
# H200 machine's 16 cores): pytest-xdist hands tests out in file order, two a worker at first,
# so these start together and the short ones fill in around them (gpu_check's kernel_tests).
@pytest.mark.parametrize("bad", [4, -1])
def test_expert_ids_out_of_range_fail_on_the_device(bad):
    """A device-side assertion (no host sync) stops the run: in a subprocess, since it ends
    the CUDA context."""
    env = dict(os.environ, MOESTACK_AUTOTUNE="0")
    proc = subprocess.run(
        [sys.executable, "-c", _BAD_IDS.format(bad=bad)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0 and "NOT-CAUGHT" not in proc.stdout, proc.stdout
    assert "assert" in proc.stderr.lower(), proc.stderr[-2000:]


CANDIDATE_CASES = [
    (kind, i) for kind, cands in tuning.CANDIDATES.items() for i in range(len(cands))
]


@pytest.mark.parametrize(
    ("kind", "index"), CANDIDATE_CASES, ids=[f"{k}-{i}" for k, i in CANDIDATE_CASES]
)
def test_every_candidate_config_matches_float64(kind, index, poisoned_buffers, monkeypatch):
    """Autotuning may pick any candidate, so each one, forced in turn (the other kinds at
    their untimed default), must give bf16 results within tolerance of float64: ragged
    groups, empty experts, tiles crossing group borders, outputs poisoned with NaN."""
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", "/nonexistent.json")
    tuning.clear_cache()
    with tuning.forced_config(kind, tuning.CANDIDATES[kind][index]):
        check_grouped_gemm(torch.bfloat16, seed=index)
        check_moe(torch.bfloat16, seed=index)
        check_moe(torch.bfloat16, seed=index + 100, T=1000, D=256, F=512, E=16, k=4, empty=(3, 11))
    tuning.clear_cache()


def test_grouped_gemm_bf16(poisoned_buffers):
    check_grouped_gemm(torch.bfloat16)


def test_moe_bf16(poisoned_buffers):
    check_moe(torch.bfloat16)


def test_fp32_is_ieee_by_default(poisoned_buffers, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    check_grouped_gemm(torch.float32, tol=5e-6)
    check_moe(torch.float32, tol=5e-6)


def test_fp16(poisoned_buffers):
    check_moe(torch.float16, tol=3e-3)


def test_torch_weight_gradient_matches_float64(poisoned_buffers, monkeypatch):
    """The weight gradient by torch._grouped_mm (a candidate where it runs: bf16 on sm90+),
    forced: ragged groups, empty experts (zeros forced), top_k = E, one token. Where it
    cannot run, the forced backend gives moestack's default tile: the grouped GEMM's 300
    columns are not 16-byte rows of bf16, so its dW goes there."""
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", "/nonexistent.json")
    tuning.clear_cache()
    if not tuning.torch_wgrad_runs(torch.device("cuda"), torch.bfloat16, 192, 320):
        pytest.skip("torch._grouped_mm's weight gradient needs bf16 on sm90+")
    with tuning.forced_config("wgrad", tuning.TORCH_WGRAD):
        check_grouped_gemm(torch.bfloat16, seed=5)
        check_moe(torch.bfloat16, seed=5)
        check_moe(torch.bfloat16, seed=6, T=64, D=128, F=64, E=4, k=4, empty=())
        check_moe(torch.bfloat16, seed=7, T=1, D=128, F=64, E=4, k=2, empty=())
    tuning.clear_cache()


def _fp32_gemm_error() -> float:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(300, 256, generator=g, dtype=torch.float64)
    w = torch.randn(3, 256, 192, generator=g, dtype=torch.float64)
    offsets = torch.tensor([100, 100, 300], dtype=torch.int32)
    y = grouped_gemm(x.float().cuda(), w.float().cuda(), offsets.cuda())
    return rel_err(y, grouped_gemm_reference(x, w, offsets))


def test_fp32_follows_the_new_precision_api(monkeypatch):
    """torch >= 2.9's fp32_precision: "ieee" keeps float32 exact to ~1e-6, "tf32" rounds the
    inputs to 10 mantissa bits (errors ~1e-3): the kernels follow whichever is set."""
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    matmul = torch.backends.cuda.matmul
    try:
        saved = matmul.fp32_precision
    except AttributeError:
        pytest.skip("this torch has no fp32_precision setting (torch < 2.9)")
    try:
        matmul.fp32_precision = "ieee"
        assert _fp32_gemm_error() <= 5e-6
        matmul.fp32_precision = "tf32"
        assert 1e-5 < _fp32_gemm_error() <= 1e-2
    finally:
        matmul.fp32_precision = saved


_BAD_IDS = """
import torch
from moestack.kernels import moe_experts
x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
w1 = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
w2 = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
experts = torch.zeros(8, 2, dtype=torch.long, device="cuda")
experts[3, 1] = {bad}
y = moe_experts(x, w1, w2, experts, torch.rand(8, 2, device="cuda"))
torch.cuda.synchronize()
print("NOT-CAUGHT")
"""


def test_autotune_cache_is_filled(monkeypatch):
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "1")
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", "/nonexistent.json")
    tuning.clear_cache()
    check_moe(torch.bfloat16, T=64, D=64, F=64, E=8, k=2)
    table = tuning.export_cache()
    gpu = torch.cuda.get_device_name()
    kinds = {key.split("|")[0] for key in table[gpu]}
    assert kinds == {"mm", "mm_swiglu", "wgrad", "mm_dswiglu"}
    assert all(key.endswith("|R=128") for key in table[gpu]), table  # 64 tokens x 2 slots
    tuning.clear_cache()


def _big_free_memory(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return free > nbytes


@pytest.mark.skipif(
    not torch.cuda.is_available() or not _big_free_memory(24 << 30),
    reason="needs ~24 GiB of free GPU memory",
)
def test_64bit_indexing(monkeypatch):
    """Tensors with more than 2**31 elements: rows past the int32 range are right."""
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    dev, dt = "cuda", torch.bfloat16
    K, M, tail = 8192, 16, 96
    N = (1 << 31) // K + tail
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, K, device=dev, dtype=dt, generator=g).requires_grad_()
    w = torch.randn(2, K, M, device=dev, dtype=dt, generator=g).requires_grad_()
    offsets = torch.tensor([N - tail, N], dtype=torch.int32, device=dev)
    y = grouped_gemm(x, w, offsets)
    dy = torch.randn(N, M, device=dev, dtype=dt, generator=g)
    y.backward(dy)
    xt, dyt = x[-tail:].detach().double(), dy[-tail:].double()
    assert rel_err(y[-tail:].detach(), xt @ w[1].detach().double()) <= BF16_TOL
    assert rel_err(x.grad[-tail:], dyt @ w[1].detach().double().T) <= BF16_TOL
    assert rel_err(w.grad[1], xt.T @ dyt) <= BF16_TOL
    del x, y, dy, w

    # The MoE path: gathered x rows and scattered output rows past 2**31 elements.
    T, D, F = N, K, 16
    x = torch.randn(T, D, device=dev, dtype=dt, generator=g).requires_grad_()
    w1 = (torch.randn(2, D, 2 * F, device=dev, generator=g) / math.sqrt(D)).to(dt)
    w2 = (torch.randn(2, F, D, device=dev, generator=g) / math.sqrt(F)).to(dt)
    experts = torch.zeros(T, 1, dtype=torch.long, device=dev)
    experts[-tail:] = 1
    weights = torch.rand(T, 1, device=dev, generator=g)
    y = moe_experts(x, w1, w2, experts, weights)
    y.backward(torch.ones_like(y))
    rows = slice(T - tail, T)
    ref_x = x[rows].detach().double().requires_grad_()
    ref = moe_experts_reference(
        ref_x, w1.double(), w2.double(), experts[rows], weights[rows].double()
    )
    ref.sum().backward()
    assert rel_err(y[rows].detach(), ref.detach()) <= BF16_TOL
    assert rel_err(x.grad[rows], ref_x.grad) <= BF16_TOL
