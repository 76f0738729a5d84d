"""End-to-end training: loss falls on real text, resume is exact, bad input fails cleanly."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import killed_at, losses, small_config

from moestack import checkpoint
from moestack.config import ModelConfig, MoEConfig, OptimConfig
from moestack.errors import MoestackError
from moestack.metrics import read_metrics
from moestack.model import MoETransformer
from moestack.trainer import train


def test_training_lowers_loss_on_real_text(tmp_path):
    summary = train(small_config(), tmp_path)
    by_step = losses(tmp_path)
    assert len(by_step) == 30
    assert by_step[1] > 5.0  # about ln(256) at the start
    assert summary["loss/val"] < 4.0 < by_step[1]
    assert math.isclose(summary["eval/perplexity"], math.exp(summary["loss/val"]), rel_tol=1e-6)
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "summary.json").exists()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")] == [
        "step_000020",
        "step_000030",
    ]


def test_resume_after_a_crash_gives_identical_losses(tmp_path):
    reference = tmp_path / "reference"
    train(small_config(steps=20, grad_accum=2), reference)

    crashed = tmp_path / "crashed"
    with killed_at(2 * 13):  # two batches a step
        train(small_config(steps=20, grad_accum=2), crashed)
    assert max(losses(crashed)) == 13
    train(small_config(steps=20, grad_accum=2, resume=True), crashed)
    assert losses(crashed) == losses(reference)  # exact equality, every step
    a = MoETransformer(small_config().model)
    b = MoETransformer(small_config().model)
    checkpoint.load_model_weights(reference / "checkpoints/step_000020", a, small_config().model)
    checkpoint.load_model_weights(crashed / "checkpoints/step_000020", b, small_config().model)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    # a Python caller's run records each start too: the kill, then the resume that finished
    starts = json.loads((crashed / "provenance.json").read_text())["starts"]
    assert [s["status"] for s in starts] == ["interrupted", "finished"]
    assert "simulated kill" in starts[0]["error"]
    assert starts[1]["command"][0] == Path(sys.argv[0]).name  # the default launch record
    assert starts[1]["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert starts[1]["device"] == "cpu" and starts[1]["ended_at"] >= starts[1]["started_at"]


def test_launch_record_is_kept_and_a_refused_start_adds_none(tmp_path):
    """(A start that fails once it began says why: tests/train/test_refused_start.py.)"""
    with pytest.raises(MoestackError, match="holds no checkpoint"):
        train(small_config(steps=2, resume=True), tmp_path, launch={"api": "notebook"})
    assert list(tmp_path.iterdir()) == []  # refused before it began: no record
    train(small_config(steps=2, ckpt_every=0), tmp_path, launch={"api": "notebook"})
    (start,) = json.loads((tmp_path / "provenance.json").read_text())["starts"]
    assert start["api"] == "notebook" and "command" not in start
    assert start["status"] == "finished"
    from moestack import provenance

    assert set(provenance.start_record(small_config(), {})) <= provenance.RECORD_KEYS
    with pytest.raises(ValueError, match="status"):  # the record's own keys are refused
        train(small_config(steps=5), tmp_path / "b", launch={"status": "mine"})
    assert not (tmp_path / "b").exists()
    (tmp_path / "provenance.json").write_text("{not json")  # unreadable: kept aside...
    with pytest.raises(MoestackError, match="resume=true"):
        train(small_config(steps=2, ckpt_every=0), tmp_path)
    assert (tmp_path / "provenance.json").read_text() == "{not json"  # ...by a start that began
    train(small_config(steps=2, ckpt_every=0, resume=True), tmp_path)
    (bad,) = tmp_path.glob("provenance.json.bad-*")
    assert bad.read_text() == "{not json"
    assert len(json.loads((tmp_path / "provenance.json").read_text())["starts"]) == 1


def test_offload_with_bf16_device_weights_tracks_fp32_and_resumes(tmp_path):
    """optim.param_dtype=bfloat16 (the CUDA default for offload_adamw), forced on the CPU."""
    fp32 = train(small_config(optim=OptimConfig(name="offload_adamw", lr=3e-3)), tmp_path / "a")
    cfg = small_config(optim=OptimConfig(name="offload_adamw", lr=3e-3, param_dtype="bfloat16"))
    bf16 = train(cfg, tmp_path / "b")
    # bf16 weights on the device, fp32 master weights in the optimizer: same learning curve.
    assert abs(bf16["loss/val"] - fp32["loss/val"]) < 0.02 * fp32["loss/val"]
    last = tmp_path / "b/checkpoints/step_000030"
    from safetensors import safe_open

    params = {n for n, _ in MoETransformer(cfg.model).named_parameters()}
    with safe_open(str(last / checkpoint.MODEL_FILE), "pt") as f:
        names = [k for k in f.keys() if k in params]  # noqa: SIM118 (safe_open is no dict)
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert dtypes == {torch.bfloat16}  # parameters only; buffers stay fp32
    state = checkpoint.load_train_state(last)["optimizer"]["state"]
    assert all(entry["master"].dtype == torch.float32 for entry in state.values())

    # A crash and a resume reproduce the uninterrupted bf16 run exactly (the master copy is
    # restored from the optimizer state, not rounded from the bf16 weights).
    with killed_at(23):
        train(cfg, tmp_path / "c")
    train(dataclasses.replace(cfg, resume=True), tmp_path / "c")
    assert losses(tmp_path / "c") == losses(tmp_path / "b")


def test_resume_needs_a_checkpoint_and_fresh_runs_refuse_old_ones(tmp_path):
    with pytest.raises(MoestackError, match="holds no checkpoint"):
        train(small_config(resume=True), tmp_path)
    train(small_config(steps=2, ckpt_every=0), tmp_path)
    with pytest.raises(MoestackError, match="resume=true"):
        train(small_config(steps=2), tmp_path)


def test_non_finite_losses_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    original = MoETransformer.forward
    calls = {"n": 0}

    def poisoned(self, tokens, targets=None):
        out = original(self, tokens, targets)
        calls["n"] += 1
        if calls["n"] in (3, 4) or calls["n"] >= 8:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(MoETransformer, "forward", poisoned)
    with pytest.raises(MoestackError, match="NaN/inf for 3 steps"):
        train(small_config(steps=20, max_bad_steps=3, ckpt_every=5), tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["perf/bad_steps"] == 2  # steps 3 and 4 were skipped, the run went on
    assert checkpoint.latest_checkpoint(tmp_path / "checkpoints").name == "step_000005"


def test_checkpoint_errors_name_the_problem(tmp_path):
    cfg = small_config()
    model = MoETransformer(cfg.model)
    path = checkpoint.save_checkpoint(tmp_path, 7, model, cfg.model, {"x": torch.ones(2)})
    restored = MoETransformer(cfg.model)
    checkpoint.load_model_weights(path, restored, cfg.model)
    for p, q in zip(model.state_dict().values(), restored.state_dict().values(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(checkpoint.load_train_state(path)["x"], torch.ones(2))

    other = ModelConfig(
        d_model=32,
        n_layers=2,
        n_heads=2,
        max_seq_len=32,
        moe=MoEConfig(num_experts=8, top_k=2, d_ff=32),
    )
    with pytest.raises(MoestackError, match="model.moe.num_experts=4"):
        checkpoint.load_model_weights(path, MoETransformer(other), other)
    with pytest.raises(MoestackError, match="does not exist"):
        checkpoint.load_model_weights(tmp_path / "nope", restored, cfg.model)
    weights = path / checkpoint.MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(MoestackError, match="truncated"):
        checkpoint.load_model_weights(path, restored, cfg.model)
    meta = json.loads((path / checkpoint.META_FILE).read_text())
    meta["sizes"] = {}
    del meta[checkpoint.SELF_DIGEST]  # as a checkpoint written before meta.json had one
    (path / checkpoint.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(MoestackError, match="cannot be read"):
        checkpoint.load_model_weights(path, restored, cfg.model)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.moe.top_k=99", "moe.top_k=99"),
        ("model.n_heads=5", "model.n_heads=5"),
        ("data=files", "data.paths"),
    ],
)
def test_cli_bad_input_is_one_clear_line(tmp_path, override, message):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moestack.train",
            override,
            f"out_dir={tmp_path}",
            "wandb_mode=disabled",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert message in output
    assert "Traceback" not in output


def test_wandb_offline_run_and_wandb_failure_never_stops_training(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(small_config(steps=2, ckpt_every=0, wandb_mode="offline"), tmp_path / "offline")
    assert list((tmp_path / "offline" / "wandb").glob("offline-run-*"))

    def broken_init(*args, **kwargs):
        raise RuntimeError("wandb is down")

    monkeypatch.setattr(wandb, "init", broken_init)
    summary = train(small_config(steps=2, ckpt_every=0, wandb_mode="offline"), tmp_path / "broken")
    assert math.isfinite(summary["loss/val"])
    assert len(read_metrics(tmp_path / "broken" / "metrics.jsonl")) >= 2


def test_delayed_offload_update_trains_and_resumes_exactly(tmp_path):
    """optim.update_delay=1: the run learns as the exact one does, and a crash and resume
    reproduce the uninterrupted delayed run exactly: a checkpoint holds the weights of every
    update made (fp32 weights are their own master copy, so a checkpoint saved before the
    update in flight was applied would resume from stale weights)."""
    exact_cfg = small_config(optim=OptimConfig(name="offload_adamw", lr=3e-3, warmup_steps=5))
    cfg = small_config(
        optim=OptimConfig(name="offload_adamw", lr=3e-3, warmup_steps=5, update_delay=1)
    )
    exact = train(exact_cfg, tmp_path / "exact")
    delayed = train(cfg, tmp_path / "delayed")
    assert losses(tmp_path / "delayed") != losses(tmp_path / "exact")  # the delay is on
    assert abs(delayed["loss/val"] - exact["loss/val"]) < 0.05 * exact["loss/val"]
    with killed_at(23):
        train(cfg, tmp_path / "crashed")
    train(dataclasses.replace(cfg, resume=True), tmp_path / "crashed")
    assert losses(tmp_path / "crashed") == losses(tmp_path / "delayed")
