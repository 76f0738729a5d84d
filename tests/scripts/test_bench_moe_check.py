"""bench_moe's output check (every contender against moestack's torch path, once per shape,
before timing), on the CPU: the Triton contender runs in the interpreter here."""

import argparse
import importlib.util
import json
import os

import pytest
import torch
from helpers.scripts import script_module

from moestack import MoE, MoEConfig, RouterConfig
from moestack import bench as moestack_bench


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_moe") as module:
        yield module


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
            ours if impl == "torch" else moestack_bench.sharing_weights(ours, impl)
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
    from moestack.kernels import tuned_table, tuning

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    table = tmp_path / "tuned.json"
    table.write_text('{"format": 1, "gpus": {"Fake GPU": {"mm|old-key": {"block_m": 16}}}}')
    tuning.clear_cache()
    cfg = tuning.KernelConfig(64, 64, 32)
    try:
        tuning.cache_config("Fake GPU", "mm|shape1", cfg)
        ok = bench.Result("shape1", "moestack-triton", 1.0, 1.0, 1.0)
        bench.save_checked(table, [ok], set())
        before = bench._tuned_keys()
        tuning.cache_config("Fake GPU", "wgrad|shape2", cfg)
        bad = bench.Result("shape2", "moestack-triton", 1.0, 1.0, 1.0, check_ok=False)
        bench.save_checked(table, [bad], before)
    finally:
        tuning.clear_cache()
    saved = json.loads(table.read_text())
    assert saved["format"] == tuned_table.TABLE_FORMAT
    assert list(saved["gpus"]["Fake GPU"]) == ["mm|shape1"]


def rows(bench, shape: str, triton_ms: float, torch_ms: float, triton_mib=90.0):
    """A shape's two rows as bench_shape gives them (qwen3_30b's FLOPs: only its rate is
    judged); torch's peak is 100 MiB."""
    tflops = bench.useful_flops(16384, 8, 2048, 768) / triton_ms / 1e9
    return [
        bench.Result(shape, "moestack-torch", torch_ms, 0.0, 100.0),
        bench.Result(shape, "moestack-triton", triton_ms, tflops, triton_mib),
    ]


def test_issue30_targets_as_the_issue_words_them(bench, capsys):
    """1.0x on the Mixtral shapes, 1.3x on the fine-grained ones (a 1.25x meets issue 3's
    1.2x, not issue 30's), 420 TFLOP/s on qwen3_30b-16k, peak memory at or below torch's."""
    # qwen3_30b-16k: 2 x 16384 x 8 x 3 x 2048 x 768 x 3 = 3.71e12 FLOPs in 10.4 ms: 357 TFLOP/s
    results = rows(bench, "qwen3_30b-16k", 10.4, 13.0) + rows(bench, "mixtral-8k", 5.0, 5.0, 101)
    results += rows(bench, "olmoe-8k", 1.0, 1.31)
    got = {t["what"]: t for t in bench.issue30_targets(results)}
    assert {w: t["met"] for w, t in got.items()} == {
        "mixtral-8k forward+backward >= 1.0x torch._grouped_mm": True,
        "mixtral-8k peak memory at or below torch's (triton / torch <= 1)": False,
        "olmoe-8k forward+backward >= 1.3x torch._grouped_mm": True,
        "olmoe-8k peak memory at or below torch's (triton / torch <= 1)": True,
        "qwen3_30b-16k forward+backward >= 1.3x torch._grouped_mm": False,
        "qwen3_30b-16k forward+backward >= 420 TFLOP/s": False,
        "qwen3_30b-16k peak memory at or below torch's (triton / torch <= 1)": True,
    }
    assert got["qwen3_30b-16k forward+backward >= 1.3x torch._grouped_mm"]["value"] == 1.25
    rate = got["qwen3_30b-16k forward+backward >= 420 TFLOP/s"]["value"]
    assert rate == pytest.approx(2 * 16384 * 8 * 3 * 2048 * 768 * 3 / 10.4e-3 / 1e12)
    issue3 = {t["what"]: t["met"] for t in bench.issue3_targets(results)}
    assert issue3["qwen3_30b-16k fwd+bwd speed-up over torch (>= 1.2)"]  # issue 3: met
    fast = rows(bench, "qwen3_30b-16k", 8.5, 11.5)  # 437 TFLOP/s, 1.35x
    assert all(t["met"] for t in bench.issue30_targets(fast))
    bench.print_targets(results)
    out = capsys.readouterr().out
    assert "\nissue-30 targets (" in out and "\nissue-3 targets (" in out
    assert "  MISSED qwen3_30b-16k forward+backward >= 1.3x torch._grouped_mm: 1.250" in out


