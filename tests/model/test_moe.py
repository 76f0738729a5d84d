"""The MoE layer against a float64 loop-over-tokens reference, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from helpers.moe import moe_layer, reference_moe

import moestack.kernels.grouped_mm as grouped_mm_module
from moestack import MoE, MoEConfig, RouterConfig
from moestack.moe import grouped_mm_torch, moe_experts_torch, sort_by_expert


def _compare(moe, x, top_k, score="softmax", renormalize=True, atol=1e-5):
    x = x.clone().requires_grad_(True)
    y = moe(x)
    grad_out = torch.randn_like(y)
    (y * grad_out).sum().backward()

    ref_params = [
        p.detach().double().clone().requires_grad_(True)
        for p in (moe.router.weight, moe.w1, moe.w2)
    ]
    x64 = x.detach().double().clone().requires_grad_(True)
    y64 = reference_moe(x64.reshape(-1, x.shape[-1]), *ref_params, top_k, score, renormalize)
    y64 = y64.reshape(x.shape)
    (y64 * grad_out.double()).sum().backward()

    torch.testing.assert_close(y.double(), y64, atol=atol, rtol=1e-4)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=atol, rtol=1e-4)
    for p, ref in zip((moe.router.weight, moe.w1, moe.w2), ref_params, strict=True):
        torch.testing.assert_close(p.grad.double(), ref.grad, atol=atol, rtol=1e-4)


@pytest.mark.parametrize(
    "d_model, num_experts, top_k, d_ff, tokens",
    [
        (16, 4, 2, 8, 24),  # grouped_mm-aligned sizes
        (13, 5, 2, 7, 19),  # odd sizes: the sorted-loop path
        (8, 3, 3, 4, 10),  # top_k = num_experts
        (8, 6, 1, 4, 1),  # a single token: most experts get none
    ],
)
def test_moe_matches_float64_reference(d_model, num_experts, top_k, d_ff, tokens):
    moe = moe_layer(d_model, num_experts, top_k, d_ff, seed=tokens)
    x = torch.randn(tokens, d_model)
    _compare(moe, x, top_k)


def test_moe_batched_input_and_sigmoid_without_renormalisation():
    moe = moe_layer(12, 4, 2, 6, seed=3, score="sigmoid", renormalize=False)
    x = torch.randn(2, 5, 12)
    _compare(moe, x, 2, score="sigmoid", renormalize=False)


def test_expert_with_no_tokens_gets_zero_gradient():
    moe = moe_layer(8, 4, 1, 4, seed=0)
    with torch.no_grad():  # expert 3 can never win: its router row is very negative
        moe.router.weight[3] = -100 * moe.router.weight[:3].abs().sum(0)
    x = torch.randn(9, 8).abs()
    _compare(moe, x, 1)
    assert (moe.w1.grad[3] == 0).all() and (moe.w2.grad[3] == 0).all()


def test_empty_input():
    moe = moe_layer(8, 4, 2, 4, seed=0)
    x = torch.randn(0, 8, requires_grad=True)
    y = moe(x)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8)


def test_grouped_mm_and_loop_agree_with_per_group_matmul():
    torch.manual_seed(0)
    x = torch.randn(20, 16)
    w = torch.randn(4, 16, 32)
    offsets = torch.tensor([5, 5, 12, 20], dtype=torch.int32)  # expert 1 is empty
    expected = torch.cat([x[0:5] @ w[0], x[5:12] @ w[2], x[12:20] @ w[3]])
    torch.testing.assert_close(grouped_mm_torch(x, w, offsets), expected)
    odd_w = torch.randn(4, 15, 33)  # not 16-byte aligned: padded to it
    torch.testing.assert_close(
        grouped_mm_torch(x[:, :15], odd_w, offsets),
        torch.cat([x[0:5, :15] @ odd_w[0], x[5:12, :15] @ odd_w[2], x[12:20, :15] @ odd_w[3]]),
    )


def per_group_float64(x, w, offsets):
    """y rows of group e = x rows of group e @ w[e], one group at a time in float64."""
    starts = [0, *offsets.tolist()[:-1]]
    rows = [
        x[s:e].double() @ w[g].double()
        for g, (s, e) in enumerate(zip(starts, offsets.tolist(), strict=True))
    ]
    return torch.cat(rows)


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    """Counts torch._grouped_mm's calls and makes both per-group loops fail if they run."""
    calls = []
    real = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(args[1].dim())  # 3: x @ w[e]; 2: the weight-gradient form
        return real(*args, **kwargs)

    def no_loop(*args):
        raise AssertionError("the per-group loop ran where torch._grouped_mm can")

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    monkeypatch.setattr(grouped_mm_module, "_grouped_mm_loop", no_loop)
    monkeypatch.setattr(grouped_mm_module, "_grouped_mm_wgrad_loop", no_loop)
    return calls


