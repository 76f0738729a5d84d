"""Config selection, the tuned table, and imports without triton or megablocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moestack.kernels import tuning


def test_shipped_table_parses_and_invents_nothing():
    data = json.loads(tuning.TABLE_PATH.read_text())
    assert data["format"] == tuning.TABLE_FORMAT
    for gpu, entries in data["gpus"].items():
        for key, cfg in entries.items():  # every entry must be a valid config
            assert key.split("|")[0] in tuning.CANDIDATES, (gpu, key)
            tuning.KernelConfig(**cfg)


def test_table_lookup(tmp_path, monkeypatch):
    key = tuning.make_key("mm", 8, 4096, 14336, torch.bfloat16, "g1s0c0z1")
    assert key == "mm|E=8|K=4096|M=14336|bfloat16|g1s0c0z1"
    cfg = tuning.KernelConfig(64, 128, 32, 4, 4, 5)
    path = tmp_path / "table.json"
    table = {"format": 1, "gpus": {"Fancy GPU": {key: cfg.__dict__}}}
    path.write_text(json.dumps(table))
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(path))
    assert tuning.lookup_table("Fancy GPU", key) == cfg
    assert tuning.lookup_table("Other GPU", key) is None
    assert tuning.lookup_table("Fancy GPU", key.replace("E=8", "E=16")) is None


def test_candidates_clip_to_small_problems():
    for kind in tuning.CANDIDATES:
        for dtype in (torch.bfloat16, torch.float32):
            cands = tuning.candidates(kind, K=20, M=5, dtype=dtype)
            assert cands and len(set(cands)) == len(cands)
            for c in cands:
                assert min(c.block_m, c.block_n, c.block_k) >= 16
                if kind == "wgrad":
                    assert c.block_m <= 32 and c.block_n == 16
                else:
                    assert c.block_n == 16 and c.block_k <= 32


def test_interpreter_uses_fixed_config():
    def fail(cfg):
        raise AssertionError("no timing under the interpreter")

    cfg = tuning.choose_config("mm", "k", torch.device("cpu"), 8, 8, torch.float32, fail, True)
    assert cfg == tuning.INTERPRET_CONFIG


def test_autotune_switch(monkeypatch):
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    assert not tuning.autotune_enabled()
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "1")
    assert tuning.autotune_enabled()


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_import_without_triton():
    """On a machine without triton the package imports; a kernel call says what to do."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, moestack.kernels as k\n"
        "x = torch.zeros(2, 3); w = torch.zeros(1, 3, 4)\n"
        "try:\n"
        "    k.grouped_gemm(x, w, torch.tensor([2], dtype=torch.int32))\n"
        "except ImportError as e:\n"
        "    print('IMPORT-ERROR', e)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR" in out.stdout and "needs triton" in out.stdout


def test_megablocks_missing_gives_clear_error():
    pytest.importorskip("triton")
    try:
        import megablocks  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("megablocks is installed")
    from moestack.kernels import moe_experts_megablocks

    x = torch.zeros(2, 4)
    with pytest.raises(ImportError, match=r"pip install moestack\[megablocks\]"):
        moe_experts_megablocks(
            x,
            torch.zeros(1, 4, 6),
            torch.zeros(1, 3, 4),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
        )


_COMPILE_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moestack.kernels import _triton as tk

def compile_for(fn, ptr, constexprs, num_warps):
    sig, cx, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            cx[(i,)] = constexprs[name]
            continue
        sig[name] = "*i32" if name.startswith(("offsets", "a_rows", "b_rows", "c_rows")) else (
            "*fp32" if name.startswith(("scale", "dscale")) else ptr if name.endswith("_ptr")
            else "i32")
        attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    except TypeError:  # another triton version's compiler API
        print("API-MISMATCH")
        raise SystemExit(0)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=3))

# A launch specialises integer arguments equal to 1 into constants: contiguous tensors'
# unit strides, given here as such, so that what compiles is what a real launch runs.
tiles = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, DOT_PRECISION="tf32")
unit_mm = dict(stride_ak=1, stride_bn=1, stride_cn=1, stride_zn=1)
fwd = compile_for(tk.grouped_mm_kernel, "*bf16", dict(tiles, **unit_mm, GATHER_A=True,
                  SCATTER_C=False, HAS_SCALE=False, SWIGLU=True, STORE_Z=True, BLOCK_E=128), 8)
compile_for(tk.grouped_mm_kernel, "*bf16", dict(tiles, **unit_mm, GATHER_A=False,
            SCATTER_C=True, HAS_SCALE=True, SWIGLU=False, STORE_Z=False, BLOCK_E=128), 8)
dx = compile_for(tk.grouped_mm_kernel, "*bf16", dict(tiles, stride_ak=1, stride_bk=1,
                 stride_cn=1, stride_zn=1, GATHER_A=False, SCATTER_C=True, HAS_SCALE=False,
                 SWIGLU=False, STORE_Z=False, BLOCK_E=128), 8)  # A @ W^T: W's K is unit
compile_for(tk.grouped_wgrad_kernel, "*bf16", dict(tiles, stride_ak=1, stride_bn=1,
            stride_cn=1, GATHER_A=False, GATHER_B=True), 8)
compile_for(tk.swiglu_bwd_kernel, "*bf16", dict(STORE_H=True, BLOCK_F=1024), 4)
# Software pipelining (several K tiles in flight through shared memory) is what makes the
# main loop fast: one stage of a 128x128x64 bf16 tile pair is 32 KiB.
print("SHARED", fwd.metadata.shared, dx.metadata.shared)
print("COMPILED")
"""


def test_kernels_compile_for_sm90():
    """The interpreter skips the compiler: compile every kernel for Hopper (no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia")
    out = _run(_COMPILE_CHECK)
    if "API-MISMATCH" in out.stdout:
        pytest.skip("this check speaks the triton 3.9 compiler API")
    if "COMPILED" not in out.stdout and ("ptxas" in out.stderr and "not found" in out.stderr):
        pytest.skip("no ptxas in this triton install")
    assert "COMPILED" in out.stdout, out.stderr[-3000:]
    shared = [int(v) for v in out.stdout.split("SHARED", 1)[1].split()[:2]]
    assert min(shared) > 32 * 1024, f"main loops not pipelined: shared memory {shared} bytes"
