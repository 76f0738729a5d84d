"""moestack: a memory-efficient Mixture-of-Experts training stack with expert caching.

The names below load on first use (PEP 562), so that ``import moestack.train`` (the entry
point) imports no torch before its Ctrl-C handling is in place: a Ctrl-C during start-up
then ends in one line, not a traceback from inside an import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CacheConfig": "moestack.config",
    "DataConfig": "moestack.config",
    "ModelConfig": "moestack.config",
    "MoEConfig": "moestack.config",
    "OptimConfig": "moestack.config",
    "ParallelConfig": "moestack.config",
    "RouterConfig": "moestack.config",
    "TelemetryConfig": "moestack.config",
    "TrainConfig": "moestack.config",
    "ModelOutput": "moestack.model",
    "MoETransformer": "moestack.model",
    "MoE": "moestack.moe",
    "Router": "moestack.router",
    "Routing": "moestack.router",
}

__all__ = sorted(_EXPORTS)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``moestack.<name>`` of an export: imported from its module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moestack' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
