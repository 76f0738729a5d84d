"""Device choice, mixed precision and validation: what training, ``moestack eval``, the
pre-registered analysis and offloaded evaluation share."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from moestack.errors import MoestackError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``name`` ("auto", "cpu", "cuda") as a device; "auto" is CUDA when there is one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise MoestackError("device=cuda but no CUDA device is available; use device=cpu")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; full precision (no autocast) on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def perplexity(loss: float) -> float:
    """exp(loss), capped so that a diverged run reports a large number, not inf."""
    return math.exp(min(loss, 50.0))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    *,
    progress: bool = False,
) -> dict[str, float]:
    """Mean validation cross-entropy over fixed batches, and its perplexity (with a
    progress bar over the batches when ``progress``)."""
    was_training = model.training
    model.eval()
    total = 0.0
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="eval", unit="batch", leave=False)
    for inputs, targets in batches:
        with autocast_context(device):
            out = model(inputs.to(device), targets.to(device))
        total += out.ce_loss.item()
    model.train(was_training)
    loss = total / max(1, len(batches))
    return {"loss/val": loss, "eval/perplexity": perplexity(loss)}
