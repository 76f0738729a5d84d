"""scripts/gpu_check.sh, the one command for a lent GPU: its plumbing works without a GPU.

On the CPU the GPU tests skip, so this checks what would waste GPU minutes if it broke: the
package staged as pip lays it out (mapped kernels/, telemetry/, configs/), pytest from the
staged tree, the phase selection, the time caps and the summary.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_gpu_check_runs_selected_phases_from_a_staged_package(tmp_path):
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        PYTHON=sys.executable,
        GPU_CHECK_SECONDS="120",
        GPU_CHECK_PHASES="env,gpu_tests",
        OMP_NUM_THREADS="1",
    )
    env.pop("TRITON_INTERPRET", None)  # the staged tests' conftest decides, as on a GPU
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "env: ok" in summary and "gpu_tests: ok" in summary, summary
    assert "tune:" not in summary and "bench_moe:" not in summary  # not selected
    log = (tmp_path / "log.txt").read_text()
    staged = [line for line in log.splitlines() if line.startswith("moestack staged at")]
    assert staged and str(ROOT) not in staged[0], staged  # imported from the staged copy
    assert " passed" in log
