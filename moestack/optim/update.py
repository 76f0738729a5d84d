"""The AdamW update of OffloadAdamW on flat fp32 host slices, and checks of its arguments.

The step runs torch's fused CPU AdamW kernel (``torch._fused_adamw_``) over a few large
contiguous slices; moments kept in bf16 are widened slice by slice through an fp32 scratch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from moestack.optim.plan import ShardPlan, Unit
from moestack.optim.transfer import HostBuffers

_BF16_CHUNK = 1 << 21  # elements per fp32 scratch slice when moments are stored in bf16

# (param or master weights, grad, exp_avg, exp_avg_sq, step): one contiguous slice each
Run = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def group_hparams(group: dict[str, Any]) -> dict[str, float]:
    """The keyword arguments of :func:`adamw_` for a param group."""
    return {
        "lr": float(group["lr"]),
        "beta1": float(group["betas"][0]),
        "beta2": float(group["betas"][1]),
        "weight_decay": float(group["weight_decay"]),
        "eps": float(group["eps"]),
    }


def slices(
    spans: Sequence[tuple[int, int, int, int]],
    params: Sequence[Tensor],
    host: HostBuffers,
    steps: Sequence[int],
    in_place: bool,
) -> list[Run]:
    """The runs of ``spans`` (``(pidx, x_start, off, numel)``, see
    :func:`~moestack.optim.plan.contiguous_runs`): weights and gradients from the parameters
    when ``in_place``, else from the host buffers; moments always from the host buffers;
    the step count (after this step) as the tensor torch's kernel takes."""
    out = []
    for pidx, x0, off, n in spans:
        if in_place:
            p = params[pidx]
            assert p.grad is not None
            x = p.data.view(-1)[x0 : x0 + n]
            g = p.grad.view(-1)[x0 : x0 + n]
        else:
            assert host.master is not None and host.grad is not None
            x = host.master[off : off + n]
            g = host.grad[off : off + n]
        m = host.exp_avg[off : off + n]
        v = host.exp_avg_sq[off : off + n]
        out.append((x, g, m, v, torch.tensor(float(steps[pidx]), dtype=torch.float32)))
    return out


def step_runs(
    runs: Sequence[Run], hparams: dict[str, float], scratch: Tensor | None
) -> Tensor | None:
    """One AdamW step over ``runs``; returns the fp32 moment scratch (bf16 moments only).

    With fp32 moments all runs go to the kernel at once. With bf16 moments each run is
    stepped in slices of at most ``_BF16_CHUNK`` elements through ``scratch`` (``[2, n]``),
    which is grown to fit and returned for reuse.
    """
    if runs[0][2].dtype == torch.float32:
        xs, gs, ms, vs, ss = (list(t) for t in zip(*runs, strict=True))
        adamw_(xs, gs, ms, vs, ss, **hparams)
        return scratch
    longest = max(x.numel() for x, *_ in runs)
    if scratch is None or scratch.shape[1] < min(longest, _BF16_CHUNK):
        scratch = torch.empty(2, min(longest, _BF16_CHUNK))
    for x, g, m, v, s in runs:  # bf16 moments: fp32 scratch slice by slice
        for a in range(0, x.numel(), _BF16_CHUNK):
            b = min(a + _BF16_CHUNK, x.numel())
            m32 = scratch[0, : b - a].copy_(m[a:b])
            v32 = scratch[1, : b - a].copy_(v[a:b])
            adamw_([x[a:b]], [g[a:b]], [m32], [v32], [s], **hparams)
            m[a:b].copy_(m32)
            v[a:b].copy_(v32)
    return scratch


