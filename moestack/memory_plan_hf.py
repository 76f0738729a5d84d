"""The memory plan's model for a transformers folder (``model=hf model.path=DIR``).

``meta_hf_model`` builds what a training run of the folder builds, transformers' own model
of ``DIR/config.json`` with each sparse-MoE block replaced by a moestack ``MoE``, with every
parameter on the meta device, from config.json alone: no weight file (nor tokenizer file) is
opened, so a folder holding only config.json is planned, as accelerate's estimate-memory
does from a config. The plan then counts its parameters, adapters and optimizer state with
the same rules as moestack's own models (``moestack.memory_plan``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moestack.interop.hf import family_router_config
from moestack.interop.hf_config import read_hf_config
from moestack.interop.hf_model import (
    HFModelConfig,
    HFMoEModel,
    hf_model_config,
    patch_sparse_blocks,
)
from moestack.interop.hf_without_experts import from_pretrained_without_experts

# what the plan says of a transformers model's figures (its notes)
HF_NOTES = (
    "model.path: weights, gradients and optimizer state are those of the model transformers "
    "builds from config.json (no weight file read), in the run's dtype",
    "model.path: the activation line is moestack's block formula at the folder's sizes "
    "(D, F, k, E, H, V), an estimate: transformers' attention (grouped KV heads, head_dim) "
    "and any dense MLP layer keep other amounts",
)


def meta_hf_model(cfg: HFModelConfig) -> HFMoEModel:
    """The model of ``cfg.path`` as ``HFModelConfig.build`` makes it for training (fp32,
    moestack MoE layers running ``cfg.moe.impl``, ``cfg.router``'s losses), every parameter
    on the meta device; reads config.json only. Buffers (rotary tables, router counters)
    are real and small."""
    info = read_hf_config(cfg.path)
    hf = from_pretrained_without_experts(Path(info["path"]), torch.float32, read=False)
    patched = patch_sparse_blocks(hf, impl=cfg.moe.impl, router=cfg.router)
    router = family_router_config(info["router"]["renormalize"], cfg.router)
    return HFMoEModel(hf, hf_model_config(info, cfg.moe.impl, router), info, patched)
