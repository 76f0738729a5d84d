"""``moestack-train``: the hydra app over configs/ (also ``python -m moestack.train``, and
under torchrun). The training loop itself is ``moestack.trainer``; nothing imports this
module but the console entry point.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from omegaconf import OmegaConf

from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.trainer import train

log = logging.getLogger(__name__)


def _check_overrides(overrides: list[str]) -> None:
    """``model.router`` is filled from ``router``: an override of it would be dropped, so it
    is refused with the override to write instead."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "model.router" or key.startswith("model.router."):
            fix = override.lstrip("+~").replace("model.router", "router", 1)
            raise MoestackError(
                f"{override!r}: the router is configured in one place, the `router` group; "
                f"write {fix!r}"
            )


def _hydra_task(dict_cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        _check_overrides(list(HydraConfig.get().overrides.task))
        cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not cfg.out_dir:
            raise MoestackError(
                "under torchrun, set out_dir=<run dir> so every rank writes one run"
            )
        train(cfg, cfg.out_dir or HydraConfig.get().runtime.output_dir)
    except (MoestackError, ValueError) as err:
        log.error("error: %s", err)
        sys.exit(2)


def main() -> None:
    """Console entry point of ``moestack-train``."""
    import hydra

    from moestack.config import register_configs

    register_configs()
    app = hydra.main(config_path="pkg://moestack.configs", config_name="train", version_base="1.3")
    app(_hydra_task)()


if __name__ == "__main__":
    main()