# (K, M): a rank-1 adapter's two products, odd widths, a width below one 16-byte row
UNALIGNED = [(16, 1), (1, 24), (7, 5), (3, 3), (13, 8)]
OFFSETS = [5, 5, 12, 12, 20]  # experts 1 and 3 are empty


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("k, m", UNALIGNED)
def test_unaligned_widths_run_on_grouped_mm_padded_not_in_a_loop(
    grouped_mm_calls, k, m, dtype, tol
):
    """Eager forward and backward (torch._grouped_mm's own autograd) against float64 groups."""
    gen = torch.Generator().manual_seed(k * 100 + m)
    x = torch.randn(20, k, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(len(OFFSETS), k, m, generator=gen).to(dtype).requires_grad_()
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    y = grouped_mm_torch(x, w, offsets)
    assert y.shape == (20, m) and y.dtype == dtype and grouped_mm_calls
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    want = per_group_float64(x64, w64, offsets)
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    probe = torch.randn(20, m, generator=gen, dtype=torch.float64)
    (y.double() * probe).sum().backward()
    (want * probe).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol, atol=tol)
    assert (w.grad[[1, 3]] == 0).all()  # the empty experts


@pytest.mark.parametrize("k, m", UNALIGNED + [(16, 8)])
def test_the_compiled_paths_ops_take_grouped_mm_and_match_float64_groups(grouped_mm_calls, k, m):
    """moestack::grouped_mm and its backward (moestack::grouped_mm_wgrad: torch._grouped_mm's
    2D x 2D form) as torch.compile runs them, called directly: fp32, padded widths, empty
    experts (first, middle, last) with exactly zero weight gradients."""
    gen = torch.Generator().manual_seed(k * 10 + m)
    offsets = torch.tensor([0, 6, 6, 13, 20, 20], dtype=torch.int32)
    x = torch.randn(20, k, generator=gen).requires_grad_()
    w = torch.randn(6, k, m, generator=gen).requires_grad_()
    y = torch.ops.moestack.grouped_mm(x, w, offsets)
    assert y.is_contiguous()  # as its fake implementation says
    probe = torch.randn(20, m, generator=gen)
    (y * probe).sum().backward()
    assert 2 in grouped_mm_calls and 3 in grouped_mm_calls  # the wgrad form and the 3D form
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    want = per_group_float64(x64, w64, offsets)
    (want * probe.double()).sum().backward()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    assert (w.grad[[0, 2, 5]] == 0).all()


def test_float64_keeps_the_loop_and_agrees():
    """torch._grouped_mm has no float64: the loops run, forward and weight gradient."""
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([4, 4, 9], dtype=torch.int32)
    x, w = (
        torch.randn(9, 3, generator=gen, dtype=torch.float64),
        torch.randn(3, 3, 5, generator=gen, dtype=torch.float64),
    )
    torch.testing.assert_close(grouped_mm_torch(x, w, offsets), per_group_float64(x, w, offsets))
    dy = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    dw = torch.ops.moestack.grouped_mm_wgrad(x, dy, offsets)
    torch.testing.assert_close(dw[2], x[4:9].t() @ dy[4:9])
    assert (dw[1] == 0).all()