def test_retune_flag_names_kernel_kinds(bench, capsys):
    pytest.importorskip("triton")
    from moestack.kernels import tuning

    parser = bench.build_parser()
    args = parser.parse_args(["--retune", "mm,wgrad,mm_dswiglu"])
    assert args.retune == ["mm", "wgrad", "mm_dswiglu"]
    assert parser.parse_args(["--retune", "all"]).retune == sorted(tuning.CANDIDATES)
    assert parser.parse_args([]).retune == []
    with pytest.raises(SystemExit):
        parser.parse_args(["--retune", "mm,dgrad"])
    assert "kinds ['dgrad'] are unknown" in capsys.readouterr().err
    every = tuning.ENTRY_SOURCES
    with bench.tuning_scope(args):
        assert tuning.retuning() == {"mm": every, "mm_dswiglu": every, "wgrad": every}
    assert not tuning.retuning()
    with bench.tuning_scope(parser.parse_args([])):
        assert not tuning.retuning()


def test_retune_seeds_flag_narrows_retune_to_seed_entries(bench, tmp_path):
    """--retune-seeds retunes the seeds of the --retune kinds, or of every kind without
    --retune; the JSON records the sources left unread."""
    pytest.importorskip("triton")
    from moestack.kernels import tuning

    parser = bench.build_parser()
    assert not parser.parse_args([]).retune_seeds
    args = parser.parse_args(["--retune", "mm,wgrad", "--retune-seeds"])
    assert args.retune_seeds and bench.retune_plan(args) == (["mm", "wgrad"], ["seed"])
    with bench.tuning_scope(args):
        assert tuning.retuning() == {"mm": ("seed",), "wgrad": ("seed",)}
    alone = parser.parse_args(["--retune-seeds"])
    assert bench.retune_plan(alone) == (sorted(tuning.CANDIDATES), ["seed"])
    with bench.tuning_scope(alone):
        assert tuning.retuning() == dict.fromkeys(sorted(tuning.CANDIDATES), ("seed",))
    assert not tuning.retuning()
    assert bench.retune_plan(parser.parse_args(["--retune", "mm"])) == (
        ["mm"],
        list(tuning.ENTRY_SOURCES),
    )
    assert bench.retune_plan(parser.parse_args([])) == ([], [])
    out = tmp_path / "bench.json"
    bench.write_json(
        str(out), "cpu", torch.float32, 1.0, [], torch.device("cpu"), *bench.retune_plan(args)
    )
    payload = json.loads(out.read_text())
    assert payload["retuned_kinds"] == ["mm", "wgrad"] and payload["retuned_sources"] == ["seed"]


def test_tuning_report_counts_what_was_measured(bench, monkeypatch):
    pytest.importorskip("triton")
    from moestack.kernels import tuning

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    tuning.clear_cache()
    cached = {
        "mm|a": (tuning.PERSISTENT_CANDIDATES[0], "measured"),
        "wgrad|b": (tuning.TORCH_WGRAD, "measured"),
        "mm_dswiglu|c": (tuning.CANDIDATES["mm_dswiglu"][1], "measured"),
        "mm|d": (tuning.CANDIDATES["mm"][0], "table"),
        "wgrad|e": (tuning.CANDIDATES["wgrad"][0], "table"),
        "mm_swiglu|f": (tuning.CANDIDATES["mm_swiglu"][0], "default"),
    }
    timed = {"gpu": "Fake GPU", "date": "2026-11-30", "torch": "2.11.0", "triton": "3.6.0"}
    # mm|d's table entry was measured at its key; wgrad|e's is a seed
    entries = {
        "mm|d": tuning.TableEntry(cached["mm|d"][0], "measured", timed, "mm|d"),
        "wgrad|e": tuning.TableEntry(cached["wgrad|e"][0], "seed", None, "wgrad|e"),
    }
    try:
        for key, (cfg, source) in cached.items():
            tuning.cache_config("Fake GPU", key, cfg, source, entries.get(key))
        line = bench.tuning_report()
    finally:
        tuning.clear_cache()
    assert line == (
        "tuned configs this run: 3 measured (1 persistent, 1 torch dW, 1 fused), 2 read from "
        "the table (1 of them seeds, never timed at their key), 1 untimed defaults"
    )
