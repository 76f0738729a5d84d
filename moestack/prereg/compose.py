"""Hydra composition of a run's TrainConfig, and the check that every arm composes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.prereg.spec import Prereg


def _compose(overrides: Sequence[str], *, choices: bool) -> Any:
    """Compose ``train`` with ``overrides``: the TrainConfig, or (``choices``) the config
    group options hydra selected (``hydra.runtime.choices``: group -> option or None)."""
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
