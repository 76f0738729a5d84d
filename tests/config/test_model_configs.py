"""The model is one of two explicit configs: ``ModelConfig`` (moestack's own) or
``HFModelConfig`` (a transformers folder). The command line's ``model`` node becomes one of
them, building a config reads no file, and a run's config.yaml loads back to the config."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from moestack.config import (
    HFModelConfig,
    ModelConfig,
    ModelSchema,
    TrainConfig,
    register_configs,
    to_yaml,
)
from moestack.errors import MoestackError
from moestack.model import MoETransformer


def _composed(*overrides: str) -> TrainConfig:
    register_configs()
    with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="train", overrides=list(overrides)))


def test_moestacks_model_config_has_no_folder_field():
    assert "path" not in {f.name for f in dataclasses.fields(ModelConfig)}
    assert "init_std" not in {f.name for f in dataclasses.fields(HFModelConfig)}


def test_the_model_node_becomes_the_config_the_command_line_chose(tmp_path):
    cfg = _composed("model=small")
    assert type(cfg.model) is ModelConfig and cfg.model.d_model == 256  # configs/model/small
    folder = tmp_path / "no-such-folder"  # not read: the config is only built
    cfg = _composed("model=hf", f"model.path={folder}", "model.moe.impl=torch")
    assert type(cfg.model) is HFModelConfig
    assert (cfg.model.path, cfg.model.moe.impl, cfg.model.d_model) == (str(folder), "torch", None)


def test_building_a_transformers_config_reads_no_file_resolving_it_does(tmp_path):
    folder = tmp_path / "absent"
    cfg = TrainConfig(model=HFModelConfig(path=str(folder)))
    assert not cfg.model.resolved and cfg.cache.capacity == 0  # sizes wait for the folder
    with pytest.raises(MoestackError, match=r"model folder .*absent does not exist"):
        cfg.resolve()


def test_a_moestack_model_config_is_resolved_as_built():
    cfg = TrainConfig()
    assert cfg.model.resolved and cfg.resolve() == cfg
    assert cfg.cache.capacity == 4 and cfg.telemetry.capacities == [2, 4]  # 2 x top_k, k/2k
    assert isinstance(cfg.model.build(), MoETransformer)


def test_config_yaml_loads_back_to_the_same_config(tmp_path):
    cfg = TrainConfig(model=ModelConfig(d_model=64, moe={"num_experts": 4, "top_k": 1}))
    text = to_yaml(cfg)
    assert "  path: ''\n" in text  # the command line's model node, as before
    node = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(text))
    assert OmegaConf.to_object(node) == cfg


def test_a_mapping_with_a_path_chooses_the_transformers_config(tmp_path):
    chosen = ModelSchema(path=str(tmp_path), checkpointing="none").choose()
    assert type(chosen) is HFModelConfig and chosen.path == str(tmp_path)
    with pytest.raises(ValueError, match=r"model\.checkpointing='block' applies to moestack"):
        TrainConfig(model={"path": str(tmp_path), "checkpointing": "block"})


def test_a_true_false_field_of_the_model_node_takes_only_true_or_false():
    from moestack.overrides import check_overrides as _check_overrides

    with pytest.raises(MoestackError, match="model.tie_embeddings is true or false, not '2'"):
        _check_overrides(["model.tie_embeddings=2"])
    _check_overrides(["model.tie_embeddings=false", "model.path=/x", "model.moe.top_k=2"])
