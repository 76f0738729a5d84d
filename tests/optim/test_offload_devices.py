"""OffloadAdamW with parameters on a device: against torch.optim.AdamW, every step.

On CUDA this exercises the overlap path (gradient copies started by post-accumulate-grad
hooks on a side stream, weights returned on the side stream, dtype changes on the device,
pinned host buffers). The same checks run on the CPU, so the test logic itself is exercised
on machines without a GPU (there the fp32 case steps in place and bf16 keeps a master copy).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from moestack.optim import OffloadAdamW, transfer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = {  # stacked experts are split per expert by the optimizer (name pattern .w1/.w2)
    "layers.0.moe.w1": (4, 24, 40),
    "layers.0.moe.w2": (4, 40, 24),
    "layers.0.attn.weight": (40, 24),
    "layers.0.norm.weight": (24,),
}
IDLE_EXPERT, IDLE_STEP = 1, 3  # expert 1 of w1 gets an exactly zero gradient at step 3
STEPS, ACCUM, MAX_NORM = 8, 2, 2.0


def make_params(device: str, dtype: torch.dtype) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {
        n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device, dtype))
        for n, s in SHAPES.items()
    }


def coefficients(step: int, micro: int) -> dict[str, torch.Tensor]:
    """Random loss coefficients: the gradient of sum(p * c) is c, bf16-exact."""
    g = torch.Generator().manual_seed(100 * step + micro)
    out = {n: torch.randn(s, generator=g).bfloat16().float() for n, s in SHAPES.items()}
    if step == IDLE_STEP:
        out["layers.0.moe.w1"][IDLE_EXPERT] = 0.0
    return out


def backward(
    params: dict[str, torch.nn.Parameter], step: int, deferring: OffloadAdamW | None = None
) -> None:
    """ACCUM micro-batches whose gradients accumulate in .grad (hooks fire on each); with
    ``deferring``, all but the last run inside its ``no_sync()``."""
    for micro in range(ACCUM):
        c = coefficients(step, micro)
        last = micro == ACCUM - 1
        ctx = deferring.no_sync() if deferring is not None and not last else nullcontext()
        with ctx:
            loss = sum((p.float() * c[n].to(p.device)).sum() for n, p in params.items())
            loss.backward()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of b's bf16 spacing (2**-7 relative, 8 mantissa bits)."""
    spacing = b.double().abs().clamp_min(1e-30) * 2.0**-7
    return float(((a.double() - b.double()).abs() / spacing).max())


