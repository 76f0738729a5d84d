"""What the fault-injection tests share: which errors count as a clear refusal, exact
equality of what loads, the loaders of a routing trace and of a pre-registration lock, and the
id of a process no longer alive (what a killed writer leaves its folders named after)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from moestack.errors import MoestackError

CLEAR = (MoestackError, ValueError)  # TraceFormatError is a ValueError


def same(a: object, b: object) -> bool:
    """``a`` and ``b`` hold the same values: tensors of one dtype, equal element by element,
    nested in dicts, lists and tuples alike."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def load_trace(path: Path) -> object:
    """The expert ids of every layer of the routing trace at ``path``."""
    from moestack.telemetry import RoutingTrace

    trace = RoutingTrace.load(path)
    return [torch.from_numpy(trace.accesses(layer)) for layer in range(trace.num_layers)]


def verify_lock(folder: Path) -> object:
    """The verified lock record of the one study in ``folder``: its hashes and chain."""
    from moestack import prereg

    record = prereg.verify(next(folder.glob("*.yaml")))
    return {k: record[k] for k in ("sha256", "study_sha256", "head", "history")}


def dead_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid
