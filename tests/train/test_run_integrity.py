"""Runs and checkpoints lose nothing and say what is wrong (each test failed before its fix)."""

import json
import math

import pytest
import torch
from helpers.runs import killed_at, losses, small_config

from moestack import checkpoint
from moestack.config import ModelConfig, MoEConfig, OptimConfig
from moestack.errors import MoestackError
from moestack.metrics import read_metrics, write_json
from moestack.model import MoETransformer
from moestack.trainer import train


def flip_byte(path, seed=0):
    data = bytearray(path.read_bytes())
    gen = torch.Generator().manual_seed(seed)
    at = int(torch.randint(len(data) // 4, len(data), (1,), generator=gen))
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_refused_and_resume_falls_back_to_a_verified_checkpoint(tmp_path):
    cfg = dict(steps=20, ckpt_every=10, log_every=5)
    reference = tmp_path / "reference"
    train(small_config(**cfg), reference)
    run = tmp_path / "run"
    train(small_config(**cfg), run)
    newest = run / "checkpoints/step_000020"
    flip_byte(newest / checkpoint.MODEL_FILE)
    model_cfg = small_config().model
    with pytest.raises(MoestackError, match=r"model.safetensors cannot be read: its sha256"):
        checkpoint.load_model_weights(newest, MoETransformer(model_cfg), model_cfg)
    flip_byte(run / "checkpoints/step_000010" / checkpoint.STATE_FILE, seed=1)
    with pytest.raises(MoestackError, match=r"train_state.pt cannot be read: its sha256"):
        checkpoint.load_train_state(run / "checkpoints/step_000010")
    assert checkpoint.newest_verified(run / "checkpoints") is None


def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path, caplog):
    cfg = dict(steps=20, ckpt_every=10, log_every=5, keep_last=3)
    reference = tmp_path / "reference"
    train(small_config(**cfg), reference)
    run = tmp_path / "run"
    train(small_config(**cfg), run)
    flip_byte(run / "checkpoints/step_000020" / checkpoint.MODEL_FILE)
    train(small_config(resume=True, **{**cfg, "steps": 20}), run)  # redoes steps 11..20
    assert "does not verify" in caplog.text and "step_000010" in caplog.text
    assert losses(run) == losses(reference)
    checkpoint.verify_checkpoint(run / "checkpoints/step_000020")  # rewritten, clean


@pytest.mark.parametrize(
    "meta",
    [[], {"step": "7"}, {"step": 7}, {"step": 7, "model": {"moe": []}},
     {"step": 7, "model": {"moe": {}}, "sizes": [1]},
     {"step": 7, "model": {"moe": {}}, "sizes": {"../../etc/passwd": 3}},
     {"step": -1, "model": {"moe": {}}}, {"step": True, "model": {"moe": {}}}],
)  # fmt: skip
def test_wrong_structure_in_meta_json_is_one_clear_error(tmp_path, meta):
    cfg = small_config()
    path = checkpoint.save_checkpoint(tmp_path, 7, MoETransformer(cfg.model), cfg.model, {})
    (path / checkpoint.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(MoestackError, match="meta.json: .* the checkpoint is corrupt"):
        checkpoint.load_model_weights(path, MoETransformer(cfg.model), cfg.model)


def test_non_finite_weights_after_a_finite_loss_are_never_checkpointed(tmp_path, monkeypatch):
    poisoned = {"done": False}
    original = MoETransformer.update_router_biases

    def poison_at_step_15(self):
        original(self)
        if len(read_metrics(tmp_path / "metrics.jsonl")) >= 14 and not poisoned["done"]:
            self.moe_layers[1].router.expert_bias[2] = float("nan")  # the loss stays finite
            poisoned["done"] = True

    monkeypatch.setattr(MoETransformer, "update_router_biases", poison_at_step_15)
    with pytest.raises(MoestackError, match=r"step 20: weight layers\.1\.moe\.router\.expert_bias"):
        train(small_config(steps=30, ckpt_every=10, keep_last=1), tmp_path)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")] == [
        "step_000010"
    ]
    assert math.isfinite(losses(tmp_path)[20])  # the loss gave no sign


def test_leftovers_of_a_killed_save_or_prune_are_removed_at_the_next_start(tmp_path):
    train(small_config(steps=10, ckpt_every=5), tmp_path)
    root = tmp_path / "checkpoints"
    (root / ".step_000015.abc123").mkdir()  # a save killed before its rename
    (root / ".step_000015.abc123" / checkpoint.MODEL_FILE).write_bytes(b"x" * 1000)
    (root / ".trash-step_000005").mkdir()  # a prune killed mid-delete
    (root / "step_000012").mkdir()  # no meta.json: never complete
    train(small_config(steps=10, ckpt_every=5, resume=True), tmp_path)  # finished: evals, saves
    assert sorted(p.name for p in root.iterdir()) == ["step_000005", "step_000010"]


def test_a_rerun_after_a_kill_before_any_checkpoint_starts_clean(tmp_path):
    with killed_at(7):
        train(small_config(steps=12, ckpt_every=10), tmp_path)
    assert sorted(losses(tmp_path)) == list(range(1, 8))
    train(small_config(steps=12, ckpt_every=10), tmp_path)
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss/train" in r]
    assert steps == list(range(1, 13))  # each step once


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"optim": OptimConfig(lr=1e-3, warmup_steps=5)}, "optim.lr 0.003 -> 0.001"),
        ({"optim": OptimConfig(name="adamw", lr=3e-3, warmup_steps=5)}, None),  # unchanged
    ],
)
def test_resume_refuses_a_changed_optimizer(tmp_path, changed, message):
    offload = OptimConfig(name="offload_adamw", lr=3e-3, warmup_steps=5)
    train(small_config(steps=10, ckpt_every=5, optim=offload), tmp_path)
    expected = message or "optim.name 'offload_adamw' -> 'adamw'"
    with pytest.raises(MoestackError, match=expected.replace(".", r"\.")):
        train(small_config(steps=10, ckpt_every=5, resume=True, **changed), tmp_path)
    # Logging and checkpoint cadence may change on resume.
    train(small_config(steps=10, ckpt_every=2, log_every=2, resume=True, optim=offload), tmp_path)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ModelConfig(init_std=-0.1), "model.init_std=-0.1"),
        (lambda: ModelConfig(rope_theta=0.0), "model.rope_theta=0.0"),
        (lambda: ModelConfig(doc_separator=300), "model.doc_separator=300"),
        (lambda: ModelConfig(norm_eps=0.0), "model.norm_eps=0.0"),
    ],
)
def test_unchecked_model_fields_are_checked(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_an_impl_that_cannot_run_here_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = small_config().model
    model.moe = MoEConfig(num_experts=4, top_k=2, d_ff=32, impl="triton")
    with pytest.raises(ValueError, match="moe.impl=triton needs a CUDA device.*use moe.impl"):
        train(small_config(model=model, device="cpu"), tmp_path)
    model.moe = MoEConfig(num_experts=4, top_k=2, d_ff=32, impl="megablocks")
    with pytest.raises(ValueError, match="moe.impl=megablocks needs a CUDA device"):
        train(small_config(model=model, device="cpu"), tmp_path / "b")


def test_summary_files_stay_valid_json_with_nan(tmp_path):
    write_json(tmp_path / "s.json", {"loss/val": float("nan"), "nested": {"x": [float("inf")]}})
    data = json.loads((tmp_path / "s.json").read_text())  # strict parsers accept it
    assert data == {"loss/val": "nan", "nested": {"x": ["inf"]}}


def test_eval_offload_takes_a_byte_budget(tmp_path, capsys):
    from moestack.cli import main

    train(small_config(steps=5, ckpt_every=5), tmp_path)
    expert_bytes = (32 * 64 + 32 * 32) * 4  # w1 [D, 2F] + w2 [F, D] in fp32, D = F = 32
    main(["eval", str(tmp_path), "--offload", "--capacity-bytes", str(3 * expert_bytes + 5)])
    result = json.loads(capsys.readouterr().out)
    assert result["cache/capacity"] == 3  # 3 experts fit the budget
    assert math.isfinite(result["loss/val"])


def test_a_killed_run_keeps_the_trace_of_every_checkpointed_step(tmp_path):
    from moestack.config import TelemetryConfig
    from moestack.telemetry import RoutingTrace

    cfg = dict(steps=10, ckpt_every=5, telemetry=TelemetryConfig(enabled=True))
    with killed_at(8):
        train(small_config(**cfg), tmp_path)
    trace = RoutingTrace.load(tmp_path / "trace" / "from-0000000")
    tokens_per_step = 4 * 32  # batch_size x seq_len of small_config
    assert trace.num_tokens == 5 * tokens_per_step  # exactly the 5 checkpointed steps