def lr_lambda(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _with_reference(device: str, dtype: torch.dtype, **kw):
    """The parameters on ``device``, fp32 CPU copies of them (their own memory), an
    OffloadAdamW (``kw``) over the first and torch AdamW over the copies, same settings."""
    params = make_params(device, dtype)
    ref = {n: torch.nn.Parameter(p.detach().float().cpu().clone()) for n, p in params.items()}
    opt = OffloadAdamW(list(params.items()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    ref_opt = torch.optim.AdamW(
        list(ref.values()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False
    )
    return params, ref, opt, ref_opt


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("defer", [False, True], ids=["copy-each", "no_sync"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_adamw_on_device(
    device: str, dtype: torch.dtype, defer: bool, pipeline: bool, fused_step: str = "auto"
) -> None:
    """Every step against torch AdamW; ``fused_step`` as OffloadAdamW takes it (the tests
    below run this one with the reference path, and with the staged fused step), serial or
    bucket by bucket (``pipeline``: on CUDA its streams, on the CPU its logic)."""
    kw = {"fused_step": fused_step, "pipeline": pipeline, "bucket_mb": 0.004}  # 2 to 4 params
    params, ref, opt, ref_opt = _with_reference(device, dtype, **kw)
    assert opt.pipelined == pipeline
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda)
    for step in range(STEPS):
        opt.zero_grad()
        backward(params, step, deferring=opt if defer else None)
        if device == "cuda":  # the copies to the host started inside backward
            assert all(opt._hooked), "post-accumulate-grad hooks did not fire"
        for n, r in ref.items():  # the reference sees the same accumulated gradients
            r.grad = params[n].grad.float().cpu().clone()
        norm = opt.clip_grad_norm_(MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.values()), MAX_NORM)
        assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), step
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        for n, p in params.items():  # read on the compute stream: it waits for the copy back
            got = p.detach().cpu()
            if dtype == torch.float32:
                assert rel(got, ref[n].detach()) <= 1e-6, (step, n)
            else:
                assert ulps_bf16(got, ref[n].detach()) <= 1.0, (step, n)

    state = opt.state_dict()["state"]
    ref_state = ref_opt.state_dict()["state"]
    for i, (n, p) in enumerate(params.items()):
        # Stacked expert tensors are saved per expert: stack them back for the comparison.
        keys = [f"{n}/expert{e}" for e in range(p.shape[0])] if ".moe." in n else [n]

        def full(entry: str, keys: list[str] = keys) -> torch.Tensor:
            parts = [state[k][entry] for k in keys]
            return torch.stack(parts) if len(parts) > 1 else parts[0]

        for entry in ("exp_avg", "exp_avg_sq"):
            assert rel(full(entry), ref_state[i][entry]) <= 1e-6, (n, entry)
        if dtype != torch.float32:  # the fp32 master copy is the reference's parameter
            assert rel(full("master"), ref[n].detach()) <= 1e-6, n
            assert torch.equal(p.detach().cpu(), full("master").to(dtype)), n


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_delayed_update_on_device(device: str, dtype: torch.dtype, pipeline: bool) -> None:
    """update_delay=1 with the copies of the device path, serial or through the buckets
    (``pipeline``: on CUDA their streams): these gradients do not depend on the weights, so
    the master weights follow torch AdamW exactly as without the delay, and the weights the
    device sees after step k are the master's after update k - 1 (after update k once
    synchronized)."""
    kw = {"pipeline": pipeline, "bucket_mb": 0.004}  # 2 to 4 parameters a bucket
    params, ref, opt, ref_opt = _with_reference(device, dtype, update_delay=1, **kw)
    assert opt.pipelined == pipeline
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda)
    for step in range(STEPS):
        opt.zero_grad()
        backward(params, step)
        for n, r in ref.items():
            r.grad = params[n].grad.float().cpu().clone()
        opt.clip_grad_norm_(MAX_NORM)
        torch.nn.utils.clip_grad_norm_(list(ref.values()), MAX_NORM)
        opt.step()
        previous = {n: r.detach().clone() for n, r in ref.items()}  # after update `step`
        ref_opt.step()
        sched.step()
        ref_sched.step()
        want = previous if step >= 1 else ref  # step 0 is the warm-up: exact
        for n, p in params.items():
            got, expected = p.detach().cpu(), want[n].detach()
            if dtype == torch.float32:
                assert rel(got, expected) <= 1e-6, (step, n)
            else:
                assert ulps_bf16(got, expected) <= 1.0, (step, n)
    opt.synchronize()
    for n, p in params.items():
        got = p.detach().cpu()
        tol = (
            rel(got, ref[n].detach()) if dtype == torch.float32 else ulps_bf16(got, ref[n].detach())
        )
        assert tol <= (1e-6 if dtype == torch.float32 else 1.0), n


def test_device_cast_path_on_the_cpu(monkeypatch) -> None:
    """The chunked dtype changes through the fp32 scratch, forced on for CPU tensors."""
    monkeypatch.setattr(transfer, "_cast_on_device", lambda dev, host: dev.dtype != host.dtype)
    monkeypatch.setattr(transfer, "_XFER_CHUNK", 7)  # many chunks, the last one partial
    buffers = []
    original = OffloadAdamW._xfer_buffer

    def spy(self, device):
        buffers.append(original(self, device))
        return buffers[-1]

    monkeypatch.setattr(OffloadAdamW, "_xfer_buffer", spy)
    test_matches_torch_adamw_on_device(
        "cpu", torch.bfloat16, defer=False, pipeline=False, fused_step="off"
    )
    assert buffers and all(b.numel() == 7 and b.dtype == torch.float32 for b in buffers)


@pytest.mark.parametrize("defer", [False, True], ids=["copy-each", "no_sync"])
def test_staged_fused_step_on_the_cpu(monkeypatch, defer: bool) -> None:
    """The CUDA mode of the fused step (packed fp32 gradients in, bf16 weights out through a
    staging buffer, copied to the parameters), forced on for CPU parameters."""
    from moestack.optim import fused

    monkeypatch.setattr(fused, "choose_mode", lambda *args: fused.STAGED)
    staged = []
    original = transfer.return_weights

    def spy(*args, **kw):
        staged.append(args[-1])
        original(*args, **kw)

    monkeypatch.setattr(transfer, "return_weights", spy)
    test_matches_torch_adamw_on_device("cpu", torch.bfloat16, defer=defer, pipeline=False)
    assert staged and all(s is not None and s.dtype == torch.bfloat16 for s in staged)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_delayed_transfers_are_waited_for(monkeypatch) -> None:
    """Stall every side-stream transfer: a missing wait would read stale values."""
    from _optim_testlib import stall_transfers

    stall_transfers(monkeypatch)
    for pipeline in (False, True):
        test_matches_torch_adamw_on_device("cuda", torch.bfloat16, defer=True, pipeline=pipeline)
        test_delayed_update_on_device("cuda", torch.bfloat16, pipeline=pipeline)


@pytest.mark.parametrize("device", DEVICES)
def test_resume_on_device_continues_exactly(device: str) -> None:
    params = make_params(device, torch.bfloat16)
    opt = OffloadAdamW(list(params.items()), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        opt.zero_grad()
        backward(params, step)
        opt.step()
    saved = opt.state_dict()
    twin = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    resumed = OffloadAdamW(list(twin.items()), lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(saved)
    for step in range(3, 6):
        for ps, o in ((params, opt), (twin, resumed)):
            o.zero_grad()
            backward(ps, step)
            o.step()
    for n in params:
        assert torch.equal(params[n].detach().cpu(), twin[n].detach().cpu()), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_and_synchronous_paths_agree() -> None:
    results = []
    for overlap in (True, False):
        params = make_params("cuda", torch.bfloat16)
        opt = OffloadAdamW(list(params.items()), lr=1e-2, weight_decay=0.1, overlap=overlap)
        for step in range(4):
            opt.zero_grad()
            backward(params, step)
            opt.step()
        results.append({n: p.detach().cpu() for n, p in params.items()})
    for n in SHAPES:
        assert torch.equal(results[0][n], results[1][n]), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_keeps_only_weights_grads_and_a_bounded_scratch() -> None:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    experts, rows, cols = 8, 512, 1024  # 4M bf16 elements per expert tensor
    params = {
        f"layers.{i}.moe.w1": torch.nn.Parameter(
            torch.randn(experts, rows, cols, device="cuda", dtype=torch.bfloat16)
        )
        for i in range(2)
    }
    for p in params.values():
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    weights_and_grads = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    opt = OffloadAdamW(list(params.items()), lr=1e-3)
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - weights_and_grads
    scratch = 4 * min(max(p.numel() for p in params.values()), 1 << 24)
    # The peak, not what is left: a full-size fp32 temporary during a copy would show here.
    assert extra <= scratch + (1 << 20), f"{extra} device bytes beyond weights and grads"
    bufs = opt.host_buffers()
    assert all(t.device.type == "cpu" and t.is_pinned() for t in bufs.values())
    assert sum(t.numel() * t.element_size() for t in bufs.values()) >= 12 * sum(
        p.numel() for p in params.values()
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_buffers_are_one_block_page_locked_in_place() -> None:
    """Every host buffer is a pinned view of one block of the bytes the plan counts
    (registered in place, not taken from torch's pinned allocator, which rounds each
    request up to a power of two: its byte count does not move), and the optimizer steps
    as torch AdamW does from there."""
    stats = getattr(torch.cuda, "host_memory_stats", None)

    def held() -> int | None:
        got = stats() if stats is not None else {}
        return got.get("allocated_bytes.current", got.get("allocated_bytes.all.current"))

    params = make_params("cuda", torch.bfloat16)
    before = held()
    opt = OffloadAdamW(list(params.items()), lr=1e-3)
    assert held() == before
    bufs = opt.host_buffers()
    storage = bufs["exp_avg"].untyped_storage()
    counted = sum(t.numel() * t.element_size() for t in bufs.values())
    assert all(t.is_pinned() for t in bufs.values())
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in bufs.values())
    assert counted <= storage.nbytes() < counted + transfer.ALIGN_BYTES * len(bufs)
    master = {n: p.detach().float().cpu().requires_grad_() for n, p in params.items()}
    ref = torch.optim.AdamW(list(master.values()), lr=1e-3)
    for step in range(3):
        for n, p in params.items():
            c = coefficients(step, 0)[n]
            p.grad = c.to("cuda", torch.bfloat16)
            master[n].grad = c.clone()
        opt.step()
        ref.step()
    opt.synchronize()
    torch.cuda.synchronize()
    for n, p in params.items():  # bf16 weights: the fp32 master rounded (half an ulp, 2^-9)
        torch.testing.assert_close(p.cpu().float(), master[n].detach(), rtol=2**-8, atol=1e-7)
    del opt, bufs, storage


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dropped_optimizer_is_freed_and_hooks_can_be_removed() -> None:
    import gc
    import weakref

    params = make_params("cuda", torch.bfloat16)
    opt = OffloadAdamW(list(params.items()), lr=1e-2)
    backward(params, 0)
    opt.step()
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None, "the gradient hooks keep a dropped optimizer alive"
    other = OffloadAdamW(list(params.items()), lr=1e-2)
    other.remove_hooks()
    other.zero_grad()
    backward(params, 1)  # the first optimizer's hooks are no-ops now; none of other's run
    assert not any(other._hooked)
    other.step()


def test_no_sync_defers_the_copy_to_a_later_backward() -> None:
    """Inside no_sync a hook starts no copy and marks the gradient as not yet on the host."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = OffloadAdamW([("w", p)])
    opt._hooked[0] = True  # as if an earlier backward had copied a partial sum
    with opt.no_sync():
        opt._grad_hook(p)  # returns before any CUDA work
    assert opt._hooked == [False]  # so the step copies the final sum itself


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_sync_copies_once_per_step(monkeypatch) -> None:
    copies = []
    to_host = OffloadAdamW._to_host

    def counting(self, dst, src, non_blocking):
        copies.append(dst.numel())
        to_host(self, dst, src, non_blocking)

    monkeypatch.setattr(OffloadAdamW, "_to_host", counting)
    counts = {}
    for defer in (False, True):
        params = make_params("cuda", torch.bfloat16)
        opt = OffloadAdamW(list(params.items()), lr=1e-2)
        copies.clear()
        opt.zero_grad()
        backward(params, 0, deferring=opt if defer else None)
        opt.step()
        counts[defer] = sum(copies)
    total = sum(p.numel() for p in make_params("cpu", torch.float32).values())
    assert counts == {False: ACCUM * total, True: total}
