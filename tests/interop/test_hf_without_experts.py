"""A transformers model folder loaded without its routed experts, against transformers' own
load: same non-expert weights and buffers, no expert tensor ever read, the same logits once
the experts are served from an expert store, and errors naming the key."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from helpers.hf import FAMILIES, reference_model, sample_tokens, tiny_hf_model_dir  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save, save_file  # noqa: E402

from moestack.cache import ExpertCache, ExpertStore, offloaded  # noqa: E402
from moestack.config import ModelConfig  # noqa: E402
from moestack.errors import MoestackError  # noqa: E402
from moestack.interop.hf_experts import is_expert_key, iter_hf_expert_layers  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402
from moestack.interop.hf_without_experts import from_pretrained_without_experts  # noqa: E402
from moestack.meta_load import parameters_on_meta  # noqa: E402
from moestack.runs import load_run  # noqa: E402


def _resident_bytes(module: nn.Module) -> int:
    """Bytes of the module's distinct parameters and buffers that hold memory (not meta)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_non_expert_weights_equal_transformers_load(tmp_path, family, tied):
    path = tiny_hf_model_dir(tmp_path, family, seed=3, tie_word_embeddings=tied)
    ref = reference_model(path)
    lean = from_pretrained_without_experts(path, torch.float32)
    want = dict(ref.named_parameters(remove_duplicate=False))
    got = dict(lean.named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys()
    experts = [name for name in want if is_expert_key(name)]
    assert experts, "the fixture has routed experts"
    for name, param in got.items():
        if name in experts:
            assert param.is_meta and param.shape == want[name].shape
        else:
            assert param.device.type == "cpu" and torch.equal(param, want[name]), name
    for name, buf in ref.named_buffers():
        assert torch.equal(dict(lean.named_buffers())[name], buf), name
    assert (lean.lm_head.weight is lean.get_input_embeddings().weight) == tied
    assert not lean.training
    expert_bytes = sum(want[n].numel() * want[n].element_size() for n in experts)
    assert _resident_bytes(lean) == _resident_bytes(ref) - expert_bytes


def test_no_expert_tensor_is_read(hf_dir, tensor_reads):
    """Every non-expert checkpoint tensor is read once, and no expert tensor at all."""
    path = hf_dir("qwen2_moe")
    from_pretrained_without_experts(path, torch.float32)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        non_expert = sorted(k for k in f.keys() if not is_expert_key(k))  # noqa: SIM118
    assert sorted(tensor_reads) == non_expert


@pytest.mark.parametrize("family", FAMILIES)
def test_served_from_the_store_the_logits_equal_the_whole_model(hf_dir, tmp_path, family):
    path = hf_dir(family)
    whole = load_hf_moe(path, impl="torch")
    lean = load_hf_moe(path, impl="torch", experts=False)
    assert all(moe.w1.is_meta and moe.w2.is_meta for moe in lean.moe_layers)
    assert all(not moe.router.weight.is_meta for moe in lean.moe_layers)
    store = ExpertStore.write_layers(
        iter_hf_expert_layers(path), tmp_path / "store", model_cfg=lean.cfg
    )
    tokens = sample_tokens(lean.cfg.doc_separator, batch=3, seq=20, seed=1)
    cache = ExpertCache(store, 3, "lru", top_k=lean.cfg.moe.top_k)
    with torch.no_grad(), offloaded(lean, cache):
        got = lean(tokens).logits
        want = whole(tokens).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert cache.stats.misses > 0
    store.close()


def _assert_non_experts_equal(lean: nn.Module, ref: nn.Module) -> None:
    got = dict(lean.named_parameters(remove_duplicate=False))
    for name, param in ref.named_parameters(remove_duplicate=False):
        if is_expert_key(name):
            assert got[name].is_meta, name
        else:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], param), name


