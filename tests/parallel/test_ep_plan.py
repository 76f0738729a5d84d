"""The memory plan under expert parallelism, against bytes counted by hand from the config."""

from __future__ import annotations

import pytest

from moestack.config import ModelConfig, MoEConfig, OptimConfig, ParallelConfig, TrainConfig
from moestack.errors import MoestackError
from moestack.memory_plan import plan_memory

MODEL = ModelConfig(
    d_model=32, n_layers=3, n_heads=2, moe=MoEConfig(num_experts=8, top_k=2, d_ff=24)
)


def expert_params(model: ModelConfig) -> int:
    """w1 [E, D, 2F] + w2 [E, F, D] over every layer."""
    d, f, e = model.d_model, model.moe.d_ff, model.moe.num_experts
    return model.n_layers * e * (d * 2 * f + f * d)


def config(optim: str, ep: int) -> TrainConfig:
    return TrainConfig(model=MODEL, optim=OptimConfig(name=optim), parallel=ParallelConfig(ep=ep))


@pytest.mark.parametrize("ep", [2, 4])
def test_each_rank_holds_its_share_of_the_experts(ep):
    whole = plan_memory(config("adamw", 1), ranks=ep)
    sharded = plan_memory(config("adamw", ep), ranks=ep)
    dropped = 4 * expert_params(MODEL) * (ep - 1) // ep  # fp32 bytes of the others' experts
    assert whole.line("weights").bytes - sharded.line("weights").bytes == dropped
    assert whole.line("gradients").bytes - sharded.line("gradients").bytes == dropped
    moments = whole.line("optimizer state").bytes - sharded.line("optimizer state").bytes
    assert moments == 2 * dropped


def test_offload_shards_expert_state_over_the_expert_data_parallel_group():
    ranks, ep = 4, 2  # 2 data-parallel groups of 2 EP ranks
    plan = plan_memory(config("offload_adamw", ep), ranks=ranks)
    local_experts = expert_params(MODEL) // ep
    per_rank = 2 * 4 * local_experts / (ranks // ep)  # two fp32 moments, shard of dp = 2
    got = plan.line("optimizer moments (experts)").bytes
    assert per_rank <= got <= per_rank * 1.2  # the largest shard: whole experts per shard
    assert plan.line("optimizer moments (replicated)").bytes > 0


def test_plan_refuses_a_layout_that_does_not_split():
    with pytest.raises(MoestackError, match=r"parallel.ep=4 does not divide the world size 2"):
        plan_memory(config("adamw", 4), ranks=2)
