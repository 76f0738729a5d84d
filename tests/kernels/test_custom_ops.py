"""The kernels as torch custom ops: schemas, fake implementations and autograd registrations
(``torch.library.opcheck``), and torch.compile over them in one graph (fullgraph)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.kernels import needs_kernels

pytest.importorskip("triton")

from moestack.kernels import _launch, grouped_gemm, moe_experts  # noqa: E402

pytestmark = needs_kernels()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ops = torch.ops.moestack


def experts_inputs(T: int = 9, D: int = 16, F: int = 8, E: int = 3, k: int = 2, seed: int = 0):
    """x, w1, w2, experts, weights (fp32, the first four needing gradients), expert 2 unused."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w1 = torch.randn(E, D, 2 * F, generator=g) / D**0.5
    w2 = torch.randn(E, F, D, generator=g) / F**0.5
    scores = torch.rand(T, E, generator=g)
    scores[:, 2] = -1.0
    weights, experts = scores.topk(k, dim=1)
    grads = [t.to(DEVICE).requires_grad_() for t in (x, w1, w2, weights.softmax(1))]
    return grads[0], grads[1], grads[2], experts.to(DEVICE), grads[3]


def gemm_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, 12, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(3, 12, 5, generator=g).to(DEVICE).requires_grad_()
    return x, w, torch.tensor([3, 3, 10], dtype=torch.int32, device=DEVICE)


def test_moe_experts_ops_pass_opcheck():
    x, w1, w2, experts, weights = experts_inputs()
    # With gradients, opcheck's AOT check compares the op's outputs after a backward, and
    # eager autograd's backward writes dz over the saved z (an output of the op; the
    # functional backward that traced code runs does not): every other check here, and
    # test_compiles_in_one_graph_and_matches_eager compares compiled and eager y and grads.
    for check in ("test_schema", "test_autograd_registration", "test_faketensor"):
        torch.library.opcheck(
            ops.triton_moe_experts, (x, w1, w2, experts, weights, True), test_utils=check
        )
    plain = [t.detach() for t in (x, w1, w2, weights)]
    torch.library.opcheck(ops.triton_moe_experts, (*plain[:3], experts, plain[3], False))
    _, z, pair, token, offsets, weight = ops.triton_moe_experts(*plain[:3], experts, plain[3], True)
    dy = torch.randn_like(plain[0])
    for needs in ([True, True, True, True], [True, False, True, False]):
        args = (dy, *plain[:3], z, pair, token, offsets, weight, 2, needs)
        torch.library.opcheck(ops.triton_moe_experts_bwd, args)
        # The in-place twin (eager autograd's) overwrites z, so a second call on the same
        # arguments computes something else: each check gets a fresh copy of z.
        for check in ("test_schema", "test_autograd_registration", "test_faketensor",
                      "test_aot_dispatch_dynamic"):  # fmt: skip
            args = (dy, *plain[:3], z.clone(), pair, token, offsets, weight, 2, needs)
            torch.library.opcheck(ops.triton_moe_experts_bwd_, args, test_utils=check)


def test_grouped_gemm_ops_pass_opcheck():
    x, w, offsets = gemm_inputs()
    torch.library.opcheck(ops.triton_grouped_gemm, (x, w, offsets))
    dy = torch.randn(10, 5, device=DEVICE)
    for need_dx, need_dw in ((True, True), (False, True), (True, False)):
        args = (dy, x.detach(), w.detach(), offsets, need_dx, need_dw)
        torch.library.opcheck(ops.triton_grouped_gemm_bwd, args)


def forward_backward(fn, *args: torch.Tensor) -> list[torch.Tensor]:
    """The output and the gradients of every input that needs one, for a fixed upstream
    gradient (non-contiguous, as compiled graphs may hand it over)."""
    y = fn(*args)
    dy = torch.linspace(-1, 1, y.numel(), device=y.device).view(y.shape[1], y.shape[0]).t()
    inputs = [a for a in args if a.requires_grad]
    return [y.detach(), *torch.autograd.grad(y, inputs, dy)]


@pytest.mark.parametrize(
    ("fn", "inputs"), [(moe_experts, experts_inputs), (grouped_gemm, gemm_inputs)]
)
def test_compiles_in_one_graph_and_matches_eager(fn, inputs):
    """fullgraph: any graph break (a kernel launch dynamo cannot trace) is an error. The
    same kernels run in both, so the results are equal to the bit."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    want = forward_backward(fn, *inputs())
    got = forward_backward(compiled, *inputs())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_backward_without_saved_tensors_is_refused():
    """The op run with keep=False saved nothing for backward: a clear error, never a read of
    missing buffers."""
    x, w1, w2, experts, weights = experts_inputs()
    y = ops.triton_moe_experts(x, w1, w2, experts, weights, False)[0]
    with pytest.raises(RuntimeError, match="keep=False"):
        y.sum().backward()


def _import_kernels_from_the_checkout(*extra_path: str) -> subprocess.CompletedProcess:
    """`import kernels` in a fresh interpreter whose cwd is the checkout's root, after
    moestack.kernels loaded, with site-packages taken off sys.path (so an installed PyPI
    `kernels` is invisible) and `extra_path` put after the root."""
    code = (
        "import sys, moestack.kernels; "
        "sys.path[:] = [p for p in sys.path if 'site-packages' not in p] + sys.argv[1:]; "
        "import kernels; print(kernels is moestack.kernels, getattr(kernels, 'ORIGIN', '-'), "
        "sorted(m for m in sys.modules if m.startswith('kernels.')))"
    )
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-c", code, *extra_path]
    return subprocess.run(argv, cwd=root, capture_output=True, text=True)


def test_top_level_kernels_name_is_moestack_kernels():
    """From a checkout's root, `import kernels` (transformers does it, probing for the PyPI
    package of that name) must not load a second copy that registers the custom ops again
    and points them at itself: with no PyPI `kernels`, the name is moestack.kernels."""
    out = _import_kernels_from_the_checkout()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "-", "[]"]


def test_an_installed_pypi_kernels_takes_the_top_level_name(tmp_path):
    """transformers >= 5.25 requires the PyPI `kernels` and, seeing it installed, runs
    `from kernels import ...`: from a checkout's root that import must reach the installed
    package, submodules included, not this repository's kernels/ folder."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("ORIGIN = 'pypi'\nfrom . import layer\n")
    (fake / "layer.py").write_text("")
    out = _import_kernels_from_the_checkout(str(tmp_path / "site"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "pypi", "['kernels.layer']"]


def test_eager_backward_is_in_place_and_compiled_is_functional(monkeypatch):
    """Eager autograd that frees the graph writes dz over the saved z; a retained graph and
    a compiled one run the functional twin (AOT autograd cannot partition a backward that
    mutates a saved tensor)."""
    in_place = []
    real = _launch.swiglu_bwd

    def spy(z, g, scale, dz, dscale, h):
        in_place.append(dz.data_ptr() == z.data_ptr())
        return real(z, g, scale, dz, dscale, h)

    monkeypatch.setattr(_launch, "swiglu_bwd", spy)
    forward_backward(moe_experts, *experts_inputs())
    y = moe_experts(*experts_inputs())
    y.sum().backward(retain_graph=True)
    torch._dynamo.reset()
    forward_backward(torch.compile(moe_experts, backend="aot_eager"), *experts_inputs())
    assert in_place == [True, False, False]
