"""LoRA on a transformers MoE model (trainable=lora / routers+lora): the adapted model starts
as transformers' own model, a fine-tune moves only the adapters (and routers asked for), the
merged export gives the trained model's logits in transformers, and the adapter alone loads
into peft onto the base model with the same logits."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import FAMILIES, hf_config, reference_model, sample_tokens  # noqa: E402
from helpers.runs import killed_at, losses  # noqa: E402

from moestack import checkpoint, cli  # noqa: E402
from moestack.config import LoRAConfig, OptimConfig  # noqa: E402
from moestack.errors import MoestackError  # noqa: E402
from moestack.interop.hf_export import REPORT_FILE, export_hf  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402
from moestack.lora import adapter_parameters, add_adapters  # noqa: E402
from moestack.runs import load_run  # noqa: E402
from moestack.trainer import train  # noqa: E402


def peft_holds_experts() -> bool:
    """Whether the installed peft and transformers can hold expert adapters as a peft folder,
    read from their versions, not from the code under test: peft >= 0.17
    (LoraConfig.target_parameters) and transformers >= 5 (experts as stacked tensors)."""
    import importlib.metadata

    from packaging.version import Version

    try:
        peft_version = Version(importlib.metadata.version("peft"))
    except importlib.metadata.PackageNotFoundError:
        return False
    transformers_version = Version(importlib.metadata.version("transformers"))
    return peft_version >= Version("0.17") and transformers_version.major >= 5


def logits_of(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_start_at_transformers_own_model(hf_dir, family):
    source = hf_dir(family)
    tokens = sample_tokens(eos_id=1)
    want = reference_model(source)(input_ids=tokens).logits.detach()
    model = load_hf_moe(source, impl="torch")
    add_adapters(model, LoRAConfig(rank=2, targets="both"), seed=0)
    names = [name for name, _ in adapter_parameters(model)]
    assert any(".self_attn.q_proj.lora_A" in n for n in names)
    assert any(".moe.lora_w1_A" in n for n in names)
    torch.testing.assert_close(logits_of(model, tokens), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def lora_run(hf_dir, tmp_path_factory):
    """A 12-step routers+lora fine-tune of the tiny Qwen3-MoE folder (both targets)."""
    tmp_path = tmp_path_factory.mktemp("lora")
    cfg = hf_config(hf_dir("qwen3_moe"), tmp_path, trainable="routers+lora", steps=12,
                    lora=LoRAConfig(rank=4, alpha=8.0, targets="both", dropout=0.1),
                    optim=OptimConfig(lr=2e-2, warmup_steps=1, weight_decay=0.0))  # fmt: skip
    train(cfg, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_a_killed_routers_lora_run_resumes_exactly(hf_dir, tmp_path, monkeypatch, base_dtype):
    """The transformers-model resume (every weight from the checkpoint, none from the folder):
    a routers+lora run with adapter dropout, killed after step 6 and resumed from its step-4
    checkpoint, logs the uninterrupted run's losses, step for step; also with the frozen
    weights held in bf16."""

    def cfg(**changes):
        lora = LoRAConfig(rank=2, alpha=4.0, targets="both", dropout=0.1, base_dtype=base_dtype)
        return hf_config(hf_dir("qwen3_moe"), tmp_path, trainable="routers+lora", lora=lora,
                         steps=8, ckpt_every=4, log_every=1, **changes)  # fmt: skip

    train(cfg(), tmp_path / "reference")
    with killed_at(6):
        train(cfg(), tmp_path / "crashed")
    assert max(losses(tmp_path / "crashed")) == 6  # the kill came after step 6
    loaded = []
    real = checkpoint.load_model_weights
    monkeypatch.setattr(checkpoint, "load_model_weights",
                        lambda path, *a: loaded.append(path.name) or real(path, *a))  # fmt: skip
    train(cfg(resume=True), tmp_path / "crashed")
    assert loaded == ["step_000004"]  # resumed from its checkpoint, not started again
    want = losses(tmp_path / "reference")
    assert len(want) == 8 and losses(tmp_path / "crashed") == want


def test_a_lora_fine_tune_moves_only_the_adapters_and_routers(lora_run, hf_dir):
    base = dict(load_hf_moe(hf_dir("qwen3_moe"), impl="torch").named_parameters())
    trained = dict(load_run(lora_run).model.named_parameters())
    moved = {k for k in trained if k not in base or not torch.equal(trained[k], base[k])}
    assert moved == {k for k in trained if "lora" in k or k.endswith("router.weight")}
    assert all(trained[k].abs().sum() > 0 for k in trained if k.endswith("lora_B"))


def test_the_merged_export_gives_the_trained_logits_in_transformers(lora_run, tmp_path, capsys):
    tokens = sample_tokens(eos_id=1)
    want = logits_of(load_run(lora_run).model, tokens)
    cli.main(["export", str(lora_run), str(tmp_path / "merged")])
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "moestack-export"
    got = reference_model(tmp_path / "merged")(input_ids=tokens).logits.detach()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    saved = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text()
                       if (tmp_path / "merged" / "model.safetensors.index.json").exists()
                       else "{}")  # fmt: skip
    assert not any("lora" in k for k in saved.get("weight_map", {}))


def test_export_refuses_a_model_with_adapters_left_unmerged(hf_dir, tmp_path):
    model = load_hf_moe(hf_dir("qwen3_moe"), impl="torch")
    add_adapters(model, LoRAConfig(rank=2), seed=0)
    with pytest.raises(MoestackError, match="carries LoRA adapters"):
        export_hf(model, tmp_path / "out", source_dir=hf_dir("qwen3_moe"))
    assert not (tmp_path / "out").exists()


def test_the_adapter_alone_loads_into_peft_with_the_trained_logits(lora_run, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    tokens = sample_tokens(eos_id=1)
    want = logits_of(load_run(lora_run).model, tokens)
    cli.main(["export", str(lora_run), str(tmp_path / "adapter"), "--adapter"])
    report = json.loads(capsys.readouterr().out)
    if not peft_holds_experts():
        pytest.skip("the installed peft (< 0.17) or transformers (< 5) cannot hold them")
    assert report["adapter_format"] == "peft", report.get("peft_unavailable")
    assert "adapter_config.json" in report["files"] and REPORT_FILE in report["files"]
    source = load_run(lora_run).cfg.model.path
    base = reference_model(source)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    got = adapted(input_ids=tokens).logits.detach()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # without the adapter: the base model, whose logits differ from the trained ones
    assert not torch.allclose(reference_model(source)(input_ids=tokens).logits, want, atol=1e-3)
    # an adapter export is an export: --overwrite replaces it, nothing else
    cli.main(["export", str(lora_run), str(tmp_path / "adapter"), "--adapter", "--overwrite"])


def test_the_adapter_alone_needs_adapters(hf_dir, tmp_path):
    from moestack.interop.hf_adapter import export_adapter

    model = load_hf_moe(hf_dir("qwen3_moe"), impl="torch")
    with pytest.raises(MoestackError, match="has no LoRA adapters"):
        export_adapter(model, tmp_path / "a", source_dir=hf_dir("qwen3_moe"), rank=2,
                       alpha=4.0, routers=False)  # fmt: skip


def test_the_adapter_reports_a_dropped_expert_bias(hf_dir, tmp_path, caplog):
    """The routers' aux-loss-free selection bias has no place in an adapter either: the
    adapter export lists it as the merged export does, with a warning; none: an empty map."""
    import logging

    from moestack.config import RouterConfig
    from moestack.interop.hf_adapter import export_adapter

    source = hf_dir("qwen3_moe")
    model = load_hf_moe(source, impl="torch", router=RouterConfig(bias_update_rate=0.01))
    add_adapters(model, LoRAConfig(rank=2), seed=0)
    kw = dict(source_dir=source, rank=2, alpha=4.0, routers=True)
    assert export_adapter(model, tmp_path / "none", **kw)["expert_bias_dropped"] == {}
    with torch.no_grad():
        model.moe_layers[1].router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.5, 0, 0, 0]))
    with caplog.at_level(logging.WARNING):
        report = export_adapter(model, tmp_path / "biased", **kw)
    assert report["expert_bias_dropped"] == {1: 0.5} and report["expert_bias_folded"] == {}
    assert "layer 1: 0.5" in caplog.text
    saved = json.loads((tmp_path / "biased" / REPORT_FILE).read_text())
    assert saved["expert_bias_dropped"] == {"1": 0.5}


def test_without_peft_the_adapter_is_written_in_moestack_names(lora_run, tmp_path, monkeypatch,
                                                               capsys):  # fmt: skip
    import safetensors.torch

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails as if not installed
    cli.main(["export", str(lora_run), str(tmp_path / "adapter"), "--adapter"])
    report = json.loads(capsys.readouterr().out)
    assert report["adapter_format"] == "moestack"
    assert "peft is not installed" in report["peft_unavailable"]
    saved = safetensors.torch.load_file(tmp_path / "adapter" / "moestack_adapter.safetensors")
    trained = dict(adapter_parameters(load_run(lora_run).model))
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k].detach()) for k in saved)


def test_the_adapter_is_written_in_the_dtype_asked_for(lora_run, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    trained = dict(adapter_parameters(load_run(lora_run).model))
    cli.main(["export", str(lora_run), str(tmp_path / "peft"), "--adapter", "--dtype", "bfloat16"])
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16"
    assert report["adapter_format"] == ("peft" if peft_holds_experts() else "moestack")
    if report["adapter_format"] == "peft":
        saved = safetensors.torch.load_file(tmp_path / "peft" / "adapter_model.safetensors")
        assert saved and {t.dtype for t in saved.values()} == {torch.bfloat16}
    monkeypatch.setitem(sys.modules, "peft", None)  # moestack's names: the values, rounded
    cli.main(["export", str(lora_run), str(tmp_path / "own"), "--adapter", "--dtype", "float16"])
    assert json.loads(capsys.readouterr().out)["dtype"] == "float16"
    saved = safetensors.torch.load_file(tmp_path / "own" / "moestack_adapter.safetensors")
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k].detach().to(torch.float16)) for k in saved)
