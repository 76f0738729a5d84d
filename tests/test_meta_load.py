"""A moestack run loaded without its experts (``load_run(experts=False)``) against the same
run loaded whole: the same weights and buffers but the experts, and, served from the expert
store written from the checkpoint, the same validation loss bit for bit."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_train import small_config

from moestack import checkpoint
from moestack.config import RouterConfig
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
    assert resident_bytes(lean) == resident_bytes(whole) - expert_bytes


def test_expert_layers_read_from_the_checkpoint(trained):
    run = load_run(trained)
    layers = list(checkpoint.iter_expert_layers(run.checkpoint))
    assert len(layers) == len(run.model.moe_layers) == 2
    for (w1, w2), moe in zip(layers, run.model.moe_layers, strict=True):
        assert torch.equal(w1, moe.w1) and torch.equal(w2, moe.w2)


def test_eval_offload_equals_eval_in_memory(trained, capsys):
    from moestack.cli import main

    main(["eval", str(trained), "--batches", "2"])
    in_memory = json.loads(capsys.readouterr().out)
    main(["eval", str(trained), "--offload", "--capacity", "2", "--batches", "2"])
    offloaded = json.loads(capsys.readouterr().out)
    assert offloaded["loss/val"] == in_memory["loss/val"]  # exact: same function, same data
    assert offloaded["cache/misses"] > 0


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
    import shutil

    ckpt = tmp_path / "step"
    shutil.copytree(load_run(trained).checkpoint, ckpt)
    file = ckpt / checkpoint.MODEL_FILE
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    tensors["layers.0.attn.qkv.weight"] = tensors["layers.0.attn.qkv.weight"] + 1.0
    save_file(tensors, file, metadata={"format": "pt"})
    run_cfg = load_run(trained).cfg
    with parameters_on_meta():
        model = run_cfg.model.build()
    with pytest.raises(MoestackError, match="model.safetensors"):
        checkpoint.load_model_weights_without_experts(ckpt, model, run_cfg.model)
