"""Fault injection: ``moestack prereg run --jobs 2`` stopped with SIGTERM mid-training, as
``timeout``, a scheduler or systemd stops it.

The runners run in sessions of their own (so that a terminal's Ctrl-C reaches the parent
only, which stops each of them once); a SIGTERM to the parent must stop them too, as Ctrl-C
does: no runner may go on training as an orphan, each start is recorded as interrupted in
the run's provenance.json, no claim stays held and no temporary file or folder of a write
cut short (``.NAME.tmp``, ``.NAME.tmp-PID``, ``.NAME.old-PID``) is left in the study folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.prereg import micro_study, write

from moestack import prereg

pytestmark = pytest.mark.faults

START_S = 180.0  # two runners importing torch and starting a run on a loaded 2-core machine
STOP_S = 20.0  # a few seconds, with room for the load


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _claimed_pids(out: Path) -> dict[str, int]:
    """Run name -> the pid of the runner whose claim.json names it."""
    found = {}
    for claim in (out / "runs").glob("*/claim.json"):
        try:
            found[claim.parent.name] = int(json.loads(claim.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            continue  # being written
    return found


def _starts(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "provenance.json").read_text())["starts"]
    except (OSError, ValueError, KeyError):
        return []


def _wait_for_training(proc: subprocess.Popen, out: Path, runs: int) -> dict[str, int]:
    """Wait until ``runs`` runs are claimed by live runners and have begun training."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        pids = _claimed_pids(out)
        begun = [n for n in pids if _starts(out / "runs" / n)]
        if len(begun) == runs and all(_alive(p) for p in pids.values()):
            return pids
        time.sleep(0.2)
    logs = {p.name: p.read_text()[-2000:] for p in out.glob("runner-*.log")}
    raise AssertionError(f"the runners did not start training in {START_S} s: {logs}")


def _leftovers(out: Path) -> list[str]:
    """Temporary files and folders of a write cut short (``moestack.atomic``)."""
    return sorted(
        str(p.relative_to(out)) for p in out.rglob(".*") if ".tmp" in p.name or ".old-" in p.name
    )


def test_sigterm_stops_every_runner_as_ctrl_c_does(tmp_path: Path, fault_report) -> None:
    data = micro_study(width=16, layers=1, max_bytes=200_000, train=["ckpt_every=0"])
    data["budget"] = {"steps": 1_000_000, "batch_size": 2}  # still training when stopped
    data["runs"]["arms"].pop("b")
    data["runs"]["seeds"] = [0]
    data["hypotheses"] = [h for h in data["hypotheses"] if h["id"] in ("H1", "H2")]
    for hyp in data["hypotheses"]:
        hyp["arms"] = ["a"]
    path = write(tmp_path, data)
    prereg.lock(path)
    out = tmp_path / "out"
    # --amend: a source file edited in the checkout between the lock and the run (the test
    # does not depend on which code trains) is put on record rather than refused
    command = [sys.executable, "-m", "moestack.cli", "prereg", "run", str(path), "--out",
               str(out), "--jobs", "2", "--quiet", "--amend", "edited while the test ran"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)  # fmt: skip
    pids: dict[str, int] = {}
    try:
        pids = _wait_for_training(proc, out, runs=2)
        assert len(set(pids.values())) == 2  # two runners, one run each
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=STOP_S)
        while any(_alive(p) for p in pids.values()) and time.monotonic() - stopped < STOP_S:
            time.sleep(0.1)
        orphans = {name: pid for name, pid in pids.items() if _alive(pid)}
        assert not orphans, f"runners still training after SIGTERM: {orphans}"
    finally:
        for pid in pids.values():  # the test's own children's children, by pid
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = stderr.strip().splitlines()
    assert proc.returncode == 130 and lines[-1] == "moestack prereg: interrupted", stderr
    assert "Traceback" not in stderr
    for name in pids:
        run_dir = out / "runs" / name
        assert _starts(run_dir)[-1]["status"] == "interrupted"  # stopped as Ctrl-C stops it
        assert _starts(run_dir)[-1]["error"] == "Terminated: stopped by SIGTERM"
        assert not (run_dir / "summary.json").exists()
        assert prereg.read_run_record(run_dir)["status"] == "started"
        assert not prereg.claimed(run_dir)
    assert _leftovers(out) == []
    fault_report.add("prereg run: SIGTERM mid-training", injected=1, stopped=1)
