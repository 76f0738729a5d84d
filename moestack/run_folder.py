"""A run's ``out_dir`` through a start: checked first, created only once every check passed.

Before its checks a start writes nothing into the folder: it holds the folder's lock when the
folder already has one (a run's folder: a second process training into it is refused before
it reads a file), and checks the folder against ``resume`` (``moestack.runs.prepare_out_dir``
on a folder that exists; a folder that does not exist holds nothing to resume). Once the
start's checks passed, ``create`` makes the folder (and those above it) and takes its lock,
a new lock file included. The one repair made before the checks is a killed save's leftovers
(``checkpoint.clean_partial``, under the lock).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from moestack import distributed, locks
from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.run_paths import check_out_dir
from moestack.runs import prepare_out_dir


class FolderInUse(MoestackError):
    """``out_dir`` is held by another process that trains into it: nothing in it is this
    start's (its log lines, .hydra/ record and lock file are the other run's)."""


class RunFolder:
    """``out_dir`` held by this process while its run trains (rank 0: ``main``); a context
    manager: the lock is dropped on exit (the system drops it however the process ends)."""

    def __init__(self, out_dir: Path, main: bool = True) -> None:
        self.out_dir = out_dir
        self.main = main
        self._fd: int | None = None

    def __enter__(self) -> RunFolder:
        """Hold the folder's lock if it has one (opening it writes nothing)."""
        lock = self.out_dir / locks.LOCK_FILE
        if self.main and lock.is_file():
            self._take(os.open(lock, os.O_RDWR))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the lock
            self._fd = None

    def check(self, cfg: TrainConfig, dist_info: distributed.DistInfo) -> Path | None:
        """Check the folder against ``resume`` (every rank, as rank 0 found it); returns the
        checkpoint to resume from (None for a new run)."""
        there = distributed.gather_objects(self.out_dir.is_dir(), dist_info)[0]
        if there:
            return prepare_out_dir(cfg, self.out_dir, dist_info)
        if cfg.resume:
            raise MoestackError(
                f"resume=true but {self.out_dir / 'checkpoints'} holds no checkpoint; start a "
                "new run"
            )
        return None

    def create(self) -> None:
        """Make the folder and hold it (rank 0; a lock file made if there was none)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.main and self._fd is None:
            self._take(os.open(self.out_dir / locks.LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644))

    def _take(self, fd: int) -> None:
        if not locks.lock_exclusive(fd):
            os.close(fd)
            raise FolderInUse(
                f"out_dir={self.out_dir} is in use: another process trains into it now; wait "
                "for it to end, or pick another out_dir"
            )
        self._fd = fd


@contextlib.contextmanager
def holding_run_dir(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir`` (made if missing) as a training process holds its folder, for as long
    as the block runs: what another process that trains into it, or waits for it, sees."""
    check_out_dir(out_dir)
    with RunFolder(out_dir) as folder:
        folder.create()
        yield
