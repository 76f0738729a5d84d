"""Durable, all-or-nothing file system steps shared by the writers of files and folders (run
files, expert stores, exported model folders): write a file, fsync a folder, move a finished
folder into place; and one rule for telling a full disk from other write errors.

A folder ``OUT`` is written as ``.OUT.tmp-PID`` beside it (``temp_dir``, PID the writer's
process id) and moved into place by ``install_dir``, which renames an old ``OUT`` aside to
``.OUT.old-PID`` first. A writer killed midway leaves those folders behind; a writer that
calls ``recover_dir(OUT)`` before it starts (the transformers exports do) puts an ``.old``
back where ``OUT`` is missing (a kill between the two renames) and removes the leftovers of
processes no longer alive."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from moestack.errors import MoestackError

log = logging.getLogger(__name__)

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


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the folders holding them to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(Path(folder))


def _aside(path: Path, kind: str) -> Path:
    """The name of this process's ``kind`` ("tmp" or "old") folder beside ``path``."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}")


def _remove(path: Path) -> None:
    """Remove what is at ``path``: a symbolic link (or a file) unlinked, never followed
    (what a link points to stays), a folder with everything in it; nothing there is no
    error."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def temp_dir(path: Path) -> Path:
    """A new, empty folder ``.NAME.tmp-PID`` beside ``path`` to write ``path``'s contents
    into (made as ``mkdir`` makes any folder, under the umask: not private); what an earlier
    process that had this PID left there (a folder or a link) is removed first (this process
    removes its own when it fails)."""
    tmp = _aside(path, "tmp")
    _remove(tmp)
    tmp.mkdir()
    return tmp


def install_dir(tmp: Path, path: Path) -> None:
    """Move the finished folder ``tmp`` to ``path``, every file in it flushed to disk first,
    replacing what is there (renamed aside to ``.NAME.old-PID`` first, so ``path`` holds a
    whole folder or none; a kill between the two renames leaves it to ``recover_dir``). A
    symbolic link at ``path`` is replaced, not followed: the link goes, what it pointed to
    stays."""
    fsync_tree(tmp)
    if os.path.lexists(path):
        old = _aside(path, "old")
        _remove(old)  # left by an earlier process with this PID
        os.rename(path, old)
        os.rename(tmp, path)
        _remove(old)
    else:
        os.rename(tmp, path)
    fsync_dir(path.parent)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this process counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # none, or a number no process can have
        return False
    except PermissionError:  # another user's process
        return True
    return True


def recover_dir(path: Path) -> None:
    """Clean up after writers of ``path`` that were killed: where ``path`` is missing, the
    newest ``.NAME.old-PID`` of a dead process is renamed back to it (the writer died
    between moving the old folder aside and the new one in); then every ``.NAME.tmp-PID``
    and ``.NAME.old-PID`` of a dead process is removed. Each may be a folder or a symbolic
    link (an old ``path`` that was a link): a link is put back or unlinked, never followed.
    What live processes left (another writer at work) is left alone."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-(\d+)")
    try:
        entries = list(path.parent.iterdir())
    except OSError:  # no parent folder yet (or not a folder): nothing was left
        return
    dead = {}
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        ours = entry.is_symlink() or entry.is_dir()  # a folder, or an old OUT that was a link
        if match and ours and not _alive(int(match[2])):
            dead[entry] = match[1]
    olds = [entry for entry, kind in dead.items() if kind == "old"]
    if olds and not os.path.lexists(path):
        newest = max(olds, key=lambda entry: entry.lstat().st_ctime)
        os.rename(newest, path)
        fsync_dir(path.parent)
        del dead[newest]
        log.warning("%s was missing after a killed write; put back its earlier copy %s",
                    path, newest.name)  # fmt: skip
    for entry in dead:
        _remove(entry)
        log.info("removed %s, left by a killed write of %s", entry, path)


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
