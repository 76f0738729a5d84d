"""Expert parallelism on torch.distributed (``parallel.ep``): the mesh, the all-to-all
MoE computation, and what sharding the experts changes for gradients and checkpoints.
docs/parallel.md."""

from moestack.parallel.dispatch import (
    ExchangeStats,
    ExpertParallelExperts,
    ExpertShard,
    expert_parallel_experts,
)
from moestack.parallel.mesh import ExpertParallelMesh, build_mesh, check_layout
from moestack.parallel.metrics import exchange_metrics
from moestack.parallel.shard import (
    ExpertBlock,
    average_gradients,
    clip_grad_norm,
    expert_blocks,
    expert_parallel,
    expert_params,
    gather_rows,
    global_grad_norm,
    shard_experts,
    whole_experts,
)

__all__ = [
    "ExchangeStats",
    "ExpertBlock",
    "ExpertParallelExperts",
    "ExpertParallelMesh",
    "ExpertShard",
    "average_gradients",
    "build_mesh",
    "check_layout",
    "clip_grad_norm",
    "exchange_metrics",
    "expert_blocks",
    "expert_parallel",
    "expert_parallel_experts",
    "expert_params",
    "gather_rows",
    "global_grad_norm",
    "shard_experts",
    "whole_experts",
]
