"""The weight gradient's two backends (moestack's kernel and torch._grouped_mm's 2D x 2D
form), each forced, against a float64 loop over the groups; the MoE backward with each; and
the mask-free main loops (EVEN_K / EVEN_KM) taken where the shapes allow, in the interpreter
(fp32). test_kernels_gpu.py checks torch's backend in bf16 on a GPU."""

from __future__ import annotations

import types

import pytest
import torch
from helpers.kernels import interpreter_only, layer_inputs, rel_err

pytest.importorskip("triton")

from moestack.kernels import _launch, moe_experts, tuning  # noqa: E402
from moestack.kernels.reference import moe_experts_reference  # noqa: E402

pytestmark = interpreter_only(
    "the interpreter's run; test_kernels_gpu.py checks the backends on CUDA"
)
TOL = 5e-6  # float32, normwise: max|err| / max|ref|
TILE = tuning.KernelConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1)
BACKENDS = {"triton": TILE, "torch": tuning.TORCH_WGRAD}


def wgrad_loop(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """out[e] = a_e^T @ b_e in float64, one group at a time (zeros for an empty group)."""
    out = torch.zeros(len(counts), a.shape[1], b.shape[1], dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        out[e] = a[start : start + c].double().T @ b[start : start + c].double()
        start += c
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    ("counts", "K", "M"),
    [
        ([0, 33, 1, 0, 60], 40, 24),  # ragged, empty first and middle groups, a single row
        ([1], 8, 12),  # one row in all
        ([64, 32, 0], 64, 32),  # whole 32-row blocks, K and M multiples of the tile (EVEN_KM)
        ([5, 0, 70], 37, 19),  # odd widths: torch's form cannot run, moestack's kernel does
    ],
)
def test_each_backend_matches_float64(backend, counts, K, M, poisoned_buffers):
    g = torch.Generator().manual_seed(sum(counts) + K)
    N = sum(counts)
    a = torch.randn(N, K, generator=g, dtype=torch.float64)
    b = torch.randn(N, M, generator=g, dtype=torch.float64)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    with tuning.forced_config("wgrad", BACKENDS[backend]):
        got = _launch.grouped_wgrad(a.float(), b.float(), offsets)
    want = wgrad_loop(a, b, counts)
    assert got.dtype == torch.float32 and rel_err(got, want) <= TOL
    for e, c in enumerate(counts):
        if c == 0:  # forced zeros, not whatever the backend left there
            assert torch.equal(got[e], torch.zeros(K, M))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_gathered_operands_with_each_backend(backend, poisoned_buffers):
    """Rows read through an index (the layout the MoE backward used before it gathered its
    operands once): torch's backend gathers a copy, moestack's kernel reads through it."""
    g = torch.Generator().manual_seed(3)
    counts, T, K, M = [3, 0, 40], 20, 16, 24
    rows = torch.randint(0, T, (sum(counts),), generator=g, dtype=torch.int32)
    x = torch.randn(T, K, generator=g, dtype=torch.float64)
    b = torch.randn(sum(counts), M, generator=g, dtype=torch.float64)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    with tuning.forced_config("wgrad", BACKENDS[backend]):
        got_a = _launch.grouped_wgrad(x.float(), b.float(), offsets, a_rows=rows)
        got_b = _launch.grouped_wgrad(b.float(), x.float(), offsets, b_rows=rows)
    assert rel_err(got_a, wgrad_loop(x[rows.long()], b, counts)) <= TOL
    assert rel_err(got_b, wgrad_loop(b, x[rows.long()], counts)) <= TOL


def test_torch_backend_only_where_it_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tuning.torch_wgrad_runs(cpu, torch.float32, 40, 24)
    assert tuning.torch_wgrad_runs(cpu, torch.float16, 8, 16)
    assert not tuning.torch_wgrad_runs(cpu, torch.float16, 8, 12)  # 24-byte rows: not 16-byte
    assert not tuning.torch_wgrad_runs(cpu, torch.float32, 37, 24)
    assert not tuning.torch_wgrad_runs(cpu, torch.float64, 40, 24)
    assert not tuning.torch_wgrad_runs(cuda, torch.float32, 64, 64)  # bf16 only on CUDA
    assert tuning.TORCH_WGRAD in tuning.candidates("wgrad", 64, 64, torch.float32, cpu)
    assert tuning.TORCH_WGRAD not in tuning.candidates("wgrad", 37, 64, torch.float32, cpu)
    assert tuning.TORCH_WGRAD not in tuning.candidates("wgrad", 64, 64, torch.float32)
    for kind in ("mm", "mm_swiglu"):
        assert all(
            c.backend == "triton" for c in tuning.candidates(kind, 64, 64, torch.float32, cpu)
        )
    assert tuning.candidates("wgrad", 64, 64, torch.float32, cpu)[0].backend == "triton"


def test_forced_torch_backend_where_it_cannot_run_gives_the_default_tile():
    """Chosen by capability, not by a failed launch: odd widths get moestack's default."""

    def fail(cfg):
        raise AssertionError("a forced config is never timed")

    with tuning.forced_config("wgrad", tuning.TORCH_WGRAD):
        args = (torch.device("cpu"), 37, 24, torch.float32, fail, True)
        got = tuning.choose_config("wgrad", "k", *args)
        ok = tuning.choose_config(
            "wgrad", "k", torch.device("cpu"), 40, 24, torch.float32, fail, True
        )
    assert got == tuning.fit(tuning.CANDIDATES["wgrad"][0], "wgrad", 37, 24, torch.float32)
    assert ok.backend == "torch"
    with (
        pytest.raises(ValueError, match="backend='torch' is for kind='wgrad' only"),
        tuning.forced_config("mm", tuning.TORCH_WGRAD),
    ):
        pass
    with pytest.raises(ValueError, match="backend='cublas' is unknown"):
        tuning.KernelConfig(64, 64, 64, backend="cublas")


def moe_case(T, D, F, E, k, seed, empty=None):
    x, w1, w2, experts, weights, dy = layer_inputs(T, D, F, E, k, seed=seed, empty=empty)
    ins = [t.float().requires_grad_() for t in (x, w1, w2, weights)]
    y = moe_experts(ins[0], ins[1], ins[2], experts, ins[3])
    y.backward(dy.float())
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    yr = moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3])
    yr.backward(dy)
    for name, a, b in zip(("dx", "dw1", "dw2", "dweights"), ins, refs, strict=True):
        assert rel_err(a.grad, b.grad) <= TOL, name
    if empty is not None:
        assert torch.equal(ins[1].grad[empty], torch.zeros(D, 2 * F))
        assert torch.equal(ins[2].grad[empty], torch.zeros(F, D))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    ("T", "D", "F", "E", "k", "empty"),
    [
        (30, 40, 24, 5, 2, 3),  # ragged groups, an expert without tokens
        (1, 16, 12, 4, 2, None),  # one token
        (9, 20, 16, 3, 3, None),  # top_k = E
        (40, 64, 32, 4, 2, None),  # K and M multiples of the tiles: the mask-free loops
    ],
)
def test_moe_backward_with_each_backend(backend, T, D, F, E, k, empty, poisoned_buffers):
    with tuning.forced_config("wgrad", BACKENDS[backend]):
        moe_case(T, D, F, E, k, seed=T + D, empty=empty)


