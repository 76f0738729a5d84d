"""What produced a run: one record per start (new or resumed) in ``<run>/provenance.json``.

Every start that begins appends ``{"status": "running", "started_at", "launch", "moestack", git
commit and whether the tree had changes, library versions, device, host}``; when the start
ends its record says "finished", "failed" (with the error) or "interrupted" (Ctrl-C). A run
killed outright keeps "running". A start begins once its checks passed, just before it first
writes into the run's folder (``StartRecord.begin``): a start refused before then (a changed
config on resume, missing data, a checkpoint of another shape) adds no record, so a run's
records hold only the starts that trained it. ``moestack.trainer.train`` records every start,
whoever calls it: the ``moestack-train`` command adds its command line, overrides and config
choices (``launch``); any other caller gets its process's command line, or passes ``launch``
itself.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import moestack
from moestack import atomic
from moestack.config import TrainConfig
from moestack.distributed import launch_info
from moestack.errors import MoestackError

log = logging.getLogger(__name__)

PROVENANCE_FILE = "provenance.json"
_PACKAGES = ("torch", "triton", "transformers", "hydra-core", "omegaconf", "wandb", "numpy")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def git_state() -> dict[str, Any]:
    """The commit (and whether the tree has changes) of the checkout moestack runs from;
    None for both when it is installed from a wheel."""
    root = Path(moestack.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return {"git_commit": None, "git_dirty": None}
    status = run_git(["status", "--porcelain", "--untracked-files=no"], root)
    return {
        "git_commit": run_git(["rev-parse", "HEAD"], root),
        "git_dirty": None if status is None else bool(status),
    }


def run_git(args: list[str], cwd: Path) -> str | None:
    """``git ARGS`` in ``cwd``: its output, stripped, or None when git is missing or fails."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def versions() -> dict[str, str | None]:
    """Python and the installed versions of the packages a run depends on (None: absent)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _device(cfg: TrainConfig) -> dict[str, Any]:
    """The device ``cfg.device`` resolves to on this rank, with the GPU's name."""
    import torch

    from moestack.device import resolve_device

    device = resolve_device(cfg.device, launch_info().local_rank)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "device": str(device),
        "device_name": name or platform.machine(),
        "cuda": torch.version.cuda,
    }


def start_record(cfg: TrainConfig, launch: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record of this start: ``launch`` (how it was started; by default the process's
    command line), moestack's version and commit, the library versions and the device."""
    launch = launch if launch is not None else {"command": [Path(sys.argv[0]).name, *sys.argv[1:]]}
    record = {
        "status": "running",
        "started_at": _now(),
        "moestack": moestack.__version__,
        **git_state(),
        "versions": versions(),
        **_device(cfg),
        "host": platform.node(),
    }
    check_launch(launch)
    return {**launch, **record}


RECORD_KEYS = frozenset(
    ("status", "started_at", "ended_at", "error", "moestack", "git_commit", "git_dirty",
     "versions", "device", "device_name", "cuda", "host")
)  # fmt: skip


def check_launch(launch: dict[str, Any] | None) -> None:
    """Raise ValueError when ``launch`` uses a key of the record's own (:data:`RECORD_KEYS`);
    cheap, so every rank checks it before any work."""
    taken = sorted(set(launch or {}) & RECORD_KEYS)
    if taken:
        raise ValueError(f"launch record keys {taken} are the provenance record's own; rename them")


def _write_starts(out_dir: Path, starts: list[dict[str, Any]]) -> None:
    atomic.write_text(out_dir / PROVENANCE_FILE, json.dumps({"starts": starts}, indent=2) + "\n")


def earlier_starts(out_dir: Path) -> list[dict[str, Any]]:
    """The records of the run's earlier starts (a resumed run keeps them). A file that cannot
    be read is kept aside as ``provenance.json.bad-<UTC time>``, with a warning, and a new one
    begun."""
    path = out_dir / PROVENANCE_FILE
    if not path.exists():
        return []
    try:
        starts = json.loads(path.read_text())["starts"]
        if not isinstance(starts, list):
            raise TypeError("'starts' is not a list")
    except (OSError, ValueError, KeyError, TypeError) as err:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        bad = path.with_name(f"{PROVENANCE_FILE}.bad-{stamp}")
        log.warning("%s cannot be read (%s): kept as %s, a new record begins", path, err, bad)
        os.replace(path, bad)
        return []
    return starts


class StartRecord:
    """One start's record in provenance.json: appended when the start begins (``begin``), then
    marked with how it ended (``end``). ``record`` is None off rank 0, where nothing is
    written; ``begun`` is kept on every rank."""

    def __init__(self, out_dir: Path, record: dict[str, Any] | None) -> None:
        self.out_dir = out_dir
        self.record = record
        self.begun = False
        self._starts: list[dict[str, Any]] = []

    def begin(self) -> None:
        """The start's checks passed and it is about to write into the run's folder: append
        its record, "running" (a second call does nothing)."""
        if self.begun:
            return
        self.begun = True
        if self.record is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._starts = [*earlier_starts(self.out_dir), self.record]
        _write_starts(self.out_dir, self._starts)

    def end(self, err: BaseException | None) -> None:
        """Mark the begun start finished, or failed with ``err`` ("interrupted" for Ctrl-C); a
        start that never began writes nothing. A record that cannot be written (the full disk
        that failed the run) never hides the error that ended the start: it is a warning
        naming the file, and the record keeps "running", as a kill leaves it; after a start
        that finished it is the error, one line."""
        if not self.begun or self.record is None:
            return
        if err is None:
            self.record["status"] = "finished"
        else:
            status = "failed" if isinstance(err, Exception) else "interrupted"
            self.record.update(status=status, error=f"{type(err).__name__}: {err}")
        self.record["ended_at"] = _now()
        try:
            _write_starts(self.out_dir, self._starts)
        except OSError as write_err:
            path, reason = self.out_dir / PROVENANCE_FILE, write_err.strerror or write_err
            if err is None:
                raise MoestackError(
                    f"{path}: the run finished (summary.json is written), but this record of "
                    f"it cannot be written ({reason}); free space on that device"
                ) from None
            log.warning("%s: this start's end (%s) is not recorded (%s); it says \"running\"",
                        path, self.record["status"], reason)  # fmt: skip


@contextlib.contextmanager
def recorded_start(
    out_dir: Path, cfg: TrainConfig, launch: dict[str, Any] | None = None
) -> Iterator[StartRecord]:
    """:func:`recorded` with :func:`start_record`, built on rank 0 only (the others write
    nothing, and need not ask git or the GPU)."""
    record = start_record(cfg, launch) if launch_info().is_main else None
    with recorded(out_dir, record) as start:
        yield start


@contextlib.contextmanager
def recorded(out_dir: Path, record: dict[str, Any] | None) -> Iterator[StartRecord]:
    """The run's record of this start (rank 0): the body calls ``begin()`` on what it yields
    when the start begins, and the record then says how the start ended: finished, or failed
    with the error (a killed run stays "running"). A body that ends before ``begin()``, a
    refused start, leaves provenance.json as it was."""
    start = StartRecord(out_dir, record if launch_info().is_main else None)
    try:
        yield start
    except BaseException as err:  # Ctrl-C included; a kill -9 leaves "running"
        start.end(err)
        raise
    start.end(None)
