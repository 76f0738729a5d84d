"""moestack.bench, the harness of the benchmark scripts: its timing order, figures, table,
JSON and options, checked against hand-worked values."""

from __future__ import annotations

import ast
import json
import re

import pytest
import torch
from helpers.paths import SCRIPTS

from moestack import bench


def test_interleave_turns_the_order_each_round_and_skips_the_warmup_rounds():
    calls: list[str] = []
    contenders = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    out = bench.interleave(contenders, rounds=3, warmup=1)
    # round 0 (warm-up) abc, then bca, cab, abc: every contender first once in the timed rounds
    assert "".join(calls) == "abc" + "bca" + "cab" + "abc"
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in out.values() for t in v)
    calls.clear()
    bench.interleave(contenders, rounds=2, rotate=False)
    assert "".join(calls) == "abcabc"


def test_times_runs_the_warmup_untimed_and_seconds_measure_the_call():
    calls = []
    got = bench.times(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and len(got) == 3
    assert bench.seconds(lambda: __import__("time").sleep(0.02)) >= 0.02


def test_spread_and_median_range_by_hand():
    assert bench.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
    assert bench.median_range(2.5, 1.0, 10.0) == "2.50 (1.00-10.00)"
    assert bench.median_range(1234.4, 1000.0, 1500.6, ".0f", " ms") == "1234 ms (1000-1501)"


def test_table_is_fixed_width_and_checks_its_columns():
    text = bench.table(("name", "ms"), [("a", "1.5"), ("long-name", "10.25")], "<9 >6", "  ")
    assert text.splitlines() == ["  name          ms", "  a            1.5", "  long-name  10.25"]
    with pytest.raises(ValueError, match="align '<9' has 1 columns, the header 2"):
        bench.table(("name", "ms"), [], "<9")


def test_write_json_round_trips_with_the_environment_record(tmp_path):
    path = tmp_path / "out.json"
    bench.write_json(path, {"rows": [1, 2.5, None]})
    got = json.loads(path.read_text())
    assert got["rows"] == [1, 2.5, None] and got["environment"] == bench.environment()
    assert path.read_text().endswith("}\n") and not list(tmp_path.glob("*.tmp*"))
    bench.write_json(path, [1, 2])  # not a dict: written as it is
    assert json.loads(path.read_text()) == [1, 2]


def test_parser_adds_the_named_common_options_with_the_scripts_defaults():
    ap = bench.parser("First line.\n\nMore.", json="", warmup=2, repeats=5)
    assert ap.description == "First line."
    args = ap.parse_args(["--repeats", "7", "--json", "x.json"])
    assert (args.json, args.warmup, args.repeats) == ("x.json", 2, 7)
    assert not hasattr(args, "device")


def test_environment_names_the_machine_torch_and_commit():
    env = bench.environment(torch.device("cpu"))
    assert env["torch"] == torch.__version__ and env["cpus"] > 0 and env["machine"]
    assert set(env) >= {"git_commit", "git_dirty", "date", "host", "cuda", "python"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", env["date"])


def test_moe_steps_share_the_weights_and_match_the_torch_path():
    """The layer through another impl holds the very same parameters, and its forward+
    backward gives the same output gradient as the original's (same impl here: torch)."""
    from moestack import MoE, MoEConfig, RouterConfig

    torch.manual_seed(0)
    ours = MoE(16, MoEConfig(num_experts=4, top_k=2, d_ff=8, impl="torch"), RouterConfig())
    twin = bench.sharing_weights(ours, "torch")
    assert twin.w1 is ours.w1 and twin.w2 is ours.w2 and twin.router is ours.router
    x = torch.randn(1, 8, 16, requires_grad=True)
    grad = torch.randn(1, 8, 16)
    bench.fwd_bwd(ours, x, grad)()
    want = x.grad.clone()
    bench.fwd_bwd(twin, x, grad)()
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def test_no_script_edits_sys_path_or_imports_another_script():
    """Scripts share code through moestack (this harness among it), never through each
    other: no ``sys.path`` edit, no import of a sibling script's module."""
    names = {p.stem for p in SCRIPTS.glob("*.py")}
    found = []
    for path in sorted(SCRIPTS.glob("*.py")):
        if path.name == "lint_imports.py":  # it loads moestack's modules by path to lint them
            continue
        text = path.read_text()
        if "sys.path" in text:
            found.append(f"{path.name}: sys.path")
        for name in names - {path.stem}:
            if re.search(rf"^\s*(import {name}\b|from {name} import)", text, re.M):
                found.append(f"{path.name}: imports {name}")
    assert found == []


BENCH_SCRIPTS = [*sorted(SCRIPTS.glob("bench_*.py")), SCRIPTS / "profile_moe.py",
                 SCRIPTS / "tune_kernels.py"]  # fmt: skip


def test_no_long_function_or_file_in_the_bench_scripts():
    """Every function of the benchmark scripts is at most 60 lines and every file under 600
    (the house rules), counted by the AST."""
    bad = []
    for path in BENCH_SCRIPTS:
        text = path.read_text()
        if len(text.splitlines()) >= 600:
            bad.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = node.end_lineno - node.lineno + 1
                if span > 60:
                    bad.append(f"{path.name}:{node.name} {span} lines")
    assert bad == []
