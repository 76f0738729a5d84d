"""The user's surface of both commands: one folder per run, sweeps that survive a bad job,
--version, --help with every field, the provenance record, and one-line CLI errors."""

import argparse
import dataclasses
import json
import os
import re
import sys

import pytest
from helpers.cli import TINY_ARGS, run_module
from helpers.runs import small_config, small_model

import moestack
from moestack import cli
from moestack.config import TrainConfig

# A run of a few seconds: a tiny model, a slice of the corpus, no telemetry, no wandb.
TINY = [*TINY_ARGS, "telemetry=off"]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """A finished run with out_dir set, started from another folder."""
    cwd = tmp_path_factory.mktemp("cwd")
    out = tmp_path_factory.mktemp("runs") / "a"
    result = run_module(*TINY, f"out_dir={out}", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd, out


def test_out_dir_holds_the_whole_run(one_run):
    cwd, out = one_run
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        assert (out / ".hydra" / name).is_file(), name
    for name in ("train.log", "config.yaml", "provenance.json", "metrics.jsonl", "summary.json"):
        assert (out / name).is_file(), name
    assert "parameters" in (out / "train.log").read_text()  # the run's log lines
    assert list(cwd.iterdir()) == []  # nothing under outputs/ in the working folder


def test_each_run_records_what_produced_it(one_run):
    _, out = one_run
    starts = json.loads((out / "provenance.json").read_text())["starts"]
    assert len(starts) == 1
    start = starts[0]
    assert start["status"] == "finished"
    assert start["choices"]["model"] == "tiny" and start["choices"]["router"] == "baseline"
    assert f"out_dir={out}" in start["overrides"]
    assert start["moestack"] == moestack.__version__
    assert re.fullmatch(r"[0-9a-f]{40}", start["git_commit"] or "")  # run from a checkout
    import torch

    assert start["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert {"triton", "transformers", "python"} <= set(start["versions"])
    assert start["device"] == "cpu"


def test_a_sweep_with_a_bad_job_runs_the_others_and_counts_failures(tmp_path):
    result = run_module("-m", *TINY, "router.z_loss=-1,0", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr  # one job failed
    assert "router.z_loss=-1.0 must be >= 0" in result.stderr
    assert "1 of 2 jobs failed" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    sweeps = list((tmp_path / "multirun").glob("*/*"))  # hydra's default sweep folder
    assert len(sweeps) == 1
    assert not (sweeps[0] / "0" / "summary.json").exists()
    assert (sweeps[0] / "1" / "summary.json").is_file()  # the good job ran after the bad one
    assert (sweeps[0] / "1" / ".hydra" / "overrides.yaml").is_file()


def test_sweep_jobs_live_in_out_dir_and_are_named_in_wandb(tmp_path):
    """wandb (a stand-in module recording what wandb.init gets) names each job by its
    overrides and groups it by its sweep; out_dir is the sweep's folder."""
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(
        "import json, os\n"
        "class Settings:\n"
        "    def __init__(self, **kw): pass\n"
        "class _Run:\n"
        "    def log(self, *a, **k): pass\n"
        "    def finish(self): pass\n"
        "def init(**kw):\n"
        "    seen = {'name': kw.get('name') or os.environ.get('WANDB_NAME'),\n"
        "            'group': kw.get('group') or os.environ.get('WANDB_RUN_GROUP')}\n"
        "    with open(os.path.join(kw['dir'], 'wandb_seen.json'), 'w') as f: json.dump(seen, f)\n"
        "    return _Run()\n"
    )
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_NAME", "WANDB_RUN_GROUP")}
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH", "")) if p)
    env.update(WANDB_MODE="offline", PYTHONPATH=path)
    result = run_module("-m", *TINY, f"out_dir={sweep}", "seed=0,1", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    seen = [json.loads((sweep / job / "wandb_seen.json").read_text()) for job in ("0", "1")]
    assert [s["group"] for s in seen] == [str(sweep)] * 2
    names = [s["name"] for s in seen]
    assert "seed=0" in names[0] and "seed=1" in names[1] and "out_dir" not in names[0]


def test_version_is_moestacks(tmp_path, capsys):
    result = run_module("--version", cwd=tmp_path)
    assert result.stdout.strip() == f"moestack {moestack.__version__}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"moestack {moestack.__version__}"


def test_help_is_moestacks_with_every_field_and_its_comment(tmp_path):
    result = run_module("model=small", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith(f"moestack-train {moestack.__version__}")
    groups = text.split("== Config groups")[1].split("==")[1]
    assert "router: " in groups and "experiment" not in groups  # prereg specs are no group
    assert "optim.lr=0.003" in text and "peak learning rate" in text
    assert "model.d_model=256" in text  # model=small's value, not the default
    assert "model.moe.top_k=2" in text and "experts each token is routed to" in text
    assert "router.temporal=0.0" in text and "README.md" in text
    for field in dataclasses.fields(TrainConfig):
        assert re.search(rf"^\s*{field.name}[=\[ ]", text, re.M), field.name


def test_every_option_has_help_with_its_default():
    parser = cli.build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in verbs.choices.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.dest}"
            if action.option_strings:
                assert "default" in action.help, f"{name} {action.option_strings[0]}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["telemetry", "mixtral", "missing.txt", "out"], "text file 'missing.txt' not found"),
        (["report", "no-such-run"], "run folder 'no-such-run' not found"),
        (["simulate", "no-such-trace"], "trace folder 'no-such-trace' not found"),
        (["eval", "no-such-run"], "is not a moestack run directory"),
    ],
)
def test_missing_inputs_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_missing_transformers_names_the_extra(tmp_path, monkeypatch, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello " * 200)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(SystemExit):
        cli.main(["telemetry", "mixtral", str(text), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert "pip install 'moestack[hf]'" in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step run of a tiny model with its routing trace."""
    from moestack.config import DataConfig, OptimConfig, TelemetryConfig
    from moestack.trainer import train

    out = tmp_path_factory.mktemp("trained")
    cfg = small_config(
        model=small_model(n_layers=1),
        optim=OptimConfig(),
        data=DataConfig(seq_len=32, max_bytes=100_000),
        telemetry=TelemetryConfig(policies=["lru"]),
        steps=2, batch_size=2, eval_batches=1, ckpt_every=0,
    )  # fmt: skip
    train(cfg, out)
    return out


def test_eval_refuses_a_too_small_cache_before_writing_the_store(trained, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", str(trained), "--offload", "--capacity", "1", "--batches", "1"])
    assert exit_info.value.code == 2
    assert "--capacity 1 is below moe.top_k=2" in capsys.readouterr().err
    assert not (trained / "experts").exists()


def test_eval_prints_cache_counts_as_integers(trained, capsys):
    cli.main(["eval", str(trained), "--offload", "--capacity", "2", "--batches", "1"])
    result = json.loads(capsys.readouterr().out)
    for key in ("cache/hits", "cache/misses", "cache/requests", "cache/capacity"):
        assert type(result[key]) is int, key
    assert isinstance(result["cache/hit_rate"], float)


def test_simulate_says_how_many_requests_warm_up(trained, capsys):
    (part,) = (trained / "trace").iterdir()
    cli.main(["simulate", str(part), "--policies", "lru"])
    out = capsys.readouterr().out
    assert "warm-up: the first 10% of each layer's requests" in out
    cli.main(["simulate", str(part), "--policies", "lru", "--warmup", "0"])
    assert "warm-up: none, every request is counted" in capsys.readouterr().out
