"""A checkpoint read into a model with another LoRA rank: one line naming the tensor and
lora.rank (not a damaged file), and the folder's config is left as it was, so the resume
with the checkpoint's rank still works."""

import shutil

import pytest
from helpers.runs import small_config

from moestack.errors import MoestackError
from moestack.lora import LoRAConfig
from moestack.runs import load_run_config
from moestack.trainer import train


def lora_config(rank: int, **overrides):
    return small_config(trainable="lora", lora=LoRAConfig(rank=rank), **overrides)


def test_another_lora_rank_is_one_line_naming_the_tensor(tmp_path):
    run = tmp_path / "run"
    train(lora_config(2, steps=2, ckpt_every=2), run)
    copy = tmp_path / "copy"  # its checkpoints alone: no config.yaml to compare with
    shutil.copytree(run / "checkpoints", copy / "checkpoints")

    with pytest.raises(MoestackError) as refused:
        train(lora_config(4, steps=4, ckpt_every=2, resume=True), copy)
    message = str(refused.value)
    assert "\n" not in message
    assert "lora_" in message and "(lora.rank?)" in message
    assert "(2," in message or ", 2)" in message  # the checkpoint's rank-2 shape named
    assert not (copy / "config.yaml").exists()  # the refused resume wrote no config

    train(lora_config(2, steps=4, ckpt_every=2, resume=True), copy)  # the right rank resumes
    assert load_run_config(copy).lora.rank == 2
