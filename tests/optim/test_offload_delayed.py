"""OffloadAdamW's one-step-delayed update (``update_delay=1``) against a plain-torch
reference of its equations (``_optim_testlib.delayed_reference``), serial and through the
pipelined step's buckets (``pipeline=True``: on the CPU its logic, on a GPU its streams)."""

from __future__ import annotations

import threading

import pytest
import torch
from _optim_testlib import (
    LR,
    MAX_NORM,
    STEPS,
    TinyMoE,
    assert_rel_close,
    batch,
    delayed_reference,
    delayed_run,
    groups,
    lr_lambda,
    micro_step,
    ours_state,
    reference_run,
)

from moestack.config import OptimConfig
from moestack.optim import OffloadAdamW

KB = 1 / 1024  # bucket_mb of one kilobyte
# Buckets of 16 bytes (every parameter alone, most larger than a bucket), of a kilobyte (a
# few parameters each) and one for all.
BUCKETS = {"param-alone": KB / 64, "some": KB, "one": 64.0}

# Relative error bound against the torch.optim.AdamW reference (max|a-b| / max|b|): the
# fused host kernel and torch's differ by rounding only.
TOL = 1e-6


def _assert_histories_close(got: list, want: list, tol: float = TOL) -> None:
    assert len(got) == len(want) == STEPS + 1
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, p in g.items():
            assert_rel_close(p, w[name], f"after step {step} {name}", tol)


@pytest.mark.parametrize(
    ("warmup", "clip", "fused_step"),
    [(1, True, "auto"), (1, False, "auto"), (0, True, "off"), (3, False, "off")],
)
def test_delayed_update_follows_its_equations(warmup: int, clip: bool, fused_step: str) -> None:
    _assert_histories_close(delayed_run(warmup, clip, fused_step), delayed_reference(warmup, clip))


@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize(("warmup", "clip"), [(1, True), (0, True), (3, False)])
def test_pipelined_delayed_update_follows_its_equations(warmup: int, clip: bool, bucket: str):
    """Through the buckets (gradients landing as backward makes them, the norm from their
    device-side norms, the update in the worker, the weights back at the next step): the
    same equations, with an idle expert, a schedule and accumulated micro-batches."""
    got = delayed_run(warmup, clip, pipeline=True, bucket_mb=BUCKETS[bucket])
    _assert_histories_close(got, delayed_reference(warmup, clip))


def test_the_delay_is_real() -> None:
    """The reference's delayed weights are not the exact ones (so the test above can tell),
    and during the first delayed step the weights do not move at all."""
    delayed, exact = delayed_reference(1, True), delayed_reference(STEPS, True)
    assert all(torch.equal(delayed[0][n], exact[0][n]) for n in exact[0])  # warm-up: exact
    assert all(torch.equal(delayed[1][n], delayed[0][n]) for n in delayed[0])  # launched only
    gap = max(float((delayed[5][n] - exact[5][n]).abs().max()) for n in exact[5])
    assert gap > 1e-4


@pytest.mark.parametrize(
    "kw",
    [
        {"update_delay": 0},
        {"update_delay": 0, "in_place": False},
        {"update_delay": 0, "fused_step": "off", "in_place": False},
        {"update_delay": 1, "delay_warmup": STEPS},
    ],
    ids=["exact-in-place", "exact-master", "exact-reference-path", "warmup-all-run"],
)
def test_update_delay_zero_is_torch_adamw(kw: dict) -> None:
    """update_delay=0 (and a warm-up as long as the run) is the exact step: every step's
    weights, clipping norm and moments those of torch.optim.AdamW to rounding."""
    model = TinyMoE()
    opt = OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    want = reference_run()
    for step in range(STEPS):
        micro_step(model, step)
        norm = float(opt.clip_grad_norm_(MAX_NORM))
        opt.step()
        sched.step()
        opt.zero_grad()
        assert abs(norm - want[step]["norm"]) <= TOL * want[step]["norm"], step
        for n, p in model.named_parameters():
            assert_rel_close(p.detach(), want[step]["params"][n], f"step {step} {n}", TOL)
    assert opt._pending is None  # nothing left in flight: every update was exact
    saved = opt.state_dict()
    for n, st in want[-1]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_rel_close(ours_state(saved, n, key), st[key], f"{key} {n}", TOL)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _delayed(
    model: torch.nn.Module, **kw
) -> tuple[OffloadAdamW, torch.optim.lr_scheduler.LambdaLR]:
    opt = OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8, update_delay=1, **kw)
    assert opt.pipelined == bool(kw.get("pipeline", False))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


PIPELINES = {"serial": {}, "pipelined": {"pipeline": True, "bucket_mb": KB}}


