"""Where a run's files go, checked before anything is made there: ``out_dir`` (a folder this
process can write, with names its file system takes) and hydra's record folder
(``hydra.run.dir``, ``.hydra/`` and ``train.log``), which must not be another run's.

Light on purpose (the standard library, yaml and ``moestack.locks``): ``moestack-train``
checks its command line with it before it imports torch or hydra.
"""

from __future__ import annotations

import os
from pathlib import Path

from moestack import locks
from moestack.errors import MoestackError

# What marks a folder as a run's: moestack's record of its starts, its checkpoints, or the
# lock of a process training into it.
_RUN_FILES = ("provenance.json", "checkpoints")


def check_out_dir(out_dir: Path, name: str = "out_dir") -> None:
    """Refuse, before anything is written, an ``out_dir`` that cannot hold a run: a name
    longer than its file system allows, a file, a path under a file, a broken symlink, or a
    folder this process may not write to (``name``: the setting the message names)."""
    check_name_lengths(out_dir, name)
    if out_dir.exists() and not out_dir.is_dir():
        raise MoestackError(f"{name}={out_dir} is a file, not a folder; pick another {name}")
    if out_dir.is_symlink() and not out_dir.exists():
        raise MoestackError(f"{name}={out_dir} is a broken symlink; remove it or pick another")
    existing = out_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise MoestackError(
            f"{name}={out_dir} lies under {existing}, which is a file; pick another {name}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MoestackError(
            f"{name}={out_dir}: {existing} is read-only for this user; pick a writable {name}"
        )


def check_name_lengths(path: Path, name: str = "out_dir") -> None:
    """Refuse a ``path`` with a folder name longer than the file system holding it allows
    (``NAME_MAX``, 255 bytes on Linux's), or longer as a whole than ``PATH_MAX``, naming
    it: the system would refuse it with ``OSError: [Errno 36]`` wherever it was first used."""
    whole = Path(os.path.abspath(path))
    existing = next(p for p in (whole, *whole.parents) if os.path.isdir(p))  # '/' at least
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            shown = part if len(part) <= 40 else f"{part[:32]}...{part[-4:]}"
            raise MoestackError(
                f"{name}={path}: the folder name {shown} is {size} bytes, longer than the "
                f"{name_max} its file system allows; pick a shorter {name}"
            )
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    if len(os.fsencode(whole)) >= path_max:
        raise MoestackError(
            f"{name}={path} is {len(os.fsencode(whole))} bytes as an absolute path, not less "
            f"than the {path_max} its file system allows; pick a shorter {name}"
        )


def _pathconf(folder: Path, key: str, default: int) -> int:
    try:
        return int(os.pathconf(folder, key))
    except (OSError, ValueError):
        return default


def check_record_dir(record: Path, run_dir: Path) -> None:
    """Refuse a hydra record folder (``hydra.run.dir=record``) apart from the run's folder
    ``run_dir`` that belongs to another run, before hydra overwrites its ``.hydra/`` and
    adds to its ``train.log``: another run's folder (or a folder inside one), or a folder
    holding hydra's record of a run whose ``out_dir`` is not ``run_dir``. The run's own
    record folder (a resume with the same ``hydra.run.dir``) is taken."""
    record_dir, run_dir = Path(os.path.abspath(record)), Path(os.path.abspath(run_dir))
    if record_dir == run_dir:
        return
    for folder in (record_dir, *record_dir.parents):
        if folder == run_dir:
            break  # inside this run's own folder
        if is_run_dir(folder):
            raise MoestackError(
                f"hydra.run.dir={record}: {folder} is the folder of another run, whose "
                f".hydra/ record and train.log hydra would overwrite; pick another "
                "hydra.run.dir, or leave it out (the record then goes to out_dir)"
            )
    owner = record_owner(record_dir)
    if owner is not None and owner != run_dir:
        raise MoestackError(
            f"hydra.run.dir={record} holds the record of the run in {owner} (its .hydra/ and "
            "train.log), which hydra would overwrite; pick another hydra.run.dir, or leave it "
            "out (the record then goes to out_dir)"
        )


def new_root(path: Path) -> Path | None:
    """The highest folder that making ``path`` would create (``path`` itself or one above
    it); None where ``path`` exists. What a start that is stopped before it kept anything
    removes again (``moestack.interrupts.discard_unused``)."""
    if path.exists():
        return None
    while path.parent != path and not path.parent.exists():
        path = path.parent
    return path


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` holds a run: its provenance record or checkpoints, or a process
    that trains into it now."""
    try:
        return any((folder / name).exists() for name in _RUN_FILES) or locks.is_held(
            folder / locks.LOCK_FILE
        )
    except OSError:  # cannot tell: not taken as one
        return False


def record_owner(record_dir: Path) -> Path | None:
    """The run folder whose hydra record ``record_dir/.hydra`` is: its ``out_dir`` (hydra's
    config.yaml), relative to the folder hydra ran in (hydra.yaml's ``runtime.cwd``), or
    ``record_dir`` itself for a run without out_dir; None without a record. A record that
    cannot be read is nobody's to overwrite: ``record_dir/.hydra`` stands for its owner."""
    import yaml

    folder = record_dir / ".hydra"
    if not folder.is_dir():
        return None
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        hydra = yaml.safe_load((folder / "hydra.yaml").read_text()) or {}
        out_dir = str(config.get("out_dir") or "")
        cwd = str(hydra["hydra"]["runtime"]["cwd"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return folder
    if not out_dir:  # the record folder was that run's folder
        return record_dir
    if "${" in out_dir:  # interpolated: whose it was cannot be told
        return folder
    return Path(os.path.abspath(os.path.join(cwd, out_dir)))
