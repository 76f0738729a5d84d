"""A small valid pre-registration and the run folders a finished study leaves, for the
pre-registration tests (file checks, lock, runner, analysis) and the fault tests."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import yaml

from moestack import prereg


def study(**changes: Any) -> dict[str, Any]:
    """A small valid pre-registration: baseline and arms a, b; three seeds; four hypotheses."""
    data: dict[str, Any] = {
        "study": "synthetic",
        "title": "synthetic study",
        "model": ["model=tiny"],
        "data": ["data.seq_len=32"],
        "budget": {"steps": 3, "batch_size": 2},
        "train": ["telemetry=off", "wandb_mode=disabled", "progress=false"],
        "runs": {
            "baseline": "baseline",
            "arms": {
                "baseline": ["router=baseline"],
                "a": ["router=temporal", "router.temporal=0.1"],
                "b": ["router=pin", "router.pin=0.1"],
            },
            "seeds": [0, 1, 2],
        },
        "analysis": {"eval_batches": 2, "policies": ["lru", "static"], "capacities": [2, 4]},
        "hypotheses": [
            {
                "id": "H1",
                "statement": "misses drop by 30%",
                "metric": "lru/cap4/miss_rate",
                "comparison": "relative_change",
                "op": "<=",
                "threshold": -0.30,
                "arms": ["a", "b"],
                "require": "any",
            },
            {
                "id": "H2",
                "statement": "perplexity within +1%",
                "metric": "perplexity",
                "comparison": "relative_change",
                "op": "<=",
                "threshold": 0.01,
                "arms": ["a", "b"],
                "require": "all",
            },
            {
                "id": "H3",
                "statement": "static hit rate up by 0.1",
                "metric": "static/cap4/hit_rate",
                "comparison": "difference",
                "op": ">=",
                "threshold": 0.10,
                "arms": ["b"],
            },
            {
                "id": "H4",
                "statement": "one arm passes H1 and H2",
                "comparison": "joint",
                "of": ["H1", "H2"],
                "arms": ["a", "b"],
                "require": "any",
            },
        ],
    }
    for key, value in changes.items():
        data[key] = value
    return data


def write(tmp_path: Path, data: dict[str, Any], name: str = "study.yaml") -> Path:
    """``data`` as YAML in ``tmp_path/name``."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    """A real checkpoint (``save_checkpoint``) of a tiny module whose weights depend on the
    run folder's name only, so that different runs hold different weights and a run trained
    again holds the same, as trained runs do."""
    import torch

    from moestack import checkpoint
    from moestack.config import ModelConfig

    gen = torch.Generator().manual_seed(zlib.crc32(Path(run_dir).name.encode()))
    module = torch.nn.Linear(4, 4)
    with torch.no_grad():
        module.weight.copy_(torch.randn(4, 4, generator=gen))
        module.bias.copy_(torch.randn(4, generator=gen))  # trained again: the same weights
    root = Path(run_dir) / "checkpoints"
    return checkpoint.save_checkpoint(root, step, module, ModelConfig(), {}, keep_last=1)


def fake_finish(cfg, out_dir: Path) -> None:
    """What a finished training leaves that the runner reads: the final checkpoint and
    summary.json."""
    fake_checkpoint(Path(out_dir), cfg.steps)
    (Path(out_dir) / "summary.json").write_text("{}")


BASE = {"perplexity": 10.0, "lru/cap4/miss_rate": 0.40, "static/cap4/hit_rate": 0.50}
ARMS = {
    # seed -> metrics; a cuts misses by 40%, 50%, 30% (mean -40%) at +0.5% perplexity;
    # b cuts misses by 10% at +2% perplexity and raises the static hit rate by 0.15.
    "a": [
        {"perplexity": 10.05, "lru/cap4/miss_rate": 0.24, "static/cap4/hit_rate": 0.5},
        {"perplexity": 10.05, "lru/cap4/miss_rate": 0.20, "static/cap4/hit_rate": 0.5},
        {"perplexity": 10.05, "lru/cap4/miss_rate": 0.28, "static/cap4/hit_rate": 0.5},
    ],
    "b": [{"perplexity": 10.2, "lru/cap4/miss_rate": 0.36, "static/cap4/hit_rate": 0.65}] * 3,
}


def full_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Every metric the report tables and plots read (values not under test set to 0.5)."""
    out = {
        f"{p}/cap{c}/{s}": 0.5
        for p in ("lru", "static")
        for c in (2, 4)
        for s in prereg.CACHE_STATS
    }
    out.update(val_loss=math.log(metrics["perplexity"]), **metrics)
    return out


