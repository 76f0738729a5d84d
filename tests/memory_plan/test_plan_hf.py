"""The memory plan of a transformers model folder (`moestack plan model=hf model.path=DIR`),
from its config.json alone: the parameter bytes are those of the model transformers builds
from that config (count x dtype size, exactly), LoRA adapters counted by hand, no weight
file read, and `--gpu-gb N` says whether a hand-worked device total fits a card of N GiB."""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from helpers.hf import tiny_config  # noqa: E402
from helpers.paths import REPO  # noqa: E402

from moestack import cli  # noqa: E402
from moestack.memory_plan import plan_memory  # noqa: E402
from moestack.prereg.compose import compose_config  # noqa: E402

RUN = ["data.seq_len=32", "batch_size=4", "telemetry.enabled=false"]
# qwen3_moe with a dense layer (mlp_only_layers), mixtral with tied embeddings: the plan
# must count what transformers builds, not a formula of the config's sizes
CASES = {
    "qwen3_moe": {"mlp_only_layers": [1]},
    "mixtral": {"tie_word_embeddings": True},
}
E, D, F = 6, 32, 16  # tiny_config's experts, hidden size and expert width


def _folder(tmp_path, family: str, **overrides) -> str:
    """A model folder holding config.json alone (no weights, no tokenizer)."""
    folder = tmp_path / family
    tiny_config(family, 0, 1, **overrides).save_pretrained(folder)
    assert os.listdir(folder) == ["config.json"]
    return str(folder)


