"""scripts/bench_lora.py end to end at toy size: the three fine-tunes run, and the counts it
reports (from the checkpointed AdamW state) and projects (from the shapes) equal counts
worked by hand."""

import json
import subprocess
import sys

import pytest
from helpers.paths import REPO

TOY = (
    *("--d-model", "32", "--layers", "2", "--experts", "4", "--top-k", "2", "--d-ff", "16"),
    *("--heads", "4", "--kv-heads", "2", "--vocab", "320", "--rank", "2", "--steps", "3"),
    *("--warmup", "1", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1"),
    *("--max-bytes", "100000", "--threads", "1", "--rounds", "2", "--repeats", "2"),
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("bench_lora")
    out = tmp / "lora.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_lora.py"), *TOY, "--dir", str(tmp),
         "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_three_fine_tunes_report_counts_times_and_losses(results):
    assert {"rows", "shapes", "projection", "machine", "args", "step_time_source"} <= set(results)
    rows = {r["contender"]: r for r in results["rows"]}
    assert set(rows) == {"all", "routers", "lora"}
    keys = {"trainable_params", "adamw_state_bytes", "step_s_median", "step_s_min",
            "step_s_max", "loss_train_final", "loss_val_final", "params_vs_all",
            "state_vs_all", "step_vs_all", "step_vs_routers", "interleaved_step_s_median",
            "interleaved_step_vs_all", "interleaved_step_vs_routers",
            "interleaved_step_best_vs_all", "interleaved_step_best_vs_routers"}  # fmt: skip
    for row in rows.values():
        assert keys <= set(row)
        assert row["n_repeats"] == len(row["repeats"]) == 2
        for run in row["repeats"]:  # each repeat: 3 steps after 1 warm-up, 2 rounds after 1
            assert run["timed_steps"] == 2 and len(run["step_s"]) == 2
            assert len(run["interleaved_step_s"]) == 2
            assert run["trainable_params"] == row["trainable_params"]
        assert len(row["step_s"]) == row["timed_steps"] == 4  # every repeat's steps
        assert 0 < row["step_s_min"] <= row["step_s_median"] <= row["step_s_max"]
        # the median and range over the repeats of each repeat's own figure
        for key in ("step_s_median", "interleaved_step_s_median", "step_vs_routers",
                    "interleaved_step_best_vs_all"):  # fmt: skip
            per_repeat = sorted(run[key] for run in row["repeats"])
            assert row[key] == pytest.approx(sum(per_repeat) / 2)  # the median of two
            assert row[f"{key}_range"] == per_repeat
        first, second = row["repeats"]
        assert (
            first["step_vs_all"]
            == first["step_s_median"] / rows["all"]["repeats"][0]["step_s_median"]
        )
        assert second["loss_train_final"] == first["loss_train_final"]  # same seed, same run
    assert results["shapes"]["vocab"] == 320
    # toy: D 32, 2 layers, 4 experts of width F 16, 4 query / 2 kv heads of head_dim 8, V 320.
    # Full: embeddings and untied head 2 x 320 x 32 = 20480, final norm 32; per layer
    # q 32x32 + k 32x16 + v 32x16 + o 32x32 = 3072, q/k norms 16, experts 4 x (32x32 + 16x32)
    # = 6144, router 4x32 = 128, two norms 64: 9424. 20480 + 32 + 2 x 9424 = 39360 in
    # 3 + 2 x 11 = 25 tensors.
    assert rows["all"]["trainable_params"] == 39360
    assert rows["all"]["adamw_state_bytes"] == 8 * 39360 + 4 * 25
    assert rows["routers"]["trainable_params"] == 2 * 128
    # LoRA rank 2, per layer: experts 4 x (32x2 + 2x32 + 16x2 + 2x32) = 896; q 2x32 + 32x2,
    # k 2x32 + 16x2, v the same, o 2x32 + 32x2: 448. 2 x 1344 = 2688 in 2 x 12 tensors.
    lora = rows["lora"]
    assert lora["trainable_params"] == 2688 < rows["all"]["trainable_params"]
    assert lora["adamw_state_bytes"] == 8 * 2688 + 4 * 24
    assert lora["params_vs_all"] == pytest.approx(2688 / 39360)


def test_the_qwen3_30b_projection_equals_the_hand_worked_counts(results):
    proj = results["projection"]
    # Qwen3-30B-A3B: D 2048, 48 layers, 128 experts of width 768, q 32 x 128, kv 4 x 128,
    # V 151936, untied. Per layer: attention 2048x4096 x 2 + 2048x512 x 2 = 18874368, q/k
    # norms 256, experts 128 x 3 x 2048 x 768 = 603979776, router 262144, norms 4096.
    per_layer = 18874368 + 256 + 603979776 + 262144 + 4096
    full = 48 * per_layer + 2 * 151936 * 2048 + 2048
    assert full == 30_532_122_624
    assert proj["all"]["trainable_params"] == full
    assert proj["weights_bf16_bytes"] == 2 * full
    # LoRA rank 2: experts 128 x 2 x (2048 + 1536 + 768 + 2048) = 1638400; q and o
    # 2 x (2048 + 4096) each, k and v 2 x (2048 + 512) each: 34816 per layer.
    assert proj["lora"]["trainable_params"] == 48 * (1638400 + 34816) == 80_314_368
    assert proj["lora"]["adamw_state_bytes"] == 8 * 80_314_368 + 4 * 48 * 12


def test_moestack_model_mode_counts_the_adapters_and_gives_the_ratios(tmp_path):
    """--moestack-model (the GPU check's mode, here model=tiny on the CPU): per contender the
    trained parameters, step times and counted bytes, and the ratios the targets read."""
    out = tmp_path / "device.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_lora.py"), "--moestack-model", "tiny",
         "--rank", "2", "--steps", "3", "--warmup", "1", "--batch-size", "2", "--seq-len", "32",
         "--max-bytes", "100000", "--threads", "1", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    # model=tiny (D 128, 4 layers, 8 experts of width 256) at rank 2, worked by hand: per layer
    # the experts' 8 x 2 x (128 + 512 + 256 + 128) = 16384, qkv 2 x (128 + 384) and out
    # 2 x (128 + 128) = 1536
    assert rows["lora"]["trainable_params"] == 4 * (16384 + 1536)
    assert rows["routers"]["trainable_params"] == 4 * 8 * 128
    assert rows["all"]["memory_x_full"] == 1.0
    assert rows["routers"]["memory_x_full"] < rows["lora"]["memory_x_full"] < 1.0
    assert all(r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"] for r in rows.values())
    assert rows["lora"]["peak_device_bytes"] is None  # measured on CUDA only
    # lora.base_dtype=bfloat16: the same adapters, every frozen (base) weight 2 bytes lighter
    bf16 = rows["lora_bf16base"]
    assert bf16["trainable_params"] == rows["lora"]["trainable_params"]
    saved = rows["lora"]["weights_grads_state_bytes"] - bf16["weights_grads_state_bytes"]
    assert saved == 2 * rows["all"]["trainable_params"]