class _Spy:
    """A kernel whose launches record their EVEN_* constants, then run the real kernel."""

    def __init__(self, kernel, seen: list) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append({k: v for k, v in kw.items() if k.startswith("EVEN_")})
            return self.kernel[grid](*args, **kw)

        return launch


def test_mask_free_loops_where_the_tiles_divide_the_shapes(monkeypatch, poisoned_buffers):
    """EVEN_K where block_k divides K, EVEN_KM where the output tile divides [K, M]: set on
    the host from the shapes, and the results still match float64 (the case above)."""
    real = _launch.kernels()
    seen: list[dict] = []
    spies = types.SimpleNamespace(
        grouped_mm_kernel=_Spy(real.grouped_mm_kernel, seen),
        grouped_wgrad_kernel=_Spy(real.grouped_wgrad_kernel, seen),
        swiglu_bwd_kernel=real.swiglu_bwd_kernel,
    )
    monkeypatch.setattr(_launch, "kernels", lambda: spies)
    monkeypatch.setattr(_launch, "interpreted", lambda: True)
    with tuning.forced_config("wgrad", TILE), tuning.forced_config("mm", TILE):
        moe_case(40, 64, 32, 4, 2, seed=1)  # fp32 halves block_k: 16 divides 64 and 32
        seen_even = list(seen)
        seen.clear()
        moe_case(12, 40, 20, 4, 2, seed=2)  # 40, 20 and 2F = 40: no tile divides them
    # mm: G (K=F), dx (K=2F), the forward's down GEMM (K=F); swiglu keeps the interpreter's
    # config (block_k 32 divides D=64); wgrad: dW2 [F, D], dW1 [D, 2F].
    assert seen_even and all(all(flags.values()) for flags in seen_even), seen_even
    wgrad = [flags["EVEN_KM"] for flags in seen if "EVEN_KM" in flags]
    assert wgrad == [False, False], seen
    assert not any(flags.get("EVEN_K") for flags in seen), seen
