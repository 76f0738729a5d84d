"""scripts/bench_ep.py and scripts/ep_check.py: the projection arithmetic against a hand-worked
example, the summary of per-rank records, and both scripts end to end at toy size on gloo
(they reach into the trainer and moestack.parallel, so a rename fails here, not on a GPU)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers.multiprocess import run_launch
from helpers.paths import SCRIPTS


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("bench_ep")


def test_exchange_bytes_hand_worked(bench):
    # 4 tokens x top-2 = 8 (token, slot) rows, half of them leave the rank: 4 rows of 3
    # two-byte elements, 24 bytes per exchange and pass; 2 exchanges x 2 passes = 96 bytes.
    b = bench.exchange_bytes(4, 2, 3, 2, remote=0.5, imbalance=1.5, layers=10)
    assert b["remote_rows_per_layer"] == 4
    assert b["per_layer"] == 96 and b["per_step"] == 960
    assert b["busiest_per_layer"] == 144 and b["busiest_per_step"] == 1440
    # The Qwen3-30B-like layer at ep=8 with uniform routing: 4 x 8192 x 8 x 7/8 x 2048 x 2
    # = 939,524,096 bytes = 896 MiB per layer; 48 layers = 42 GiB per rank and step.
    q = bench.exchange_bytes(8192, 8, 2048, 2, remote=7 / 8, layers=48)
    assert q["per_layer"] == 939_524_096 == 896 * 2**20
    assert q["per_step"] == 45_097_156_608 == 42 * 2**30


def test_ring_allreduce_and_scaled_remote(bench):
    assert bench.ring_allreduce_bytes(1000, 4) == 6000  # 2 x 3/4 x 4000 bytes
    assert bench.ring_allreduce_bytes(1000, 1) == 0
    assert bench.scaled_remote(0.75, 4, 8) == pytest.approx(0.875)  # uniform stays uniform
    assert bench.scaled_remote(0.6, 4, 8) == pytest.approx(0.7)
    assert bench.scaled_remote(0.9, 2, 8) == 1.0  # capped


def record(step_s: float, rows: int = 0, nbytes: int = 0, imbalance: float = 1.0) -> dict:
    return {"step_s": step_s, "a2a_s": step_s / 4, "rows_sent": rows, "bytes": nbytes,
            "imbalance": imbalance}  # fmt: skip


def test_summarize_pairs_rounds_and_counts_rows(bench):
    # 2 ranks, 2 rounds; 8 tokens per rank, top-2, 1 layer: 16 rows per rank and step.
    measured = {
        "records": [
            {"1": [record(1.0), record(2.0)], "2": [record(1.5, 8, 512, 1.2), record(2.0, 8, 512, 1.2)]},
            {"1": [record(0.9), record(2.1)], "2": [record(1.4, 4, 256, 1.2), record(1.9, 4, 256, 1.2)]},
        ],
        "grad_sync_bytes": {"1": 100.0, "2": 40.0},
        "tokens_per_rank": 8,
        "shape": {"n_layers": 1, "d_model": 4, "num_experts": 4, "top_k": 2},
    }  # fmt: skip
    base, ep2 = bench.summarize(measured)
    assert base["vs_ep1"]["median"] == 1.0 and base["remote_fraction"] == 0
    assert ep2["step_s"] == {"median": 1.75, "min": 1.5, "max": 2.0}  # slowest rank per round
    # Per round, ep=2's slowest rank over ep=1's: 1.5 / 1.0 and 2.0 / 2.1.
    assert ep2["vs_ep1"]["min"] == 2.0 / 2.1 and ep2["vs_ep1"]["max"] == 1.5
    assert ep2["rows_sent_per_rank"] == 6 and ep2["remote_fraction"] == 6 / 16
    assert ep2["a2a_bytes_per_rank"] == 384 and ep2["grad_sync_bytes_per_rank"] == 40
    assert ep2["load_imbalance"] == pytest.approx(1.2) and ep2["dp"] == 1
    assert ep2["tokens_per_s"] == 2 * 8 / 1.75


def test_projection_and_merge(bench, tmp_path):
    rows = [{"ep": 1, "remote_fraction": 0.0, "load_imbalance": 1.0},
            {"ep": 4, "remote_fraction": 0.6, "load_imbalance": 1.5}]  # fmt: skip
    uniform, tiny = bench.projection({"tiny": {"rows": rows}})
    assert uniform["per_step"] == 42 * 2**30 and uniform["imbalance"] == 1.0
    assert tiny["remote"] == pytest.approx(0.7) and tiny["measured_remote"] == 0.6
    assert tiny["busiest_per_step"] == pytest.approx(42 * 2**30 * 0.7 / 0.875 * 1.5)
    paths = []
    for i, step in enumerate([1.0, 3.0, 2.0]):
        row = {"ep": 4, "dp": 1, "step_s": {"median": step, "min": 0, "max": 9}, "a2a_share": i}
        run = {"wall_s": 60 + i, "models": {"tiny": {"rows": [row]}}, "projection": [uniform]}
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    merged = bench.merge([str(p) for p in paths])
    assert merged["tiny"][0]["step_s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert merged["tiny"][0]["a2a_share"] == {"median": 1, "min": 0, "max": 2}
    assert merged["projection"][0]["per_step"]["median"] == 42 * 2**30


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    proc = run_launch(args, " ".join(Path(a).name for a in args[:3]), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_ep_end_to_end_at_toy_size(tmp_path):
    toy = ["model.d_model=32", "model.n_heads=2", "model.moe.d_ff=32", "data.seq_len=32",
           "model.max_seq_len=32", "data.max_bytes=200000"]  # fmt: skip
    out = tmp_path / "ep.json"
    proc = run([sys.executable, str(SCRIPTS / "bench_ep.py"), "--models", "tiny", "--ranks", "2",
                "--eps", "1,2", "--warmup", "0", "--rounds", "1", "--batch", "4",
                "--json", str(out), "--override", *toy])  # fmt: skip
    result = json.loads(out.read_text())
    base, ep2 = result["models"]["tiny"]["rows"]
    assert ep2["rows_sent_per_rank"] > 0 and ep2["a2a_bytes_per_rank"] > 0
    assert ep2["grad_sync_bytes_per_rank"] < base["grad_sync_bytes_per_rank"]
    assert "ratio 1.0000" in proc.stdout  # the formula reproduces moestack's own byte count
    assert "4 x T x k x f x D x b" in proc.stdout


def test_ep_check_on_gloo_and_its_skip(tmp_path):
    ep_check = load("ep_check")
    rows = [{"ep": 2, "impl": "torch", "rank": 0, "cases": {"random": {
        "y": {"max_abs_err": 1e-3, "ref_max_abs": 1.0}}}}]  # fmt: skip
    assert not ep_check.verdict(rows)["ok"]  # 1e-3 > 1e-5 + 1e-4 x 1
    rows[0]["cases"]["random"]["y"]["max_abs_err"] = 1e-6
    assert ep_check.verdict(rows)["ok"]

    out = tmp_path / "gloo.json"
    proc = run([sys.executable, str(SCRIPTS / "ep_check.py"), "--json", str(out),
                "--backend", "gloo", "--world", "2"])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["ok"] and report["world"] == 2 and len(report["per_rank"]) == 2
    assert "ep_check: ok, gloo, 2 ranks" in proc.stdout
    # Without GPUs the NCCL check skips, saying why.
    proc = run([sys.executable, str(SCRIPTS / "ep_check.py"), "--json", str(out)],
               CUDA_VISIBLE_DEVICES="")  # fmt: skip
    assert json.loads(out.read_text()) == {"skipped": True, "reason": "needs >= 2 GPUs, found 0"}
    assert "ep_check: skipped, needs >= 2 GPUs, found 0" in proc.stdout


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_gpu_check_ep_check_phase_reports_the_skip(tmp_path):
    proc = run(
        ["bash", str(SCRIPTS / "gpu_check.sh")],
        OUT=str(tmp_path), PYTHON=sys.executable, GPU_CHECK_PHASES="ep_check",
        CUDA_VISIBLE_DEVICES="",
    )  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text()
    assert "ep_check: ok in " in summary, proc.stdout
    assert "ep_check: skipped, needs >= 2 GPUs, found 0" in summary
    assert json.loads((tmp_path / "ep_check.json").read_text())["skipped"]