def finished_run(
    item: prereg.RunSpec, lock: dict[str, Any], key: str, metrics: dict[str, float], steps: int = 3
) -> None:
    """A run folder as a finished study leaves it: summary.json, the final checkpoint, the
    run's identity record (trained under ``lock``) and its cached evaluation with
    ``metrics`` (sealed, under the analysis hash ``key``)."""
    item.run_dir.mkdir(parents=True, exist_ok=True)
    (item.run_dir / "summary.json").write_text("{}")
    fake_checkpoint(item.run_dir, steps)
    prereg.write_run_record(item.run_dir, lock, "finished", item)
    identity = prereg.read_run_record(item.run_dir)
    result = {"step": steps, "metrics": metrics}
    prereg.analysis.store_evaluation(item.run_dir, identity, key, result)


def fake_metrics(arm: str, seed: int, caps: tuple[int, ...]) -> dict[str, float]:
    """The fake evaluation of a run: helpers.prereg's numbers, every capacity filled in."""
    if arm in ARMS and caps == (2, 4):
        return full_metrics(ARMS[arm][seed])
    base = BASE if arm == "baseline" else ARMS.get(arm, [BASE] * 3)[seed % 3]
    out = {
        f"{p}/cap{c}/{s}": 0.5 for p in ("lru", "static") for c in caps for s in prereg.CACHE_STATS
    }
    return {**out, "val_loss": math.log(base["perplexity"]), **base}


def evaluating_train(spec: prereg.Prereg, calls: list[tuple[str, bool]] | None = None):
    """A train_fn that leaves a finished run (a final checkpoint, no real training); its
    evaluation is cached once the runner recorded the run's identity (``fake_evaluations``)."""

    def train(cfg, out_dir: Path) -> dict[str, Any]:
        if calls is not None:
            calls.append((Path(out_dir).name, cfg.resume))
        fake_finish(cfg, out_dir)
        return {}

    return train


def fake_evaluations(path: Path, out: Path) -> None:
    """Cache the fake evaluation (``fake_metrics``) of every finished run, as ``prereg evaluate``
    caches a real one: sealed, with the run's identity."""
    spec = prereg.load(path)
    key = prereg.analysis_key(spec)
    for item in prereg.plan(spec, out):
        identity = prereg.read_run_record(item.run_dir)
        metrics = fake_metrics(item.arm, item.seed, spec.analysis.capacities)
        result = {"step": identity["step"], "metrics": metrics}
        prereg.analysis.store_evaluation(item.run_dir, identity, key, result)


def trained_study(tmp_path: Path) -> tuple[Path, Path, str]:
    """A locked study whose 9 runs finished under the lock: (file, out dir, study hash)."""
    path = write(tmp_path, study())
    prereg.lock(path)
    out = tmp_path / "out"
    prereg.run(path, out, train_fn=evaluating_train(prereg.load(path)), progress=False)
    fake_evaluations(path, out)
    return path, out, prereg.verify(path)["study_sha256"]


def micro_study(width: int, layers: int, max_bytes: int, train: list[str] | None = None):
    """:func:`study` on a model small enough for real training in a test: two steps."""
    return study(
        model=[
            f"model.d_model={width}", f"model.n_layers={layers}", "model.n_heads=2",
            f"model.max_seq_len={width}", "model.moe.num_experts=4", f"model.moe.d_ff={width}",
        ],
        data=[f"data.seq_len={width}", f"data.max_bytes={max_bytes}"],
        budget={"steps": 2, "batch_size": 2},
        train=["telemetry=off", "wandb_mode=disabled", "progress=false", "eval_batches=1",
               "threads=1", *(train or [])],
    )  # fmt: skip


def two_arm_micro_study() -> dict[str, Any]:
    """:func:`micro_study` (width 32, two layers) cut to the baseline and arm a, seed 0, and
    the two hypotheses on arm a: the smallest study that really trains and evaluates."""
    data = micro_study(width=32, layers=2, max_bytes=1_000_000)
    data["runs"]["arms"].pop("b")
    data["runs"]["seeds"] = [0]
    data["hypotheses"] = data["hypotheses"][:2]
    for hyp in data["hypotheses"]:
        hyp["arms"] = ["a"]
    return data
