"""A tiny model, fixed batches and a written store, for the expert cache tests and the tests
of the MoE layer's experts back-ends."""

from __future__ import annotations

from pathlib import Path

import torch

from moestack import ModelConfig, MoEConfig, MoETransformer


def tiny_cfg(
    num_experts: int = 8, top_k: int = 2, d_model: int = 32, n_layers: int = 2
) -> ModelConfig:
    return ModelConfig(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=2,
        max_seq_len=32,
        moe=MoEConfig(num_experts=num_experts, top_k=top_k, d_ff=16, impl="torch"),
    )


def tiny_model(seed: int = 0, **kw: int) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(tiny_cfg(**kw))
    # Spread the router logits so routing is not uniform noise (more reuse, realistic skew).
    with torch.no_grad():
        for moe in model.moe_layers:
            moe.router.weight.mul_(40.0)
    return model.eval()


def batches(
    n: int = 3, batch: int = 2, seq: int = 16, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        window = torch.randint(1, 256, (batch, seq + 1), generator=gen)
        out.append((window[:, :-1], window[:, 1:]))
    return out


def store_path(tmp_path: Path, name: str = "store") -> Path:
    return tmp_path / name
