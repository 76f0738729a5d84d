"""moe_experts (Triton; the interpreter on CPU) against the float64 reference."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.kernels import layer_inputs, needs_kernels, rel_err

pytest.importorskip("triton")

from moestack.kernels import moe_experts  # noqa: E402
from moestack.kernels.reference import moe_experts_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = needs_kernels()
# Normwise relative error bounds: max|err| / max|ref|.
TOL = {torch.float32: 5e-6, torch.float16: 3e-3, torch.bfloat16: 3e-2}
NAMES = ("y", "dx", "dw1", "dw2", "dweights")


def run_case(T, D, F, E, k, dtype, seed=0, empty_expert=None, weights_dtype=None):
    """Output and the four gradients of moe_experts vs the float64 reference."""
    weights_dtype = weights_dtype or dtype
    # The reference sees the same rounded inputs, so only the kernels' error is measured.
    x, w1, w2, experts, weights, dy = layer_inputs(
        T, D, F, E, k, seed=seed, empty=empty_expert, dtype=dtype, weights_dtype=weights_dtype
    )

    ins = [
        t.to(DEVICE, dt).requires_grad_()
        for t, dt in ((x, dtype), (w1, dtype), (w2, dtype), (weights, weights_dtype))
    ]
    y = moe_experts(ins[0], ins[1], ins[2], experts.to(DEVICE), ins[3])
    assert y.dtype == dtype
    y.backward(dy.to(DEVICE, dtype))
    got = [y.detach()] + [t.grad for t in ins]

    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    yr = moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3])
    yr.backward(dy)
    want = [yr.detach()] + [t.grad for t in refs]
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel_err(a, b) <= TOL[dtype], name
    assert ins[3].grad.dtype == weights_dtype
    if empty_expert is not None:  # an expert without tokens gets exact zero gradients
        assert torch.equal(ins[1].grad[empty_expert].cpu(), torch.zeros_like(w1[0], dtype=dtype))
        assert torch.equal(ins[2].grad[empty_expert].cpu(), torch.zeros_like(w2[0], dtype=dtype))
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_general(dtype):
    # Odd D and F (not multiples of the 32-wide interpreter tiles), k=2 of E=5, one
    # expert that receives no token, some experts spanning several row tiles.
    run_case(T=40, D=37, F=21, E=5, k=2, dtype=dtype, empty_expert=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_top1(dtype):
    run_case(T=23, D=48, F=40, E=4, k=1, dtype=dtype, seed=1, empty_expert=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_top_k_equals_num_experts(dtype):
    run_case(T=9, D=20, F=16, E=3, k=3, dtype=dtype, seed=2)


def test_single_token():
    run_case(T=1, D=33, F=17, E=4, k=2, dtype=torch.float32, seed=3)


def test_fp32_router_weights_with_fp16_activations():
    run_case(T=12, D=24, F=16, E=3, k=2, dtype=torch.float16, seed=4, weights_dtype=torch.float32)


def test_empty_input():
    E, D, F, k = 3, 8, 6, 2
    x = torch.zeros(0, D, device=DEVICE, requires_grad=True)
    w1 = torch.randn(E, D, 2 * F, device=DEVICE, requires_grad=True)
    w2 = torch.randn(E, F, D, device=DEVICE, requires_grad=True)
    weights = torch.zeros(0, k, device=DEVICE, requires_grad=True)
    experts = torch.zeros(0, k, dtype=torch.long, device=DEVICE)
    y = moe_experts(x, w1, w2, experts, weights)
    assert y.shape == (0, D)
    y.sum().backward()
    assert x.grad.shape == (0, D) and weights.grad.shape == (0, k)
    assert torch.equal(w1.grad, torch.zeros_like(w1))
    assert torch.equal(w2.grad, torch.zeros_like(w2))


def test_no_grad_matches_grad_path():
    x, w1, w2, experts, weights, _ = layer_inputs(10, 16, 12, 3, 2, seed=5)
    args = [t.float().to(DEVICE) for t in (x, w1, w2)]
    with torch.no_grad():
        y0 = moe_experts(*args, experts.to(DEVICE), weights.float().to(DEVICE))
    y1 = moe_experts(
        args[0].requires_grad_(), *args[1:], experts.to(DEVICE), weights.float().to(DEVICE)
    )
    assert torch.equal(y0, y1.detach())


def test_every_output_element_written(poisoned_buffers):
    """Poison every buffer the kernels allocate with NaN: no NaN may survive."""
    run_case(T=17, D=35, F=19, E=4, k=2, dtype=torch.float32, seed=6, empty_expert=1)


def test_bad_arguments():
    x, w1, w2, experts, weights, _ = layer_inputs(4, 8, 6, 3, 2, seed=7)
    x, w1, w2, weights = (t.float() for t in (x, w1, w2, weights))
    with pytest.raises(ValueError, match="shape mismatch"):
        moe_experts(x, w1, w2[:, :5], experts, weights)
    with pytest.raises(ValueError, match="experts and weights"):
        moe_experts(x, w1, w2, experts[:, :1], weights)
    with pytest.raises(TypeError, match="integer"):
        moe_experts(x, w1, w2, experts.float(), weights)
    with pytest.raises(TypeError, match="weights must be"):
        moe_experts(x, w1, w2, experts, weights.half())


def test_expanded_upstream_gradient():
    """``y.sum().backward()`` hands the kernels a stride-0 gradient; it must be read right."""
    x, w1, w2, experts, weights, _ = layer_inputs(11, 18, 10, 3, 2, seed=8)
    ins = [t.float().to(DEVICE).requires_grad_() for t in (x, w1, w2, weights)]
    moe_experts(ins[0], ins[1], ins[2], experts.to(DEVICE), ins[3]).sum().backward()
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3]).sum().backward()
    for name, a, b in zip(NAMES[1:], ins, refs, strict=True):
        assert rel_err(a.grad, b.grad) <= TOL[torch.float32], name


@pytest.mark.parametrize("wanted", [(0,), (1,), (2,), (3,), (0, 3), (1, 2)])
def test_gradients_of_some_inputs(wanted):
    """Only some inputs need a gradient (the backward skips the others' GEMMs): the ones
    asked for still match the float64 reference."""
    x, w1, w2, experts, weights, dy = layer_inputs(13, 20, 9, 4, 2, seed=9)
    ins = [
        t.float().to(DEVICE).requires_grad_(i in wanted) for i, t in enumerate((x, w1, w2, weights))
    ]
    moe_experts(ins[0], ins[1], ins[2], experts.to(DEVICE), ins[3]).backward(dy.float().to(DEVICE))
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3]).backward(dy)
    for i, (name, a, b) in enumerate(zip(NAMES[1:], ins, refs, strict=True)):
        if i in wanted:
            assert rel_err(a.grad, b.grad) <= TOL[torch.float32], name
        else:
            assert a.grad is None, name


@pytest.mark.parametrize(
    "hooks",
    [
        contextlib.nullcontext,
        lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        torch.autograd.graph.save_on_cpu,
    ],
    ids=["plain", "identity_hooks", "save_on_cpu"],
)
def test_backward_twice_through_a_retained_graph(hooks):
    """With retain_graph the backward must leave the saved z as it was (the in-place
    backward runs only when the graph is freed): both backwards match the reference, also
    under saved-tensors hooks that hand back the very tensor they packed."""
    x, w1, w2, experts, weights, dy = layer_inputs(9, 12, 7, 3, 2, seed=10)
    ins = [t.float().to(DEVICE).requires_grad_() for t in (x, w1, w2, weights)]
    with hooks():
        y = moe_experts(ins[0], ins[1], ins[2], experts.to(DEVICE), ins[3])
    first = torch.autograd.grad(y, ins, dy.float().to(DEVICE), retain_graph=True)
    second = torch.autograd.grad(y, ins, dy.float().to(DEVICE))
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    want = torch.autograd.grad(moe_experts_reference(*refs[:3], experts, refs[3]), refs, dy)
    for name, a, b, w in zip(NAMES[1:], first, second, want, strict=True):
        assert rel_err(a, w) <= TOL[torch.float32], name
        assert rel_err(b, w) <= TOL[torch.float32], name


def test_backward_intermediates_stay_small(count_allocations):
    """The backward's own buffers (not the gradients it returns) peak at one [R, F] G plus
    the [R, D] per-slot dx rows and two [R] fp32 vectors: dz is written over the saved z,
    and weight * h over G. Counted by wrapping the kernels' allocator."""
    T, D, F, E, k = 16, 24, 40, 4, 3
    R = T * k
    x, w1, w2, experts, weights, dy = layer_inputs(T, D, F, E, k, seed=11)
    ins = [t.float().to(DEVICE).requires_grad_() for t in (x, w1, w2, weights)]
    y = moe_experts(ins[0], ins[1], ins[2], experts.to(DEVICE), ins[3])
    counted = count_allocations(returned=((E, D, 2 * F), (E, F, D), (T, D)))
    y.backward(dy.float().to(DEVICE))
    assert (R, 2 * F) not in counted.sizes  # no dz buffer beside z
    assert counted.sizes.count((R, F)) == 1  # G only; weight * h is written over it
    assert counted.peak <= 4 * (R * F + R * D + 2 * R)
