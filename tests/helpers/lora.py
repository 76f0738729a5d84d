"""LoRA on the experts against a float64 reference written token by token, on random cases
at the edges (ragged groups, an empty expert, top_k = num_experts, rank 1 and one token, odd
sizes): the checks tests/model/test_lora.py runs on the CPU and test_lora_gpu.py on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestack.moe import ExpertAdapters, run_experts


def reference_experts(x, w1, w2, experts, weights, a1, b1, a2, b2, scale):
    """y[t] = sum_j weights[t, j] * SwiGLU expert e = experts[t, j] of x[t], each product
    ``v @ W[e] + scale * (v @ A[e]) @ B[e]``: one token and one expert at a time (float64)."""
    d_ff = w2.shape[1]
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(x.shape[1])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = x[t] @ w1[e] + scale * (x[t] @ a1[e]) @ b1[e]
            act = F.silu(h[:d_ff]) * h[d_ff:]
            y = y + weights[t, j] * (act @ w2[e] + scale * (act @ a2[e]) @ b2[e])
        rows.append(y)
    return torch.stack(rows)


def random_case(seed, tokens, d_model, d_ff, num_experts, top_k, rank, empty_expert=None):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).requires_grad_()

    x = rand(tokens, d_model)
    w1, w2 = (
        rand(num_experts, d_model, 2 * d_ff, std=0.3),
        rand(num_experts, d_ff, d_model, std=0.3),
    )
    adapters = [rand(num_experts, d_model, rank, std=0.3), rand(num_experts, rank, 2 * d_ff, std=0.3),
                rand(num_experts, d_ff, rank, std=0.3), rand(num_experts, rank, d_model, std=0.3)]  # fmt: skip
    choices = [e for e in range(num_experts) if e != empty_expert]
    scores = torch.rand(tokens, len(choices), generator=gen)
    experts = torch.tensor(choices)[scores.topk(top_k, dim=-1).indices]
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    return x, w1, w2, experts, weights, adapters


CASES = {
    "ragged groups": dict(tokens=13, d_model=16, d_ff=24, num_experts=5, top_k=2, rank=4),
    "an empty expert": dict(tokens=9, d_model=16, d_ff=8, num_experts=4, top_k=2, rank=3,
                            empty_expert=2),
    "top_k = num_experts": dict(tokens=7, d_model=8, d_ff=12, num_experts=3, top_k=3, rank=2),
    "rank 1, one token": dict(tokens=1, d_model=16, d_ff=16, num_experts=4, top_k=2, rank=1),
    "odd sizes": dict(tokens=11, d_model=7, d_ff=5, num_experts=3, top_k=2, rank=3),
}  # fmt: skip


def check_against_reference(impl: str, dtype: torch.dtype, case: str, device: str = "cpu") -> None:
    """run_experts with adapters in ``dtype`` on ``device`` against ``reference_experts``
    (float64, on the CPU): output and the gradients of every input; an empty expert's
    adapters get exact zeros."""
    x, w1, w2, experts, weights, adapters = random_case(7, **CASES[case])
    scale = 1.7
    want = reference_experts(x, w1, w2, experts, weights, *adapters, scale)
    leaves = [x, w1, w2, *adapters]
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_grads = torch.autograd.grad((want * probe).sum(), leaves)
    cast = [t.detach().to(device, dtype).requires_grad_() for t in leaves]
    got = run_experts(cast[0], cast[1], cast[2], experts.to(device), weights.to(device, dtype),
                      impl, ExpertAdapters(*cast[3:], scale, 0.0))  # fmt: skip
    got_grads = torch.autograd.grad((got * probe.to(device, dtype)).sum(), cast)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    names = ["x", "w1", "w2", "w1_A", "w1_B", "w2_A", "w2_B"]
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.cpu().double(), w, **tol, msg=lambda m, n=name: f"d{n}: {m}")
    if case == "an empty expert":  # no rows: its adapters get exactly zero gradient
        assert all(float(g[2].abs().max()) == 0.0 for g in got_grads[3:])


def check_half_precision_base(impl: str, base_dtype: torch.dtype, device: str = "cpu") -> None:
    """lora.base_dtype's layout at the experts: w1/w2 in half precision, the input and the
    adapters in fp32, on ``device``. The experts compute in the weights' dtype and give the
    float64 reference of the same values within that dtype's rounding; the adapters'
    gradients come back in fp32."""
    x, w1, w2, experts, weights, adapters = random_case(5, **CASES["ragged groups"])
    w1, w2 = (w.detach().to(device, base_dtype) for w in (w1, w2))
    x32 = x.detach().to(device, torch.float32)
    a32 = [a.detach().to(device, torch.float32).requires_grad_() for a in adapters]
    got = run_experts(x32, w1, w2, experts.to(device), weights.to(device, torch.float32), impl,
                      ExpertAdapters(*a32, 1.5, 0.0))  # fmt: skip
    assert got.dtype == base_dtype
    got.float().square().sum().backward()
    want = reference_experts(x32.to(base_dtype).cpu().double(), w1.cpu().double(),
                             w2.cpu().double(), experts, weights,
                             *(a.detach().cpu().double() for a in a32), 1.5)  # fmt: skip
    torch.testing.assert_close(got.cpu().double(), want, rtol=5e-2, atol=5e-2)
    assert all(a.grad.dtype == torch.float32 and a.grad.abs().sum() > 0 for a in a32[1::2])
