"""This user's cache folders (built kernels, token ids): where they are, and the one rule for
using one. A cache is read back into the process (a library is loaded, token ids are trained
on), so a folder is used only if it belongs to this user and no one else can write it.

Where: ``$<ENV>`` if set and not empty (the folder itself), else ``moestack/<name>`` under
``$XDG_CACHE_HOME`` when that is absolute (the XDG spec makes an empty or relative one
invalid: it is ignored), else under ``~/.cache``.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path


class NotPrivate(Exception):
    """A cache folder (or file) that is not used; the message says why."""


def cache_folder(env: str, name: str) -> Path:
    """The cache folder the environment names (see the module docstring)."""
    given = os.environ.get(env)
    if given:
        return Path(given).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else home() / ".cache"
    return base / "moestack" / name


def home() -> Path:
    """This user's home: ``$HOME`` if absolute, else the password database's entry."""
    given = os.environ.get("HOME", "")
    if os.path.isabs(given):
        return Path(given)
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        raise NotPrivate(f"no home folder for uid {os.getuid()}") from None


def private_folder(folder: Path) -> Path:
    """``folder``, made (mode 0o700) if missing, with its symbolic links resolved;
    NotPrivate unless the folder it resolves to belongs to this user, only they can write
    it, and this process can."""
    try:
        folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        real = Path(os.path.realpath(folder))  # a link is followed: its target is judged
        st = os.lstat(real)
    except OSError as err:
        raise NotPrivate(f"cannot create it: {err.strerror or err}") from None
    problem = "not a folder" if not stat.S_ISDIR(st.st_mode) else not_ours_alone(st)
    if problem is None and not os.access(real, os.W_OK | os.X_OK):
        problem = "not writable"
    if problem:
        raise NotPrivate(problem)
    return real


def not_ours_alone(st: os.stat_result) -> str | None:
    """Why a cache folder or file with status ``st`` may hold what another user wrote, or
    None: it must belong to this process's (effective) user, and neither group nor others
    may write it."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others, mode {stat.S_IMODE(st.st_mode):#o}"
    return None
