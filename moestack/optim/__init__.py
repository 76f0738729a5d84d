"""Optimizers: OffloadAdamW (host-resident, sharded AdamW state) and the config factory."""

from moestack.optim.factory import (
    apply_param_dtype,
    build_optimizer,
    clip_grad_norm,
    device_param_dtype,
    param_groups,
)
from moestack.optim.offload import OffloadAdamW

__all__ = [
    "OffloadAdamW",
    "apply_param_dtype",
    "build_optimizer",
    "clip_grad_norm",
    "device_param_dtype",
    "param_groups",
]
