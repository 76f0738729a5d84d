"""scripts/bench_tiered.py: the state bytes it reports for the default model, worked by hand,
and its device section's dry run on the CPU (the code path a GPU runs)."""

from __future__ import annotations

from helpers.scripts import script_module


def test_tiny_model_bytes_worked_by_hand() -> None:
    with script_module("bench_tiered") as bench:
        with bench.torch.device("meta"):
            model = bench.model_config("tiny").build()
        got = bench.state_bytes(model)
    d, f, e, layers, v = 128, 256, 8, 4, 256
    experts = layers * 4 * e * ((d + 2 * f) + (f + d))  # factored rows and columns, fp32
    routers = layers * 4 * e * d  # full fp32
    embeddings = 4 * v * d + 4 * (v + d)  # fp32 momentum + factors (tied output)
    attn = 4 * (3 * d * d + 3 * d + d) + 4 * (d * d + 2 * d)  # momentum + factors
    norms = 8 * d  # 1-D: momentum + full
    backbone = layers * (attn + 2 * norms) + norms
    assert got["tiered_state_bytes"] == {"experts": experts, "routers": routers,
        "embeddings": embeddings, "backbone": backbone, "adapters": 0}  # fmt: skip
    params = got["params"]
    assert got["ratio_vs_adamw_fp32"] == (experts + routers + embeddings + backbone) / (8 * params)
    assert got["expert_training_bytes_per_param"] == 4 + experts / got["expert_params"]
    per_layer = e * (d * 2 * f + f * d)  # w1 [8, 128, 512] and w2 [8, 256, 128]: held at once
    assert got["expert_params"] == layers * per_layer
    assert got["expert_gradients_held_in_backward"] == per_layer
    in_backward = (2 * layers * per_layer + 2 * per_layer + experts) / (layers * per_layer)
    assert got["expert_training_bytes_per_param_in_backward"] == in_backward


def test_device_section_dry_run_on_the_cpu() -> None:
    with script_module("bench_tiered") as bench:
        out = bench.device_section(steps=1, batch=1, seq_len=16)
    assert out["adamw"]["param_dtype"] == "torch.float32"
    assert out["tiered"]["param_dtype"] == "torch.bfloat16"
    assert out["time_ratio"] > 0 and "memory_ratio" not in out  # no device memory on the CPU
