"""The memory plan tests' model and batch: big enough for the plan's lines to be seen,
small enough for many forwards on two cores."""

from __future__ import annotations

from typing import Any

import torch

from moestack.config import ModelConfig, RouterConfig, TrainConfig


def tiny(checkpointing: str = "none", router: RouterConfig | None = None, **train: Any):
    """A two-layer model small enough for many forwards on two cores."""
    model = ModelConfig(
        d_model=64, n_layers=2, n_heads=4, max_seq_len=64, checkpointing=checkpointing,
        moe={"num_experts": 4, "top_k": 2, "d_ff": 96, "impl": "torch"},
    )  # fmt: skip
    return TrainConfig(model=model, router=router or RouterConfig(), batch_size=4,
                       data={"seq_len": 64}, device="cpu", **train)  # fmt: skip


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets of tiny's shape (4 x 64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (4, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g)
