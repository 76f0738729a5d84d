"""HFModelConfig, the config of a transformers model folder: its architecture is read from
config.json by ``resolve``, where a run is built, never while the config is built."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from moestack.config import DataConfig, HFModelConfig, TrainConfig, to_yaml  # noqa: E402
from moestack.interop.hf_model import HFMoEModel  # noqa: E402
from moestack.runs import load_run_config  # noqa: E402


def test_resolve_reads_the_architecture_and_sets_the_cache_sizes(hf_dir):
    folder = hf_dir("olmoe")
    cfg = TrainConfig(model=HFModelConfig(path=str(folder), moe={"impl": "torch"}),
                      data=DataConfig(seq_len=64))  # fmt: skip
    resolved = cfg.resolve()
    model = resolved.model
    # the tiny fixture's config.json: vocab 320, hidden 32, 2 layers of 4 heads, 128
    # positions, 6 experts (top-2) of width 16
    assert (model.vocab_size, model.d_model, model.n_layers, model.n_heads) == (320, 32, 2, 4)
    assert model.max_seq_len == 128 and model.resolved
    assert (model.moe.num_experts, model.moe.top_k, model.moe.d_ff) == (6, 2, 16)
    assert model.moe.impl == "torch"  # the user's, not config.json's
    assert resolved.cache.capacity == 4 and resolved.telemetry.capacities == [2, 4]
    assert not cfg.model.resolved and cfg.cache.capacity == 0  # the config itself unchanged


def test_a_sequence_longer_than_the_folders_model_is_refused_when_resolved(hf_dir):
    cfg = TrainConfig(model=HFModelConfig(path=str(hf_dir("olmoe"))))  # seq_len 256 > 128
    with pytest.raises(ValueError, match=r"data\.seq_len=256 exceeds model\.max_seq_len=128"):
        cfg.resolve()


def test_a_runs_config_yaml_loads_back_resolved(hf_dir, tmp_path):
    cfg = TrainConfig(model=HFModelConfig(path=str(hf_dir("qwen3_moe"))),
                      data=DataConfig(seq_len=32)).resolve()  # fmt: skip
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_run_config(tmp_path) == cfg


def test_build_loads_the_folder_with_moestack_layers(hf_dir):
    model = HFModelConfig(path=str(hf_dir("olmoe")), moe={"impl": "torch"}).build()
    assert isinstance(model, HFMoEModel) and len(model.moe_layers) == 2
    assert model.cfg.resolved and model.cfg.d_model == 32