def _train(model, opt, sched, steps: range) -> list[dict[str, torch.Tensor]]:
    """The weights after each of ``steps`` (clipped, scheduled, accumulated)."""
    out = []
    for step in steps:
        micro_step(model, step)
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(_weights(model))
    return out


@pytest.mark.parametrize("how", list(PIPELINES))
def test_resume_from_a_checkpoint_taken_with_an_update_in_flight(how: str) -> None:
    """A checkpoint after step 9's launch applies that update first (state_dict calls
    synchronize); the run resumed from it goes on bitwise as the run that took it, and both
    follow the reference with a synchronize after step 9."""
    half, kw = STEPS // 2, PIPELINES[how]
    model = TinyMoE()
    opt, sched = _delayed(model, **kw)
    history = _train(model, opt, sched, range(half))
    assert opt._pending is not None  # the checkpoint is taken with an update in flight
    saved = {"optim": opt.state_dict(), "model": _weights(model), "sched": sched.state_dict()}
    history[-1] = _weights(model)  # as the checkpoint saw them: synchronized
    went_on = _train(model, opt, sched, range(half, STEPS))
    opt.synchronize()
    went_on.append(_weights(model))

    resumed = TinyMoE()
    resumed.load_state_dict(saved["model"])
    opt2, sched2 = _delayed(resumed, **kw)
    sched2.load_state_dict(saved["sched"])
    opt2.load_state_dict(saved["optim"])
    after_resume = _train(resumed, opt2, sched2, range(half, STEPS))
    opt2.synchronize()
    after_resume.append(_weights(resumed))

    for a, b in zip(went_on, after_resume, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    want = delayed_reference(1, True, synced_after=frozenset({half - 1}))
    _assert_histories_close(history + went_on, want)


def _worker_of(opt: OffloadAdamW):
    return opt._pipe._worker if opt.pipelined else opt._worker


@pytest.mark.parametrize("pipe", list(PIPELINES))
@pytest.mark.parametrize("how", ["close", "remove_hooks"])
def test_closing_applies_the_update_in_flight_and_stops_the_worker(how: str, pipe: str) -> None:
    """Closing (or unhooking) a delayed optimizer applies the update its last step launched,
    as a synchronize would, and stops its worker thread; a later step starts another."""
    model = TinyMoE()
    opt, sched = _delayed(model, **PIPELINES[pipe])
    _train(model, opt, sched, range(3))
    assert opt._pending is not None and _worker_of(opt) is not None
    worker = _worker_of(opt)
    getattr(opt, how)()
    assert opt._pending is None and _worker_of(opt) is None and opt._hooks == []
    assert all(not t.is_alive() for t in worker._threads)
    want = delayed_reference(1, True, synced_after=frozenset({2, 3}))
    for n, p in _weights(model).items():
        assert_rel_close(p, want[2][n], f"closed after step 2 {n}", TOL)
    after = _train(model, opt, sched, range(3, 4))
    opt.synchronize()
    for n, p in _weights(model).items():  # the update launched after closing applied too
        assert_rel_close(p, want[3][n], f"after step 3 {n}", TOL)
    assert not torch.equal(after[0]["moe.w1"], want[3]["moe.w1"])  # it was in flight
    opt.close()


@pytest.mark.parametrize("pipe", list(PIPELINES))
def test_the_update_runs_in_a_worker_and_its_error_reaches_the_next_step(monkeypatch, pipe):
    model = TinyMoE()
    opt = OffloadAdamW(groups(model), lr=LR, update_delay=1, delay_warmup=0, **PIPELINES[pipe])
    threads = []
    real = opt._step_spans

    def recording(*args):
        threads.append(threading.current_thread().name)
        real(*args)

    monkeypatch.setattr(opt, "_step_spans", recording)
    micro_step(model, 0)
    opt.step()
    opt.synchronize()
    name = "offload-adamw-buckets" if opt.pipelined else "offload-adamw-update"
    assert threads and all(t.startswith(name) for t in threads)

    def failing(*args):
        raise RuntimeError("host update failed")

    monkeypatch.setattr(opt, "_step_spans", failing)
    opt.zero_grad()
    micro_step(model, 1)
    opt.step()  # launched; the worker fails
    opt.zero_grad()
    micro_step(model, 2)
    with pytest.raises(RuntimeError, match="host update failed"):
        opt.step()


def test_the_delayed_update_keeps_a_spare_gradient_buffer() -> None:
    exact = OffloadAdamW(groups(TinyMoE()), lr=LR, in_place=False).host_buffers()
    delayed = OffloadAdamW(groups(TinyMoE()), lr=LR, update_delay=1).host_buffers()
    numel = sum(p.numel() for p in TinyMoE().parameters())
    assert "grad_spare" not in exact
    assert delayed["grad_spare"].numel() == delayed["grad_comm"].numel() == numel
    assert delayed["master"].numel() == numel  # a master copy: never stepped in place


def test_pipelined_delayed_gradients_cross_as_bf16_with_no_device_scratch() -> None:
    """Through the buckets, bf16 gradients land as bf16 in two host buffers (the update in
    flight reads one, the next step's gradients land in the other), and no fp32 device
    scratch is made; the weights the forward sees are those before the update in flight."""
    model = TinyMoE().bfloat16()
    opt = OffloadAdamW(groups(model), lr=LR, update_delay=1, pipeline=True, bucket_mb=KB)
    bufs = opt.host_buffers()
    assert bufs["grad_comm"].dtype == bufs["grad_spare"].dtype == torch.bfloat16
    numel = sum(p.numel() for p in model.parameters())
    assert bufs["grad_comm"].numel() == bufs["grad_spare"].numel() == numel
    seen = []
    for step in range(4):
        for micro in range(2):
            x, y = batch(step, micro)
            ((model(x.bfloat16()).float() - y).square().mean() / 2).backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        seen.append(_weights(model))
    assert opt._pending is not None and opt.device_buffers() == {}
    assert all(torch.equal(seen[1][n], seen[0][n]) for n in seen[0])  # launched only
    assert not torch.equal(seen[2]["moe.w1"], seen[1]["moe.w1"])  # applied at the next step
    opt.synchronize()
    assert opt._pending is None and not torch.equal(_weights(model)["inp.weight"], seen[3][
        "inp.weight"])  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"update_delay": 2}, r"update_delay=2: use 0 \(exact\) or 1"),
        ({"update_delay": True}, r"update_delay=True"),
        ({"update_delay": 1, "delay_warmup": -1}, r"delay_warmup=-1"),
        ({"update_delay": 1, "in_place": True}, r"in_place=True steps the parameters"),
        (
            {"update_delay": 1, "pipeline": True, "update_in_backward": True},
            r"update_in_backward=True updates each bucket during its own backward",
        ),
    ],
)
def test_bad_delay_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OffloadAdamW(groups(TinyMoE()), lr=LR, **kw)


