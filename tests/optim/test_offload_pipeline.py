"""OffloadAdamW's pipelined step (moestack.optim.buckets) against its serial step.

The pipelined step runs the same per-element arithmetic as the serial fused step, bucket by
bucket, and measures the clipping norm as it does (each gradient's fp32 norm on the device,
combined in parameter order in fp64), so clipped or not, exact or delayed, it is bitwise the
serial step. Here the parameters are on the CPU: its logic (hooks, buckets, the worker
thread, per-layer waits) runs without CUDA streams; on a GPU
tests/optim/test_offload_devices.py runs it with them.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from _optim_testlib import (
    ACCUM,
    MAX_NORM,
    STEPS,
    TinyMoE,
    batch,
    groups,
    lr_lambda,
    stall_transfers,
)

from moestack.config import OptimConfig
from moestack.model import ModelConfig
from moestack.optim import OffloadAdamW, build_training_optimizer
from moestack.optim.buckets import Bucket, layers_of, make_buckets
from moestack.optim.plan import ParamSpec

KB = 1 / 1024  # bucket_mb of one kilobyte


def _model(dtype: torch.dtype, unused: bool = False) -> TinyMoE:
    model = TinyMoE().to(dtype)
    if unused:  # a parameter no forward uses: no gradient, never stepped
        model.spare = torch.nn.Parameter(
            torch.randn(5, 3, generator=torch.Generator().manual_seed(7)).to(dtype)
        )
    return model


def _optimizer(model: torch.nn.Module, pipeline: bool, **kw) -> OffloadAdamW:
    serial = {} if pipeline else {"in_place": False}  # the fused kernel's step, like the pipeline
    return OffloadAdamW(
        groups(model), lr=1e-2, betas=(0.9, 0.95), pipeline=pipeline, **serial, **kw
    )


def _train(
    dtype: torch.dtype,
    pipeline: bool,
    *,
    clip: bool = False,
    defer: bool = True,
    skip_at: int | None = None,
    unused: bool = False,
    steps: int = STEPS,
    **kw,
) -> tuple[TinyMoE, OffloadAdamW, list[float]]:
    """``steps`` steps of TinyMoE (an expert the router never picks: an idle expert) with a
    warm-up/cosine schedule; micro-batches accumulate inside ``no_sync`` when ``defer``;
    at ``skip_at`` the gradients are dropped without a step (a skipped non-finite step)."""
    model = _model(dtype, unused)
    opt = _optimizer(model, pipeline, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    norms = []
    for step in range(steps):
        for micro in range(ACCUM):
            x, y = batch(step, micro)
            last = micro == ACCUM - 1
            with opt.no_sync() if defer and not last else nullcontext():
                loss = (model(x.to(dtype)).float() - y).square().mean() / ACCUM
                loss.backward()
        if step == skip_at:
            opt.zero_grad()
            continue
        if clip:
            norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.synchronize()
    return model, opt, norms


def _assert_same(
    a: torch.nn.Module, b: torch.nn.Module, oa: OffloadAdamW, ob: OffloadAdamW
) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for entry, value in sa[key].items():
            other = sb[key][entry]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            assert same, (key, entry)


# ------------------------------------------------------------------------------- buckets


def test_buckets_follow_backward_order_and_hold_at_most_their_size():
    """Worked by hand: sizes in bytes 40, 24, 100, 8, 8 (fp32) with 48-byte buckets, the
    frozen third-from-last skipped: backward order is 4, 3, (2 frozen), 1, 0."""
    shapes = [(10,), (6,), (25,), (2,), (2,)]
    specs = [ParamSpec(s, "cpu", torch.float32) for s in shapes]
    trainable = [True, True, False, True, True]
    got = make_buckets(specs, trainable, 48)
    assert got == [Bucket((4, 3, 1), 40), Bucket((0,), 40)]
    # a parameter larger than a bucket has one of its own
    got = make_buckets([ParamSpec((100,), "cpu", torch.bfloat16)] * 3, [True] * 3, 150)
    assert got == [Bucket((2,), 200), Bucket((1,), 200), Bucket((0,), 200)]
    with pytest.raises(ValueError, match="positive"):
        make_buckets(specs, trainable, 0)


def test_layers_of_a_model_are_its_blocks_in_order():
    model = ModelConfig(
        vocab_size=64, d_model=16, n_layers=3, n_heads=2, moe={"num_experts": 4, "top_k": 2}
    ).build()
    layers = layers_of(model)
    assert layers[0] is model.embed
    assert layers[1 : 1 + 3] == list(model.layers)
    assert layers[-2:] == [model.norm, model.lm_head]


# ----------------------------------------------------------------- bitwise the serial step


@pytest.mark.parametrize("bucket_mb", [KB / 64, KB, 64.0], ids=["param-alone", "some", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unclipped_pipeline_is_bitwise_the_serial_step(dtype, bucket_mb):
    """Buckets smaller than a parameter, of a few parameters, and one for all; an idle
    expert; a step skipped by zero_grad; a parameter without a gradient."""
    model, opt, _ = _train(dtype, True, bucket_mb=bucket_mb, skip_at=3, unused=True)
    ref, ref_opt, _ = _train(dtype, False, skip_at=3, unused=True)
    assert opt.pipelined and not ref_opt.pipelined
    buckets = opt._pipe.buckets
    if bucket_mb == 64.0:
        assert len(buckets) == 1
    if (
        bucket_mb == KB / 64
    ):  # 16 bytes: every bucket is one parameter, some larger than the bucket size
        assert all(len(b.pidxs) == 1 for b in buckets)
        assert any(b.nbytes > bucket_mb * 2**20 for b in buckets)
    _assert_same(model, ref, opt, ref_opt)
    spare = _model(dtype, unused=True).spare
    assert torch.equal(model.spare, spare)  # never stepped, as the serial step leaves it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_accumulated_without_no_sync_land_again(dtype):
    """Each micro-batch's hooks fire: a bucket lands again with the summed gradients."""
    model, opt, _ = _train(dtype, True, bucket_mb=KB, defer=False)
    ref, ref_opt, _ = _train(dtype, False, defer=False)
    _assert_same(model, ref, opt, ref_opt)