def test_sort_by_expert_offsets():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, tokens, offsets = sort_by_expert(experts, 4)
    assert offsets.tolist() == [2, 3, 6, 6]
    assert experts.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2]
    assert tokens.tolist() == (order // 2).tolist()


def _experts_float64(x, w1, w2, experts, weights):
    """y[t] = sum_j weights[t, j] * SwiGLU expert experts[t, j] of x[t], token by token in
    float64: the definition moe_experts_torch computes, independent of its sort and bmm."""
    d_ff = w2.shape[1]
    y = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = x[t].double() @ w1[e].double()
            y[t] += float(weights[t, j]) * ((F.silu(h[:d_ff]) * h[d_ff:]) @ w2[e].double())
    return y


def test_bf16_torch_path_matches_float64_reference_normwise():
    """bf16 inputs (exact in float64) through the bf16 path: its only error is bf16 rounding
    of the intermediates, a few units of 2**-8 normwise (measured 0.0044); a 2% scale error
    or a wrong activation is far more."""
    torch.manual_seed(1)
    x = torch.randn(32, 16).bfloat16()
    w1, w2 = (torch.randn(4, 16, 16) * 0.3).bfloat16(), (torch.randn(4, 8, 16) * 0.3).bfloat16()
    experts = torch.randint(0, 4, (32, 2))
    weights = torch.rand(32, 2)
    y16 = moe_experts_torch(x, w1, w2, experts, weights)
    assert y16.dtype == torch.bfloat16
    y64 = _experts_float64(x, w1, w2, experts, weights)
    rel = (y16.double() - y64).norm() / y64.norm()
    assert rel < 3 * 2**-8, f"bf16 path off the float64 reference by {rel:.4f} normwise"


def test_aux_loss_only_in_training_and_metrics_present():
    moe = MoE(
        8, MoEConfig(num_experts=4, top_k=2, d_ff=4), RouterConfig(load_balance=0.1, z_loss=0.01)
    )
    x = torch.randn(10, 8)
    moe.train()
    moe(x)
    assert moe.aux_loss.item() > 0
    assert {"imbalance", "entropy", "load_balance", "z_loss"} <= set(moe.metrics)
    moe.eval()
    moe(x)
    assert moe.aux_loss.item() == 0


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
def test_triton_impl_matches_torch_impl(dtype, atol):
    """The whole layer with impl="triton" (Triton interpreter on CPU) against impl="torch"."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(5)
    layers = {}
    for impl in ("torch", "triton"):
        cfg = MoEConfig(num_experts=5, top_k=2, d_ff=12, impl=impl)
        layers[impl] = MoE(16, cfg, RouterConfig())
    layers["triton"].load_state_dict(layers["torch"].state_dict())
    x = torch.randn(2, 9, 16)
    outs, grads = {}, {}
    for impl, layer in layers.items():
        layer.to(device, dtype)
        xi = x.to(device, dtype).requires_grad_(True)
        y = layer(xi)
        y.float().square().sum().backward()
        outs[impl] = y.float()
        grads[impl] = [xi.grad.float()] + [p.grad.float() for p in layer.parameters()]
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=atol, rtol=atol)
    for got, want in zip(grads["triton"], grads["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=atol * 10, rtol=atol * 10)


def test_training_step_never_counts_with_bincount(monkeypatch):
    """torch.bincount syncs host and device on CUDA (it sizes its output from the data);
    tests/model/test_no_host_sync_gpu.py catches that on a GPU, this on any machine: a
    training step of the layer with the default router losses runs with bincount refused."""
    torch.manual_seed(0)
    layer = MoE(16, MoEConfig(num_experts=6, top_k=2, d_ff=8, impl="torch"), RouterConfig())
    layer.train()
    x = torch.randn(2, 7, 16, requires_grad=True)

    def refused(*args, **kwargs):
        raise AssertionError("torch.bincount called on the MoE hot path (a host sync on CUDA)")

    monkeypatch.setattr(torch, "bincount", refused)
    (layer(x).square().mean() + layer.aux_loss).backward()
    assert layer.aux_loss.item() > 0 and x.grad is not None


def test_cpu_half_precision_rows_are_bucketed_and_agree(monkeypatch):
    """bf16 on the CPU: torch._grouped_mm sees each group's rows rounded up to a bucket
    (multiples of 16; above 128 rows, of an eighth of the power of two below), so the
    shapes repeat as the routing moves; forward, input and weight gradients agree with a
    float64 loop over the groups (empty, one row, 63, 64, 65 and 1500 rows). Below 1024 rows
    in all (decoding's few rows an expert) nothing is padded."""
    rows = [0, 1, 63, 64, 65, 1500]
    offsets = torch.tensor(rows, dtype=torch.int32).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(rows), 24, generator=gen).bfloat16().requires_grad_(True)
    w = torch.randn(len(rows), 24, 40, generator=gen).bfloat16().requires_grad_(True)
    seen = []
    original = torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append(torch.diff(offs, prepend=offs.new_zeros(1)).tolist())
        return original(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    y = grouped_mm_torch(x, w, offsets)
    dy = torch.randn(y.shape, generator=gen).bfloat16()
    y.backward(dy)
    assert seen[0] == [0, 16, 64, 64, 80, 1536]  # 1500 -> a multiple of 1024 / 8
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = per_group_float64(x64, w64, offsets)
    want.backward(dy.double())
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-2, atol=1e-1)
    assert (w.grad[0] == 0).all()  # the empty group
    seen.clear()  # the weight gradient torch.compile's op computes: bucketed rows too
    dw = torch.ops.moestack.grouped_mm_wgrad(x.detach(), dy, offsets)
    assert seen == [[0, 16, 64, 64, 80, 1536]]
    torch.testing.assert_close(dw.double(), w64.grad, rtol=2e-2, atol=1e-1)
    assert (dw[0] == 0).all()
    seen.clear()
    grouped_mm_torch(x[:1023].detach(), w.detach(), offsets.clamp(max=1023))
    assert seen == [[0, 1, 63, 64, 65, 830]]


def test_cpu_bucketing_saves_only_the_padded_input():
    """Autograd keeps the padded copy the matmul needs for the weight gradient, the weights
    and index vectors: not the unpadded input too (a scatter into zeros would save it)."""
    offsets = torch.tensor([300, 700, 1000, 1500, 3000], dtype=torch.int32)
    x = torch.randn(3000, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        grouped_mm_torch(x * 1, w, offsets)
    big = sorted(tuple(t.shape) for t in saved if t.dim() == 2)
    assert big == [(3104, 128)]  # 300->320, 400->416, 300->320, 500->512, 1500->1536 rows
