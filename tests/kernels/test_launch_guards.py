"""The launchers' guards, on the CPU: the fp32 dot precision under torch's old and new TF32
settings, expert-id and offset assertions that never sync with the host, and the tuning
key of every launch (weight layout and row bucket)."""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import needs_kernels

pytest.importorskip("triton")

from moestack.kernels import _launch, grouped_gemm, moe_experts, tuned_table, tuning  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def matmul_precision():
    """torch's real cuBLAS matmul settings (settable on a CPU build), restored afterwards."""
    matmul = torch.backends.cuda.matmul
    if not _has_new_api(matmul):
        pytest.skip("this torch has no fp32_precision setting (torch < 2.9)")
    saved_new, saved_global = matmul.fp32_precision, torch.backends.fp32_precision
    yield matmul
    torch.backends.fp32_precision = saved_global
    matmul.fp32_precision = saved_new


def _has_new_api(matmul) -> bool:
    try:
        matmul.fp32_precision  # noqa: B018
    except AttributeError:
        return False
    return True


def test_dot_precision_reads_the_new_setting_first(matmul_precision):
    """Once TF32 is set through ``fp32_precision``, reading ``allow_tf32`` may raise (mixed
    APIs, torch >= 2.9): the launch must not depend on it."""
    matmul_precision.fp32_precision = "tf32"
    assert _launch._dot_precision(torch.float32) == "tf32"
    matmul_precision.fp32_precision = "ieee"
    assert _launch._dot_precision(torch.float32) == "ieee"
    for dtype in (torch.float16, torch.bfloat16):  # 16-bit inputs ignore the setting
        assert _launch._dot_precision(dtype) == "tf32"


def test_dot_precision_follows_the_legacy_flag_when_the_new_one_is_unset(matmul_precision):
    matmul_precision.fp32_precision = "none"
    matmul_precision.allow_tf32 = True
    assert _launch._dot_precision(torch.float32) == "tf32"
    matmul_precision.allow_tf32 = False
    assert _launch._dot_precision(torch.float32) == "ieee"


class _OldMatmul:
    """torch < 2.9's cuBLAS settings: only ``allow_tf32``."""

    def __init__(self, allow_tf32: bool) -> None:
        self.allow_tf32 = allow_tf32


class _MixedMatmul:
    """New setting unset, legacy read refused (the two APIs mixed)."""

    fp32_precision = "none"

    @property
    def allow_tf32(self) -> bool:
        raise RuntimeError("you have used mix of the legacy and new APIs")


@pytest.mark.parametrize(
    ("matmul", "want"),
    [(_OldMatmul(True), "tf32"), (_OldMatmul(False), "ieee"), (_MixedMatmul(), "ieee")],
)
def test_dot_precision_on_older_torch_and_mixed_settings(monkeypatch, matmul, want):
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    assert _launch._dot_precision(torch.float32) == want


def test_expert_id_assertion_on_the_cpu():
    E = 4
    _launch.assert_expert_ids(torch.tensor([[0, 3], [2, 1]]), E)
    _launch.assert_expert_ids(torch.tensor([[3]], dtype=torch.int32), E)
    for bad in (torch.tensor([[0, 4]]), torch.tensor([[-1, 2]])):
        with pytest.raises(RuntimeError, match=r"expert ids must lie in \[0, 4\)"):
            _launch.assert_expert_ids(bad, E)


def test_offsets_assertion_on_the_cpu():
    _launch.assert_offsets(torch.tensor([0, 3, 3, 7], dtype=torch.int32), 7)
    _launch.assert_offsets(torch.tensor([0], dtype=torch.int32), 0)
    for bad in ([0, 3, 2, 7], [0, 3, 5, 6], [-1, 3, 5, 7], [0, 3, 5, 8]):
        with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
            _launch.assert_offsets(torch.tensor(bad, dtype=torch.int32), 7)


@needs_kernels()
@pytest.mark.parametrize("bad_id", [3, 7, -1])
def test_moe_experts_refuses_expert_ids_out_of_range(bad_id):
    """Ids >= E used to leave output rows unwritten and negative ids to compute with
    expert 0; both now fail (on the CPU at once, on CUDA by a device-side assertion)."""
    if DEVICE == "cuda":
        pytest.skip("a device-side assertion ends the CUDA context: test_kernels_gpu.py")
    x, w1, w2 = torch.randn(5, 8), torch.randn(3, 8, 12), torch.randn(3, 6, 8)
    experts = torch.tensor([[0, 1], [2, 0], [1, 2], [0, bad_id], [2, 1]])
    with pytest.raises(RuntimeError, match=r"expert ids must lie in \[0, 3\)"):
        moe_experts(x, w1, w2, experts, torch.rand(5, 2))


