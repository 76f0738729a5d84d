"""Each section's config lives beside the class it configures and builds it; moestack.config
re-exports them all. The two model configs answer the same questions (what the callers once
asked their type), each as its own model is."""

from __future__ import annotations

import sysconfig

import pytest
import torch

import moestack.config
from moestack import meta_load
from moestack.data import DataConfig
from moestack.errors import MoestackError
from moestack.interop.hf_model import HFModelConfig
from moestack.model import ModelConfig
from moestack.moe import MoEConfig
from moestack.optim.config import OptimConfig
from moestack.parallel.config import ParallelConfig
from moestack.telemetry.config import TelemetryConfig

TINY = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=16,
                   moe=MoEConfig(num_experts=4, top_k=2, d_ff=16))  # fmt: skip


def test_moestack_config_names_each_section_from_its_home():
    homes = {"OptimConfig": OptimConfig, "DataConfig": DataConfig,
             "TelemetryConfig": TelemetryConfig, "ParallelConfig": ParallelConfig}  # fmt: skip
    for name, cls in homes.items():
        assert getattr(moestack.config, name) is cls
        assert name in moestack.config.__all__


def test_optim_config_builds_the_optimizer_it_names():
    model = TINY.build(seed=0)
    opt = OptimConfig(name="adamw", lr=2e-3, weight_decay=0.25).build(model)
    inner = opt.optimizer
    assert type(inner) is torch.optim.AdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.25, 0.0]  # matrices; norms
    assert all(g["lr"] == 2e-3 for g in opt.param_groups)
    counted = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert counted == sum(p.numel() for p in model.parameters())


def test_data_config_reads_the_documents_it_names(tmp_path):
    assert DataConfig().documents()[1] == f"stdlib:{sysconfig.get_paths()['stdlib']}"
    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i} " * 20)
    cfg = DataConfig(source="files", paths=[str(tmp_path)], val_fraction=0.3, seq_len=8)
    corpus = cfg.build()
    texts = [body for _, body in cfg.documents()[0]]
    assert sorted(texts) == sorted(f"document number {i} ".encode() * 20 for i in range(6))
    # every document's bytes, one separator (0) after each, in one split or the other
    assert len(corpus.train) + len(corpus.val) == sum(len(t) + 1 for t in texts)


def test_parallel_config_leaves_a_one_rank_model_as_it_is():
    model = TINY.build(seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert ParallelConfig(ep=1).build(model, world_size=1, rank=0) == (None, None)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_telemetry_config_builds_a_trace_part_per_start(tmp_path):
    model = TINY.build(seed=0)
    assert TelemetryConfig(enabled=False).build(model, tmp_path, 0, 32, 320) is None
    telemetry = TelemetryConfig(policies=["lru"], capacities=[2]).build(model, tmp_path, 3, 32, 320)
    try:
        model(torch.randint(0, 256, (2, 16)))
    finally:
        telemetry.close()
    assert [p.name for p in (tmp_path / "trace").iterdir()] == ["from-0000003"]


def test_model_configs_answer_what_callers_ask():
    own, folder = TINY, HFModelConfig(path="some/folder")  # nothing is read
    assert (own.is_transformers, folder.is_transformers) == (False, True)
    assert own.pretrained_path == "" and folder.pretrained_path == folder.path
    assert folder.path.endswith("some/folder") and folder.path.startswith("/")
    assert own.describe() == "2x32" and own.store_shape is own and folder.store_shape is None
    assert own.plan_notes == () and len(folder.plan_notes) == 2
    assert own.tokenizer() is None  # bytes
    with pytest.raises(MoestackError, match="model.vocab_size=100 is below 256"):
        ModelConfig(vocab_size=100).tokenizer()


def test_a_meta_build_has_the_whole_models_shapes_and_experts_filled_match_it():
    whole = TINY.build(seed=5)
    plan, empty = TINY.build_for_plan(), TINY.build_for_checkpoint()
    shapes = {n: p.shape for n, p in whole.named_parameters()}
    for model in (plan, empty):
        assert {n: p.shape for n, p in model.named_parameters()} == shapes
        assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in empty.buffers())  # rotary tables real, for loading
    # experts built on meta, given memory (as a rank's share is), then filled: the weights
    # the whole build draws
    ranked = TINY.build_for_run(seed=5, experts_on_meta=True, from_checkpoint=False)
    assert ranked.layers[0].moe.w1.is_meta
    meta_load.materialize(ranked)
    TINY.fill_experts(ranked, 5, resumed=False)
    got = dict(ranked.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in whole.named_parameters())
