"""optim.offload=cpu with optim=tiered: the state of device parameters lives in pinned host
memory and each tensor's is copied to its device for its update and back, stepping the bits
of the state kept on the device (CUDA; on the CPU the state is beside the parameters
either way); the plan puts the state on the host with one tensor's in flight on the device;
bad settings are refused naming the field."""

from __future__ import annotations

import pytest
import torch
from _tiered_testlib import run_steps, small_model, tiered, weights
from helpers.runs import small_model as small_model_config

from moestack.config import DataConfig, OptimConfig, TrainConfig
from moestack.memory_plan import plan_memory
from moestack.optim import build_optimizer
from moestack.optim.offload import OffloadAdamW

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"offload": "disk"}, "optim.offload='disk' is unknown"),
        ({"name": "offload_adamw", "offload": "none"}, "optim=offload_adamw keeps its state"),
    ],
)
def test_bad_settings_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimConfig(**fields)


def test_the_factory_offloads_only_where_asked() -> None:
    assert not tiered(small_model()).offload  # "auto": beside the parameters
    assert tiered(small_model(), offload="cpu").offload
    offload_adamw = build_optimizer(small_model(torch.float32), OptimConfig(name="offload_adamw"))
    assert isinstance(offload_adamw, OffloadAdamW)  # "auto" is host memory for it


def test_on_the_cpu_offload_changes_nothing() -> None:
    """CPU parameters: the state is in host memory already, stepped by the C++ kernel."""
    a, b = small_model(), small_model()
    run_steps(a, tiered(a), range(3))
    opt = tiered(b, offload="cpu")
    run_steps(b, opt, range(3))
    a_w, b_w = weights(a), weights(b)
    assert all(torch.equal(a_w[n], b_w[n]) for n in a_w)
    assert opt._plan is not None  # the kernel's descriptors kept, as without offload


def test_the_plan_puts_the_state_on_the_host() -> None:
    """small_model (width 32, vocabulary 256 tied): the tensor that keeps most is the
    embedding [256, 32], fp32 momentum and factored second moment."""
    optim = OptimConfig(name="tiered", offload="cpu")
    cfg = TrainConfig(model=small_model_config(), optim=optim, data=DataConfig(seq_len=32))
    plan = plan_memory(cfg, device="cuda")
    state = [line for line in plan.lines if line.what.startswith("optimizer state (tiered")]
    assert state and all(line.where == "host" for line in state)
    flight = plan.line("optimizer state in flight (tiered, optim.offload=cpu)")
    assert flight.where == "device" and flight.bytes == 4 * 256 * 32 + 4 * (256 + 32)
    beside = plan_memory(TrainConfig(model=small_model_config(), data=DataConfig(seq_len=32),
                                     optim=OptimConfig(name="tiered")), device="cuda")  # fmt: skip
    assert sum(line.bytes for line in state) == sum(
        line.bytes for line in beside.lines if line.what.startswith("optimizer state (tiered")
    )


@needs_cuda
@pytest.mark.parametrize("master", ["none", "float32"])
def test_offloaded_state_steps_the_device_bits(master: str) -> None:
    on_device, offloaded = small_model().cuda(), small_model().cuda()
    kept = tiered(on_device, master=master)
    moved = tiered(offloaded, master=master, offload="cpu")
    run_steps(on_device, kept, range(3))
    run_steps(offloaded, moved, range(3))
    a, b = weights(on_device), weights(offloaded)
    assert all(torch.equal(a[n], b[n]) for n in a)
    for p, st in moved.state.items():
        assert p.is_cuda
        for t in (v for v in st.values() if torch.is_tensor(v)):
            assert t.device.type == "cpu" and t.is_pinned()
    saved = moved.state_dict()
    moved.load_state_dict(saved)
    assert all(t.is_pinned() for st in moved.state.values() for t in st.values()
               if torch.is_tensor(t))  # fmt: skip
    peaks = []  # a step's device bytes beyond what was held before it
    for model, opt in ((on_device, kept), (offloaded, moved)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_steps(model, opt, range(3, 5))
        peaks.append(torch.cuda.max_memory_allocated() - base)
    a, b = weights(on_device), weights(offloaded)
    assert all(torch.equal(a[n], b[n]) for n in a)
    held = sum(t.numel() * t.element_size() for st in moved.state.values() for t in st.values()
               if torch.is_tensor(t))  # fmt: skip
    assert peaks[1] - peaks[0] < held / 2  # one tensor's state in flight, not the whole state
