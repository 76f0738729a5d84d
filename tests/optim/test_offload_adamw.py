"""OffloadAdamW against torch.optim.AdamW, one process."""

from __future__ import annotations

import io

import pytest
import torch
from _optim_testlib import (
    IDLE,
    LR,
    MAX_NORM,
    STEPS,
    TinyMoE,
    assert_rel_close,
    groups,
    lr_lambda,
    micro_step,
    ours_state,
    reference_run,
)

from moestack.optim import OffloadAdamW


@pytest.fixture(scope="module")
def reference() -> list:
    return reference_run()


def _build(model: torch.nn.Module, **kw: object) -> OffloadAdamW:
    return OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8, **kw)


@pytest.mark.parametrize(
    ("in_place", "fused_step"),
    [(None, "auto"), (False, "auto"), (False, "off")],
    ids=["in_place", "master_copy_fused", "master_copy_reference"],
)
def test_matches_torch_adamw_every_step(
    reference: list, in_place: bool | None, fused_step: str
) -> None:
    """Scheduler, clipping, accumulation, a zero-grad expert, 2 groups, save/resume at 10."""
    model = TinyMoE()
    opt = _build(model, in_place=in_place, fused_step=fused_step)
    assert opt.in_place == (in_place is None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    names = dict(model.named_parameters())
    for step in range(STEPS):
        if step == STEPS // 2:  # checkpoint through bytes, weights_only load, fresh optimizer
            buf = io.BytesIO()
            torch.save({"optim": opt.state_dict(), "sched": sched.state_dict()}, buf)
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            opt = _build(model, in_place=in_place, fused_step=fused_step)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            sched.load_state_dict(ckpt["sched"])
            opt.load_state_dict(ckpt["optim"])
        micro_step(model, step)
        assert names["moe.w1"].grad[IDLE].abs().max() == 0  # the idle expert's slice
        norm = opt.clip_grad_norm_(MAX_NORM)
        assert float(norm) == pytest.approx(reference[step]["norm"], rel=1e-6)
        assert float(norm) > MAX_NORM  # clipping is active
        opt.step()
        sched.step()
        opt.zero_grad()
        ref = reference[step]
        sd = opt.state_dict()
        for n, p in names.items():
            assert_rel_close(p.detach(), ref["params"][n], f"step {step} param {n}", 1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                got = ours_state(sd, n, key).reshape(p.shape)
                assert_rel_close(got, ref["state"][n][key], f"step {step} {key} {n}", 1e-6)
        assert sd["state"]["moe.w1/expert0"]["step"] == step + 1


@pytest.mark.parametrize("in_place", [None, False], ids=["in_place", "master_copy_fused"])
def test_skip_idle_experts_leaves_idle_expert_untouched(
    reference: list, in_place: bool | None
) -> None:
    """With skipping, the idle expert keeps its weights and zero moments; the rest is AdamW."""
    model = TinyMoE()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _build(model, skip_idle_experts=True, in_place=in_place)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for step in range(5):
        micro_step(model, step)
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
    sd = opt.state_dict()
    for n, p in model.named_parameters():
        if n.startswith("moe."):
            assert torch.equal(p.detach()[IDLE], init[n][IDLE])
            assert sd["state"][f"{n}/expert{IDLE}"]["exp_avg"].abs().max() == 0
            busy = [e for e in range(p.shape[0]) if e != IDLE]
            assert_rel_close(p.detach()[busy], reference[4]["params"][n][busy], n, 1e-6)
        else:
            assert_rel_close(p.detach(), reference[4]["params"][n], n, 1e-6)


def test_bf16_moments_track_fp32() -> None:
    """bf16 host moments: half the moment bytes, parameters close to torch's AdamW."""
    ref_model, model = TinyMoE(), TinyMoE()
    ref = torch.optim.AdamW(groups(ref_model), lr=LR, betas=(0.9, 0.95))
    opt = _build(model, moment_dtype=torch.bfloat16)
    assert opt.host_buffers()["exp_avg"].dtype == torch.bfloat16
    for step in range(10):
        for m in (ref_model, model):
            micro_step(m, step)
        ref.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert_rel_close(a.detach(), b.detach(), n, 2e-2)


def test_bf16_params_use_fp32_master() -> None:
    """bf16 parameters: the fp32 master copy follows torch AdamW run on an fp32 copy."""
    ref_model = TinyMoE()
    model = TinyMoE().to(torch.bfloat16)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.1)
    opt = OffloadAdamW(model.named_parameters(), lr=LR, weight_decay=0.1)
    assert not opt.in_place
    with torch.no_grad():
        for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
            b.copy_(a.float())  # same starting point
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
            grad = torch.randn(a.shape, generator=g).to(torch.bfloat16)
            a.grad, b.grad = grad, grad.float()
        opt.step()
        ref.step()
    sd = opt.state_dict()
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        master = ours_state(sd, n, "master").reshape(a.shape)
        assert_rel_close(master, b.detach(), n, 1e-6)
        assert torch.equal(a.detach(), b.detach().to(torch.bfloat16))


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"offload": "nvme"}, "offload"),
        ({"offload": "cuda"}, "offload"),
        ({"moment_dtype": torch.float16}, "moment_dtype"),
    ],
)
def test_bad_arguments_raise_naming_them(kw: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        OffloadAdamW(TinyMoE().named_parameters(), **kw)


def test_bad_group_value_and_late_group() -> None:
    model = TinyMoE()
    with pytest.raises(ValueError, match="lr"):
        OffloadAdamW([{"params": list(model.parameters()), "lr": -2.0}])
    opt = OffloadAdamW(model.named_parameters())
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})