def _reference(folder: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model transformers itself builds from the folder's config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _moe_layers(reference: torch.nn.Module) -> int:
    return sum(1 for n, _ in reference.named_modules() if n.endswith("mlp.experts"))


def _plan(folder: str, *overrides: str, device: str = "cpu"):
    return plan_memory(compose_config(["model=hf", f"model.path={folder}", *RUN, *overrides]),
                       device=device)  # fmt: skip


@pytest.mark.parametrize("family", CASES)
def test_the_plan_counts_the_parameters_transformers_builds(tmp_path, family):
    folder = _folder(tmp_path, family, **CASES[family])
    plan = _plan(folder)
    ref = _reference(folder)
    params = list(ref.parameters())  # a tied tensor once
    count = sum(p.numel() for p in params)
    # buffers: transformers' (rotary tables) + moestack's router keeps expert_bias and
    # pending_counts, E floats each, per MoE layer
    buffers = sum(b.numel() * b.element_size() for b in ref.buffers())
    buffers += _moe_layers(ref) * 2 * E * 4
    assert plan.line("weights").bytes == 4 * count + buffers
    assert plan.line("gradients").bytes == 4 * count
    # torch AdamW: two fp32 moments per element and a 4-byte step per tensor
    assert plan.line("optimizer state (adamw)").bytes == 8 * count + 4 * len(params)


@pytest.mark.parametrize("family", CASES)
def test_bf16_device_weights_are_the_bf16_model_transformers_builds(tmp_path, family):
    """offload_adamw on CUDA holds the weights and gradients in bf16 on the device."""
    folder = _folder(tmp_path, family, **CASES[family])
    plan = _plan(folder, "optim=offload_adamw", device="cuda")
    ref = _reference(folder, torch.bfloat16)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert plan.line("gradients").bytes == param_bytes
    assert plan.line("weights").bytes - plan.line("gradients").bytes == (
        sum(b.numel() * b.element_size() for b in ref.buffers()) + _moe_layers(ref) * 2 * E * 4
    )
    master = sum(p.numel() for p in ref.parameters()) * 4
    assert plan.line("optimizer master weights").bytes in (master, master // 2)  # split: low halves


def test_the_plan_counts_lora_adapters_by_hand(tmp_path):
    """rank 2 on the experts and the attention of qwen3_moe (one MoE layer, one dense):
    expert adapters E x (D r + r 2F + F r + r D) = 6 x (64 + 64 + 32 + 64) = 1344; attention
    adapters r x (in + out) per projection, q 32->32, k 32->16, v 32->16, o 32->32: 2 x (64 +
    48 + 48 + 64) = 448 per layer, 896 for two: 2240 trained parameters."""
    folder = _folder(tmp_path, "qwen3_moe", **CASES["qwen3_moe"])
    plan = _plan(folder, "trainable=lora", "lora.rank=2", "lora.targets=both")
    assert plan.line("gradients").bytes == 4 * 2240
    full = _plan(folder)
    assert plan.line("weights").bytes == full.line("weights").bytes + 4 * 2240
    # 4 adapter tensors on the MoE layer's experts (w1, w2: A and B), 2 per attention projection
    assert plan.line("optimizer state (adamw)").bytes == 8 * 2240 + 4 * (4 + 2 * 4 * 2)


def test_the_plan_reads_no_weight_file(tmp_path, monkeypatch):
    """A folder whose weight and tokenizer files are garbage plans as one with config.json
    alone: nothing but config.json is read (safetensors never opened)."""
    import safetensors
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    bare = _plan(_folder(tmp_path / "bare", "mixtral"))
    folder = _folder(tmp_path / "junk", "mixtral")
    for name in ("model.safetensors", "tokenizer.json", "pytorch_model.bin"):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"\x00not a real file" * 64)
    junk = _plan(folder)
    assert [(ln.what, ln.bytes) for ln in junk.lines] == [(ln.what, ln.bytes) for ln in bare.lines]


def _cli_plan(capsys, folder: str, *argv: str) -> str:
    cli.main(["plan", "model=hf", f"model.path={folder}", *RUN, *argv])
    return capsys.readouterr().out


def test_gpu_gb_says_whether_a_hand_worked_total_fits(tmp_path, capsys):
    """mixtral (tiny_config, untied): P parameters from transformers' model, 21 tensors. On
    CUDA with torch AdamW (the default optim) the device holds, per rank:
    weights 4P + buffers (2 rotary tables of 4 fp32 + 2 layers x 2 x 6 router floats) = 4P + 128,
    gradients 4P, AdamW 8P + 4 x 21, activations in bf16 (b = 2) for 4 x 32 = 128 tokens:
    per layer b(13D + 3kD + 4kF) + 4(H + 2) + 4(2E + 2k + 4) + 8x3k with D 32, k 2, F 16,
    H 4, E 6 = 1472 + 24 + 80 + 48 = 1624; head b(3D + 2V) + 12 with V 320 = 1484;
    128 x (2 x 1624 + 1484) = 605696 bytes."""
    folder = _folder(tmp_path, "mixtral")
    count = sum(p.numel() for p in _reference(folder).parameters())
    total = (4 * count + 128) + 4 * count + (8 * count + 84) + 605696
    assert _plan(folder, device="cuda").total("device") == total
    gib = total / 2**30
    fits = _cli_plan(capsys, folder, "--gpu-gb", f"{gib * 1.001:.12f}")
    assert re.search(r"^device: fits a GPU of [\d.]+ GiB", fits, re.M), fits
    short = _cli_plan(capsys, folder, "--gpu-gb", f"{gib * 0.999:.12f}")
    assert re.search(r"^device: does not fit a GPU of [\d.]+ GiB", short, re.M), short
    assert f"{total / 2**20:.2f} MiB" in short
    # the plan is for a GPU: --gpu-gb plans for cuda without --device, refuses --device cpu
    assert "device=cuda" in fits
    with pytest.raises(SystemExit) as err:
        _cli_plan(capsys, folder, "--gpu-gb", "24", "--device", "cpu")
    assert err.value.code == 2
    assert "--gpu-gb" in capsys.readouterr().err


def test_gpu_gb_takes_a_number_above_zero(tmp_path, capsys):
    folder = _folder(tmp_path, "mixtral")
    for bad in ("0", "-3", "lots", "nan", "inf"):
        with pytest.raises(SystemExit) as err:
            _cli_plan(capsys, folder, "--gpu-gb", bad)
        assert err.value.code == 2
        assert "--gpu-gb" in capsys.readouterr().err


def test_a_training_run_of_a_folder_logs_the_plan_moestack_plan_prints(tmp_path, caplog):
    """The run's model (weights read) and the plan's (config.json alone) give one table."""
    import logging

    from helpers.hf import hf_config, tiny_hf_model_dir

    from moestack.config import DataConfig
    from moestack.trainer import train

    folder = tiny_hf_model_dir(tmp_path, "qwen3_moe")
    cfg = hf_config(folder, tmp_path, steps=1, ckpt_every=0, trainable="routers+lora",
                    data=DataConfig(seq_len=32, max_bytes=60_000))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="moestack.memory_plan"):
        train(cfg, tmp_path / "run")
    logged = [r.getMessage() for r in caplog.records if "memory plan (per rank)" in r.getMessage()]
    assert len(logged) == 1
    want = plan_memory(cfg, device="cpu")  # built from config.json, as `moestack plan` does
    assert logged[0] == f"memory plan (per rank):\n{want.format()}"
    assert want.line("gradients").bytes > 0