def test_the_config_refuses_a_delay_without_offload_adamw() -> None:
    with pytest.raises(
        ValueError, match=r"optim.update_delay=1 .*optim=adamw has none \(use optim=offload_adamw\)"
    ):
        OptimConfig(name="adamw", update_delay=1)
    with pytest.raises(ValueError, match=r"optim.update_delay=3"):
        OptimConfig(name="offload_adamw", update_delay=3)
    assert OptimConfig(name="offload_adamw", update_delay=1).delay_warmup == 1


def test_a_failed_bucket_keeps_its_weights_and_the_others_still_go_back(monkeypatch):
    """A delayed pipelined update whose first bucket raises in the worker: the next step
    raises that error, the failed bucket's parameters keep the weights they had, and every
    other bucket's new weights still reach the parameters, bitwise those of the same run
    without the failure."""

    def run(fail: bool) -> tuple[dict, dict, set]:
        model = TinyMoE()
        opt = OffloadAdamW(
            groups(model), lr=LR, update_delay=1, delay_warmup=0, **PIPELINES["pipelined"]
        )
        assert opt.pipelined and len(opt._pipe.buckets) > 1
        failed: set[int] = set()
        real = opt._step_spans

        def first_fails(jobs, *args):
            if fail and not failed:
                failed.update(span[0] for spans, _ in jobs for span in spans)
                raise RuntimeError("host update failed")
            real(jobs, *args)

        micro_step(model, 0)
        opt.step()
        opt.synchronize()  # update 1 applied before the worker's steps fail
        monkeypatch.setattr(opt, "_step_spans", first_fails)
        opt.zero_grad()
        micro_step(model, 1)
        opt.step()  # update 2 launched: its first bucket fails
        opt.zero_grad()
        micro_step(model, 2)
        before = _weights(model)
        if fail:
            with pytest.raises(RuntimeError, match="host update failed"):
                opt.step()
        else:
            opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        failed_names = {names[id(opt._params[i])] for i in failed}
        return _weights(model), before, failed_names

    want, _, _ = run(fail=False)
    got, before, failed = run(fail=True)
    assert failed and failed != set(got)  # one bucket failed, not all
    for name, w in got.items():
        expected = before[name] if name in failed else want[name]
        assert torch.equal(w, expected), name
    assert any(not torch.equal(want[n], before[n]) for n in failed)  # the update was real
