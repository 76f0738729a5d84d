"""bench_moe's output check (every contender against moestack's torch path, once per shape,
before timing), on the CPU: the Triton contender runs in the interpreter here."""

import argparse
import importlib.util
import json
import os
import sys

import pytest
import torch
from helpers.paths import SCRIPTS

from moestack import MoE, MoEConfig, RouterConfig


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("bench_moe", SCRIPTS / "bench_moe.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_moe"] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_moe", None)
        sys.path.remove(str(SCRIPTS))


class Scaled(torch.nn.Module):
    """A wrong contender: the layer's output, 5% too large."""

    def __init__(self, layer: MoE) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * 1.05


class Broken(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this shape")


def layers(bench, impls):
    torch.manual_seed(0)
    ours = MoE(32, MoEConfig(num_experts=4, top_k=2, d_ff=16, impl="torch"), RouterConfig())
    return ours, {
        "moestack-torch" if impl == "torch" else f"moestack-{impl}": (
            ours if impl == "torch" else bench._sharing_weights(ours, impl)
        )
        for impl in impls
    }


def test_equal_paths_pass_and_wrong_ones_fail(bench, capsys):
    impls = ["torch"]
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        impls.append("triton")
    ours, contenders = layers(bench, impls)
    contenders["scaled"] = Scaled(ours)
    contenders["broken"] = Broken()
    x = torch.randn(1, 24, 32, requires_grad=True)
    checks = bench.check_outputs("tiny", contenders, ours, x, torch.randn(1, 24, 32))
    assert checks["moestack-torch"] == (0.0, True)
    if "triton" in impls:
        err, ok = checks["moestack-triton"]
        assert ok and 0 <= err <= 1e-5
    err, ok = checks["scaled"]
    assert not ok and err == pytest.approx(0.05, rel=1e-3)
    assert "broken" not in checks
    out = capsys.readouterr().out
    assert "tiny broken: failed: RuntimeError: no kernel for this shape" in out
    assert "tiny scaled vs moestack-torch: y " in out and "dw1 " in out and "FAILED" in out


def test_a_shape_is_checked_before_timing_and_reported(bench):
    args = argparse.Namespace(warmup=1, repeats=1)
    rows = bench.bench_shape("tiny", 4, 2, 32, 16, 48, torch.device("cpu"), torch.float32, args)
    assert rows and rows[0].contender == "moestack-torch"
    for row in rows:  # transformers' blocks on the same weights, when installed
        assert row.check_ok and row.check_err <= 1e-4, row


def test_failures_name_wrong_rows_and_missing_triton(bench):
    row = bench.Result("s1", "moestack-triton", 1.0, 1.0, 1.0, check_err=0.3, check_ok=False)
    ok = bench.Result("s1", "moestack-torch", 1.0, 1.0, 1.0)
    cpu = bench.check_failures([row, ok], ["s1"], torch.device("cpu"))
    assert cpu == ["s1 moestack-triton"]
    gpu = bench.check_failures([ok], ["s1", "s2"], torch.device("cuda"))
    assert gpu == ["s1 moestack-triton (did not run)", "s2 moestack-triton (did not run)"]


def test_normwise_error(bench):
    b = torch.tensor([1.0, -4.0, 2.0])
    assert bench.normwise_error(b.clone(), b) == 0.0
    assert bench.normwise_error(b + torch.tensor([0.0, 0.4, 0.0]), b) == pytest.approx(0.1)
    assert bench.normwise_error(torch.tensor([1.0, float("nan"), 2.0]), b) == float("inf")


def test_tuned_configs_of_a_failed_shape_are_not_saved(bench, tmp_path, monkeypatch):
    """--save-tuned on a (faked) GPU: configs first tuned at a shape whose triton output
    failed the check stay out of the table; those of a passing shape go in; a table of
    the old key format is replaced rather than mixed."""
    pytest.importorskip("triton")
    from moestack.kernels import tuning

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    table = tmp_path / "tuned.json"
    table.write_text('{"format": 1, "gpus": {"Fake GPU": {"mm|old-key": {"block_m": 16}}}}')
    tuning.clear_cache()
    cfg = tuning.KernelConfig(64, 64, 32)
    try:
        tuning._AUTOTUNE_CACHE[("Fake GPU", "mm|shape1")] = cfg
        ok = bench.Result("shape1", "moestack-triton", 1.0, 1.0, 1.0)
        bench.save_checked(table, [ok], set())
        before = bench._tuned_keys()
        tuning._AUTOTUNE_CACHE[("Fake GPU", "wgrad|shape2")] = cfg
        bad = bench.Result("shape2", "moestack-triton", 1.0, 1.0, 1.0, check_ok=False)
        bench.save_checked(table, [bad], before)
    finally:
        tuning.clear_cache()
    saved = json.loads(table.read_text())
    assert saved["format"] == tuning.TABLE_FORMAT
    assert list(saved["gpus"]["Fake GPU"]) == ["mm|shape1"]
