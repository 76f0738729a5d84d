"""Checkpoints: model weights as safetensors, training state beside them, written atomically.

Layout of one checkpoint, ``<run>/checkpoints/step_000200/``:

    model.safetensors   model weights (shared tensors such as tied embeddings stored once)
    train_state.pt      optimizer, scheduler, RNG and data-loader state (plain tensors and
                        numbers only, loaded with ``torch.load(weights_only=True)``)
    meta.json           step, model config, file sizes (written last)

A checkpoint is written into a temporary folder, every file fsynced, then renamed into place,
so a crash never leaves a half-written checkpoint that looks complete; only the newest
``keep_last`` are kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from moestack.config import ModelConfig
from moestack.errors import MoestackError

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
META_FILE = "meta.json"
PREFIX = "step_"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_root: Path | str,
    step: int,
    model: nn.Module,
    model_cfg: ModelConfig,
    train_state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write checkpoint ``step`` under ``ckpt_root`` atomically; prune all but ``keep_last``."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"{PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=ckpt_root))
    try:
        safetensors.torch.save_model(model, str(tmp / MODEL_FILE))
        torch.save(train_state, tmp / STATE_FILE)
        meta = {
            "step": step,
            "model": dataclasses.asdict(model_cfg),
            "sizes": {name: (tmp / name).stat().st_size for name in (MODEL_FILE, STATE_FILE)},
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        for name in (MODEL_FILE, STATE_FILE, META_FILE):
            _fsync(tmp / name)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path | str) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest first (temporary folders ignored)."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    found = [
        p for p in ckpt_root.iterdir() if p.name.startswith(PREFIX) and (p / META_FILE).is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(ckpt_root: Path | str) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def read_meta(path: Path | str) -> dict[str, Any]:
    """The checkpoint's meta.json, checked against the sizes of the files it lists."""
    path = Path(path)
    if not path.is_dir():
        raise MoestackError(f"checkpoint {path} does not exist")
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise MoestackError(f"checkpoint {path} has no {META_FILE}: it is incomplete") from None
    except json.JSONDecodeError:
        raise MoestackError(f"{meta_path} is not valid JSON: the checkpoint is corrupt") from None
    for name, size in meta.get("sizes", {}).items():
        file = path / name
        actual = file.stat().st_size if file.exists() else None
        if actual != size:
            raise MoestackError(
                f"{file} is {'missing' if actual is None else f'{actual} bytes'}, expected {size} "
                "bytes: the checkpoint is truncated; use an older one"
            )
    return meta


def check_model_config(meta: dict[str, Any], model_cfg: ModelConfig, path: Path | str) -> None:
    """Refuse a checkpoint whose model shape differs from ``model_cfg``, naming the field."""
    saved = meta.get("model", {})
    current = dataclasses.asdict(model_cfg)
    for section, keys in (
        (None, ("vocab_size", "d_model", "n_layers", "n_heads", "tie_embeddings")),
        ("moe", ("num_experts", "top_k", "d_ff")),
    ):
        for key in keys:
            old = saved.get(section, {}).get(key) if section else saved.get(key)
            new = current[section][key] if section else current[key]
            if old != new:
                field = f"model.{section}.{key}" if section else f"model.{key}"
                raise MoestackError(
                    f"checkpoint {path} was trained with {field}={old}, this model has {new}; "
                    "use the checkpoint's model config"
                )


def load_model_weights(
    path: Path | str, model: nn.Module, model_cfg: ModelConfig
) -> dict[str, Any]:
    """Load the weights of checkpoint ``path`` into ``model``; returns its meta."""
    path = Path(path)
    meta = read_meta(path)
    check_model_config(meta, model_cfg, path)
    try:
        missing, unexpected = safetensors.torch.load_model(
            model, str(path / MODEL_FILE), strict=False
        )
    except (safetensors.SafetensorError, OSError, RuntimeError) as err:
        raise MoestackError(f"{path / MODEL_FILE}: cannot be read ({err})") from None
    # Tied weights are stored once; only complain about genuinely absent tensors.
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise MoestackError(
            f"{path / MODEL_FILE} does not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); use the checkpoint's model config"
        )
    return meta


def load_train_state(path: Path | str) -> dict[str, Any]:
    """The optimizer/scheduler/RNG/data state saved beside the weights (no pickled code)."""
    file = Path(path) / STATE_FILE
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise MoestackError(f"{file} is missing: the checkpoint is incomplete") from None
    except Exception as err:  # truncated zip, foreign pickle
        raise MoestackError(f"{file} cannot be read ({err}); use an older checkpoint") from None
