"""scripts/bench_stream_hf.py at toy size: the folder it writes is a transformers Qwen3-MoE
checkpoint (transformers' own loader reads it, every tensor in place), its experts' bytes
are counted as worked by hand, and the run's store holds them once in fp32."""

from __future__ import annotations

import json

from helpers.scripts import script_module


def test_toy_folder_and_run(tmp_path) -> None:
    layers, experts, hidden, inter = 2, 4, 64, 32
    with script_module("bench_stream_hf") as bench:
        import sys

        argv = ["bench_stream_hf.py", "--out", str(tmp_path), "--layers", str(layers),
                "--experts", str(experts), "--hidden", str(hidden), "--moe-inter", str(inter),
                "--steps", "1", "--capacity", "2", "--threads", "1",
                "--json", str(tmp_path / "out.json"), "lora.targets=attention"]  # fmt: skip
        saved, sys.argv = sys.argv, argv
        try:
            bench.main()
        finally:
            sys.argv = saved
    row = json.loads((tmp_path / "out.json").read_text())
    by_hand = layers * experts * 3 * hidden * inter * 2  # gate, up, down in bf16
    assert row["experts_bf16_bytes"] == by_hand
    assert 2 * by_hand <= row["store_bytes"] <= 2 * by_hand + 64 * 1024  # fp32, plus headers
    assert row["peak_rss_bytes"] > 0

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert sum(p.numel() for p in model.parameters()) == (
        2 * 320 * hidden + hidden  # embeddings, head, final norm
        + layers * (2 * hidden + 2 * 64 * hidden + 2 * 32 * hidden + 2 * 8  # norms, q/o, k/v, q/k norms
                    + experts * hidden + experts * 3 * hidden * inter)  # router, experts
    )  # fmt: skip
