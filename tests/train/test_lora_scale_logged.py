"""A LoRA run states its adapters' scale (alpha / rank) among its first lines: with
lora.alpha unset, 2 x rank, so rank 4 scales by 2, not 32 / 4 = 8."""

from __future__ import annotations

import logging

from helpers.runs import small_config

from moestack.lora import LoRAConfig
from moestack.trainer import train


def test_the_scale_is_logged_before_training(tmp_path, caplog) -> None:
    cfg = small_config(trainable="lora", lora=LoRAConfig(rank=4), steps=1, ckpt_every=1)
    with caplog.at_level(logging.INFO, logger="moestack.trainer"):
        train(cfg, tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if r.name == "moestack.trainer"]
    scale = next(i for i, line in enumerate(lines) if line.startswith("lora: rank 4, alpha 8"))
    assert "scale alpha/rank = 2;" in lines[scale]
    assert scale < next(i for i, line in enumerate(lines) if line.startswith("model:"))
