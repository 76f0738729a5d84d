"""Config validation names the bad field; every hydra group option composes and validates."""

import pytest
from helpers.paths import CONFIGS
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from moestack.config import (
    CacheConfig,
    DataConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    RouterConfig,
    TrainConfig,
    register_configs,
)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: MoEConfig(num_experts=4, top_k=5), "moe.top_k"),
        (lambda: MoEConfig(impl="cutlass"), "moe.impl"),
        (lambda: ModelConfig(d_model=130, n_heads=4), "model.n_heads"),
        (lambda: RouterConfig(score="relu"), "router.score"),
        (lambda: RouterConfig(z_loss=-1.0), "router.z_loss"),
        (lambda: OptimConfig(lr=0.0), "optim.lr"),
        (lambda: OptimConfig(betas=(0.9, 1.5)), "optim.betas"),
        (lambda: DataConfig(source="files"), "data.paths"),
        (lambda: CacheConfig(policy="fifo"), "cache.policy"),
        (lambda: TrainConfig(cache=CacheConfig(capacity=1)), "cache.capacity"),
        (lambda: TrainConfig(data=DataConfig(seq_len=512)), "data.seq_len"),
        (lambda: TrainConfig(steps=0), "steps"),
    ],
)
def test_invalid_values_raise_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()


def test_defaults_are_valid_and_router_flows_into_model():
    cfg = TrainConfig(router=RouterConfig(z_loss=0.5))
    assert cfg.model.router.z_loss == 0.5


def _groups():
    for group in sorted(p for p in CONFIGS.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for option in sorted(group.glob("*.yaml")):
            yield group.name, option.stem


@pytest.mark.parametrize("group, option", list(_groups()))
def test_every_group_option_composes_into_a_valid_config(group, option, tmp_path):
    register_configs()
    overrides = [f"{group}={option}"]
    if group == "data" and option == "files":
        overrides.append("data.paths=[somewhere]")
    if group == "model" and option == "hf":  # a transformers model folder, built offline
        pytest.importorskip("transformers")
        from helpers.hf import tiny_hf_model_dir

        overrides += [f"model.path={tiny_hf_model_dir(tmp_path, 'olmoe')}", "data.seq_len=64"]
    with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    train_cfg = OmegaConf.to_object(cfg)
    assert isinstance(train_cfg, TrainConfig)


def test_model_hf_without_a_path_names_the_field():
    register_configs()
    with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model=hf"])
    with pytest.raises(ValueError, match=r"model=hf needs model\.path=DIR"):
        OmegaConf.to_object(cfg)


def test_unknown_group_option_is_an_error():
    from hydra.errors import MissingConfigException

    register_configs()
    with (
        initialize_config_module(config_module="moestack.configs", version_base="1.3"),
        pytest.raises(MissingConfigException, match="model"),
    ):
        compose(config_name="train", overrides=["model=huge"])


def test_m137_has_137m_parameters():
    import torch

    from moestack import MoETransformer

    register_configs()
    with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=["model=m137"]))
    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    total = model.num_params()["total"]
    assert 137.0e6 <= total < 137.5e6, total
