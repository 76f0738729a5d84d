"""Data-parallel plumbing for torchrun: process-group set-up, rank info, reductions.

``torchrun --nproc-per-node N -m moestack.train ...`` sets WORLD_SIZE/RANK/LOCAL_RANK; one
process without them is a world of one and nothing here talks to anybody.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init_from_env(device_type: str) -> DistInfo:
    """Join the process group torchrun describes in the environment (gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return info


def all_reduce_mean(value: float, info: DistInfo, device: torch.device) -> float:
    """The mean of a Python number over ranks (itself in a world of one)."""
    if not info.active:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def gather_objects(value: Any, info: DistInfo) -> list[Any]:
    """``value`` of every rank, in rank order (picklable values; a world of one: [value]).
    Object collectives go through gloo even beside NCCL (the "cpu" backend of the group)."""
    if not info.active:
        return [value]
    values: list[Any] = [None] * info.world_size
    dist.all_gather_object(values, value)
    return values


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.active and dist.is_initialized():
        dist.destroy_process_group()
