"""profile_moe's second gpu_check pass, on the CPU in the interpreter: with every new path of
the backward forced, each launch is labelled with the path that ran it and the run says which
configs it used."""

import json
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO


def test_every_new_path_forced_is_labelled(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "profile_moe.py"), "--tiny", "--steps", "1",
         "--no-warmup", "--persistent", "--fused-dswiglu", "--torch-wgrad", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    roles = {r["role"] for r in result["profiles"][0]["rows"]}
    assert roles == {
        "fwd x@W1 +SwiGLU", "fwd h@W2 +combine [persistent]", "bwd G=dy@W2^T +SwiGLU'",
        "bwd gather dy,x rows", "bwd dW2=(wh)^T dy [torch._grouped_mm]",
        "bwd dx=dz@W1^T [persistent]", "bwd dW1=x^T dz [torch._grouped_mm]", "other",
    }  # fmt: skip
    line = (
        "configs: mm forced to 128x128x64 w8 s3 persistent; mm_dswiglu forced to 128x128x64 "
        "w8 s3 fused; wgrad forced to torch._grouped_mm; mm_swiglu from the interpreter's "
        "fixed tile"
    )
    assert line in proc.stdout.splitlines() and result["configs"] == line
    assert "backend='torch'" in result["forced_wgrad_config"]
