"""moestack: a memory-efficient Mixture-of-Experts training stack with expert caching."""

from moestack.config import (
    CacheConfig,
    DataConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    RouterConfig,
    TelemetryConfig,
    TrainConfig,
)
from moestack.model import ModelOutput, MoETransformer
from moestack.moe import MoE
from moestack.router import Router, Routing

__all__ = [
    "CacheConfig",
    "DataConfig",
    "ModelConfig",
    "MoE",
    "MoEConfig",
    "MoETransformer",
    "ModelOutput",
    "OptimConfig",
    "ParallelConfig",
    "Router",
    "RouterConfig",
    "Routing",
    "TelemetryConfig",
    "TrainConfig",
]

__version__ = "0.1.0"
