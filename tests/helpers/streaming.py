"""Training by hand as the trainer's train_step does, for the tests of streamed experts
(moestack.cache.streaming): a frozen tiny model, its run config, its steps."""

from __future__ import annotations

import torch

from helpers.cache import batches, tiny_cfg, tiny_model
from moestack.config import CacheConfig, DataConfig, OptimConfig, TrainConfig
from moestack.lora import LoRAConfig, add_adapters_for
from moestack.optim.factory import build_training_optimizer

STEPS = 20


def run_cfg(trainable: str, mode: str = "disk", **cache: object) -> TrainConfig:
    cache.setdefault("capacity", 2)
    model = cache.pop("model", tiny_cfg())
    return TrainConfig(
        model=model, data=DataConfig(seq_len=16), trainable=trainable, offload_experts=mode,
        cache=CacheConfig(**cache), lora=LoRAConfig(rank=4, dropout=0.1),
        optim=OptimConfig(lr=1e-2, warmup_steps=0),
    )  # fmt: skip


def build(cfg: TrainConfig, seed: int = 0, **kw: int) -> torch.nn.Module:
    """The trainer's build of a frozen model: weights, adapters, then freezing."""
    model = tiny_model(seed, **kw).train()
    add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)
    model.set_trainable(cfg.trainable)
    return model


def train(model: torch.nn.Module, cfg: TrainConfig, steps: int = STEPS) -> list[float]:
    """``steps`` of the trainer's train_step: forward, loss.backward, clip, step, zero_grad;
    the batches on the device of the model's (materialised) parameters."""
    optimizer = build_training_optimizer(model, cfg.optim)
    device = next(p.device for p in model.parameters() if not p.is_meta)
    data = [(x.to(device), y.to(device)) for x, y in batches(n=4)]
    torch.manual_seed(cfg.seed)  # the trainer's: dropout draws from the global stream
    losses = []
    for step in range(steps):
        inputs, targets = data[step % len(data)]
        out = optimizer.forward_model(inputs, targets)
        out.loss.backward()
        optimizer.clip_grad_norm(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


def trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
