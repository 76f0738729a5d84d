"""Advisory locks on files (``flock``): the one process that may write a folder holds an
exclusive lock on a file in it; anyone may ask, with a shared lock taken and dropped at once,
whether it is held. The system drops a lock when the last descriptor of it closes, however
the process ends (on a network file system, as far as it supports ``flock``)."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_FILE = ".moestack.lock"  # in a run folder: flock'ed by the process training into it


def lock_exclusive(fd: int, tries: int = 3, wait_s: float = 0.02) -> bool:
    """``flock(LOCK_EX | LOCK_NB)`` on ``fd``, tried again after a moment (an
    :func:`is_held` probe holds a shared lock for microseconds); False when it stays held."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt < tries - 1:
                time.sleep(wait_s)
    return False


def is_held(path: Path) -> bool:
    """Whether a process holds ``path`` locked now (False when there is no such file). A
    process that tries to lock it in that instant waits a moment (:func:`lock_exclusive`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock if it was taken
    return False
