"""The two rules every config dataclass of moestack follows, written once.

Each part of the stack defines its config beside the class it configures (``MoEConfig`` in
moestack.moe, ``RouterConfig`` in moestack.router, ``ModelConfig`` in moestack.model, ...;
moestack.config assembles them): a bad value raises ``ValueError`` naming the field when the
config is built (``check``), and a nested config may arrive as a plain mapping, which hydra
hands to nested fields at times (``coerce``). This module imports nothing of moestack, so
any config module can use it.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def check(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``; the message names the field and the fix."""
    if not ok:
        raise ValueError(message)


def coerce(value: Any, cls: type[T]) -> T:
    """``value`` as a ``cls``: itself, or built from a mapping of its fields."""
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise ValueError(f"expected a {cls.__name__} or a mapping, got {type(value).__name__}")