def adamw_(
    xs: list[Tensor],
    gs: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """AdamW on lists of fp32 CPU tensors: torch's fused kernel, or a foreach fallback."""
    if hasattr(torch, "_fused_adamw_"):
        torch._fused_adamw_(
            xs,
            gs,
            ms,
            vs,
            [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        return
    torch._foreach_mul_(xs, 1 - lr * weight_decay)  # pragma: no cover - torch < 2.4
    torch._foreach_lerp_(ms, gs, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
    for x, m, v, s in zip(xs, ms, vs, steps, strict=True):
        t = float(s)
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        x.addcdiv_(m, denom, value=-lr / bc1)


def idle_experts(
    plan: ShardPlan, active: Sequence[bool], grad_of: Callable[[Unit], Tensor]
) -> set[int]:
    """This rank's expert units (indices into ``plan.units``) whose gradient is exactly zero:
    with ``skip_idle_experts`` they get no update this step."""
    idle = set()
    for k in plan.my_units:
        u = plan.units[k]
        if u.expert and active[u.pidx] and _all_zero(grad_of(u)):
            idle.add(k)
    return idle


def _all_zero(t: Tensor) -> bool:
    """Exactly zero everywhere (NaN is not).

    A busy expert's gradient almost never has 64 evenly spread zeros, so a strided probe
    answers "no" for it at once; only a probe of zeros pays the full pass (aminmax: one read,
    no bool copy). The answer is exact either way.
    """
    if t.numel() == 0:
        return True
    if bool(t[:: max(1, t.numel() // 64)].any()):  # NaN counts as nonzero here too
        return False
    lo, hi = torch.aminmax(t)
    return bool(lo == 0) and bool(hi == 0)


def grad_norms(grads: Sequence[Tensor]) -> Tensor:
    """Each gradient's 2-norm as fp32 (``[len(grads)]``, on the first gradient's device).

    The first half of the one clipping norm of OffloadAdamW (the serial step and the
    pipelined buckets both call it): one multi-tensor launch per device and dtype, so a
    gradient's norm is the same bits whichever list it is measured in."""
    if not grads:
        return torch.zeros(0)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(k)
    norms: list[Tensor] = list(grads)  # each replaced by its norm below
    for ks in groups.values():
        got = torch._foreach_norm([grads[k] for k in ks], 2.0, dtype=torch.float32)
        for k, n in zip(ks, got, strict=True):
            norms[k] = n.to(grads[0].device)
    return torch.stack(norms)


def param_norms(grads: Sequence[Tensor | None]) -> Tensor:
    """``norms_P``: each parameter's gradient 2-norm (:func:`grad_norms`) in parameter
    order, 0 where a parameter has no gradient."""
    have = [k for k, g in enumerate(grads) if g is not None]
    if not have:
        return torch.zeros(len(grads))
    norms = grad_norms([grads[k] for k in have])  # type: ignore[misc]
    if len(have) == len(grads):
        return norms
    out = norms.new_zeros(len(grads))
    return out.index_copy_(0, torch.tensor(have, device=out.device), norms)


def total_norm(norms_P: Tensor, wide_P: Tensor | None = None) -> Tensor:
    """The global 2-norm (a 0-d fp32 tensor) from per-parameter fp32 norms ``norms_P`` in
    parameter order: squared and summed in fp64, the root narrowed to fp32.

    The second half of the one clipping norm: the serial step and the pipelined step combine
    the same per-parameter norms with it, so their norms, clipping factors and results are
    bitwise equal. ``wide_P`` (fp64, as long) is scratch made once by a caller that wants
    nothing allocated per step."""
    wide = norms_P.double() if wide_P is None else wide_P.copy_(norms_P)
    return wide.square_().sum().sqrt().float()


# Elements a chunk of :func:`sum_of_squares` squares at a time (16 MB of fp32).
NORM_CHUNK = 1 << 22


def sum_of_squares(t: Tensor) -> Tensor:
    """``(t * t).sum()`` as a 0-d fp32 tensor (zero for an empty ``t``, fp32 sums of a bf16
    ``t``), chunk by chunk.

    Why chunks: ``t.square()`` whole is a temporary as large as the gradients (0.5 GB at
    137M parameters, allocated and faulted in every step); a 16 MB chunk's is reused from
    the allocator's cache. Each chunk sums as torch sums, the chunks add in fp64. Measured
    on 30M fp32 elements, 2 threads: 23 ms against 115 ms for ``t.square().sum()``, equal
    to 1e-8 relative."""
    if not t.numel():
        return torch.zeros(())
    total = torch.zeros((), dtype=torch.float64)
    for chunk in t.reshape(-1).split(NORM_CHUNK):
        total += chunk.float().square().sum()  # bf16 gradients are summed in fp32
    return total.to(torch.float32)


def check_group(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Raise ValueError naming a bad hyper-parameter of a param group."""
    if any(k in group for k in ("lr", "betas", "eps", "weight_decay")):
        h = {**defaults, **group}
        check_hparams(h["lr"], h["betas"], h["eps"], h["weight_decay"], "group ")


def check_floating(params: Sequence[Tensor]) -> None:
    """Raise ValueError for a parameter AdamW cannot optimise (not floating point)."""
    for p in params:
        if not p.is_floating_point():
            raise ValueError(f"parameter of dtype {p.dtype} cannot be optimised by AdamW")


def check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str) -> None:
    """Raise ValueError naming the bad hyper-parameter, as torch.optim.AdamW does."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}lr must be a float or a 1-element tensor, got {lr.shape}")
        lr = float(lr)
    if not lr >= 0.0:
        raise ValueError(f"Invalid {where}lr={lr}: the learning rate must be >= 0")
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"Invalid {where}betas={betas!r}: give two numbers in [0, 1)") from None
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid {where}betas[0]={b1}: must be in [0, 1)")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid {where}betas[1]={b2}: must be in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"Invalid {where}eps={eps}: must be >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid {where}weight_decay={weight_decay}: must be >= 0")


def parse_moment_dtype(value: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or ``torch.bfloat16`` from a dtype or its name (``fp32``, ``bf16``)."""
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if isinstance(value, torch.dtype) and value in (torch.float32, torch.bfloat16):
        return value
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(
        f"moment_dtype={value!r} is not supported; use torch.float32 or torch.bfloat16"
    )


def check_offload(offload: str) -> None:
    """Raise ValueError unless ``offload`` names host memory (``"cpu"``)."""
    if str(offload) != "cpu":
        raise ValueError(
            f"offload={offload!r} is not supported: the optimizer state lives in host memory; "
            "use offload='cpu'"
        )