def test_sharded_checkpoint_and_load_run(tmp_path):
    path = tiny_hf_model_dir(tmp_path, "mixtral", max_shard_size="20KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    run = load_run(path, experts=False, device="cpu")
    assert all(moe.w1.is_meta for moe in run.model.moe_layers)
    _assert_non_experts_equal(
        from_pretrained_without_experts(path, torch.float32), reference_model(path)
    )


def test_bf16_checkpoint_read_as_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_hf_model_dir(tmp_path, "qwen3_moe", seed=5)
    path = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    _assert_non_experts_equal(
        from_pretrained_without_experts(path, torch.float32), reference_model(path)
    )


def test_weights_do_not_follow_a_rewritten_file(hf_dir, tmp_path):
    """The weights read are copies: rewriting the file in place (same layout, other values)
    does not change a loaded model."""
    path = tmp_path / "m"
    shutil.copytree(hf_dir("olmoe"), path)
    lean = from_pretrained_without_experts(path, torch.float32)
    before = {n: p.clone() for n, p in lean.named_parameters() if not p.is_meta}
    file = path / "model.safetensors"
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) + 1.0 for k in f.keys()}  # noqa: SIM118 (no dict)
    blob = save(tensors, metadata={"format": "pt"})
    assert len(blob) == file.stat().st_size
    with open(file, "r+b") as out:  # same inode: what a private mapping would see
        out.write(blob)
    for name, param in lean.named_parameters():
        if not param.is_meta:
            assert torch.equal(param, before[name]), name


def test_unread_checkpoint_tensors_are_warned_about(hf_dir, tmp_path, caplog):
    path = tmp_path / "m"
    shutil.copytree(hf_dir("qwen3_moe"), path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    tensors["model.layers.0.self_attn.stray.weight"] = torch.randn(3, 3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        from_pretrained_without_experts(path, torch.float32)
    assert "model.layers.0.self_attn.stray.weight" in caplog.text


def test_missing_tensor_names_the_parameter(hf_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(hf_dir("olmoe"), path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        MoestackError, match=r"no checkpoint tensor for parameter model\.layers\.1"
    ) as err:
        from_pretrained_without_experts(path, torch.float32)
    assert "\n" not in str(err.value)


def test_shape_mismatch_names_the_key(hf_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(hf_dir("qwen3_moe"), path)
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] += 7
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoestackError, match=r"embed_tokens\.weight has shape \(320, 32\)"):
        from_pretrained_without_experts(path, torch.float32)


def test_parameters_on_meta_is_undone_even_on_error():
    register = nn.Module.register_parameter
    with pytest.raises(RuntimeError), parameters_on_meta():
        inside = nn.Linear(3, 5)
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is register
    assert inside.weight.is_meta and nn.Linear(3, 5).weight.device.type == "cpu"


def test_parameters_on_meta_acts_in_its_own_thread_only():
    """Another thread building a module meanwhile gets real weights; a second build waits its
    turn; afterwards the original register_parameter is back."""
    register = nn.Module.register_parameter
    entered, release = threading.Event(), threading.Event()
    built: dict[str, nn.Module] = {}

    def first() -> None:
        with parameters_on_meta():
            built["first"] = nn.Linear(2, 2)
            entered.set()
            release.wait(10)

    def second() -> None:
        with parameters_on_meta():
            built["second"] = nn.Linear(2, 2)

    a = threading.Thread(target=first)
    a.start()
    assert entered.wait(10)
    built["other"] = nn.Linear(2, 2)  # this thread, while the first build is inside
    b = threading.Thread(target=second)
    b.start()
    b.join(0.2)
    assert b.is_alive()  # waiting for the first build
    release.set()
    a.join(10)
    b.join(10)
    assert built["first"].weight.is_meta and built["second"].weight.is_meta
    assert built["other"].weight.device.type == "cpu"
    assert nn.Module.register_parameter is register


def test_own_model_config_cannot_build_without_experts():
    """Building reads no weights: moestack's own model without experts comes from a
    checkpoint (``load_run(experts=False)``, tests/train/test_meta_load.py), not from build()."""
    with pytest.raises(ValueError, match="transformers model folder"):
        ModelConfig().build(experts=False)


def test_running_without_experts_outside_the_cache_is_an_error(hf_dir):
    lean = load_hf_moe(hf_dir("olmoe"), impl="torch", experts=False)
    tokens = sample_tokens(lean.cfg.doc_separator)
    with pytest.raises(RuntimeError, match="expert weights are not in memory"):
        lean(tokens)
