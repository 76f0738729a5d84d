"""iter_hf_experts: each layout and sharding read one expert at a time, equal to the model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import FAMILIES, tiny_hf_model_dir  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from moestack.errors import MoestackError  # noqa: E402
from moestack.interop.hf_experts import iter_hf_experts  # noqa: E402
from moestack.interop.hf_model import load_hf_moe  # noqa: E402


def _check_equal(path, model) -> int:
    count = 0
    for layer, expert, tensors in iter_hf_experts(path):
        assert set(tensors) == {"w1", "w2"}
        assert torch.equal(tensors["w1"], model.moe_layers[layer].w1[expert].detach())
        assert torch.equal(tensors["w2"], model.moe_layers[layer].w2[expert].detach())
        assert tensors["w1"].is_contiguous() and tensors["w2"].is_contiguous()
        count += 1
    return count


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_equal_the_loaded_model(hf_dir, family):
    path = hf_dir(family)
    assert _check_equal(path, load_hf_moe(path, impl="torch")) == 2 * 6


def test_order_is_layer_then_expert(hf_dir):
    ids = [(layer, e) for layer, e, _ in iter_hf_experts(hf_dir("olmoe"))]
    assert ids == [(layer, e) for layer in range(2) for e in range(6)]


def test_sharded_checkpoint(tmp_path):
    path = tiny_hf_model_dir(tmp_path, "mixtral", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert _check_equal(path, load_hf_moe(path, impl="torch")) == 12


def test_a_layer_s_files_are_unmapped_before_the_next_layer(tmp_path):
    """Each safetensors file read through a memory map keeps the pages it read resident
    while mapped: at each expert only the files holding its own layer's tensors are mapped
    (read from /proc/self/maps), so reading every layer never maps the whole folder."""
    path = tiny_hf_model_dir(tmp_path, "mixtral", max_shard_size="20KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files_of = {}
    for key, file in weight_map.items():
        if ".experts." in key or ".block_sparse_moe.experts." in key:
            files_of.setdefault(int(key.split(".layers.")[1].split(".")[0]), set()).add(file)
    assert len(set().union(*files_of.values())) > len(files_of[0])  # layers in several files

    def mapped() -> set[str]:
        lines = Path("/proc/self/maps").read_text().splitlines()
        return {Path(line.split()[-1]).name for line in lines if str(path) in line}

    seen = set()
    for layer, _, _ in iter_hf_experts(path):
        now = mapped()
        assert now <= files_of[layer], (layer, now - files_of[layer])
        seen |= now
    assert seen  # the check looked at real mappings


def test_fused_layout(hf_dir, tmp_path):
    """A checkpoint in the fused in-memory layout (experts.gate_up_proj [E, 2F, D],
    experts.down_proj [E, D, F]), written from the per-expert one."""
    source = hf_dir("qwen3_moe")
    path = tmp_path / "fused"
    shutil.copytree(source, path)
    with safe_open(source / "model.safetensors", framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        get = [
            [tensors[f"{prefix}.{e}.{name}.weight"] for e in range(6)]
            for name in ("gate_proj", "up_proj", "down_proj")
        ]
        gate_up = [torch.cat([g, u]) for g, u in zip(get[0], get[1], strict=True)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack(get[2])
    save_file(fused, path / "model.safetensors")
    assert _check_equal(path, load_hf_moe(source, impl="torch")) == 12


def test_reads_one_expert_at_a_time(hf_dir, tensor_reads):
    """Yielding expert (0, 0) has read its three tensors and nothing else."""
    experts = iter_hf_experts(hf_dir("qwen2_moe"))
    layer, expert, tensors = next(experts)
    assert (layer, expert) == (0, 0) and tensors["w1"].shape == (32, 32)
    assert sorted(tensor_reads) == [
        f"model.layers.0.mlp.experts.0.{name}.weight"
        for name in ("down_proj", "gate_proj", "up_proj")
    ]
    experts.close()


def test_missing_expert_tensor_names_layer_and_expert(hf_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(hf_dir("olmoe"), path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    del tensors["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(MoestackError, match="layer 1 expert 4 has no up projection") as err:
        list(iter_hf_experts(path))
    assert "\n" not in str(err.value)


def test_checkpoint_and_config_disagree(hf_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(hf_dir("mixtral"), path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoestackError, match=r"decoder layers \[0, 1\], config.json implies"):
        list(iter_hf_experts(path))


def test_no_weights(hf_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(hf_dir("mixtral"), path)
    (path / "model.safetensors").unlink()
    with pytest.raises(MoestackError, match="holds no model weights"):
        next(iter_hf_experts(path))
