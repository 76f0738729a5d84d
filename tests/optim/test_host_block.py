"""OffloadAdamW's host buffers are aligned views of one host block (moestack.optim.transfer):
the bytes held are the bytes its plan counts (torch's pinned allocator would round each
buffer up to a power of two), and training is bitwise what separately allocated buffers give.
On a GPU the block is page-locked in place; here a stand-in for the CUDA runtime checks
that it is registered once, whole, and unregistered only when its last view is gone."""

from __future__ import annotations

import gc

import pytest
import torch
from _optim_testlib import MAX_NORM, TinyMoE, groups, micro_step

from moestack.optim import OffloadAdamW, transfer

CONFIGS = {
    "in_place": {},
    "master": {"in_place": False},
    "reference": {"in_place": False, "fused_step": "off"},
    "bf16_split": {"bf16": True},
    "bf16_moments": {"in_place": False, "moment_dtype": torch.bfloat16},
    "delayed": {"update_delay": 1},
    "pipelined": {"bf16": True, "pipeline": True, "bucket_mb": 2**-13},
    "pipelined_delayed": {"pipeline": True, "bucket_mb": 2**-13, "update_delay": 1},
}


def _build(kw: dict) -> tuple[TinyMoE, OffloadAdamW]:
    kw = dict(kw)
    model = TinyMoE()
    if kw.pop("bf16", False):
        model.to(torch.bfloat16)
    return model, OffloadAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), **kw)


def _train(model: TinyMoE, opt: OffloadAdamW, steps: range) -> None:
    for step in steps:
        if next(model.parameters()).dtype == torch.bfloat16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                micro_step(model, step)
        else:
            micro_step(model, step)
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()


def _separate(sizes: transfer.Sizes, pin=()) -> dict[str, torch.Tensor]:
    """The buffers as they were allocated before the block: one zeroed tensor each."""
    assert not pin
    return {role: torch.zeros(n, dtype=dtype) for role, (n, dtype) in sizes.items()}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_host_buffers_are_aligned_views_of_one_block_of_the_counted_bytes(config) -> None:
    model, opt = _build(CONFIGS[config])
    _train(model, opt, range(2))
    bufs = {r: t for r, t in opt.host_buffers().items() if r != "bf16_moment_scratch"}
    planned = opt._layout.host
    assert {r: (t.numel(), t.dtype) for r, t in bufs.items()} == planned
    storage = next(iter(bufs.values())).untyped_storage()
    base = storage.data_ptr()
    spans = []
    for role, t in bufs.items():
        assert t.untyped_storage().data_ptr() == base, role  # one block
        assert t.dim() == 1 and t.is_contiguous(), role
        assert t.data_ptr() % transfer.ALIGN_BYTES == 0, role
        spans.append((t.data_ptr() - base, t.data_ptr() - base + t.numel() * t.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap
    counted = sum(n * dtype.itemsize for n, dtype in planned.values())
    assert counted <= storage.nbytes() < counted + transfer.ALIGN_BYTES * len(planned)
    assert storage.nbytes() == transfer.block_layout(planned)[1]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_block_trains_and_resumes_bitwise_as_separate_buffers(config, monkeypatch) -> None:
    """Six steps, with a checkpoint after three loaded into a fresh optimizer: weights and
    state bitwise those of separately allocated buffers (today's results)."""

    def run(resume: bool) -> tuple[dict, dict]:
        model, opt = _build(CONFIGS[config])
        _train(model, opt, range(3))
        if resume:
            saved, weights = opt.state_dict(), model.state_dict()
            opt.close()
            model, opt = _build(CONFIGS[config])
            model.load_state_dict(weights)
            opt.load_state_dict(saved)
        _train(model, opt, range(3, 6))
        state = opt.state_dict()
        opt.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, state

    got = run(resume=False), run(resume=True)
    monkeypatch.setattr(transfer, "carve", _separate)
    want = run(resume=False), run(resume=True)
    for (gw, gs), (ww, ws) in zip(got, want, strict=True):
        for n, w in ww.items():
            assert torch.equal(gw[n], w), (config, n)
        assert gs["state"].keys() == ws["state"].keys()
        for key, entry in ws["state"].items():
            for field, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(gs["state"][key][field], value), (config, key, field)
                else:
                    assert gs["state"][key][field] == value, (config, key, field)


class _FakeCudaRuntime:
    """Stands in for ``torch.cuda.cudart()``: records registrations, returns success."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, nbytes, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_a_pinned_block_is_registered_whole_and_released_with_its_last_view(monkeypatch) -> None:
    fake = _FakeCudaRuntime()
    synced = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    sizes = {"exp_avg": (1000, torch.float32), "master": (999, torch.int16),
             "grad_comm": (77, torch.bfloat16)}  # fmt: skip
    device = torch.device("cuda", 0)
    bufs = transfer.carve(sizes, (device,))
    base = bufs["exp_avg"].untyped_storage()
    assert fake.registered == [(base.data_ptr(), transfer.block_layout(sizes)[1], 1)]
    kept = bufs["grad_comm"][5:]  # a view of a view outlives the others
    del bufs, base
    gc.collect()
    assert fake.unregistered == [] and synced == []  # its memory is still in use
    ptr = fake.registered[0][0]
    del kept
    gc.collect()
    assert fake.unregistered == [ptr] and synced == [device]  # the device done first


def test_a_block_that_cannot_be_registered_is_pinned_by_torch_saying_so(monkeypatch, caplog):
    class Refusing(_FakeCudaRuntime):
        def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
            return 2  # cudaErrorMemoryAllocation

    pinned = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(transfer, "_ROUNDED_WARNED", [])
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self)
    with caplog.at_level("WARNING", logger="moestack.optim.transfer"):
        bufs = transfer.carve({"exp_avg": (3000, torch.float32)}, (torch.device("cuda", 0),))
        transfer.carve({"exp_avg": (10, torch.float32)}, (torch.device("cuda", 0),))
    assert len(pinned) == 2 and bufs["exp_avg"].numel() == 3000
    (record,) = caplog.records  # once per process
    assert "CUDA error 2" in record.getMessage() and "16384 bytes for 12000" in record.getMessage()