def test_load_rejects_torch_state() -> None:
    model = TinyMoE()
    torch_sd = torch.optim.AdamW(model.parameters()).state_dict()
    with pytest.raises(ValueError, match="format"):
        OffloadAdamW(model.named_parameters()).load_state_dict(torch_sd)


def test_idle_check_is_exact_beyond_its_probe() -> None:
    """The zero test probes 64 strided elements first; values between probes still count."""
    from moestack.optim.update import _all_zero

    g = torch.zeros(1000)
    assert _all_zero(g) and _all_zero(g[:0])
    for value in (1e-30, -2.0, float("nan")):
        h = g.clone()
        h[7] = value  # 1000 // 64 = 15: element 7 is between two probes
        assert not _all_zero(h), value
    assert not _all_zero(torch.randn(1000, generator=torch.Generator().manual_seed(0)))


def test_gradient_hooks_hold_the_optimizer_weakly() -> None:
    """The CUDA hooks outlive a dropped optimizer (torch keeps them in C++): they must not
    keep it, and its device scratch, alive."""
    import gc
    import weakref

    from moestack.optim.transfer import weak_grad_hook as _weak_grad_hook

    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = OffloadAdamW([("w", p)])
    seen = []
    opt._grad_hook = seen.append  # what the hook forwards to while the optimizer lives
    hook = _weak_grad_hook(opt)
    hook(p)
    assert seen == [p]
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None
    hook(p)  # a no-op once the optimizer is gone
    assert seen == [p]


@pytest.mark.parametrize("numel", [0, 1, 7, 4096, 4097, 12345])
def test_sum_of_squares_in_chunks_matches_float64(monkeypatch, numel):
    """The host gradient norm sums chunk by chunk (no full-size square): against the sum
    in float64, with chunks smaller than the tensor, a partial last chunk, and empty."""
    from moestack.optim import update

    monkeypatch.setattr(update, "NORM_CHUNK", 1000)
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    got = update.sum_of_squares(t)
    assert got.dtype == torch.float32 and got.dim() == 0
    want = t.double().square().sum().item()
    assert abs(got.item() - want) <= 1e-6 * max(want, 1e-30)
