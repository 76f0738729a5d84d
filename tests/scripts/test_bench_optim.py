"""bench_optim's training-step and delayed-loss sections on the CPU's tiny model: each
contender says how its step ran (pipelined or not, which host kernel); one that fails is
recorded with its reason while the others still run; the delayed-loss comparison fits a
time budget and reports a failing mode instead of dying."""

import pytest
import torch
from helpers.native_kernel import native_kernel

from moestack.optim import buckets, fused

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def parts():
    from moestack.optim import train_bench  # bench_optim's train_step and delay_loss sections

    return train_bench


def test_a_contender_that_fails_is_recorded_and_the_others_still_run(parts, monkeypatch, capsys):
    """As on a GPU image without a C++ compiler: "auto" wants the pipeline (stood in for
    here), no fused kernel loads. OffloadAdamW falls back to its serial step on the
    reference path and says so; the update-in-backward contender cannot be built (it
    needs the pipeline): its error is recorded, and every other contender is still timed."""
    names = ("adamw", "offload_adamw", "offload_adamw_in_backward_unclipped",
             "offload_adamw_delayed", "adamw_unclipped")  # fmt: skip
    monkeypatch.setattr(parts, "TRAIN_CONTENDERS", {n: parts.TRAIN_CONTENDERS[n] for n in names})
    monkeypatch.setattr(buckets, "on_devices", lambda specs: True)
    monkeypatch.setattr(fused, "_native", lambda: "RuntimeError: no C++ compiler")
    monkeypatch.setattr(fused, "_compiled", lambda combos: "RuntimeError: no C++ compiler")
    out = parts.train_step_time(CPU, 1, "torch")
    assert out["contenders"] == list(names)
    assert "no C++ compiler" in out["offload_adamw_in_backward_unclipped_error"]
    assert "offload_adamw_in_backward_unclipped_step_ms" not in out
    for name in ("adamw", "offload_adamw", "offload_adamw_delayed", "adamw_unclipped"):
        assert out[f"{name}_step_ms"] > 0 and f"{name}_error" not in out, name
    # the dry run's fp32 weights: the serial exact step steps them in place, the delayed
    # one keeps a master copy and runs the reference path (bf16 weights on a GPU: "off")
    for name, host in (("offload_adamw", "in_place"), ("offload_adamw_delayed", "off")):
        assert out[f"{name}_pipelined"] is False and out[f"{name}_host_step"] == host
        assert "no C++ compiler" in out[f"{name}_serial_reason"]
        assert out[f"{name}_vs_adamw_step_time"] > 0
    assert out["adamw_pipelined"] is None and out["adamw_host_step"] == "none"
    assert "native host kernel: unavailable" in out["host_kernel"]
    table = parts.train_table(out)
    row = next(line for line in table.splitlines() if "in_backward" in line)
    assert "no C++ compiler" in row and row.split()[1:3] == ["-", "-"]
    row = next(line for line in table.splitlines() if line.split()[:1] == ["offload_adamw"])
    assert row.split()[3:5] == ["False", "in_place"]


def test_the_contenders_run_pipelined_where_the_kernel_loads(parts, monkeypatch):
    """The same contenders with the kernel: pipelined, on the native kernel, nothing failed."""
    names = ("adamw", "offload_adamw", "offload_adamw_serial")
    monkeypatch.setattr(parts, "TRAIN_CONTENDERS", {n: parts.TRAIN_CONTENDERS[n] for n in names})
    monkeypatch.setattr(buckets, "on_devices", lambda specs: True)
    native_kernel()  # skips only without a C++ compiler; a broken build fails, naming why
    out = parts.train_step_time(CPU, 1, "torch")
    assert out["offload_adamw_pipelined"] is True and out["offload_adamw_host_step"] == "native"
    assert out["offload_adamw_serial_pipelined"] is False
    assert "offload_adamw_serial_reason" not in out  # chose the serial step: no fallback
    assert not [k for k in out if k.endswith("_error")]
    assert out["offload_adamw_loss_first_last"] == out["adamw_loss_first_last"]


def test_delay_loss_fits_its_budget(parts):
    """A budget spent at once: both modes stop after the 10 steps the comparison needs (the
    exact one first, the delayed one as many), and say so."""
    out = parts.delayed_loss(CPU, 200, "torch", budget_s=1e-9)
    assert out["steps_requested"] == 200 and out["cut_by_budget"]
    assert out["steps"] == out["offload_adamw_steps"] == out["offload_adamw_delayed_steps"] == 10
    assert abs(out["delayed_vs_exact_loss"]) < 0.5
    whole = parts.delayed_loss(CPU, 12, "torch")
    assert whole["steps"] == 12 and not whole["cut_by_budget"]


def test_delay_loss_reports_a_failing_mode(parts, monkeypatch):
    build = parts._build_contender

    def failing(name, *args):
        if name == "offload_adamw_delayed":
            raise RuntimeError("the worker thread could not start\nsecond line")
        return build(name, *args)

    monkeypatch.setattr(parts, "_build_contender", failing)
    out = parts.delayed_loss(CPU, 10, "torch")
    assert out["offload_adamw_delayed_error"] == "RuntimeError: the worker thread could not start"
    assert out["offload_adamw_last10_loss"] > 0 and "delayed_vs_exact_loss" not in out


def test_the_tiered_contender_trains_bf16_weights_beside_adamw(parts, monkeypatch):
    """optim=tiered's contender (issue 53's GPU target: its peak memory and step time
    against device AdamW's): bf16 weights without a master, its ratio to AdamW reported."""
    names = ("adamw", "tiered")
    monkeypatch.setattr(parts, "TRAIN_CONTENDERS", {n: parts.TRAIN_CONTENDERS[n] for n in names})
    out = parts.train_step_time(CPU, 1, "torch")
    assert out["tiered_param_dtype"] == "bfloat16" and out["adamw_param_dtype"] == "float32"
    assert out["tiered_host_step"] == "none" and "tiered_error" not in out
    assert out["tiered_vs_adamw_step_time"] > 0
    first, last = out["tiered_loss_first_last"]
    assert last < first  # it trains