@pytest.mark.parametrize("bucket_mb", [KB / 64, KB, 64.0], ids=["param-alone", "some", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_clipped_pipeline_is_bitwise_the_serial_step(dtype, bucket_mb):
    """Both steps measure the clipping norm one way (each gradient's fp32 norm on the
    device, combined in parameter order in fp64): norms, weights and state bit for bit,
    with an idle expert, a skipped step and a parameter without a gradient."""
    kw = {"clip": True, "skip_at": 3, "unused": True}
    model, opt, norms = _train(dtype, True, bucket_mb=bucket_mb, **kw)
    ref, ref_opt, ref_norms = _train(dtype, False, **kw)
    assert opt.pipelined and not ref_opt.pipelined
    assert norms == ref_norms and max(norms) > MAX_NORM  # clipping changed the steps
    _assert_same(model, ref, opt, ref_opt)


@pytest.mark.parametrize("bucket_mb", [KB / 64, KB, 64.0], ids=["param-alone", "some", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delayed_pipeline_is_bitwise_the_serial_delayed_step(dtype, bucket_mb):
    """update_delay=1 through the buckets (bf16 gradients as bf16, device-side norms, the
    update in the worker, weights back at the next step) against the serial delayed step
    (fp32 host gradients, the clipping norm from the same per-parameter norms): clipped,
    accumulated inside no_sync, a step skipped, an idle expert, a parameter without a
    gradient; weights and state bit for bit."""
    kw = {"clip": True, "skip_at": 3, "unused": True, "update_delay": 1}
    model, opt, norms = _train(dtype, True, bucket_mb=bucket_mb, **kw)
    ref, ref_opt, ref_norms = _train(dtype, False, **kw)
    assert opt.pipelined and not ref_opt.pipelined and opt._pending is None
    assert opt._host.comm.dtype == dtype and ref_opt._host.comm.dtype == torch.float32
    assert norms == ref_norms and max(norms) > MAX_NORM
    _assert_same(model, ref, opt, ref_opt)
    exact, _, _ = _train(dtype, True, bucket_mb=bucket_mb, clip=True, skip_at=3, unused=True)
    assert not torch.equal(exact.moe.w1, model.moe.w1)  # the delay changed the run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_clipped_serial_step_on_the_reference_path_keeps_its_norm(dtype):
    """The reference path scales its host copy of the gradients and measures its norm on
    the device gradients: the pipeline's norms bit for bit, a second clip seeing the first's
    factor; the weights to rounding (torch's kernel, not the fused step's)."""
    model, opt, norms = _train(dtype, True, clip=True, bucket_mb=KB)
    ref, _, ref_norms = _train(dtype, False, clip=True, fused_step="off")
    assert norms[0] == ref_norms[0]  # the first step's gradients are the same
    for a, b in zip(norms, ref_norms, strict=True):
        assert abs(a - b) <= 1e-5 * b
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        q = q.detach().double()
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        assert float((p.detach().double() - q).abs().max()) <= tol * float(q.abs().max()), name


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "serial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_side_norm_against_a_float64_norm(dtype, pipeline):
    model = _model(dtype, unused=True)
    opt = _optimizer(model, pipeline, bucket_mb=KB)
    x, y = batch(0, 0)
    (model(x.to(dtype)).float() - y).square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    want = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    got = opt.grad_norm()
    assert got.dtype == torch.float32 and abs(float(got) - want) <= 1e-6 * want
    if pipeline:
        assert len(opt._pipe.buckets) > 1 and opt._pipe.norms_P.dtype == torch.float32
        assert opt._pipe.norms_P[opt._index[id(model.spare)]] == 0  # no gradient: 0
    opt.clip_grad_norm_(want / 4)
    again = float(opt.grad_norm())  # the norm of the gradients as the step reads them
    assert abs(again - want / 4) <= 1e-5 * want


def _clipped_steps(model: torch.nn.Module, opt: OffloadAdamW, steps: range) -> None:
    """Clipped steps of ``model`` (so every bucket's norm is taken), gradients from hooks."""
    dtype = next(model.parameters()).dtype
    for step in steps:
        x, y = batch(step, 0)
        (model(x.to(dtype)).float() - y).square().mean().backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def _buffers_of(opt: OffloadAdamW) -> dict[str, tuple[int, int, torch.dtype]]:
    """Address, size and dtype of every buffer the optimizer and its pipeline own."""
    pipe = opt._pipe
    tensors = {**opt.host_buffers(), **opt.device_buffers()}
    tensors.update(norms=pipe.norms_P, norms64=pipe._wide_P)
    return {k: (t.data_ptr(), t.numel(), t.dtype) for k, t in tensors.items()}


def test_bf16_gradients_cross_as_bf16_with_no_device_scratch():
    model = _model(torch.bfloat16)
    opt = _optimizer(model, True)
    assert opt._host.comm.dtype == torch.bfloat16
    _clipped_steps(model, opt, range(2))
    assert opt._steps[0] == 2 and opt.device_buffers() == {}  # stepped, and no dtype scratch
    fp32 = _optimizer(_model(torch.float32), True)
    assert fp32._host.comm.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_pipeline_allocates_nothing_per_step(dtype, monkeypatch):
    """After the first step, later (clipped) steps use the same buffers at the same
    addresses, make no device buffer (gradients cross in their own dtype), and reuse each
    bucket's slices instead of working them out again."""
    from moestack.optim import buckets

    model = _model(dtype)
    opt = _optimizer(model, True, bucket_mb=KB)
    _clipped_steps(model, opt, range(1))
    before, spans = _buffers_of(opt), dict(opt._pipe.span_cache)
    assert len(spans) >= len(opt._pipe.buckets)
    calls = []
    real = buckets.contiguous_runs
    monkeypatch.setattr(buckets, "contiguous_runs", lambda *a: calls.append(a) or real(*a))
    _clipped_steps(model, opt, range(1, 5))
    assert opt._steps[0] == 5
    assert _buffers_of(opt) == before and opt.device_buffers() == {}
    assert calls == []  # every bucket's slices came from the cache
    assert all(opt._pipe.span_cache[k] is v for k, v in spans.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_pipeline_allocates_nothing_per_step_on_cuda(monkeypatch):
    """On a GPU, after warm-up steps: no CUDA event is made, the optimizer's buffers and
    events stay the same objects, and the device memory in use between steps does not
    grow."""
    model = _lm(torch.bfloat16).cuda()
    cfg = OptimConfig(name="offload_adamw", pipeline=True, bucket_mb=0.02, grad_clip=1.0)
    opt = build_training_optimizer(model, cfg)
    inner = opt.optimizer
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0)).cuda()

    def steps(n: int) -> None:
        for _ in range(n):
            model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        torch.cuda.synchronize()

    steps(3)
    pipe = inner._pipe
    events = [id(e) for e in (*pipe.landed_events, *pipe.back_events, *pipe.queued_events)]
    before, in_use = _buffers_of(inner), torch.cuda.memory_allocated()
    made = []
    real_event = torch.cuda.Event

    def counting(*args, **kw):
        made.append(1)
        return real_event(*args, **kw)

    monkeypatch.setattr(torch.cuda, "Event", counting)
    monkeypatch.setattr(torch.cuda.streams, "Event", counting)  # Stream.wait_stream's
    steps(4)
    assert made == []
    assert [id(e) for e in (*pipe.landed_events, *pipe.back_events, *pipe.queued_events)] == events
    assert _buffers_of(inner) == before
    assert torch.cuda.memory_allocated() <= in_use


# --------------------------------------------------------------------- update in backward


def test_update_in_backward_is_bitwise_the_serial_step():
    """Every bucket's update starts from its hook, inside backward; unclipped, it is the
    serial step bit for bit. A bucket with a parameter without a gradient waits for step()."""
    model = _model(torch.bfloat16, unused=True)
    opt = _optimizer(model, True, bucket_mb=KB, update_in_backward=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    spare_bucket = opt._pipe.bucket_of[opt._index[id(model.spare)]]
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = batch(step, micro)
            with opt.no_sync() if micro < ACCUM - 1 else nullcontext():
                ((model(x.bfloat16()).float() - y).square().mean() / ACCUM).backward()
        started = opt._pipe.submitted
        assert all(s for b, s in enumerate(started) if b != spare_bucket)
        assert not started[spare_bucket]
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.synchronize()
    ref, ref_opt, _ = _train(torch.bfloat16, False, unused=True)
    _assert_same(model, ref, opt, ref_opt)


def test_update_in_backward_refuses_clipping_and_late_accumulation():
    model = _model(torch.float32)
    opt = _optimizer(model, True, update_in_backward=True)
    x, y = batch(0, 0)
    (model(x) - y).square().mean().backward()
    with pytest.raises(RuntimeError, match="update_in_backward"):
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    (model(x) - y).square().mean().backward()
    with pytest.raises(RuntimeError, match="no_sync"):  # a second micro-batch, no no_sync
        (model(x) - y).square().mean().backward()


# --------------------------------------------------------------------- per-layer waits


def _lm(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ModelConfig(
        vocab_size=64, d_model=32, n_layers=3, n_heads=2, moe={"num_experts": 4, "top_k": 2}
    ).build()
    return model.to(dtype)


def _lm_run(
    pipeline: bool,
    steps: int = 5,
    resume_at: int | None = None,
    device: str = "cpu",
    update_delay: int = 0,
) -> tuple[list, dict]:
    """A small language model on ``device`` through build_training_optimizer (which makes a
    pipelined step wait per layer); bf16 weights; unclipped; optionally saved and resumed at
    ``resume_at`` into a fresh optimizer over the same model."""
    model = _lm(torch.bfloat16).to(device)
    cfg = OptimConfig(
        name="offload_adamw", pipeline=pipeline, bucket_mb=0.02, grad_clip=0.0,
        update_delay=update_delay,
    )  # fmt: skip
    opt = build_training_optimizer(model, cfg)
    g = torch.Generator().manual_seed(3)
    losses = []
    for step in range(steps):
        if step == resume_at:
            opt.synchronize()
            saved = opt.state_dict()
            opt = build_training_optimizer(model, cfg)
            opt.load_state_dict(saved)
        tokens = torch.randint(0, 64, (4, 17), generator=g).to(device)
        loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
        loss.backward()
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    inner = opt.optimizer
    assert inner.pipelined == pipeline
    if pipeline:
        assert all(inner._pipe.covered)  # every bucket waited for by a layer's forward
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def test_per_layer_waits_train_as_the_serial_step():
    """The next forward waits for each layer's weights just before it (the worker thread may
    still be stepping later buckets meanwhile): losses and weights bitwise the serial run's,
    also across a checkpoint taken and loaded mid-run."""
    serial_losses, serial_weights = _lm_run(False)
    for resume_at in (None, 3):
        losses, weights = _lm_run(True, resume_at=resume_at)
        assert losses == serial_losses
        for name, w in weights.items():
            assert torch.equal(w, serial_weights[name]), name


def test_delayed_per_layer_waits_train_as_the_serial_delayed_step(monkeypatch):
    """Delayed: each layer's forward waits for the weights the last step sent back, never
    for the update in flight (its futures are not waited for inside a forward; the first
    step's, exact, are);
    losses and weights bitwise the serial delayed run's, across a checkpoint too."""
    from moestack.optim import buckets

    waited_in_forward = []
    in_forward = []
    real_wait, real_release = buckets.Pipeline.wait_update, buckets.Pipeline.release

    def wait_update(self, b):  # in a forward, for a delayed update (its job sends nothing)
        if in_forward and not self._job_sends[b]:
            waited_in_forward.append(b)
        return real_wait(self, b)

    def release(self, b):  # called by the layers' pre-hooks (and by step(), not in forward)
        in_forward.append(b)
        try:
            return real_release(self, b)
        finally:
            in_forward.pop()

    monkeypatch.setattr(buckets.Pipeline, "wait_update", wait_update)
    monkeypatch.setattr(buckets.Pipeline, "release", release)
    for resume_at in (None, 3):  # a checkpoint synchronizes: the serial run takes it too
        serial_losses, serial_weights = _lm_run(False, 6, resume_at, update_delay=1)
        losses, weights = _lm_run(True, 6, resume_at, update_delay=1)
        assert losses == serial_losses
        for name, w in weights.items():
            assert torch.equal(w, serial_weights[name]), name
    assert waited_in_forward == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_layer_waits_on_cuda_with_every_transfer_stalled(monkeypatch):
    """The streams and events of the pipeline: every copy each way stalled on its stream
    (~10 ms of GPU time), so a missing wait reads stale weights or gradients. The forward's
    scatter sums are not deterministic on a GPU: weights within two bf16 ulps of the serial
    run's (a stale weight is a whole update, about lr, away), losses to 1e-3."""
    serial_losses, serial_weights = _lm_run(False, device="cuda")
    stall_transfers(monkeypatch)
    losses, weights = _lm_run(True, resume_at=3, device="cuda")
    for a, b in zip(losses, serial_losses, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b)
    for name, w in weights.items():
        ref = serial_weights[name].float()
        assert float((w.float() - ref).abs().max()) <= 2 * 2**-8 * float(ref.abs().max()), name


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"skip_idle_experts": True}, "skip_idle_experts"),
        ({"fused_step": "off"}, "fused_step"),
        ({"in_place": True}, "in_place"),
    ],
)
def test_forcing_the_pipeline_where_it_cannot_run_says_why(kw, words):
    with pytest.raises(ValueError, match=words):
        _optimizer(_model(torch.float32), True, **kw)


def test_bad_pipeline_settings_are_refused_naming_them():
    model = _model(torch.float32)
    with pytest.raises(ValueError, match="pipeline='yes'"):
        OffloadAdamW(groups(model), pipeline="yes")
    with pytest.raises(ValueError, match="bucket_mb"):
        OffloadAdamW(groups(model), pipeline=True, bucket_mb=0)
    for pipeline in (True, "auto", False):  # 1e-8 MB rounds to buckets of 0 bytes
        with pytest.raises(ValueError, match=r"bucket_mb=1e-08 .* give bucket_mb >= 9.54e-07"):
            OffloadAdamW(groups(model), pipeline=pipeline, bucket_mb=1e-8)
    assert OffloadAdamW(groups(model), pipeline=True, bucket_mb=9.54e-07).bucket_bytes == 1
    with pytest.raises(ValueError, match="update_in_backward"):
        OffloadAdamW(groups(model), pipeline=False, update_in_backward=True)
    with pytest.raises(ValueError, match="optim.pipeline"):
        OptimConfig(name="offload_adamw", pipeline="sometimes")
    with pytest.raises(ValueError, match="optim.bucket_mb"):
        OptimConfig(name="offload_adamw", bucket_mb=-1)
    # "auto" on CPU parameters: the serial step (the pipeline pays where copies cross PCIe)
    assert not OffloadAdamW(groups(model)).pipelined


def test_forcing_the_pipeline_without_its_kernel_names_only_the_pipeline(monkeypatch):
    from moestack.optim import fused

    monkeypatch.setattr(fused.FusedHostStep, "resolve", lambda self: False)
    with pytest.raises(RuntimeError, match="^pipeline=True needs the fused host step's kernel"):
        _optimizer(_model(torch.float32), True)
    assert not _optimizer(_model(torch.float32), "auto").pipelined  # "auto": the serial step


def test_no_kernel_where_the_pipeline_pays_runs_the_serial_step_saying_why(monkeypatch, caplog):
    """As on a GPU image without a C++ compiler: "auto" plans the pipeline (every parameter
    on a device, stood in for here), neither backend of the fused kernel loads. The serial
    step runs, exactly the reference path's; one warning says the pipelined step is off and
    why, serial_reason keeps it, and update_in_backward (which needs the pipeline) is
    refused naming it."""
    import logging

    from moestack.optim import buckets, fused

    why = "RuntimeError: no C++ compiler (set CXX, or install g++)"
    monkeypatch.setattr(buckets, "on_devices", lambda specs: True)
    monkeypatch.setattr(fused, "_native", lambda: why)
    monkeypatch.setattr(fused, "_compiled", lambda combos: "RuntimeError: inductor needs one")
    monkeypatch.setattr(fused, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="moestack.optim"):
        opt = _optimizer(_model(torch.bfloat16), "auto")
    assert not opt.pipelined and "no C++ compiler" in opt.serial_reason
    (line,) = [r for r in caplog.records if r.name == "moestack.optim.offload"]
    assert line.levelno == logging.WARNING
    msg = line.getMessage()
    assert "pipelined step turned off" in msg and "serial step" in msg and "no C++ compiler" in msg
    with pytest.raises(ValueError, match="update_in_backward=True.*no C\\+\\+ compiler"):
        _optimizer(_model(torch.bfloat16), "auto", update_in_backward=True)
    assert opt.host_step == "pending"  # chosen at the first step
    model, opt, norms = _train(torch.bfloat16, "auto", clip=True, steps=4)
    ref_model, ref, ref_norms = _train(torch.bfloat16, False, clip=True, steps=4, fused_step="off")
    assert not opt.pipelined and opt.host_step == ref.host_step == "off"
    assert norms == ref_norms  # the reference path's step, bitwise
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_forcing_the_pipeline_over_two_devices_names_only_the_pipeline():
    model = _model(torch.float32)
    model.scale = torch.nn.Parameter(torch.ones(8, device="meta"))  # a second device
    with pytest.raises(ValueError, match=r"^pipeline=True needs every parameter on one device"):
        _optimizer(model, True)


def test_a_parameter_unfrozen_after_the_build_is_refused_naming_it():
    """A parameter frozen when the optimizer was built has no bucket; its gradient later is
    an error naming it (the serial step would step it), not a silent skip."""
    model = _model(torch.float32)
    model.scale.requires_grad_(False)
    opt = _optimizer(model, True)
    model.scale.requires_grad_(True)
    x, y = batch(0, 0)
    (model(x) - y).square().mean().backward()
    with pytest.raises(RuntimeError, match="'scale' has a gradient but was frozen"):
        opt.step()


def test_dropping_the_layer_waits_waits_for_what_they_would_have():
    model = _lm(torch.bfloat16)
    cfg = OptimConfig(name="offload_adamw", pipeline=True, bucket_mb=0.02, grad_clip=0.0)
    inner = build_training_optimizer(model, cfg).optimizer
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    inner.step()
    inner.remove_hooks()  # the next forward has no pre-hook: nothing may be left unwaited
    assert not any(inner._pipe.unreleased) and not any(inner._pipe.covered)


def test_device_collectives_refuse_skipping_idle_experts():
    from moestack.optim import device_comm

    specs = [ParamSpec((4, 3), "cuda", torch.bfloat16)]
    why = device_comm.refusal(specs, num_shards=2, fused_step="auto", backend="nccl",
                              skip_idle_experts=True)  # fmt: skip
    assert "skip_idle_experts" in why
    assert device_comm.refusal(specs, num_shards=2, fused_step="auto", backend="nccl") is None
    assert "backend" in device_comm.refusal(specs, num_shards=2, fused_step="auto",
                                            backend="gloo")  # fmt: skip
