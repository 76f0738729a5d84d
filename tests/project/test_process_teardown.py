"""tests/helpers/multiprocess.py: a multi-process test that fails or runs past its deadline says what
it waited for and leaves no process of its own running; every start has its own rendezvous;
launched commands do not inherit an outer torchrun's variables."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
from helpers.multiprocess import (
    LaunchTimedOut,
    RanksFailed,
    file_rendezvous,
    run_launch,
    spawn_ranks,
)

SLEEPER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"worker{os.environ.get('LOCAL_RANK', 'x')}.pid").write_text(str(os.getpid()))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped yet, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


def _wait_dead(pids: list[int], within_s: float = 10.0) -> list[int]:
    """The pids still running ``within_s`` seconds from now (at once if none is)."""
    until = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < until:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _sleepy_rank(rank: int, folder: str) -> None:
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)  # a rank that never finishes (as one blocked on a dead peer)


def _failing_rank(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gave up")
    time.sleep(600)  # its peer, waiting for rank 1 for ever


def _children() -> set[int]:
    """The pids of this process's multiprocessing children that are alive."""
    return {p.pid for p in multiprocessing.active_children()}


def test_ranks_past_their_deadline_are_named_and_ended(tmp_path):
    before = _children()
    with pytest.raises(RanksFailed, match=r"sleepy ranks: rank\(s\) \[(0, )?1\] of 2 still "
                                          r"running after 20 s \(RANKS_DEADLINE_S\)"):  # fmt: skip
        spawn_ranks(_sleepy_rank, (str(tmp_path),), 2, "sleepy ranks", deadline_s=20)
    assert _children() <= before
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert _wait_dead(pids) == []


def test_a_failing_rank_is_named_and_its_waiting_peer_ended():
    before, started = _children(), time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)two ranks: rank 1 failed: .*rank 1 gave up"):
        spawn_ranks(_failing_rank, (), 2, "two ranks")
    assert _children() <= before
    assert time.monotonic() - started < 300  # not the peer's 600 s


def test_a_launch_past_its_deadline_is_killed_with_the_workers_it_started(tmp_path):
    """torchrun starts each worker in a session of its own, and killing torchrun alone
    leaves them running: every process the launch started is ended."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", str(script), str(tmp_path)]  # fmt: skip
    with pytest.raises(LaunchTimedOut, match=r"two sleepers: not finished after 30 s"):
        run_launch(launcher, "two sleepers", cwd=tmp_path, deadline_s=30)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("worker*.pid"))]
    assert len(pids) == 2, "the workers did not start within the deadline"
    assert _wait_dead(pids) == []


def test_what_a_finished_launch_left_behind_is_killed(tmp_path):
    leftover = tmp_path / "leftover.pid"
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(600)']); open(sys.argv[1], 'w').write(str(p.pid))")  # fmt: skip
    done = run_launch([sys.executable, "-c", code, str(leftover)], "a quick command")
    assert done.returncode == 0, done.stderr
    assert _wait_dead([int(leftover.read_text())]) == []


def test_a_launch_does_not_inherit_an_outer_rendezvous(monkeypatch):
    outer = {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2",
             "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "outer"}  # fmt: skip
    for key, value in outer.items():
        monkeypatch.setenv(key, value)
    code = "import os, sys; print(sorted(k for k in sys.argv[1:] if k in os.environ))"
    done = run_launch([sys.executable, "-c", code, *outer], "an env probe", env={"RANK": "0"})
    assert done.stdout.strip() == "['RANK']", done.stderr  # only what the caller passes


def test_each_start_gets_a_store_file_of_its_own(tmp_path):
    first, second = file_rendezvous(tmp_path), file_rendezvous(tmp_path)
    paths = [Path(url.removeprefix("file://")) for url in (first, second)]
    assert first.startswith("file://") and paths[0] != paths[1]
    assert paths[0].parent != paths[1].parent  # a folder per start
    assert all(p.parent.is_dir() and not p.exists() for p in paths)
