"""Locking a pre-registration (sha256, git commit, UTC time) and verifying the lock."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.compose import check_overrides
from moestack.prereg.spec import load

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock.json"


def lock_path(path: Path | str) -> Path:
    """Where the lock of ``path`` lives: ``<file>.lock.json`` beside it."""
    path = Path(path)
    return path.with_name(path.name + LOCK_SUFFIX)


def sha256_file(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def lock(path: Path | str, force: bool = False) -> Path:
    """Validate ``path`` and record its sha256, the git commit and the UTC time; returns the lock.

    Refuses to replace an existing lock unless ``force`` (re-locking after results exist
    defeats pre-registration; the old lock's hash is kept in the new one as ``replaces``).
    """
    path = Path(path)
    spec = load(path)
    check_overrides(spec)
    target = lock_path(path)
    previous = None
    if target.exists():
        if not force:
            raise MoestackError(
                f"{target} exists: {path.name} is already locked; a pre-registration is locked "
                "once (pass --force to re-lock, and say why in the report)"
            )
        previous = json.loads(target.read_text()).get("sha256")
    folder = path.resolve().parent
    commit = _git(["rev-parse", "HEAD"], folder) or "unknown"
    status = _git(["status", "--porcelain"], folder)
    record = {
        "file": path.name,
        "study": spec.study,
        "sha256": sha256_file(path),
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "locked_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if previous:
        record["replaces"] = previous
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, target)
    log.info("locked %s: sha256 %s at commit %s", path, record["sha256"][:12], commit[:12])
    return target


def verify(path: Path | str) -> dict[str, Any]:
    """The lock record of ``path``; raises when there is none or the file changed since."""
    path = Path(path)
    target = lock_path(path)
    if not target.is_file():
        raise MoestackError(
            f"{path} is not locked ({target.name} not found); run `moestack prereg lock {path}` "
            "before running or analysing the study"
        )
    try:
        record = json.loads(target.read_text())
        locked = record["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise MoestackError(f"{target} is not a valid lock file; restore it from git") from None
    current = sha256_file(path)
    if current != locked:
        raise MoestackError(
            f"{path} changed since it was locked at {record.get('locked_at', '?')} "
            f"(sha256 {locked[:12]} in {target.name}, {current[:12]} now): the pre-registered "
            f"hypotheses no longer match; restore the locked version (git checkout {path}) or "
            "register the change as a new study with its own name and lock"
        )
    return record
