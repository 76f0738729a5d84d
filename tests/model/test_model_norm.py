"""moestack.model.RMSNorm: nn.RMSNorm run in its input's dtype, outside autocast (so bf16
weights under CUDA autocast keep the fused kernel), checked against nn.RMSNorm and float64."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from moestack.model import RMSNorm


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w.double()


def norms(d: int, seed: int) -> tuple[RMSNorm, nn.RMSNorm]:
    torch.manual_seed(seed)
    ours, plain = RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(1.0, 0.1)
        plain.weight.copy_(ours.weight)
    return ours, plain


def test_fp32_is_nn_rmsnorm_exactly():
    ours, plain = norms(37, seed=0)
    x = torch.randn(5, 3, 37, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), plain(x))


def test_mixed_dtypes_run_in_the_input_dtype_without_a_warning():
    """An fp32 weight with bf16 input (and the reverse): the weight follows the input, the
    gradient reaches the weight in its own dtype."""
    for x_dtype, w_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        ours, _ = norms(64, seed=2)
        ours.to(w_dtype)
        x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).to(x_dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = ours(x)
            y.float().sum().backward()
        assert y.dtype == x_dtype and ours.weight.grad.dtype == w_dtype
        tol = 2e-2 if torch.bfloat16 in (x_dtype, w_dtype) else 1e-6
        err = (y.double() - reference(x, ours.weight.detach(), 1e-6)).abs().max().item()
        assert err <= tol, (x_dtype, w_dtype, err)
