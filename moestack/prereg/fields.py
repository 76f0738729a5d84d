"""Checking one value of a study file: the helpers every part of the pre-registration file
format (``parts``, ``spec``) builds and checks its fields with, and the names of the metrics a
hypothesis may test (``lru/cap4/miss_rate``, ``reroute0.5/cap2/perplexity``).

Each check raises one line naming the field and the fix (``fail``); ``build_part`` builds a
part from the file's mapping, refusing a key the part has no field for.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any, TypeVar

from moestack.errors import MoestackError

COMPARISONS = ("relative_change", "difference", "value", "gap_fraction", "joint")
OPS = ("<=", ">=")
DECISIONS = ("mean", "ci", "noninferiority", "superiority")
ONE_SIDED = ("noninferiority", "superiority")  # the decision rules Holm's correction needs
CORRECTIONS = ("none", "holm")
REQUIRES = ("any", "all")
CACHE_STATS = ("hit_rate", "miss_rate", "misses_per_token")
SCALAR_METRICS = ("perplexity", "val_loss")
RESERVED_KEYS = ("seed", "out_dir", "resume")  # set by the runner, one value per run
# <policy>/cap<c>[/b<batch>]/<stat>; \Z: "$" lets a newline end it
_CACHE_METRIC = re.compile(r"^([a-z+]+)/cap(\d+)/(?:b(\d+)/)?([a-z_]+)\Z")
# a steered evaluation's metric: reroute<tau>/cap<c>/<stat> or bias<b>/cap<c>/<stat>
_STEERED_METRIC = re.compile(r"^((?:reroute|bias)[0-9.e+-]+)/cap(\d+)/([a-z_]+)\Z")
STEERED_STATS = (*SCALAR_METRICS, *CACHE_STATS)
NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")
BUDGET_KEYS = ("steps", "batch_size", "grad_accum")  # each becomes the override KEY=VALUE
COUNT_KEYS = ("eval_batches", "eval_batch_size", "eval_seq_len", "scatter_capacity")
DEVICES = ("auto", "cpu", "cuda")

Part = TypeVar("Part")


# --------------------------------------------------------------------------- checks
def fail(field_name: str, problem: str, fix: str) -> MoestackError:
    return MoestackError(f"{field_name}: {problem}; {fix}")


def set_field(part: Any, name: str, value: Any) -> None:
    """Store a checked (normalised) value on a frozen part, in its ``__post_init__``."""
    object.__setattr__(part, name, value)


def left_out(part: Any, name: str, given: frozenset[str] | None) -> bool:
    """Whether the field ``name`` of ``part`` was left out: not among the keys of the file's
    mapping (``given``), or, for a part built in Python (``given`` None), at its default."""
    if given is not None:
        return name not in given
    default = next(f.default for f in dataclasses.fields(part) if f.name == name)
    return bool(getattr(part, name) == default)


def is_name(value: Any) -> bool:
    return isinstance(value, str) and NAME.match(value) is not None


def mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(where, f"expected a mapping, got {type(value).__name__}", "see docs/prereg.md")
    return value


def override_list(value: Any, where: str) -> tuple[str, ...]:
    """A list of hydra override strings, none of them setting a runner-owned key."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise fail(where, f"expected a list of overrides, got {value!r}", "write [key=value, ...]")
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, str) or not ("=" in item or item.startswith("~")):
            raise fail(at, f"{item!r} is not a hydra override", "write it as key=value")
        key = item.split("=", 1)[0].lstrip("+~")
        if not key:
            raise fail(at, f"{item!r} has no key", "write it as key=value")
        if key in RESERVED_KEYS:
            raise fail(
                at, f"{key} is set by the runner for every run", f"remove {item!r} from the file"
            )
        out.append(item)
    return tuple(out)


def number(value: Any, where: str, kind: type = float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(where, f"expected a number, got {value!r}", "give a number")
    if not math.isfinite(value):
        raise fail(where, f"expected a finite number, got {value!r}", "give a number")
    if kind is int and int(value) != value:
        raise fail(where, f"expected a whole number, got {value!r}", "give an integer")
    return kind(value)


def share(value: Any, where: str, *, zero: bool, fix: str) -> float:
    """A number in [0, 1) (``zero``: a share that may be none, a warm-up) or in (0, 1)."""
    share = number(value, where)
    if zero and not 0 <= share < 1:
        raise fail(where, f"{share} not in [0, 1)", fix)
    if not zero and not 0 < share < 1:
        raise fail(where, f"{share} not in (0, 1)", fix)
    return share


def nonempty_text(value: Any, where: str, fix: str) -> str:
    """``value`` stripped, refused (showing it) unless it is text with something in it."""
    if not isinstance(value, str) or not value.strip():
        raise fail(where, f"{value!r}", fix)
    return value.strip()


def cache_metric(metric: str) -> tuple[str, int, str] | None:
    """(policy, capacity, statistic) of a cache metric name, or None: not of that form."""
    match = _CACHE_METRIC.match(metric)
    return (match.group(1), int(match.group(2)), match.group(4)) if match else None


def steered_metric(metric: str) -> tuple[str, int, str] | None:
    """(label, capacity, statistic) of a steered evaluation's metric name, or None."""
    match = _STEERED_METRIC.match(metric)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def is_quality_metric(metric: str) -> bool:
    """Whether ``metric`` measures the model's quality (perplexity or val_loss), plain or
    under a steered evaluation: what a budget hypothesis may let rise by at most its
    threshold."""
    steered = steered_metric(metric)
    return metric in SCALAR_METRICS or (steered is not None and steered[2] in SCALAR_METRICS)


def serve_batch(metric: str) -> int:
    """The batch a cache metric's replay serves (``lru/cap4/b8/miss_rate``: 8; 1 without)."""
    match = _CACHE_METRIC.match(metric)
    return int(match.group(3)) if match and match.group(3) else 1


def build_part(cls: type[Part], value: Any, at: str, *, fix: str = "", **extra: Any) -> Part:
    """``value`` as a ``cls``: itself when it is one, else built from the file's mapping at
    ``at`` ("" for the file itself). A key ``cls`` has no field for is refused (``fix``,
    default: its fields); a field without a default that the file leaves out reads as None,
    so that the field's own check names it; ``extra`` are fields that come from elsewhere
    than the file (the file's path)."""
    if isinstance(value, cls):
        return value
    raw = mapping(value, at or "the file")
    fields = [f for f in dataclasses.fields(cls) if f.name not in extra]
    names = [f.name for f in fields]
    for key in raw:
        if key not in names:
            problem = "unknown field" if at else "unknown top-level field"
            raise fail(
                f"{at}.{key}" if at else str(key),
                problem,
                fix or f"use fields from {sorted(names)}",
            )
    needed = {
        f.name: None
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if "given" in inspect.signature(cls).parameters:
        extra = {**extra, "given": frozenset(raw)}
    return cls(**{**needed, **raw}, **extra)


def share_window(value: Any, where: str) -> tuple[float, float]:
    """A share ``[lo, hi)`` of the validation split: two numbers, 0 <= lo < hi <= 1."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise fail(where, f"{value!r}", "give [lo, hi], shares of the validation split")
    lo, hi = (number(v, f"{where}[{i}]") for i, v in enumerate(value))
    if not 0 <= lo < hi <= 1:
        raise fail(where, f"[{lo}, {hi}]", "give 0 <= lo < hi <= 1")
    return (float(lo), float(hi))
