"""What a study's hash covers: the study file and every packaged config file its runs load.

A run of the study is ``moestack-train <overrides>``, and hydra builds its config from
``configs/train.yaml`` and one file per config group (``model/tiny.yaml``,
``router/pin.yaml``, ``telemetry/off.yaml``, ...): the defaults of train.yaml as the study's
overrides change them. Editing one of those files changes what every run trains, so the study
hash (``study_sha256``) is the sha256 of the study file's hash together with the hash of each
of those files, for every arm. The Python defaults of the config classes
(``moestack/config.py`` and each section's own module, such as ``moestack/optim/config.py``)
are code: the lock pins them with the code hash (``code_files``: the sha256 of every source
file of the installed moestack package, kernels and telemetry included) beside the git
commit, and ``prereg run`` refuses to train with other sources unless the change is put on record.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import moestack.configs
from moestack.errors import MoestackError
from moestack.prereg.compose import config_choices
from moestack.prereg.spec import Prereg

CONFIG_ROOT = Path(moestack.configs.__file__).resolve().parent  # the packaged configs/
TRAIN_FILE = "train.yaml"


def sha256_file(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digest(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON (sorted keys, no spaces): the same on every machine."""
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


CODE_PACKAGES = ("moestack", "moestack.kernels", "moestack.telemetry")  # installed apart


def code_files() -> dict[str, str]:
    """Every source file (Python, and the host kernels' C++) of the installed moestack package
    (``moestack/...``, the kernels and telemetry folders it installs from included) -> its
    sha256: what a study's runs execute. Found without importing the kernels (no triton
    needed)."""
    files: dict[str, str] = {}
    for package in CODE_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        prefix = package.replace(".", "/")
        for file in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp")):
            rel = file.relative_to(root)
            if "__pycache__" in rel.parts or (
                package == "moestack" and rel.parts[0] in ("kernels", "telemetry")
            ):
                continue
            files[f"{prefix}/{rel.as_posix()}"] = sha256_file(file)
    return dict(sorted(files.items()))


def changed_files(locked: dict[str, str], now: dict[str, str]) -> list[str]:
    """The files whose hash differs between ``locked`` and ``now`` (added or removed too)."""
    return [name for name in sorted(set(locked) | set(now)) if locked.get(name) != now.get(name)]


def config_files(spec: Prereg, root: Path | str | None = None) -> dict[str, Path]:
    """The config files (relative to ``root``, default the packaged configs/) that hydra loads
    for any run of the study: train.yaml and the selected option of every config group."""
    root = Path(root) if root is not None else CONFIG_ROOT
    files = {TRAIN_FILE: root / TRAIN_FILE}
    for arm in spec.arms:
        for group, option in config_choices(spec.overrides(arm, spec.seeds[0])).items():
            if option is None or not (root / group).is_dir():  # hydra's own groups, removed ones
                continue
            files[f"{group}/{option}.yaml"] = root / group / f"{option}.yaml"
    missing = sorted(rel for rel, file in files.items() if not file.is_file())
    if missing:
        raise MoestackError(
            f"{root}: config files {missing} that the study {spec.study} loads are missing; "
            "restore them (git checkout -- configs/)"
        )
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class Fingerprint:
    """The hashes a lock records and a run is checked against."""

    sha256: str  # the study file alone (what a legacy lock records)
    configs: dict[str, str]  # config file, relative to configs/ -> its sha256
    study_sha256: str  # digest of both: the study hash

    def changed_configs(self, locked: dict[str, str]) -> list[str]:
        """The config files whose hash differs from ``locked`` (added or removed included)."""
        names = sorted(set(locked) | set(self.configs))
        return [name for name in names if locked.get(name) != self.configs.get(name)]


def fingerprint(spec: Prereg, root: Path | str | None = None) -> Fingerprint:
    """The study hash of ``spec`` (its file and its config files under ``root``)."""
    configs = {rel: sha256_file(file) for rel, file in config_files(spec, root).items()}
    spec_sha = sha256_file(spec.path)
    return Fingerprint(spec_sha, configs, digest({"spec": spec_sha, "configs": configs}))
