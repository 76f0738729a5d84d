"""The small moestack model the telemetry tests attach to: decisive routing, fixed seed."""

from __future__ import annotations

import torch
from torch import nn

from moestack import ModelConfig, MoEConfig, MoETransformer


def small_moestack() -> MoETransformer:
    """Two MoE layers of 8 experts (top-2), router weights spread so top-k is unambiguous."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, moe=MoEConfig(8, 2, 32))
    model = MoETransformer(cfg).eval()
    for moe in model.moe_layers:
        nn.init.normal_(moe.router.weight, std=1.0)
    return model
