"""build_optimizer and clip_grad_norm, the two entry points the training loop calls."""

from __future__ import annotations

import pytest
import torch
from _optim_testlib import TinyMoE, micro_step

from moestack.config import OptimConfig
from moestack.optim import OffloadAdamW, build_optimizer, clip_grad_norm, device_param_dtype


def _decay_by_name(opt: torch.optim.Optimizer) -> dict[str, float]:
    return {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}


@pytest.mark.parametrize("name", ["adamw", "offload_adamw"])
def test_build_optimizer_groups(name: str) -> None:
    model = TinyMoE()
    cfg = OptimConfig(name=name, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, OffloadAdamW if name == "offload_adamw" else torch.optim.AdamW)
    decay = _decay_by_name(opt)
    assert set(decay) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert decay[n] == (0.1 if p.ndim >= 2 else 0.0), n
    assert all(g["lr"] == 1e-3 and tuple(g["betas"]) == (0.9, 0.95) for g in opt.param_groups)


def test_build_offload_passes_options() -> None:
    cfg = OptimConfig(name="offload_adamw", moment_dtype="bfloat16", skip_idle_experts=True)
    opt = build_optimizer(TinyMoE(), cfg)
    assert isinstance(opt, OffloadAdamW)
    assert opt.skip_idle_experts and opt.moment_dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["adamw", "offload_adamw"])
def test_clip_grad_norm_matches_torch(name: str) -> None:
    ref_model, model = TinyMoE(), TinyMoE()
    micro_step(ref_model, 0)
    micro_step(model, 0)
    expected = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01))
    opt = build_optimizer(model, OptimConfig(name=name))
    got = clip_grad_norm(model, opt, 0.01)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("name", "param_dtype", "device", "expected"),
    [
        ("offload_adamw", "auto", "cuda", torch.bfloat16),  # master weights on the host
        ("offload_adamw", "auto", "cpu", torch.float32),
        ("adamw", "auto", "cuda", torch.float32),  # the parameters are AdamW's master copy
        ("offload_adamw", "float32", "cuda", torch.float32),
        ("adamw", "bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_device_param_dtype(name: str, param_dtype: str, device: str, expected) -> None:
    cfg = OptimConfig(name=name, param_dtype=param_dtype)
    assert device_param_dtype(cfg, torch.device(device)) == expected


def test_bad_param_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match="optim.param_dtype='fp8'"):
        OptimConfig(param_dtype="fp8")


def test_the_schedule_warms_up_linearly_then_decays_by_a_cosine_to_its_floor() -> None:
    """lr = 1e-2, 4 warm-up steps of 12, floor 0.1: 1/4 .. 4/4 of lr, then the cosine from 1
    at step 4 to 0.1 at step 12 (0.55 halfway, step 8), 0.1 after the end."""
    cfg = OptimConfig(lr=1e-2, warmup_steps=4, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    schedule = cfg.build_scheduler(opt, total_steps=12)
    lrs = []
    for _ in range(14):
        lrs.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    want = [0.25, 0.5, 0.75, 1.0, 1.0, None, None, None, 0.55, None, None, None, 0.1, 0.1]
    for step, factor in enumerate(want):
        if factor is not None:
            assert lrs[step] == pytest.approx(1e-2 * factor, rel=1e-12), step
    assert all(a > b for a, b in zip(lrs[4:12], lrs[5:13], strict=True))  # decreasing
