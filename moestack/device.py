"""Where a run computes, and in what precision: the device a ``device`` setting names, a
model moved there with its meta (unread) expert weights left behind, and the autocast a
forward pass runs under there. Training, ``moestack eval``, the pre-registered analysis
and the benchmarks share them."""

from __future__ import annotations

import contextlib

import torch

from moestack.errors import MoestackError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``name`` ("auto", "cpu", "cuda") as a device; "auto" is CUDA when there is one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise MoestackError("device=cuda but no CUDA device is available; use device=cpu")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def move_resident(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """``model.to(device)`` for a model whose expert weights may be meta tensors (released,
    or never read): those stay meta, everything else moves."""
    return model._apply(lambda t: t if t.is_meta else t.to(device))


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; full precision (no autocast) on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
