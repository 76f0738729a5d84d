"""Hydra composition of a run's TrainConfig, and the check that every arm composes."""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.prereg.spec import Prereg


def _compose(overrides: Sequence[str], *, choices: bool) -> Any:
    """Compose ``train`` with ``overrides``: the TrainConfig, or (``choices``) the config
    group options hydra selected (``hydra.runtime.choices``: group -> option or None).

    A composition costs about half a second, and locking, verifying and analysing a study
    ask for each arm's several times: they are remembered per overrides and config files'
    bytes (an edited file composes afresh), and each caller gets its own copy."""
    composed = _compose_files(tuple(overrides), choices, _configs_digest())
    return copy.deepcopy(composed)


def _configs_digest() -> str:
    """sha256 over the relative names and bytes of every file under moestack.configs."""
    import moestack.configs

    root = Path(moestack.configs.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=256)
def _compose_files(overrides: tuple[str, ...], choices: bool, configs_digest: str) -> Any:
    """_compose's work, for configs whose files have ``configs_digest``."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from moestack.config import register_configs

    register_configs()
    try:
        with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
            cfg = compose(
                config_name="train", overrides=list(overrides), return_hydra_config=choices
            )
        if choices:
            selected = cfg.hydra.runtime.choices
            return {str(k): None if v is None else str(v) for k, v in selected.items()}
        return OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise MoestackError(f"overrides {list(overrides)} do not compose: {err}") from None


def compose_config(overrides: Sequence[str]) -> TrainConfig:
    """The TrainConfig ``moestack-train <overrides>`` would run (hydra compose over configs/)."""
    return _compose(overrides, choices=False)


def config_choices(overrides: Sequence[str]) -> dict[str, str | None]:
    """The config group options (``model: tiny``, ``router: pin``, ...) hydra loads for
    ``moestack-train <overrides>``: the defaults of train.yaml as the overrides change them."""
    return _compose(overrides, choices=True)


def check_overrides(spec: Prereg) -> None:
    """Compose every arm once, so a typo fails at lock time, naming the arm."""
    for arm in spec.arms:
        try:
            compose_config(spec.overrides(arm, spec.seeds[0]))
        except MoestackError as err:
            raise MoestackError(f"runs.arms.{arm}: {err}") from None
