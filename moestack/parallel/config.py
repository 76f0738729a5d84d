"""``ParallelConfig``: how the ranks of a torchrun job share the work (docs/parallel.md).

The ``parallel`` section of a run's config, beside the expert parallelism it configures;
``ParallelConfig.build`` cuts a model's experts to this rank's (``expert_parallel``).
``moestack.config`` re-exports it and nests it in ``TrainConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moestack.checks import check
from moestack.parallel.dispatch import ExchangeStats
from moestack.parallel.mesh import ExpertParallelMesh
from moestack.parallel.shard import expert_parallel


@dataclass
class ParallelConfig:
    """How the ranks of a torchrun job share the work (docs/parallel.md)."""

    # expert-parallel degree: each group of ep ranks splits every MoE layer's experts
    # (num_experts / ep whole experts per rank) and moves tokens to them by all-to-all; the
    # world is world_size / ep data-parallel groups of ep ranks (1 = data parallel only)
    ep: int = 1
    # with ep > 1, host allocations of this many KiB and more get mappings of their own,
    # returned to the OS when freed (glibc's heap keeps freed blocks: 0.25 GB a process at
    # ep=4 in BENCHMARKS.md); 0 keeps glibc's behaviour (moestack.host_allocator)
    host_mmap_threshold_kb: int = 128

    def __post_init__(self) -> None:
        check(
            0 <= self.host_mmap_threshold_kb <= 32768,
            f"parallel.host_mmap_threshold_kb={self.host_mmap_threshold_kb}: use 0 (glibc's "
            "default) to 32768 (glibc's largest, 32 MiB)",
        )

    def build(
        self, model: nn.Module, world_size: int, rank: int
    ) -> tuple[ExpertParallelMesh | None, ExchangeStats | None]:
        """This rank's place in the mesh and ``model``'s experts cut to its own, in place
        (collective under ``ep > 1``: every rank calls it); ``(None, None)`` with ``ep=1``."""
        return expert_parallel(model, world_size, rank, self.ep)
