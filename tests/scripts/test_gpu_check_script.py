"""scripts/gpu_check.sh, the one command for a lent GPU: its plumbing works without a GPU.

On the CPU the GPU tests skip, so this checks what would waste GPU minutes if it broke: the
package staged as pip lays it out (mapped kernels/, telemetry/, configs/), pytest from the
staged tree, the phase selection, the time caps, the files and the summary, that the plan fits
one device call of 580 s and the second call the time the session's 15 minutes leave after it,
and that the phases pass flags their scripts accept.
"""

import os
import re
import shlex
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


CALL_S = 580  # the timeout_s of the first device call (docs/kernels.md)
SESSION_S = 900  # a session's device time: 15 minutes, the machine's start included
START_S = 90  # the machine's start (a minute or more), the transfers, the pause between calls
# The phases the open GPU issues need, in their order: 29 and 53 (optimizer), 30 (MoE
# kernels), 31 (serving), 34 (LoRA) and 56 (streamed experts); the first 6 are the first call.
NEEDED = [
    "env", "kernel_tests", "bench_moe", "profile_moe", "optim_tests", "bench_optim",
    "bench_serve", "bench_lora", "bench_stream",
]  # fmt: skip


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


def worst_case(out: str) -> tuple[int, int, int, int]:
    """setup, the phases' caps, grace and summary of the first "worst case:" line."""
    m = re.search(r"worst case: setup (\d+) \+ phases (\d+) \+ grace (\d+) \+ summary (\d+)", out)
    return tuple(int(v) for v in m.groups())


def test_dry_run_plan_fits_one_call_of_580_seconds(tmp_path):
    phases, out = dry_run(OUT=str(tmp_path))
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
    names = [name for name, _, _ in phases]
    # The order the issues ask for: kernel correctness, the MoE benchmark and the profile of
    # what it chose, the optimizer's CUDA tests and benchmark; every default phase with a cap
    # and the files it writes. The rest of what the issues need is the second call, below.
    assert names == NEEDED[:6]
    assert all(cap >= 10 and files for _, cap, files in phases)
    files = dict((n, f) for n, _, f in phases)
    assert "bench_moe.json" in files["bench_moe"]
    assert files["profile_moe"] == ["profile_moe.json"]
    assert files["bench_optim"] == ["bench_optim.json"]
    budget = int(re.search(r"budget (\d+) s", out).group(1))
    setup, caps, grace, summary = worst_case(out)
    assert caps == sum(cap for _, cap, _ in phases)
    # No phase of the plan is cut by the budget, and the worst case (every phase at its cap,
    # one SIGKILL grace, the summary) ends inside the call.
    assert setup + caps <= budget
    assert budget + grace + summary <= CALL_S
    assert f"= {setup + caps + grace + summary} s of a {CALL_S} s call" in out
    assert "optional (name them in GPU_CHECK_PHASES): " in out
    optional = out.split("optional", 1)[1].split("\n", 1)[0].split()
    assert "tune" in optional and "profile_moe_new" in optional


def test_the_second_call_covers_the_rest_within_what_is_left(tmp_path):
    """What the first call leaves out of the phases the issues need is named as one second
    call, in the plan's order, whose own dry run fits the time the 15 minutes leave after
    the machine's start and the first call."""
    _, out = dry_run(OUT=str(tmp_path))
    second = re.search(r"second call .*: GPU_CHECK_PHASES=(\S+) bash scripts/gpu_check.sh", out)
    assert second and second.group(1).split(",") == NEEDED[6:]
    call_s = int(re.search(r"its worst case: .* = \d+ s of a (\d+) s call", out).group(1))
    phases, alone = dry_run(OUT=str(tmp_path), GPU_CHECK_PHASES=second.group(1))
    assert [name for name, _, _ in phases] == NEEDED[6:]
    setup, caps, grace, summary = worst_case(alone)
    assert caps == sum(cap for _, cap, _ in phases)
    worst = setup + caps + grace + summary
    assert (
        f"its worst case: setup {setup} + phases {caps} + grace {grace} + summary {summary} = {worst} s of a {call_s} s call"
        in out
    )  # noqa: E501
    assert worst <= call_s and CALL_S + call_s <= SESSION_S - START_S
    assert "second call" not in alone  # only the default plan names it


def phase_args(name: str) -> list[str]:
    """The arguments gpu_check.sh passes to the script of phase ``name`` (continuation
    lines joined, shell quotes removed, variables left as written)."""
    text = (REPO / "scripts/gpu_check.sh").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if re.match(rf"^\s*(\w+=\S+ )*phase {name} ", ln))
    words = shlex.split(line)
    script = next(i for i, w in enumerate(words) if w.startswith("scripts/"))
    return words[script + 1 :]


def test_the_phases_pass_flags_their_scripts_accept(monkeypatch):
    """A typo in a flag would cost the GPU minutes of a phase: bench_moe's and both
    profile_moe passes' arguments parse, and bench_moe retunes the kinds issue 30 added
    candidates to; the plan's profile runs what the tuner chose (nothing forced), the
    optional pass forces every new path; bench_lora's and bench_stream's parse, on CUDA."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_moe
    import profile_moe

    args = bench_moe.build_parser().parse_args(phase_args("bench_moe"))
    assert args.retune == ["mm", "wgrad", "mm_dswiglu"] and args.save_tuned and args.json
    before = profile_moe.build_parser().parse_args(phase_args("profile_moe"))
    assert not profile_moe.forced_configs(before)
    after = profile_moe.build_parser().parse_args(phase_args("profile_moe_new"))
    assert set(profile_moe.forced_configs(after)) == {"mm", "wgrad", "mm_dswiglu"}
    assert before.shapes == after.shapes
    import bench_lora
    import bench_stream

    monkeypatch.setattr(sys, "argv", ["bench_lora.py", *phase_args("bench_lora")])
    lora = bench_lora.parse_args()
    assert lora.device == "cuda" and lora.moestack_model == "m137" and lora.json
    stream = bench_stream.build_parser().parse_args(phase_args("bench_stream"))
    assert stream.device == "cuda" and stream.json and stream.modes == "resident,host"


def test_dry_run_follows_the_phase_selection(tmp_path):
    phases, out = dry_run(OUT=str(tmp_path), GPU_CHECK_PHASES="bench_moe,train")
    assert [name for name, _, _ in phases] == ["bench_moe", "train_offload_adamw", "train_adamw"]
    phases, out = dry_run(OUT=str(tmp_path), GPU_CHECK_PHASES="profile_moe")  # a prefix: both
    assert [name for name, _, _ in phases] == ["profile_moe", "profile_moe_new"]
    phases, out = dry_run(OUT=str(tmp_path), GPU_CHECK_SECONDS="200")
    assert "over the budget by" in out  # a smaller budget says which caps cannot all hold


def test_unknown_argument_is_refused():
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), "--dryrun"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown argument --dryrun" in proc.stderr
