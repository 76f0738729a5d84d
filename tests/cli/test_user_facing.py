"""What a user reads must be true: torchrun's default folder, refused runs that leave nothing,
throughput and counts that mean what they say, wandb's project from the environment, the
help pages, one table comparing a sweep's jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import TINY_ARGS, run_module
from helpers.runs import small_config

from moestack.metrics import format_summary, human_count
from moestack.train import torchrun_out_dir
from moestack.trainer import train


# --------------------------------------------------------------------------- torchrun
def test_torchrun_without_out_dir_gets_one_folder_every_rank_agrees_on():
    env = {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "3f2a9c"}
    assert torchrun_out_dir(["steps=2"], env) == "outputs/torchrun/3f2a9c"
    assert torchrun_out_dir(["out_dir=runs/a"], env) is None  # the user's folder wins
    assert torchrun_out_dir(["-m", "seed=0,1"], env) is None  # a sweep has its own folder
    assert torchrun_out_dir([], {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}) is None
    assert torchrun_out_dir([], {"TORCHELASTIC_RUN_ID": "3f2a9c"}) is None  # one process


def test_readmes_torchrun_command_runs_as_written(tmp_path):
    """README: `torchrun --standalone --nproc-per-node 4 -m moestack.train parallel.ep=2`,
    with 2 ranks and a tiny model: it trains into outputs/torchrun/<launch id>/."""
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "moestack.train",
         "parallel.ep=2", *TINY_ARGS, "telemetry=off"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "torchrun").iterdir())
    assert len(runs) == 1 and (runs[0] / "summary.json").is_file()
    assert (runs[0] / "train.rank1.log").is_file()  # both ranks wrote into the one folder


# --------------------------------------------------------------------------- refusals
def test_a_refused_run_leaves_no_folder(tmp_path):
    done = run_module(*TINY_ARGS, "model.n_heads=3", cwd=tmp_path)
    assert done.returncode == 2 and "model.n_heads=3" in done.stderr
    assert not (tmp_path / "outputs").exists()  # the dated default folder is gone
    done = run_module(*TINY_ARGS, "model.n_heads=3", "out_dir=runs/a", cwd=tmp_path)
    assert done.returncode == 2
    assert not (tmp_path / "runs/a").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("the user's")
    done = run_module(*TINY_ARGS, "model.n_heads=3", "out_dir=mine", cwd=tmp_path)
    assert done.returncode == 2 and (tmp_path / "mine/notes.txt").read_text() == "the user's"


# --------------------------------------------------------------------------- numbers
def test_summary_throughput_counts_training_steps_only(tmp_path, monkeypatch):
    """An evaluation that takes 0.5 s must not lower the tokens/s of the training steps."""
    import time

    from moestack import trainer

    real = trainer.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", slow_evaluate)
    cfg = small_config(steps=4, ckpt_every=0, eval_every=2)
    summary = train(cfg, tmp_path / "run")
    assert summary["perf/eval_s"] >= 1.0  # one periodic and the final evaluation
    tokens = cfg.batch_size * cfg.data.seq_len * cfg.steps
    assert summary["perf/tokens_per_s"] == pytest.approx(tokens / summary["perf/train_s"])
    assert "evaluation" in format_summary(summary)


@pytest.mark.parametrize(
    "n, shown",
    [(0, "0"), (384, "384"), (24_800, "24.8K"), (99_999, "100K"), (999_999, "1.00M"),
     (3_452_160, "3.45M"), (1_200_000_000, "1.20B")],
)  # fmt: skip
def test_counts_are_shown_with_three_digits_never_as_zero(n, shown):
    assert human_count(n) == shown


def test_trainable_count_and_global_batch_are_logged(tmp_path, caplog):
    with caplog.at_level("INFO", logger="moestack.trainer"):
        train(small_config(steps=1, ckpt_every=0, trainable="routers"), tmp_path / "run")
    routers = 2 * 32 * 4  # 2 layers x a D x E router, worked by hand
    assert f"trainable=routers: {routers} parameters train" in caplog.text
    assert "4 sequences of 32 tokens per micro-batch, the global batch" in caplog.text


# --------------------------------------------------------------------------- wandb
def test_wandb_project_from_the_environment_is_honoured(tmp_path):
    pytest.importorskip("wandb")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_PROJECT": "my-own-project-7q"}
    env.pop("WANDB_DIR", None)
    done = run_module(*TINY_ARGS, "telemetry=off", "out_dir=run", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    found = [
        p for p in (tmp_path / "run" / "wandb").rglob("*")
        if p.is_file() and b"my-own-project-7q" in p.read_bytes()
    ]  # fmt: skip
    assert found, "the offline run does not name the WANDB_PROJECT project"
    assert (tmp_path / "run" / "wandb_id.txt").is_file()  # where the README says it is


# --------------------------------------------------------------------------- help pages
def test_hydra_help_names_moestacks_version_flag(tmp_path):
    done = run_module("--hydra-help", cwd=tmp_path)
    assert done.returncode == 0
    assert "--version : Show moestack's version" in done.stdout
    assert "Show Hydra's version" not in done.stdout


def test_moestack_help_is_plain_text(tmp_path):
    done = run_module("--help", cwd=tmp_path, module="moestack.cli")
    assert done.returncode == 0 and "``" not in done.stdout


# --------------------------------------------------------------------------- sweeps
def test_a_sweep_ends_with_one_table_comparing_its_jobs(tmp_path):
    done = run_module("-m", *TINY_ARGS, "out_dir=sweep", "seed=0,1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "sweep/sweep_summary.json").read_text())
    assert [r["overrides"] for r in rows] == ["seed=0", "seed=1"]  # what sets them apart
    for job, row in zip(("0", "1"), rows, strict=True):
        summary = json.loads((tmp_path / "sweep" / job / "summary.json").read_text())
        assert row["val loss"] == summary["loss/val"]
        assert row["lru cap4 hit"] > 0  # telemetry on: the hit rates are in the table
    header = next(line for line in done.stdout.splitlines() if line.startswith("job "))
    assert "val loss" in header and "perplexity" in header and "lru cap4 hit" in header
    assert done.stdout.count("memory plan (per rank):\n") <= 1  # the table once, not per job
