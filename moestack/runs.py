"""Loading a finished or running training run: its config, its model, a checkpoint.

One function, ``load_run``, serves ``moestack eval``, the pre-registered analysis and
offloaded evaluation, so that they all rebuild a run the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from moestack import checkpoint
from moestack.config import TrainConfig
from moestack.errors import MoestackError
from moestack.evaluation import resolve_device
from moestack.model import MoETransformer


@dataclass
class LoadedRun:
    """A run rebuilt from disk: its config and the model holding one checkpoint's weights."""

    run_dir: Path
    cfg: TrainConfig  # the resolved config the run wrote (config.yaml)
    model: MoETransformer  # on the CPU unless load_run was given a device
    checkpoint: Path  # the checkpoint folder whose weights the model holds
    step: int  # the optimizer step that checkpoint was written at


def load_run_config(run_dir: Path | str) -> TrainConfig:
    """The resolved config a training run wrote into ``run_dir/config.yaml``."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise MoestackError(f"{path} not found: {run_dir} is not a moestack run directory")
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def resolve_checkpoint(run_dir: Path | str, checkpoint_path: Path | str | None = None) -> Path:
    """``checkpoint_path`` if given, else the run's newest complete checkpoint."""
    if checkpoint_path:
        return Path(checkpoint_path)
    root = Path(run_dir) / "checkpoints"
    latest = checkpoint.latest_checkpoint(root)
    if latest is None:
        raise MoestackError(f"{root} holds no checkpoint")
    return latest


def load_run(
    run_dir: Path | str,
    checkpoint_path: Path | str | None = None,
    *,
    device: str | torch.device | None = None,
) -> LoadedRun:
    """Config, model and weights of the newest (or the named) checkpoint of ``run_dir``.

    ``device`` moves the model there ("auto" = the run's own device setting resolved here);
    None leaves it on the CPU (offloaded evaluation writes the expert store from there).
    """
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    ckpt = resolve_checkpoint(run_dir, checkpoint_path)
    model = MoETransformer(cfg.model)
    meta = checkpoint.load_model_weights(ckpt, model, cfg.model)
    if device is not None:
        model.to(resolve_device(cfg.device if device == "auto" else str(device)))
    return LoadedRun(run_dir, cfg, model, ckpt, int(meta["step"]))
