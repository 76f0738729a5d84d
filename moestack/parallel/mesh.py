"""The (data-parallel x expert-parallel) mesh of a torchrun job.

With ``parallel.ep = P`` over ``N`` ranks, rank ``r`` sits at ``(dp_rank, ep_rank) =
(r // P, r % P)``: the ``P`` consecutive ranks of one row form an *EP group*, which splits
every MoE layer's experts and exchanges tokens by all-to-all; the ``N / P`` ranks of one
column hold the same experts and form the *expert data-parallel group*, over which those
experts' gradients are averaged. The EP degree is borrowed from the data-parallel ranks (no
extra devices): every rank still trains on its own slice of each batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from moestack.errors import MoestackError


@dataclass(frozen=True)
class ExpertParallelMesh:
    """This rank's place in the mesh and the two process groups it talks to."""

    world_size: int  # all ranks (N)
    ep: int  # ranks per EP group (P): each holds num_experts / P whole experts
    ep_rank: int  # this rank's index in its EP group: its experts are one contiguous block
    dp_rank: int  # index of this rank's EP group (its data-parallel replica of the experts)
    ep_group: Any  # process group of this rank's EP group (tokens move inside it)
    expert_dp_group: Any  # process group of the ranks that hold the same experts

    @property
    def dp(self) -> int:
        """Replicas of each expert shard (N / P)."""
        return self.world_size // self.ep

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """The global ids ``[lo, hi)`` of the experts this rank holds."""
        local = num_experts // self.ep
        return self.ep_rank * local, (self.ep_rank + 1) * local


def check_layout(world_size: int, ep: int, num_experts: int | None = None) -> None:
    """Refuse an EP degree that does not split the world (or the experts) evenly, in one line
    naming both numbers."""
    if ep < 1 or world_size % ep:
        raise MoestackError(
            f"parallel.ep={ep} does not divide the world size {world_size} (torchrun "
            f"--nproc-per-node x nodes); use an ep that divides {world_size}"
        )
    if num_experts is not None and num_experts % ep:
        raise MoestackError(
            f"parallel.ep={ep} does not divide num_experts={num_experts}; every rank holds "
            "the same number of whole experts: use an ep that divides it"
        )


def build_mesh(world_size: int, rank: int, ep: int) -> ExpertParallelMesh:
    """The mesh of ``world_size`` ranks at EP degree ``ep`` (collective: every rank creates
    every group, in the same order, as torch.distributed requires)."""
    check_layout(world_size, ep)
    ep_group = expert_dp_group = None
    for row in range(world_size // ep):
        group = dist.new_group(list(range(row * ep, (row + 1) * ep)))
        if rank // ep == row:
            ep_group = group
    for col in range(ep):
        group = dist.new_group(list(range(col, world_size, ep)))
        if rank % ep == col:
            expert_dp_group = group
    return ExpertParallelMesh(
        world_size=world_size,
        ep=ep,
        ep_rank=rank % ep,
        dp_rank=rank // ep,
        ep_group=ep_group,
        expert_dp_group=expert_dp_group,
    )
