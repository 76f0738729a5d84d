"""``OptimConfig``: the optimizer, its learning-rate schedule and gradient clipping.

The ``optim`` section of a run's config, beside the optimizers it configures;
``OptimConfig.build`` makes the optimizer a training loop holds for a model at its parallel
layout (``moestack.optim.factory.build_training_optimizer``). ``moestack.config`` re-exports
it and nests it in ``TrainConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moestack.checks import check, coerce
from moestack.optim.container import TrainingOptimizer
from moestack.optim.factory import build_training_optimizer
from moestack.parallel.mesh import ExpertParallelMesh
from moestack.populations import MASTER, POPULATIONS, PopulationConfig, population_field

OPTIMIZERS = ("adamw", "offload_adamw", "tiered")  # optim.name


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient clipping."""

    # "adamw" (torch.optim.AdamW), "offload_adamw" (host state, sharded) or "tiered" (state
    # sized per parameter population: the fields from clip_update on; docs/optim.md)
    name: str = "adamw"
    lr: float = 3e-3  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)  # Adam moment decay rates
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.1  # decoupled weight decay on matrices (not norms or biases)
    warmup_steps: int = 30  # linear warm-up from 0 to lr
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0  # clip gradients to this global norm (0 = off)
    # where the state lives: "auto" (offload_adamw: host memory; tiered: beside the
    # parameters), "cpu" (host memory; tiered: the state of device parameters, each tensor's
    # copied to its device for its update) or "none" (tiered: beside the parameters)
    offload: str = "auto"
    shard: bool = True  # offload_adamw: shard state over data-parallel ranks (ZeRO-1)
    overlap: bool = True  # offload_adamw: overlap host copies with compute
    skip_idle_experts: bool = False  # offload_adamw: skip experts that got no tokens
    moment_dtype: str = "float32"  # offload_adamw: "float32" or "bfloat16" host moments
    # offload_adamw: the one-pass host step: "auto" (the native C++ kernel, else
    # torch.compile, else the reference), "native", "compile" or "off" (the reference path)
    fused_step: str = "auto"
    # offload_adamw: 1 runs the host update of step t while step t+1 computes (whose forward
    # and backward see the weights before it: one step stale; docs/optim.md), 0 is exact
    update_delay: int = 0
    delay_warmup: int = 1  # offload_adamw with update_delay: the first steps that run exact
    # offload_adamw: step bucket by bucket as gradients land, weights back per bucket, the
    # next forward waiting per layer (docs/optim.md): "auto" (on a GPU, one process, exact
    # updates), true (also on the CPU) or false (one serial step)
    pipeline: Any = "auto"
    bucket_mb: float = 32.0  # offload_adamw with the pipeline: megabytes of gradients a bucket
    # offload_adamw, sharded over several ranks: reduce-scatter the gradients and all-gather
    # the new weights on the devices (NCCL), each rank copying only its shard to the host:
    # "auto" (on GPUs), true (also CPU parameters over gloo) or false (collectives on the host)
    reduce_on_device: Any = "auto"
    # dtype of the model's weights and gradients on the device: "auto" is bfloat16 for
    # offload_adamw and tiered on CUDA (the fp32 master copy, if any, lives elsewhere), and for
    # tiered with master=none on every device; float32 otherwise.
    param_dtype: str = "auto"
    # tiered: the RMS threshold of each matrix's update (each expert's on its own; 0 = off)
    clip_update: float = 1.0
    # tiered: "float32" keeps an fp32 master copy of bf16 weights; "none" keeps bf16 precision
    # only, each fp32 update stochastically rounded (bf16 weights; or, with
    # param_dtype=float32, on the bf16 grid in fp32 storage, for a CPU)
    master: str = "none"
    # tiered: step each tensor in backward as its gradient lands and free the gradient, so the
    # whole model's gradients are never held (docs/optim.md); needs grad_clip=0, grad_accum=1
    # and one process
    update_in_backward: bool = False
    # tiered: the state of each parameter population (momentum, second_moment, weight_decay)
    experts: PopulationConfig = population_field("experts")
    routers: PopulationConfig = population_field("routers")
    embeddings: PopulationConfig = population_field("embeddings")
    backbone: PopulationConfig = population_field("backbone")
    adapters: PopulationConfig = population_field("adapters")

    def __post_init__(self) -> None:
        self._check_tiered()
        check(
            self.name in OPTIMIZERS, f"optim.name={self.name!r} is unknown; use one of {OPTIMIZERS}"
        )
        check(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        check(
            self.offload in ("auto", "cpu", "none"),
            f"optim.offload={self.offload!r} is unknown; use 'auto', 'cpu' or 'none'",
        )
        check(
            self.offload != "none" or self.name != "offload_adamw",
            "optim.offload=none: optim=offload_adamw keeps its state in host memory; use "
            "optim=adamw or optim=tiered for state beside the parameters",
        )
        betas = tuple(self.betas)
        check(
            len(betas) == 2 and all(0 <= b < 1 for b in betas),
            f"optim.betas={list(betas)} must be two numbers in [0, 1)",
        )
        self.betas = (float(betas[0]), float(betas[1]))
        check(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} not in [0,1]")
        check(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (0 = off)")
        check(
            self.fused_step in ("auto", "native", "compile", "off"),
            f"optim.fused_step={self.fused_step!r}; use 'auto', 'native', 'compile' or 'off'",
        )
        check(
            self.moment_dtype in ("float32", "bfloat16"),
            f"optim.moment_dtype={self.moment_dtype!r}; use 'float32' or 'bfloat16'",
        )
        check(
            self.param_dtype in ("auto", "float32", "bfloat16"),
            f"optim.param_dtype={self.param_dtype!r}; use 'auto', 'float32' or 'bfloat16'",
        )
        check(
            self.update_delay in (0, 1),
            f"optim.update_delay={self.update_delay}; use 0 (exact) or 1 (one step delayed)",
        )
        check(
            self.update_delay == 0 or self.name == "offload_adamw",
            f"optim.update_delay={self.update_delay} delays the host update of "
            f"optim=offload_adamw; optim={self.name} has none (use optim=offload_adamw)",
        )
        check(self.delay_warmup >= 0, f"optim.delay_warmup={self.delay_warmup} must be >= 0")
        check(
            isinstance(self.pipeline, bool) or self.pipeline == "auto",
            f"optim.pipeline={self.pipeline!r}; use auto, true or false",
        )
        check(self.bucket_mb > 0, f"optim.bucket_mb={self.bucket_mb} must be > 0")
        check(
            isinstance(self.reduce_on_device, bool) or self.reduce_on_device == "auto",
            f"optim.reduce_on_device={self.reduce_on_device!r}; use auto, true or false",
        )

    def check_ranks(self, world_size: int) -> None:
        """Refuse settings that cannot run on ``world_size`` ranks (before a run writes)."""
        check(
            not self.update_in_backward or world_size == 1,
            f"optim.update_in_backward=true steps one process's tensors in its backward; "
            f"this run has {world_size} ranks: use optim.update_in_backward=false",
        )

    def policy(self, population: str) -> PopulationConfig:
        """The state policy of ``population`` (optim=tiered)."""
        return getattr(self, population)

    def build(
        self, model: nn.Module, world_size: int = 1, mesh: ExpertParallelMesh | None = None
    ) -> TrainingOptimizer:
        """The optimizer a training loop holds for ``model``'s trainable parameters over
        ``world_size`` ranks (with ``mesh``, its experts already cut to this rank's): the
        factory's choice of which optimizer does what at which layout
        (``build_training_optimizer``)."""
        return build_training_optimizer(model, self, world_size, mesh)

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LambdaLR:
        """The learning-rate schedule of a run of ``total_steps``: ``lr_factor`` times lr."""
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(s, total_steps, self.warmup_steps, self.min_lr_ratio),
        )

    def _check_tiered(self) -> None:
        for population in POPULATIONS:
            setattr(self, population, coerce(getattr(self, population), PopulationConfig))
            self.policy(population).check(population)
        check(
            self.master in MASTER, f"optim.master={self.master!r} is unknown; use one of {MASTER}"
        )
        check(self.clip_update >= 0, f"optim.clip_update={self.clip_update} must be >= 0 (0 = off)")
        if self.update_in_backward:
            check(
                self.name == "tiered",
                f"optim.update_in_backward=true is optim=tiered's; optim={self.name} steps "
                "after backward (use optim=tiered or optim.update_in_backward=false)",
            )
            check(
                self.grad_clip == 0,
                f"optim.grad_clip={self.grad_clip} needs every gradient before any update, but "
                "optim.update_in_backward=true updates during backward: set optim.grad_clip=0 "
                "(optim.clip_update clips each matrix's update)",
            )


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
