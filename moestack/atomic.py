"""Durable, all-or-nothing file system steps shared by the writers of files and folders (run
files, expert stores, exported model folders): write a file, fsync a folder, move a finished
folder into place; and one rule for telling a full disk from other write errors."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from moestack.errors import MoestackError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "StorageFull")  # in messages


def fsync_file(path: Path) -> None:
    """fsync a file's contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
    return digest.hexdigest()


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


def write_text(path: Path, text: str) -> None:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` all or nothing: into a private temporary file beside it,
    fsynced, then renamed over ``path``. A symlink at ``path`` is replaced, never followed,
    and a reader (or a kill) sees the old file or the new one, never half of it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a run's files from its group
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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


def out_of_space(err: BaseException, folder: Path, needed: int, what: str) -> MoestackError | None:
    """The one-line error for a write of ``what`` into ``folder`` that failed for want of
    space, or None when ``err`` is another failure. A full disk reaches Python as an OSError
    (ENOSPC, EDQUOT), or inside another library's own error (safetensors', torch.save's),
    so a write error while ``folder`` has less than ``needed`` bytes free counts too."""
    if not isinstance(err, Exception) or isinstance(err, MoestackError):
        return None
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    full = (isinstance(err, OSError) and err.errno in _FULL) or any(
        words in str(err) for words in _FULL_WORDS
    )
    if not full and not (free is not None and free < needed):
        return None
    have = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
    return MoestackError(
        f"no space left on the device of {folder} to write {what}: it needs about "
        f"{needed / 2**20:.1f} MiB, {have} free; free some space and run again"
    )
