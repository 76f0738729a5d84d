"""Optimizers: OffloadAdamW (host-resident, sharded AdamW state), the config factory, and the
one optimizer interface a training loop holds at any parallel layout (TrainingOptimizer)."""

from moestack.optim.container import TrainingOptimizer, clip_grad_norm
from moestack.optim.factory import (
    apply_param_dtype,
    build_optimizer,
    build_training_optimizer,
    device_param_dtype,
    param_cast,
    param_groups,
)
from moestack.optim.offload import OffloadAdamW

__all__ = [
    "OffloadAdamW",
    "TrainingOptimizer",
    "apply_param_dtype",
    "build_optimizer",
    "build_training_optimizer",
    "clip_grad_norm",
    "device_param_dtype",
    "param_cast",
    "param_groups",
]
