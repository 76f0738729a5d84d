"""Locking a pre-registration and verifying the lock (format and history: ``chain``).

A lock records the study hash (the study file and the config files its runs load,
``fingerprint``), the code hash (every moestack source file, ``hashing.code_files``), the git
commit and the UTC time, appended to the lock file's hash chain. Re-locking is ``--force``
before any run of the study exists and ``--amend REASON`` after; ``verify`` checks the chain,
then the files against the newest record; ``check_code`` refuses to train with sources other
than the locked ones unless the change is recorded as an amendment.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg import chain as chains
from moestack.prereg import hashing, sources
from moestack.prereg.compose import check_overrides
from moestack.prereg.decision import check_rules
from moestack.prereg.hashing import fingerprint, sha256_file
from moestack.prereg.plain import check_plain
from moestack.prereg.provenance import find_run
from moestack.prereg.records import write_json
from moestack.prereg.spec import Prereg, load
from moestack.provenance import run_git

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock.json"
__all__ = ["LOCK_SUFFIX", "lock", "lock_path", "sha256_file", "verify"]


def lock_path(path: Path | str) -> Path:
    """Where the lock of ``path`` lives: ``<file>.lock.json`` beside it."""
    path = Path(path)
    return path.with_name(path.name + LOCK_SUFFIX)


def _read(target: Path) -> dict[str, Any]:
    """The lock file's JSON object (format 2 or legacy), not yet verified."""
    try:
        doc = json.loads(target.read_text())
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise MoestackError(f"{target} is not a valid lock file; restore it from git")
    return doc


def _chain(target: Path) -> list[dict[str, Any]]:
    """The verified chain of an existing lock (a legacy lock becomes its first record)."""
    doc = _read(target)
    if "format" not in doc:
        return chains.from_legacy(chains.check_legacy(doc, target))
    return chains.check_chain(doc, target)


def _previous(
    path: Path, spec: Prereg, force: bool, amend: str | None, out_dir: Path | str | None
) -> list[dict[str, Any]]:
    """The chain the new record extends ([] for a first lock), after the re-lock rules."""
    target = lock_path(path)
    if amend is not None and not amend.strip():
        raise MoestackError(f"--amend needs a reason: say why {path.name} changes after its lock")
    if amend is not None:
        check_plain(amend.strip(), "--amend reason")
    if not target.exists():
        if amend is not None:
            raise MoestackError(
                f"{target} not found: there is no lock of {path.name} to amend (restore it from "
                f"git, or lock the study without --amend)"
            )
        found = find_run(spec, out_dir)
        if found is not None:
            log.warning(
                "%s: runs of study %s exist but %s has no lock; a new lock will not cover them "
                "(restore the old lock from git and amend it to keep them)", found, spec.study,
                path.name,
            )  # fmt: skip
        return []
    previous = _chain(target)
    if amend is None:
        if not force:
            raise MoestackError(
                f"{target} exists: {path.name} is already locked; a pre-registration is locked "
                "once (pass --force to re-lock before any run, --amend REASON after runs exist)"
            )
        found = find_run(spec, out_dir)
        if found is not None:
            raise MoestackError(
                f"{found}: a run of study {spec.study} exists, so a re-lock of {path.name} is an "
                f'amendment: moestack prereg lock {path} --amend "why" (the reason goes into the '
                "lock history and the report)"
            )
    return previous


