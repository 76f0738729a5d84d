"""The wandb run a training run mirrors its metrics to: which modes a run may name, and
starting it so that a failure never stops training.

wandb runs offline unless the user sets WANDB_MODE (or ``wandb_mode``); its project is
``wandb_project``, else $WANDB_PROJECT, else "moestack"; a resumed run continues the same
wandb run (its id kept in ``<run>/wandb_id.txt``). ``moestack.metrics.MetricsWriter`` starts
it; ``TrainConfig`` checks ``wandb_mode`` with ``check_wandb_mode`` when it is built.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any

from moestack import atomic

log = logging.getLogger(__name__)

# the wandb modes a run may name: "" = $WANDB_MODE, else offline; "disabled" turns wandb off
WANDB_MODES = ("", "online", "offline", "disabled")


def check_wandb_mode(mode: str) -> None:
    """Refuse a wandb mode wandb has no use for: a typo must not train with wandb off."""
    if mode not in WANDB_MODES:
        raise ValueError(
            f"wandb_mode={mode!r} is unknown; use online, offline, disabled or '' "
            "($WANDB_MODE, else offline)"
        )


def start_wandb(run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> Any:
    """The wandb run of ``run_dir`` (``project`` and ``mode`` as given: "" takes the
    environment's, then the defaults above), or None when wandb is disabled or fails to
    start (no wandb, bad settings, no network in online mode: logged, never raised)."""
    mode = mode or os.environ.get("WANDB_MODE", "offline")
    project = project or os.environ.get("WANDB_PROJECT") or "moestack"
    if mode == "disabled":
        return None
    try:
        import wandb

        run_id_file = run_dir / "wandb_id.txt"
        run_id = run_id_file.read_text().strip() if run_id_file.exists() else secrets.token_hex(4)
        atomic.write_text(run_id_file, run_id)
        return wandb.init(
            project=project,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow",
            config=config,
            name=os.environ.get("WANDB_NAME") or run_dir.name,  # sweeps name their jobs
            settings=wandb.Settings(console="off", silent=True),
        )
    except Exception as err:  # no wandb, bad settings, no network in online mode
        log.warning("wandb disabled: %s", err)
        return None
