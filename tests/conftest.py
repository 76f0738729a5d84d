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
# Caches the tests write stay out of the user's own, which other checkouts and runs share
# (subprocesses inherit these too): token ids, and Triton's compiled kernels, so that a
# test's cost does not depend on what another run compiled before it. A test that checks a
# cache points it elsewhere itself.
for _var, _prefix in (("MOESTACK_DATA_CACHE", "tokens"), ("TRITON_CACHE_DIR", "triton")):
    if not os.environ.get(_var):
        _folder = tempfile.mkdtemp(prefix=f"moestack-test-{_prefix}-")
        atexit.register(shutil.rmtree, _folder, True)
        os.environ[_var] = _folder


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
    """Write the fault report; under pytest-xdist each worker writes its part beside it and
    the controller, which finishes last, writes their sum."""
    import json
    from pathlib import Path

    path = os.environ.get("MOESTACK_FAULT_REPORT")
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        Path(f"{path}.{worker}").write_text(json.dumps(_REPORT.rows))
        return
    for part in sorted(Path(path).parent.glob(Path(path).name + ".gw*")):
        for kind, counts in json.loads(part.read_text()).items():
            _REPORT.add(kind, **counts)
        part.unlink()
    if _REPORT.rows:
        Path(path).write_text(json.dumps(_REPORT.rows, indent=2, sort_keys=True))