@needs_kernels()
def test_grouped_gemm_refuses_decreasing_cpu_offsets():
    x, w = torch.randn(7, 8), torch.randn(3, 8, 4)
    with pytest.raises(ValueError, match=r"non-decreasing .*: offsets\[1\] = 2 < offsets\[0\] = 3"):
        grouped_gemm(x, w, torch.tensor([3, 2, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets\[0\] = -1 must be >= 0"):
        grouped_gemm(x, w, torch.tensor([-1, 2, 7], dtype=torch.int32))


@pytest.fixture
def tuning_keys(monkeypatch) -> list[str]:
    """The tuning key of every launch, in order (each launch still chooses its config)."""
    keys: list[str] = []
    choose = tuning.choose_config

    def spy(kind, key, *args):
        keys.append(key)
        return choose(kind, key, *args)

    monkeypatch.setattr(tuning, "choose_config", spy)
    return keys


def round_robin_inputs() -> tuple[torch.Tensor, ...]:
    """x, w1, w2, experts, weights of a layer (D = 16, F = 8, E = 3) routing token t to
    experts t and t + 1 (mod E): 9 tokens make R = 18 sorted rows (bucket 32)."""
    T, D, F, E, k = 9, 16, 8, 3, 2
    x = torch.randn(T, D, device=DEVICE, requires_grad=True)
    w1 = torch.randn(E, D, 2 * F, device=DEVICE, requires_grad=True)
    w2 = torch.randn(E, F, D, device=DEVICE, requires_grad=True)
    weights = torch.rand(T, k, device=DEVICE, requires_grad=True)
    experts = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1).to(DEVICE)
    return x, w1, w2, experts, weights


@needs_kernels()
def test_every_launch_keys_its_weight_layout_and_row_bucket(tuning_keys):
    """Forward launches read W as stored, the backward's G and dx read W^T (a transposed
    view): separate keys. Every key carries the power-of-two bucket of its sorted rows."""
    x, w1, w2, experts, weights = round_robin_inputs()
    moe_experts(x, w1, w2, experts, weights).sum().backward()
    keys = tuning_keys
    flags = {key.split("|")[0] + "|" + key.split("|")[5] for key in keys}
    assert flags == {
        "mm_swiglu|g1s0c0z1t0",  # h = swiglu(x[tok] @ W1)
        "mm|g0s1c1z0t0",  # ys = w * h @ W2
        "mm_dswiglu|h1t1",  # G with the SwiGLU backward (weight * h stored), fused or not
        "mm|g0s0c0z0t1",  # G = dy[tok] @ W2^T, dy's rows gathered beforehand (unfused)
        "mm|g0s1c0z0t1",  # dx = dz @ W1^T
        "wgrad|g00",  # dW2 and dW1, on contiguous gathered rows
    }, keys
    wgrad = sorted(key.split("|")[2:4] for key in keys if key.startswith("wgrad"))
    assert wgrad == [["K=16", "M=16"], ["K=8", "M=16"]], keys  # dW1 [D, 2F], dW2 [F, D]
    assert all(key.endswith("|R=32") for key in keys), keys


@needs_kernels()
def test_every_shipped_table_key_is_one_the_layer_asks_for(tuning_keys):
    """A table entry whose weight layout and flags no launch asks for any more (the backward
    changed) is dead: it would never be looked up, and those launches would autotune or run
    the default tile instead. Every shipped key's kind and flags must be among those the
    layer's forward (with and without grad) and backward ask for."""
    import json

    x, w1, w2, experts, weights = round_robin_inputs()
    moe_experts(x, w1, w2, experts, weights).sum().backward()
    with torch.no_grad():
        moe_experts(x, w1, w2, experts, weights)
    asked = {key.split("|")[0] + "|" + key.split("|")[5] for key in tuning_keys}
    shipped = json.loads(tuned_table.TABLE_PATH.read_text())["gpus"]
    for gpu, entries in shipped.items():
        dead = sorted(k for k in entries if k.split("|")[0] + "|" + k.split("|")[5] not in asked)
        assert not dead, (gpu, dead, asked)


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "refused"),
    [
        ("3.4.0", "2.4.6", True),
        ("3.6.0", "2.4.0rc1", True),
        ("3.6.0", "2.3.5", False),
        ("3.7.1", "2.4.6", False),
        ("3.9.0", "3.0.0", False),
        ("4.0.0", "2.4.0", False),
    ],
)
def test_interpreter_refused_where_numpy_breaks_it(triton_version, numpy_version, refused):
    """triton 3.4-3.6's interpreter fails inside every kernel under numpy >= 2.4 (checked by
    running the kernel tests on 3.4.0, 3.5.1, 3.6.0, 3.7.1 and 3.8.0): refused in one line
    naming both versions and the fix instead."""
    from moestack.kernels._guards import interpreter_conflict

    why = interpreter_conflict(triton_version, numpy_version)
    assert (why is not None) == refused
    if refused:
        assert triton_version in why and numpy_version in why and "numpy<2.4" in why
