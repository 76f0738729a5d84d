"""A transformers MoE model folder through moestack's whole path: train (routers only, with
temporal + anchor), resume, load_run, export, and evaluate the export in memory and with
its experts served from an expert store."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from helpers.hf import hf_config
from helpers.runs import killed_at, losses

from moestack.cache import ExpertStore, evaluate_offloaded
from moestack.config import OptimConfig, TelemetryConfig
from moestack.data import BatchLoader, eval_batches
from moestack.evaluation import evaluate
from moestack.interop.hf_experts import iter_hf_expert_layers
from moestack.interop.hf_export import export_hf
from moestack.metrics import read_metrics
from moestack.runs import load_run, run_corpus
from moestack.trainer import train

pytest.importorskip("transformers")


@torch.no_grad()
def temporal_loss(model, batches) -> float:
    """Mean temporal-consistency loss over the MoE layers and batches (train-mode forward)."""
    from moestack import router_losses

    values = []
    captured = []
    hooks = [
        moe.router.register_forward_hook(lambda m, a, out: captured.append(out))
        for moe in model.moe_layers
    ]
    for inputs, _ in batches:
        captured.clear()
        model(inputs)
        segments = model.segment_ids(inputs)
        for routing in captured:
            shape = inputs.shape
            values.append(float(router_losses.temporal_consistency(routing, shape, segments)))
    for hook in hooks:
        hook.remove()
    return sum(values) / len(values)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_router_fine_tuning_of_a_transformers_model_end_to_end(hf_dir, tmp_path, family):
    source = hf_dir(family)
    cfg = hf_config(source, tmp_path)
    assert cfg.model.vocab_size > 256 and cfg.model.moe.top_k == 2  # from config.json
    train(cfg, tmp_path / "run")
    run = load_run(tmp_path / "run")
    original = load_run(source)  # the folder itself, as a run at step 0
    fixed = eval_batches(run_corpus(cfg).val, 4, 32, 4)
    # The locality loss the routers were tuned for fell, on fixed validation batches.
    assert temporal_loss(run.model, fixed) < temporal_loss(original.model, fixed)
    tuned_weights = run.model.state_dict()  # + the anchor's reference (a buffer)
    changed = {
        name
        for name, before in original.model.state_dict().items()
        if not torch.equal(tuned_weights[name], before)
    }
    assert changed and all(name.endswith(".router.weight") for name in changed), changed
    for name, ref in tuned_weights.items():  # the anchor held the pretrained routers
        if name.endswith("anchor_weight"):
            assert torch.equal(ref, original.model.state_dict()[name.replace("anchor_", "")])

    out = tmp_path / "export"
    report = export_hf(run.model, out, source_dir=source)
    assert report["expert_bias_dropped"] == {}
    exported = load_run(out)
    corpus = run_corpus(cfg)
    batches = eval_batches(corpus.val, 2, 32, 2)
    tuned = evaluate(run.model, batches, torch.device("cpu"))
    again = evaluate(exported.model, batches, torch.device("cpu"))
    assert again["loss/val"] == pytest.approx(tuned["loss/val"], rel=1e-5)

    # The exported folder's experts, read one at a time, served from a store: the same
    # perplexity as in memory, exactly.
    layers = iter_hf_expert_layers(out)  # one layer in memory at a time
    store = ExpertStore.write_layers(layers, tmp_path / "store", model_cfg=exported.cfg.model)
    offloaded = evaluate_offloaded(load_run(out).model, store, batches, "cpu")
    assert offloaded["loss/val"] == again["loss/val"]
    assert math.isfinite(offloaded["eval/perplexity"]) and offloaded["cache/misses"] > 0


def test_resume_of_a_transformers_run_is_exact(hf_dir, tmp_path, monkeypatch):
    """Killed at step 13 (checkpoints every 10 steps), resumed: the second start draws
    batches 10-19 alone (a resume that restarted from step 0 would draw 0-19 and log the
    same losses), and ends with the losses and weights of an uninterrupted run."""
    source = hf_dir("mixtral")
    reference = tmp_path / "reference"
    train(hf_config(source, tmp_path, trainable="all"), reference)
    crashed = tmp_path / "crashed"
    with killed_at(13):
        train(hf_config(source, tmp_path, trainable="all"), crashed)
    drawn = []
    real_next = BatchLoader.next

    def next_batch(self):
        drawn.append(self.position)
        return real_next(self)

    monkeypatch.setattr(BatchLoader, "next", next_batch)
    train(hf_config(source, tmp_path, trainable="all", resume=True), crashed)
    assert drawn == list(range(10, 20))
    assert losses(crashed) == losses(reference) and set(losses(reference)) == {5, 10, 15, 20}
    resumed, uninterrupted = load_run(crashed).model, load_run(reference).model
    want = uninterrupted.state_dict()
    for name, weight in resumed.state_dict().items():
        assert torch.equal(weight, want[name]), name
    shutil.rmtree(crashed)


def test_telemetry_and_offload_adamw_on_a_transformers_model(hf_dir, tmp_path):
    from moestack.telemetry import RoutingTrace

    cfg = hf_config(
        hf_dir("olmoe"), tmp_path, steps=6, ckpt_every=3, trainable="routers+experts",
        optim=OptimConfig(name="offload_adamw", lr=1e-2, warmup_steps=1),
        telemetry=TelemetryConfig(enabled=True),
    )  # fmt: skip
    summary = train(cfg, tmp_path / "run")
    assert math.isfinite(summary["loss/val"])
    trace = RoutingTrace.load(tmp_path / "run" / "trace" / "from-0000000")
    assert trace.num_layers == 2 and trace.num_tokens == 6 * 4 * 32  # every training token
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert any("telemetry/hit_rate" in r for r in records)
