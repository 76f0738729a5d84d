"""What the kernel tests share: the normwise error against a float64 reference, the MoE
layer's seeded inputs, and the markers that skip a module where its kernels cannot run.
Nothing here imports triton, so a module can skip before it needs it."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import pytest
import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / max|expected| (floored at 1e-6), in float64 on the CPU, for
    tensors on any device; 0.0 for empty ones. Fails on a shape mismatch or a non-finite
    value in ``actual`` (an output element the kernels never wrote)."""
    assert actual.shape == expected.shape, f"{tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), "non-finite values (unwritten output?)"
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    err = (actual - expected).abs().max().item()
    return err / max(expected.abs().max().item(), 1e-6)


def layer_inputs(
    T: int,
    D: int,
    F: int,
    E: int,
    k: int,
    *,
    seed: int,
    empty: int | Sequence[int] | None = (),
    dtype: torch.dtype | None = None,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """x [T, D], w1 [E, D, 2F], w2 [E, F, D], experts [T, k], weights [T, k], dy [T, D] of
    the MoE layer, in float64 from ``seed``: experts are the top k of random scores, never
    an expert in ``empty`` (an id or several), weights their softmax. With ``dtype`` the
    float64 tensors hold values rounded through it (the weights through ``weights_dtype``,
    ``dtype`` unless given), so a reference fed them sees what the kernels see."""
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g, dtype=torch.float64)
    w1_EDF = torch.randn(E, D, 2 * F, generator=g, dtype=torch.float64) / math.sqrt(D)
    w2_EFD = torch.randn(E, F, D, generator=g, dtype=torch.float64) / math.sqrt(F)
    scores_TE = torch.rand(T, E, generator=g, dtype=torch.float64)
    unused = [] if empty is None else [empty] if isinstance(empty, int) else list(empty)
    scores_TE[:, unused] = -1.0  # experts that receive no token
    top_Tk, experts_Tk = scores_TE.topk(k, dim=1)
    weights_Tk = torch.softmax(top_Tk, dim=1)
    dy_TD = torch.randn(T, D, generator=g, dtype=torch.float64)
    if dtype is not None:
        x_TD, w1_EDF, w2_EFD, dy_TD = (t.to(dtype).double() for t in (x_TD, w1_EDF, w2_EFD, dy_TD))
        weights_Tk = weights_Tk.to(weights_dtype or dtype).double()
    return x_TD, w1_EDF, w2_EFD, experts_Tk, weights_Tk, dy_TD


def interpreter_only(reason: str) -> pytest.MarkDecorator:
    """Skip (saying ``reason``) unless the kernels run in Triton's interpreter on the CPU."""
    return pytest.mark.skipif(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1", reason=reason
    )


def needs_kernels() -> pytest.MarkDecorator:
    """Skip unless the kernels can run: on CUDA, or in the interpreter."""
    return pytest.mark.skipif(
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
        reason="needs CUDA or TRITON_INTERPRET=1 (set before the first kernel call)",
    )
