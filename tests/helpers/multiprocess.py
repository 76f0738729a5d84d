"""How the multi-process tests start their processes and end them, whatever the outcome.

Every start has a rendezvous of its own: ``file_rendezvous`` names a store file that does not
exist yet, in a folder made for that one start (gloo's file store must not be reused: a
left-over file holds another run's keys); torchrun is launched ``--standalone``, whose store
listens on a port the system picks when it binds (no port is chosen ahead and raced for).

Every wait has a deadline named here, generous enough for a loaded 2-core machine, and its
expiry says what was waited for and what was still running. Every process started is ended
before the helper returns or raises: spawned ranks are terminated, then killed; every
process of a launched command (torchrun's workers, a script's spawned ranks) carries a mark
in its environment by which it is found and ended, so a failed or timed-out test leaves
nothing running to slow or confuse the tests after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from moestack import distributed

# How long one collective (and the process-group set-up, which waits for every rank to start)
# may wait for the other ranks before gloo gives up: starting a rank under load (importing
# torch and moestack beside other processes) takes tens of seconds on 2 cores.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long a test waits for its spawned ranks to finish, and for a launched command.
RANKS_DEADLINE_S = 900.0
LAUNCH_DEADLINE_S = 900.0
# How long ranks get to exit on SIGTERM before they are killed.
TERMINATE_GRACE_S = 10.0
# Variables through which an outer torchrun (or a test) would steer the processes launched:
# a launched command gets its rendezvous from its own command line, never from these.
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME")  # fmt: skip
DIST_ENV_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
# Set, to a value of its own, in the environment of every launched command: its processes
# inherit it, so the teardown finds each of them, wherever torchrun put it.
LAUNCH_MARK = "MOESTACK_TEST_LAUNCH"


class RanksFailed(RuntimeError):
    """Spawned ranks that failed or did not finish in time; the message says which."""


class LaunchTimedOut(RuntimeError):
    """A launched command that did not finish in time; the message says which."""


def file_rendezvous(folder: Path) -> str:
    """A ``file://`` init method for one start: a store file that does not exist yet, in a
    new folder under ``folder``."""
    store = Path(tempfile.mkdtemp(prefix="rendezvous-", dir=folder)) / "store"
    return f"file://{store}"


def spawn_ranks(
    fn: Callable[..., None],
    args: Sequence[Any],
    nprocs: int,
    what: str,
    deadline_s: float = RANKS_DEADLINE_S,
) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes and wait for all of them;
    RanksFailed naming ``what`` when one fails or they are not done within ``deadline_s``.
    No rank is left running when this returns or raises."""
    ctx = mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=False)
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise RanksFailed(
                    f"{what}: rank(s) {running} of {nprocs} still running after "
                    f"{deadline_s:.0f} s (RANKS_DEADLINE_S), ended now; their output is in "
                    "the captured stderr"
                )
            try:
                if ctx.join(timeout=min(left, 5.0)):
                    return
            except ProcessException as err:
                raise RanksFailed(f"{what}: rank {err.error_index} failed: {err}") from err
    finally:
        end_processes(ctx.processes)


def run_gloo_rank(
    rank: int, world: int, init_method: str, body: Callable[..., None], *args: Any
) -> None:
    """``body(*args)`` as rank ``rank`` of a gloo group of ``world`` ranks, ended as moestack's
    runs end theirs: every rank at a barrier, then ``distributed.close_process_groups``, with
    no gloo worker thread left running (one left would free tensors while the interpreter
    exits and may abort the process). The body runs in its own frame, so its objects (an
    optimizer, a mesh) are gone before the groups are closed; a failing body's frames are
    cleared for the same reason."""
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        body(*args)
        dist.barrier()  # no rank tears gloo down while a peer is still connected
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        left = distributed.close_process_groups()
    assert left == 0, f"rank {rank}: {left} gloo worker thread(s) outlived the process groups"


def end_processes(processes: Sequence[Any]) -> None:
    """SIGTERM the processes still alive, SIGKILL those alive ``TERMINATE_GRACE_S`` later,
    and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    until = time.monotonic() + TERMINATE_GRACE_S
    for p in processes:
        p.join(max(0.0, until - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the variables of :data:`DIST_ENV` (nor any
    ``TORCHELASTIC_*``), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DIST_ENV and not k.startswith(DIST_ENV_PREFIXES)
    }
    env.update(extra or {})
    return env


def run_launch(
    args: Sequence[str],
    what: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    deadline_s: float = LAUNCH_DEADLINE_S,
) -> subprocess.CompletedProcess:
    """Run ``args`` (output captured as text) with :func:`launch_env` plus ``env``;
    LaunchTimedOut naming ``what`` if it is not done within ``deadline_s``. Every process it
    started is ended before this returns or raises (:func:`end_launched`). The output goes to
    files, not pipes: a process it left behind holding a pipe would keep the wait going."""
    marker = uuid.uuid4().hex
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(args),
            cwd=cwd,
            env=launch_env({**(env or {}), LAUNCH_MARK: marker}),
            stdout=out,
            stderr=err,
            text=True,
        )
        try:
            proc.wait(timeout=deadline_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            end_launched(marker)  # whatever is still running, on any way out of here
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        raise LaunchTimedOut(
            f"{what}: not finished after {deadline_s:.0f} s (LAUNCH_DEADLINE_S); it and the "
            f"processes it started were ended. Last output:\n{stdout[-2000:]}{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def end_launched(marker: str) -> None:
    """End every process whose environment carries ``LAUNCH_MARK=marker``: SIGTERM, then
    SIGKILL for those alive ``TERMINATE_GRACE_S`` later. The mark finds them wherever they
    went: torchrun starts each worker in a session of its own, and a worker whose launcher
    died is re-parented, so neither the process group nor the parent finds them all."""
    pids = _marked(marker)
    _signal(pids, signal.SIGTERM)
    until = time.monotonic() + TERMINATE_GRACE_S
    while pids and time.monotonic() < until:
        time.sleep(0.1)
        pids = _marked(marker)
    _signal(pids, signal.SIGKILL)


def _marked(marker: str) -> list[int]:
    """The running processes (not zombies) whose environment holds ``LAUNCH_MARK=marker``."""
    needle = f"{LAUNCH_MARK}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
