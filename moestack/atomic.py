"""Durable, all-or-nothing file system steps shared by the writers of folders (expert stores,
exported model folders): fsync a folder, move a finished folder into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries), where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def install_dir(tmp: Path, path: Path) -> None:
    """Move the finished, fsynced folder ``tmp`` to ``path``, replacing an old one there
    (renamed aside first, so ``path`` always holds a whole folder or none)."""
    fsync_dir(tmp)
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    fsync_dir(path.parent)