def test_the_documented_qwen3_30b_a3b_projection_holds():
    """docs/hf.md's LoRA fine-tune of Qwen3-30B-A3B (docs/qwen3-30b-a3b/config.json) with its
    experts streamed from disk: one bf16 expert is 3 x 2048 x 768 x 2 B = 9 MiB; 48 layers x
    128 of them leave the device weights; the cache holds 48 x 8 + 8 slots of them; the
    device total is the table's 19,632.09 MiB, which fits 24 GiB."""
    folder = str(REPO / "docs/qwen3-30b-a3b")
    overrides = ["trainable=lora", "lora.rank=16", "lora.targets=attention",
                 "lora.base_dtype=bfloat16", "offload_experts=disk", "cache.capacity=8",
                 "batch_size=1", "data.seq_len=1024"]  # fmt: skip
    plan = _plan(folder, *overrides, device="cuda")
    expert = 3 * 2048 * 768 * 2
    assert plan.line("expert cache slots").bytes == (48 * 8 + 8) * expert == 3528 * 2**20
    assert f"- {48 * 128 * expert} B routed experts" in plan.line("weights").formula
    assert f"{plan.total('device') / 2**20:,.2f}" == "19,632.09"
    assert plan.total("device") < 24 * 2**30 and plan.total("host") == 0


class _Total:
    """A plan of ``device`` bytes on the device (all that gpu_fit reads)."""

    def __init__(self, device: int) -> None:
        self.device = device

    def total(self, kind: str) -> int:
        return self.device if kind == "device" else 0


def test_gpu_gb_advice_names_the_settings_that_apply():
    """A LoRA run of a transformers folder, batch 1, over a 1 GiB card: the advice names
    offload_experts and lora.base_dtype (its frozen experts and fp32 base weights are the
    bulk), never "a batch_size below 1"; a full fine-tune with AdamW is told optim and
    trainable, and a streamed one no offload_experts again."""
    from moestack.memory_plan import gpu_fit

    cfg = compose_config(["model=hf", "model.path=x", "trainable=lora", "batch_size=1",
                          "data.seq_len=128"])  # fmt: skip
    line = gpu_fit(_Total(2 * 2**30), 1.0, cfg)
    assert line.startswith("device: does not fit a GPU of 1 GiB: 2048.00 MiB planned"), line
    assert "offload_experts=host or disk" in line and "lora.base_dtype=bfloat16" in line
    assert "batch_size below" not in line and "a data.seq_len below 128" in line
    full = gpu_fit(_Total(2 * 2**30), 1.0, compose_config(["batch_size=4"]))
    assert "optim=tiered or offload_adamw" in full and "trainable=lora or routers" in full
    assert "offload_experts" not in full and "a batch_size below 4" in full
    streamed = compose_config(["trainable=lora", "offload_experts=disk", "optim=tiered"])
    assert "offload_experts" not in gpu_fit(_Total(2 * 2**30), 1.0, streamed)
    assert gpu_fit(_Total(2**29), 1.0, cfg).startswith("device: fits a GPU of 1 GiB")
