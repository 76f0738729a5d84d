"""scripts/gpu_check.sh, the one command for a lent GPU: its plumbing works without a GPU.

On the CPU the GPU tests skip, so this checks what would waste GPU minutes if it broke: the
package staged as pip lays it out (mapped kernels/, telemetry/, configs/), pytest from the
staged tree, the phase selection, the time caps, the files and the summary, and that the
plan fits one device call of 560 s.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers.paths import REPO


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_gpu_check_runs_selected_phases_from_a_staged_package(tmp_path):
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        PYTHON=sys.executable,
        GPU_CHECK_SECONDS="120",
        GPU_CHECK_PHASES="env,kernel_tests",
        OMP_NUM_THREADS="1",
    )
    env.pop("TRITON_INTERPRET", None)  # the staged tests' conftest decides, as on a GPU
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "env: ok" in summary and "kernel_tests: ok" in summary, summary
    verdicts = [line.split(":")[0] for line in summary.splitlines() if ": ok in " in line]
    assert verdicts == ["env", "kernel_tests"], summary  # only the selected phases ran
    log = (tmp_path / "log.txt").read_text()
    staged = [line for line in log.splitlines() if line.startswith("moestack staged at")]
    assert staged and str(REPO) not in staged[0], staged  # imported from the staged copy
    assert " passed" in log or " skipped" in log
    assert (tmp_path / "kernel_tests.xml").is_file()  # written by the phase, as it ends
    assert "--- tests (per phase" in summary and "kernel_tests: " in summary


CALL_S = 560  # the timeout_s of the one device call the plan is for (docs/kernels.md)


def dry_run(**env: str) -> tuple[list[tuple[str, int, list[str]]], str]:
    """The phases (name, cap, files) that ``--dry-run`` prints, and its whole output."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), "--dry-run"],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    phases = []
    for line in proc.stdout.splitlines():
        parts = line.split(None, 3)
        if line.startswith("  ") and len(parts) == 4 and parts[1][:-1].isdigit():
            phases.append((parts[0], int(parts[1][:-1]), parts[2].split(",")))
    return phases, proc.stdout


def test_dry_run_plan_fits_one_call_of_560_seconds(tmp_path):
    phases, out = dry_run(OUT=str(tmp_path))
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
    names = [name for name, _, _ in phases]
    # The order the issues ask for: kernel correctness, the issue-3 table and its profile,
    # the optimizer (its modes, issue 29), serving from the cache (issue 31); every default
    # phase with a cap and the files it writes.
    assert names == [
        "env", "kernel_tests", "bench_moe", "profile_moe", "optim_tests", "bench_optim",
        "bench_serve",
    ]  # fmt: skip
    assert all(cap >= 10 and files for _, cap, files in phases)
    assert "bench_moe.json" in dict((n, f) for n, _, f in phases)["bench_moe"]
    budget = int(re.search(r"budget (\d+) s", out).group(1))
    setup, grace, summary = (
        int(re.search(rf"{word} (\d+)", out).group(1)) for word in ("setup", "grace", "summary")
    )
    caps = sum(cap for _, cap, _ in phases)
    # No phase of the plan is cut by the budget, and the worst case (every phase at its cap,
    # one SIGKILL grace, the summary) ends inside the call.
    assert setup + caps <= budget
    assert budget + grace + summary <= CALL_S
    assert f"= {setup + caps + grace + summary} s of a {CALL_S} s call" in out
    assert "optional (name them in GPU_CHECK_PHASES): " in out
    assert "tune" in out.split("optional", 1)[1]


def test_dry_run_follows_the_phase_selection(tmp_path):
    phases, out = dry_run(OUT=str(tmp_path), GPU_CHECK_PHASES="bench_moe,train")
    assert [name for name, _, _ in phases] == ["bench_moe", "train_offload_adamw", "train_adamw"]
    phases, out = dry_run(OUT=str(tmp_path), GPU_CHECK_SECONDS="200")
    assert "over the budget by" in out  # a smaller budget says which caps cannot all hold


def test_unknown_argument_is_refused():
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), "--dryrun"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown argument --dryrun" in proc.stderr
