"""Fixtures of the kernel tests: spies on the kernels' buffer allocator. Each imports the
kernels in its body, not at the top, so that collecting the tests needs no triton."""

import types
import weakref

import pytest
import torch


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Every buffer the kernels allocate starts as NaN, so an element they never write shows."""
    from moestack.kernels import _launch

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_launch, "new_empty", poisoned)


@pytest.fixture
def count_allocations(monkeypatch):
    """``count_allocations(returned)`` counts the buffers the kernels allocate from then on
    (after a forward, say): its result's ``sizes`` holds every buffer's shape, and ``peak``
    the most bytes alive at once of the buffers whose shape is not in ``returned`` (the
    gradients handed back to the caller)."""
    from moestack.kernels import _launch

    def start(returned: tuple[tuple[int, ...], ...]) -> types.SimpleNamespace:
        record = types.SimpleNamespace(sizes=[], peak=0)
        live: dict[int, int] = {}
        real = _launch.new_empty

        def counting(shape, dtype, device):
            t = real(shape, dtype, device)
            record.sizes.append(tuple(shape))
            if tuple(shape) not in returned:
                live[id(t)] = t.numel() * t.element_size()
                weakref.finalize(t, live.pop, id(t), None)
                record.peak = max(record.peak, sum(live.values()))
            return t

        monkeypatch.setattr(_launch, "new_empty", counting)
        return record

    return start
