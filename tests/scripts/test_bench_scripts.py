"""The benchmark scripts run end to end at toy sizes (they reach into the optimizer's and the
kernels' internals, so a rename must fail here rather than on a lent GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_optim_sections_at_toy_size(tmp_path):
    """Every section runs at a toy size (one throughput round; the torch.compile'd variant,
    which tests/optim/test_fused.py compiles, left out) and reports the fields read here."""
    out = tmp_path / "optim.json"
    run_script(
        "bench_optim.py",
        *("--only", "memory,throughput,drift,gpu,train_step,delay_loss", "--params", "2e4"),
        *("--reps", "2", "--drift-steps", "4", "--threads", "1", "--json", str(out)),
        *("--delay-loss-steps", "12", "--rounds", "1", "--skip-variants", "master_bf16_compile"),
    )
    results = json.loads(out.read_text())
    assert {"memory", "throughput", "drift", "gpu", "train_step", "delay_loss"} <= set(results)
    throughput = results["throughput"]
    for part in ("pack", "update", "copy_back"):
        assert throughput[f"offload_master_copy_{part}_ms"] > 0
    step = results["train_step"]
    parts = ("clip", "wait_grads", "host_update", "return_weights", "rest")
    assert all(step[f"offload_adamw_part_{p}_ms"] >= 0 for p in parts)
    assert step["offload_adamw_part_host_update_ms"] > 0 and step["offload_adamw_part_rest_ms"] > 0
    # Same seed, same data, same AdamW arithmetic: the two optimizers train identically.
    assert step["adamw_loss_first_last"] == step["offload_adamw_loss_first_last"]
    assert (
        step["adamw_unclipped_loss_first_last"] == step["offload_adamw_unclipped_loss_first_last"]
    )
    # the delayed update: its host update runs in the worker, its step waits for it
    for p in ("host_update", "wait_update", "rest"):
        assert step[f"offload_adamw_delayed_part_{p}_ms"] > 0
    assert step["offload_adamw_delayed_loss_first_last"] != step["offload_adamw_loss_first_last"]
    assert step["offload_adamw_delayed_vs_adamw_step_time"] > 0
    assert step["offload_adamw_unclipped_vs_adamw_unclipped_step_time"] > 0
    delay = results["delay_loss"]
    assert delay["steps"] == 12 and abs(delay["delayed_vs_exact_loss"]) < 0.5


def test_bench_hf_offload_at_toy_size(tmp_path):
    """Loaded without its experts, the model holds less than loaded whole (counted bytes).
    The contenders fork from one server that imported their modules once."""
    pytest.importorskip("transformers")
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("bench_hf_offload.py reads Linux's /proc/self memory counters")
    out = tmp_path / "hf_offload.json"
    run_script(
        "bench_hf_offload.py",
        *("--layers", "2", "--experts", "4", "--d-model", "32", "--d-ff", "32"),
        *("--vocab", "320", "--tokens", "128", "--start-method", "forkserver"),
        *("--json", str(out)),
    )
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"import", "whole", "without_experts", "served"}
    per_expert = (32 * 2 * 32 + 32 * 32) * 4  # (w1 [D, 2F] + w2 [F, D]) x fp32
    whole, lean = rows["whole"]["model_bytes"], rows["without_experts"]["model_bytes"]
    assert whole - lean == 2 * 4 * per_expert and lean > 0  # 2 layers x 4 experts


def test_profile_moe_labels_every_launch_at_toy_size(tmp_path):
    """Each of the eight launches of the Triton experts is found and labelled by its role;
    the GEMMs' useful FLOPs are worked by hand for the tiny shape. No warm-up passes: the
    interpreter has nothing to compile, tune or warm."""
    pytest.importorskip("triton")
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "profile_moe.py"), "--tiny", "--steps", "1",
         "--no-warmup", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = json.loads(out.read_text())["profiles"][0]
    rows = {r["role"]: r for r in profile["rows"]}
    assert set(rows) == {
        "fwd x@W1 +SwiGLU", "fwd h@W2 +combine", "bwd G=dy@W2^T", "bwd SwiGLU' (elementwise)",
        "bwd gather dy,x rows", "bwd dW2=(wh)^T dy", "bwd dx=dz@W1^T", "bwd dW1=x^T dz",
        "other",
    }  # fmt: skip
    assert all(r["ms"] >= 0 for r in rows.values()) and profile["triton_ms"] > 0
    # tiny: 64 tokens x top-2 = 128 rows, d_model 32, d_ff 48; dW1 is [32, 96] per expert
    # summed over the 128 rows: 2 x 128 x 32 x 96 FLOPs.
    sys.path.insert(0, str(REPO / "scripts"))
    import profile_moe

    assert profile_moe.gemm_flops("bwd dW1=x^T dz", 128, 32, 48) == 2 * 128 * 32 * 96
    assert profile_moe.gemm_flops("bwd G=dy@W2^T", 128, 32, 48) == 2 * 128 * 32 * 48
    assert profile_moe.gemm_flops("bwd G=dy@W2^T [persistent]", 128, 32, 48) == 2 * 128 * 32 * 48
    assert profile_moe.gemm_flops("bwd G=dy@W2^T +SwiGLU'", 128, 32, 48) == 2 * 128 * 32 * 48
    assert profile_moe.gemm_flops("bwd SwiGLU' (elementwise)", 128, 32, 48) == 0


def test_bench_shards_at_toy_size(tmp_path):
    """4 gloo processes at ep=4, ep=2 and a resume: each reads exactly its share of the model
    folder (the backbone and 1/ep of the experts) and of the checkpoint its weights' share
    (plus the routers' persistent buffers, which the share from the folder leaves out). A
    2-layer folder, 40 kB of corpus, and processes forked from one server that imported
    torch, transformers and moestack once (their imports were most of the time)."""
    pytest.importorskip("transformers")
    out = tmp_path / "shards.json"
    run_script(
        "bench_shards.py", "--gb", "0.0005", "--d-model", "64", "--experts", "16", "--steps", "1",
        "--max-bytes", "40000", "--start-method", "forkserver",
        "--folder", str(tmp_path / "model"), "--json", str(out),
    )  # fmt: skip
    phases = json.loads(out.read_text())["phases"]
    assert [phases[p]["ep"] for p in ("ep4", "ep2", "resume")] == [4, 2, 2]
    for name, phase in phases.items():
        if name == "resume":
            assert 1.0 <= phase["read_ratio"] <= 1.01, name
        else:
            assert phase["read_ratio"] == pytest.approx(1.0, abs=1e-9), name
        assert len(phase["records"]) == 4 and phase["ideal_gb"] < phase["whole_model_gb"]
        assert all(r["anon_peak"] > r["anon_before"] for r in phase["records"]), name