def lock(
    path: Path | str,
    force: bool = False,
    *,
    amend: str | None = None,
    out_dir: Path | str | None = None,
    rules: bool = False,
) -> Path:
    """Validate ``path`` and append a lock record to ``<file>.lock.json``; returns the lock.

    The record holds the study hash (the file and the config files its runs load), the git
    commit and the UTC time. An existing lock is extended only with ``force`` (allowed while
    no run of the study exists under ``out_dir``, default runs/prereg/<study>) or ``amend``
    (the reason, recorded and reported); the previous record stays in the chain.

    With ``rules`` (``moestack prereg lock`` passes it) a new lock is refused while a
    non-inferiority hypothesis is decided by "mean" without ``analysis.decision_reason``
    (``decision.check_rules``); it is off by default so that locks scripted before the rule
    (and their tests) keep working, and re-locks of an existing study are not affected.
    """
    path = Path(path)
    spec = load(path)
    if rules and not lock_path(path).exists():
        check_rules(spec)  # a budget decided by the seed mean needs a stated reason
    check_overrides(spec)
    previous = _previous(path, spec, force, amend, out_dir)
    fp = fingerprint(spec)
    code = hashing.code_files()
    folder = path.resolve().parent
    commit = run_git(["rev-parse", "HEAD"], folder) or "unknown"
    status = run_git(["status", "--porcelain"], folder)
    record: dict[str, Any] = {
        "action": "amend" if amend is not None else ("relock" if previous else "lock"),
        "reason": amend.strip() if amend is not None else None,
        "file": path.name,
        "study": spec.study,
        "sha256": fp.sha256,
        "study_sha256": fp.study_sha256,
        "configs": fp.configs,
        "code_sha256": hashing.digest(code),
        "code": code,
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "locked_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if previous:
        record["replaces"] = chains.records(previous)[-1]["sha256"]
    doc = chains.document(chains.append(previous, record))
    target = write_json(lock_path(path), doc)  # all or nothing
    log.info(
        "locked %s (%s): study sha256 %s at commit %s", path, record["action"],
        fp.study_sha256[:12], commit[:12],
    )  # fmt: skip
    return target


def _changed(path: Path, target: Path, head: dict[str, Any], now: str) -> MoestackError:
    """The refusal of a study file that differs from its lock."""
    return MoestackError(
        f"{path} changed since it was locked at {head.get('locked_at', '?')} "
        f"(sha256 {head['sha256'][:12]} in {target.name}, {now[:12]} now): the pre-registered "
        f"hypotheses no longer match; restore the locked version (git checkout {path}), "
        "register the change as a new study with its own name and lock, or, once runs exist, "
        f'record it as an amendment (moestack prereg lock {path} --amend "why")'
    )


def _check_configs(path: Path, target: Path, head: dict[str, Any]) -> None:
    """Refuse when the config files the study loads hash differently from the newest lock."""
    now = fingerprint(load(path))
    if now.study_sha256 != head["study_sha256"]:
        files = ", ".join(now.changed_configs(head.get("configs") or {}))
        raise MoestackError(
            f"config files that {path} loads changed since it was locked at "
            f"{head['locked_at']} ({files}; study sha256 {head['study_sha256'][:12]} in "
            f"{target.name}, {now.study_sha256[:12]} now): restore them (git checkout -- "
            f"{hashing.CONFIG_ROOT}), or record the change: "
            f'moestack prereg lock {path} --amend "why"'
        )


def verify(path: Path | str) -> dict[str, Any]:
    """The newest lock record of ``path``, with ``history`` (every lock, oldest first) and
    ``legacy`` (the newest predates the chain); raises when there is no lock, the chain does
    not verify, or the study file or a config file it loads changed since the newest lock."""
    path = Path(path)
    target = lock_path(path)
    if not target.is_file():
        raise MoestackError(
            f"{path} is not locked ({target.name} not found); run `moestack prereg lock {path}` "
            "before running or analysing the study"
        )
    doc = _read(target)
    legacy = "format" not in doc
    head = chains.check_legacy(doc, target) if legacy else chains.check_chain(doc, target)[-1]
    current = sha256_file(path)
    if current != head["sha256"]:
        raise _changed(path, target, head, current)
    if not legacy:  # a legacy lock is verified the old way: the study file's sha256 only
        _check_configs(path, target, head)
    record = {k: v for k, v in head.items() if k not in ("seq", "prev", "hash", "legacy")}
    record.setdefault("study_sha256", head["sha256"])
    record.update(
        head=None if legacy else head["hash"],
        legacy=legacy,
        history=chains.history(doc),
        path=str(path),
    )
    return record


def check_code(
    path: Path | str,
    head: dict[str, Any],
    amend: str | None = None,
    out_dir: Path | str | None = None,
) -> dict[str, Any]:
    """Refuse to train a study's runs with moestack sources that differ from those of its
    newest lock (``head``, from :func:`verify`), naming the files; with ``amend`` (why the
    change leaves the study's answer alone) the change is locked as an amendment instead,
    which the report lists. Returns the newest lock record, amended or not. A lock older
    than the code hash pinned its git commit only: its code is that commit's sources, read
    from git; where git cannot show them the run goes on with a warning."""
    path = Path(path)
    if amend is not None and not amend.strip():
        raise MoestackError(f"--amend needs a reason: say why the code {path.name} runs changed")
    locked = head.get("code")
    if locked is None and head.get("git_commit"):
        locked = sources.code_files_at_commit(str(head["git_commit"]), str(path.resolve().parent))
    if locked is None:
        log.warning(
            "%s: its lock predates the code hash and git cannot show its commit's sources; "
            "the code is not checked", path.name,
        )  # fmt: skip
        return head
    changed = hashing.changed_files(locked, hashing.code_files())
    if not changed:
        return head
    if amend is None:
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        commit = str(head.get("git_commit") or "unknown")[:12]
        raise MoestackError(
            f"moestack's sources differ from those {path.name} was locked with at commit "
            f"{commit} ({', '.join(changed[:5])}{more}): train its runs with the locked code, a "
            f"checkout of {commit} (scripts/reproduce_locked.sh {path.stem} makes a worktree of "
            f"its lock's commit), or put the change on "
            f'record: moestack prereg run {path} --amend "why it leaves the answer alone"'
        )
    lock(path, amend=f"code changed ({', '.join(changed[:5])}): {amend.strip()}", out_dir=out_dir)
    return verify(path)
