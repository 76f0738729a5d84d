"""A run trained with streamed experts (offload_experts=disk) is read back whole: its
checkpoints hold no experts, so load_run (eval, export) takes them from the run's store,
and the model is the resident run's, weight for weight; eval --offload serves them from
that store (tests/cache/test_streaming_readers.py: export, a transformers model's run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.runs import small_config

from moestack import cli
from moestack.cache.expert_cache import CacheConfig
from moestack.errors import MoestackError
from moestack.lora import LoRAConfig
from moestack.runs import load_run
from moestack.trainer import train


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("streamed_readers")
    for offload in ("off", "disk"):
        cfg = small_config(trainable="lora", lora=LoRAConfig(rank=4), steps=4, ckpt_every=4,
                           offload_experts=offload, cache=CacheConfig(capacity=2))  # fmt: skip
        train(cfg, tmp / offload)
    return tmp / "off", tmp / "disk"


def test_load_run_reads_the_experts_from_the_store(runs) -> None:
    resident, streamed = (load_run(path).model.state_dict() for path in runs)
    assert resident.keys() == streamed.keys()
    for name, value in resident.items():
        assert torch.equal(streamed[name], value), name


def test_eval_of_a_streamed_run_is_the_resident_runs(runs, capsys) -> None:
    printed = []
    for path in runs:
        cli.main(["eval", str(path)])
        printed.append(json.loads(capsys.readouterr().out)["loss/val"])
    assert printed[0] == printed[1]


def test_a_streamed_run_without_its_store_is_refused(runs, tmp_path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(runs[1], copy)
    shutil.rmtree(copy / "experts")
    with pytest.raises(MoestackError, match="streamed its experts .* which is gone"):
        load_run(copy)


def test_offloaded_eval_of_a_streamed_run_is_the_resident_runs(runs, capsys) -> None:
    """moestack's own model, LoRA on its experts: served from the run's own store with the
    adapters applied, the resident run's validation loss."""
    printed = []
    for path, offload in ((runs[0], []), (runs[1], ["--offload", "--capacity", "2"])):
        cli.main(["eval", str(path), *offload])
        printed.append(json.loads(capsys.readouterr().out))
    assert printed[1]["loss/val"] == printed[0]["loss/val"]
    assert printed[1]["cache/loads"] > 0
