"""Test-wide settings: Triton kernels run in the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates any kernel, so it is set here, at
collection time, before any test module imports moestack.kernels.
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# Token ids cached by the tests stay out of the user's cache (subprocesses inherit it too);
# a test that checks the cache points it elsewhere itself.
_TOKEN_CACHE = tempfile.mkdtemp(prefix="moestack-test-tokens-")
atexit.register(shutil.rmtree, _TOKEN_CACHE, True)
os.environ.setdefault("MOESTACK_DATA_CACHE", _TOKEN_CACHE)


class FaultReport:
    """Counts of the fault-injection suite (pytest -m faults): per kind of fault, how many
    were injected and how each ended. Written as JSON to $MOESTACK_FAULT_REPORT when set;
    docs/reliability.md records a run of it."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}

    def add(self, kind: str, **counts: int) -> None:
        row = self.rows.setdefault(kind, {})
        for key, value in counts.items():
            row[key] = row.get(key, 0) + int(value)


_REPORT = FaultReport()


@pytest.fixture(scope="session")
def fault_report():
    return _REPORT


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MOESTACK_FAULT_REPORT")
    if path and _REPORT.rows:
        import json

        with open(path, "w") as f:
            json.dump(_REPORT.rows, f, indent=2, sort_keys=True)
