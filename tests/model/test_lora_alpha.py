"""lora.alpha follows lora.rank unless set (a scale alpha / rank of 2), on the command line as
in Python, and the adapters' output carries that scale (against a hand-merged weight)."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import small_model
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from moestack.config import LoRAConfig, TrainConfig, register_configs
from moestack.lora import add_adapters


def test_default_alpha_is_twice_the_rank_and_an_explicit_alpha_is_kept():
    four = LoRAConfig(rank=4)
    assert (four.alpha_value, four.scale) == (8.0, 2.0)
    assert LoRAConfig(rank=16).alpha_value == 32.0  # the old default where it was right
    given = LoRAConfig(rank=4, alpha=32.0)
    assert (given.alpha_value, given.scale) == (32.0, 8.0)
    assert "scale alpha/rank = 2;" in four.describe()
    assert "alpha 8 (2 x rank" in four.describe()
    assert "alpha 32, scale alpha/rank = 8;" in given.describe()


@pytest.mark.parametrize(
    ("overrides", "scale"),
    [(["lora.rank=4"], 2.0), (["lora.rank=4", "lora.alpha=32"], 8.0), (["lora.rank=16"], 2.0)],
)
def test_the_command_line_default_follows_the_rank(overrides, scale):
    """The schema is built from a default LoRAConfig: a resolved alpha there (32) would be
    kept by lora.rank=4, as it was (scale 8)."""
    register_configs()
    with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["trainable=lora", *overrides])
    train_cfg = OmegaConf.to_object(cfg)
    assert isinstance(train_cfg, TrainConfig)
    assert train_cfg.lora.scale == scale


def test_the_expert_and_attention_adapters_are_scaled_by_two_at_rank_4():
    """Adapted model == the base model with W + 2 * A @ B merged by hand (float64), for the
    experts' w1/w2 and the attention projections, at rank 4 with alpha unset."""
    torch.manual_seed(0)
    model = small_model(moe={"impl": "torch"}).build().double()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    add_adapters(model, LoRAConfig(rank=4, targets="both"), seed=0)
    with torch.no_grad():
        base = model(tokens).logits  # B = 0
    gen = torch.Generator().manual_seed(1)
    merged = {}
    with torch.no_grad():
        for moe in model.moe_layers:
            moe.lora_w1_B.copy_(torch.randn(moe.lora_w1_B.shape, generator=gen) * 0.1)
            moe.lora_w2_B.copy_(torch.randn(moe.lora_w2_B.shape, generator=gen) * 0.1)
            merged[moe] = (
                moe.w1 + 2.0 * moe.lora_w1_A @ moe.lora_w1_B,
                moe.w2 + 2.0 * moe.lora_w2_A @ moe.lora_w2_B,
            )
        for _, linear in model.attention_projections():
            linear.lora_B.copy_(torch.randn(linear.lora_B.shape, generator=gen) * 0.1)
            merged[linear] = linear.weight + 2.0 * linear.lora_B @ linear.lora_A
        adapted = model(tokens).logits
        for moe in model.moe_layers:  # the base model with the hand-merged weights
            moe.w1.copy_(merged[moe][0])
            moe.w2.copy_(merged[moe][1])
            for name in ("lora_w1_B", "lora_w2_B"):
                getattr(moe, name).zero_()
        for _, linear in model.attention_projections():
            linear.weight.copy_(merged[linear])
            linear.lora_B.zero_()
        by_hand = model(tokens).logits
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapters did act
    torch.testing.assert_close(adapted, by_hand, rtol=1e-10, atol=1e-10)
