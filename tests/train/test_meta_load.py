"""A moestack run loaded without its experts (``load_run(experts=False)``) against the same
run loaded whole: the same weights and buffers but the experts, and, served from the expert
store written from the checkpoint, the same validation loss bit for bit."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from helpers.runs import small_config
from safetensors import safe_open
from safetensors.torch import save_file

from moestack import checkpoint
from moestack.config import OptimConfig, RouterConfig
from moestack.errors import MoestackError
from moestack.meta_load import TensorReader, fill_buffers, parameters_on_meta, resident_bytes
from moestack.runs import load_run
from moestack.trainer import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run whose routers carry state that lives in buffers: the aux-loss-free bias
    (moves every step) and the anchor loss's reference routing."""
    out = tmp_path_factory.mktemp("run")
    router = RouterConfig(bias_update_rate=0.01, anchor=0.1)
    train(small_config(steps=6, ckpt_every=6, log_every=3, router=router), out)
    return out


def test_everything_but_the_experts_equals_the_whole_load(trained):
    whole = load_run(trained).model
    lean = load_run(trained, experts=False).model
    got = dict(lean.named_parameters(remove_duplicate=False))
    expert_bytes = 0
    for name, param in whole.named_parameters(remove_duplicate=False):
        if name.endswith((".moe.w1", ".moe.w2")):
            assert got[name].is_meta and got[name].shape == param.shape
            expert_bytes += param.numel() * param.element_size()
        else:
            assert torch.equal(got[name], param), name
    buffers = dict(lean.named_buffers())
    for name, buf in whole.named_buffers():
        assert torch.equal(buffers[name], buf), name
    assert any(m.router.expert_bias.abs().sum() > 0 for m in lean.moe_layers)  # loaded, not 0
    unique = {id(t): t for t in (*whole.parameters(), *whole.buffers())}.values()
    everything = sum(t.numel() * t.element_size() for t in unique)
    assert resident_bytes(lean) == everything - expert_bytes


def test_expert_layers_read_from_the_checkpoint(trained):
    run = load_run(trained)
    layers = list(checkpoint.iter_expert_layers(run.checkpoint))
    assert len(layers) == len(run.model.moe_layers) == 2
    for (w1, w2), moe in zip(layers, run.model.moe_layers, strict=True):
        assert torch.equal(w1, moe.w1) and torch.equal(w2, moe.w2)


def _eval(capsys, run_dir, *args: str) -> dict:
    from moestack.cli import main

    main(["eval", str(run_dir), "--batches", "2", *args])
    return json.loads(capsys.readouterr().out)


def test_eval_offload_equals_eval_in_memory(trained, capsys):
    in_memory = _eval(capsys, trained)
    offloaded = _eval(capsys, trained, "--offload", "--capacity", "2")
    assert offloaded["loss/val"] == in_memory["loss/val"]  # exact: same function, same data
    assert offloaded["cache/misses"] > 0
    whole = load_run(trained).model
    experts = sum(p.numel() * p.element_size() for m in whole.moe_layers for p in (m.w1, m.w2))
    assert offloaded["memory/experts_bytes"] == experts  # in the store, not in the model
    unique = {id(t): t for t in (*whole.parameters(), *whole.buffers())}.values()
    everything = sum(t.numel() * t.element_size() for t in unique)
    assert offloaded["memory/model_bytes"] == everything - experts


def test_a_bf16_checkpoint_serves_its_experts_as_the_model_computes_them(tmp_path, capsys):
    """Weights trained and saved in bf16 are loaded into an fp32 model: the store holds the
    experts in fp32 too, so the offloaded loss is the in-memory one exactly."""
    train(small_config(steps=4, ckpt_every=4, optim=OptimConfig(param_dtype="bfloat16")), tmp_path)
    ckpt = load_run(tmp_path).checkpoint
    with safe_open(ckpt / checkpoint.MODEL_FILE, framework="pt") as f:
        assert f.get_tensor("layers.0.moe.w1").dtype == torch.bfloat16
    in_memory = _eval(capsys, tmp_path)
    offloaded = _eval(capsys, tmp_path, "--offload", "--capacity", "2")
    assert offloaded["loss/val"] == in_memory["loss/val"]


def test_a_retrained_run_gets_a_new_store(tmp_path, capsys):
    """The store remembers the weights it came from: the same checkpoint path with other
    weights (a run trained again, longer) is not served from the old store."""
    store = ("--offload", "--capacity", "2", "--store-dir", str(tmp_path / "store"))
    train(small_config(steps=4, ckpt_every=4, keep_last=1), tmp_path / "run")
    first = _eval(capsys, tmp_path / "run", *store)
    shutil.rmtree(tmp_path / "run")
    train(small_config(steps=4, ckpt_every=4, keep_last=1, seed=7), tmp_path / "run")
    second = _eval(capsys, tmp_path / "run", *store)
    in_memory = _eval(capsys, tmp_path / "run")
    assert second["loss/val"] == in_memory["loss/val"] != first["loss/val"]


def test_a_persistent_buffer_missing_from_the_checkpoint_is_refused(trained):
    """The aux-loss-free bias decides routing: a checkpoint without it must not load with the
    bias at its initial zeros."""
    run = load_run(trained)
    file = run.checkpoint / checkpoint.MODEL_FILE
    with safe_open(file, framework="pt") as f:
        keys = {k: file for k in f.keys() if k != "layers.1.moe.router.expert_bias"}  # noqa: SIM118
    with parameters_on_meta():
        model = run.cfg.model.build()
    with contextlib.ExitStack() as stack, pytest.raises(MoestackError) as err:
        fill_buffers(
            model,
            TensorReader(keys, stack),
            lambda n: n if n in keys else None,
            file,
            required=True,
        )
    assert "no checkpoint tensor for buffer layers.1.moe.router.expert_bias" in str(err.value)


def test_a_checkpoint_with_flipped_bytes_is_refused(trained, tmp_path):
    ckpt = tmp_path / "step"
    shutil.copytree(load_run(trained).checkpoint, ckpt)
    file = ckpt / checkpoint.MODEL_FILE
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        metadata = f.metadata()
    tensors["layers.0.attn.qkv.weight"] = tensors["layers.0.attn.qkv.weight"] + 1.0
    size = file.stat().st_size
    save_file(tensors, file, metadata=metadata)  # same size: only the digest can tell
    assert file.stat().st_size == size
    run_cfg = load_run(trained).cfg
    with parameters_on_meta():
        model = run_cfg.model.build()
    with pytest.raises(MoestackError, match="sha256"):
        checkpoint.load_model_weights_without_experts(ckpt, model, run_cfg.model)
