"""Pre-registered experiments: lock the hypotheses, run the grid, report pass/fail.

A pre-registration file (YAML, ``configs/experiment/<study>.yaml``, format in docs/prereg.md)
names the study, the training settings shared by every run (model, data, budget), the arms
(one list of hydra overrides per router loss and weight), the seeds, the analysis (final
checkpoint, the evaluation batches, cache policies and capacities, how seeds combine) and the
hypotheses (metric, comparison against the baseline arm, threshold).

Three steps, each a function the ``moestack prereg`` verbs call:

- ``lock(path)`` writes ``<file>.lock.json`` (sha256 of the file, git commit, UTC time)
  before any run; it refuses to overwrite a lock unless ``force``.
- ``run(path, out_dir)`` checks the lock, then trains every arm x seed with
  ``moestack.train.train``, each config composed by hydra from configs/ (``compose`` with the
  same overrides ``moestack-train`` takes, one process, one run after another). A run whose
  directory holds ``summary.json`` is skipped; one with a checkpoint resumes from it.
- ``analyze(path, out_dir)`` refuses a file whose hash differs from the lock, evaluates each
  run's final checkpoint (perplexity over the pre-registered validation batches; the routing
  of the same batches, recorded with telemetry in eval mode, replayed through LRU and
  static-pin caches) and writes report.md, results.json and two PNGs.

Seeds combine by pairing: arm and baseline with the same seed share the initialisation and
the data order, so each hypothesis's comparison is computed per seed and the seeds give its
mean and a two-sided t confidence interval.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import math
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moestack.config import CACHE_POLICIES, TrainConfig
from moestack.errors import MoestackError

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock.json"
EVAL_FILE = "prereg_eval.json"
SUMMARY_FILE = "summary.json"
COMPARISONS = ("relative_change", "difference", "value", "joint")
OPS = ("<=", ">=")
DECISIONS = ("mean", "ci")
REQUIRES = ("any", "all")
CACHE_STATS = ("hit_rate", "miss_rate", "misses_per_token")
SCALAR_METRICS = ("perplexity", "val_loss")
RESERVED_KEYS = ("seed", "out_dir", "resume")  # set by the runner, one value per run
_CACHE_METRIC = re.compile(r"^([a-z+]+)/cap(\d+)/([a-z_]+)$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


# --------------------------------------------------------------------------- the file format
@dataclass(frozen=True)
class Hypothesis:
    """One pre-registered claim: ``comparison(metric of arm, of baseline) op threshold``."""

    id: str
    statement: str
    metric: str  # "perplexity", "val_loss" or "<policy>/cap<c>/<hit_rate|miss_rate|...>"
    arms: tuple[str, ...]  # the arms it is tested on, one table row each
    comparison: str  # relative_change (arm/base - 1), difference (arm - base), value, joint
    op: str  # "<=" or ">=": the side of the threshold that passes
    threshold: float
    require: str  # "any" arm passing suffices, or "all" must pass
    of: tuple[str, ...] = ()  # joint: the hypotheses one arm must pass together


@dataclass(frozen=True)
class Analysis:
    """How each run is evaluated and how seeds combine (fixed before any run)."""

    checkpoint: str = "final"  # only the final checkpoint (step == steps) is evaluated
    eval_batches: int = 16  # validation batches (moestack.data.eval_batches, fixed windows)
    eval_batch_size: int = 0  # sequences per batch (0 = the run's batch_size)
    eval_seq_len: int = 0  # tokens per sequence (0 = the run's data.seq_len)
    policies: tuple[str, ...] = ("lru", "static")
    capacities: tuple[int, ...] = (2, 4, 6)  # expert slots per layer
    warmup: float = 0.1  # share of each layer's requests that warms the cache, not counted
    confidence: float = 0.95  # two-sided t interval over seeds
    decision: str = "mean"  # "mean": the seed mean meets the threshold; "ci": the whole CI does
    scatter_capacity: int = 0  # capacity of the hit-rate-vs-perplexity scatter (0 = 2nd)
    device: str = "auto"  # where the evaluation runs


@dataclass(frozen=True)
class Prereg:
    """A validated pre-registration file."""

    path: Path
    study: str
    title: str
    question: str
    base_overrides: tuple[str, ...]  # model, data, budget and train settings, in that order
    baseline: str
    arms: dict[str, tuple[str, ...]]  # arm name -> its overrides
    seeds: tuple[int, ...]
    analysis: Analysis
    hypotheses: tuple[Hypothesis, ...]
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def overrides(self, arm: str, seed: int) -> list[str]:
        """The moestack-train overrides of one run (out_dir and resume added by the runner)."""
        return [*self.base_overrides, *self.arms[arm], f"seed={seed}"]


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid: an arm, a seed, its directory and overrides."""

    arm: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.arm}-s{self.seed}"


def _fail(field_name: str, problem: str, fix: str) -> MoestackError:
    return MoestackError(f"{field_name}: {problem}; {fix}")


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected a mapping, got {type(value).__name__}", "see docs/prereg.md")
    return value


def _overrides(value: Any, where: str) -> tuple[str, ...]:
    """A list of hydra override strings, none of them setting a runner-owned key."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail(where, f"expected a list of overrides, got {value!r}", "write [key=value, ...]")
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, str) or not ("=" in item or item.startswith("~")):
            raise _fail(at, f"{item!r} is not a hydra override", "write it as key=value")
        key = item.split("=", 1)[0].lstrip("+~")
        if not key:
            raise _fail(at, f"{item!r} has no key", "write it as key=value")
        if key in RESERVED_KEYS:
            raise _fail(
                at, f"{key} is set by the runner for every run", f"remove {item!r} from the file"
            )
        out.append(item)
    return tuple(out)


def _number(value: Any, where: str, kind: type = float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"expected a number, got {value!r}", "give a number")
    if kind is int and int(value) != value:
        raise _fail(where, f"expected a whole number, got {value!r}", "give an integer")
    return kind(value)


def _analysis(raw: dict[str, Any]) -> Analysis:
    known = {f.name for f in dataclasses.fields(Analysis)}
    for key in raw:
        if key not in known:
            raise _fail(f"analysis.{key}", "unknown field", f"use fields from {sorted(known)}")
    kw: dict[str, Any] = {}
    if "checkpoint" in raw and raw["checkpoint"] != "final":
        raise _fail(
            "analysis.checkpoint",
            f"{raw['checkpoint']!r} is not supported",
            "use 'final' (the checkpoint at step == steps)",
        )
    for name in ("eval_batches", "eval_batch_size", "eval_seq_len", "scatter_capacity"):
        if name in raw:
            kw[name] = _number(raw[name], f"analysis.{name}", int)
            low = 1 if name == "eval_batches" else 0
            if kw[name] < low:
                raise _fail(f"analysis.{name}", f"{kw[name]} must be >= {low}", "raise it")
    if "policies" in raw:
        policies = raw["policies"]
        if not isinstance(policies, list) or not policies:
            raise _fail("analysis.policies", f"{policies!r} is not a list", "e.g. [lru, static]")
        for i, p in enumerate(policies):
            if p not in CACHE_POLICIES:
                raise _fail(
                    f"analysis.policies[{i}]", f"{p!r} is unknown", f"use one of {CACHE_POLICIES}"
                )
        kw["policies"] = tuple(policies)
    if "capacities" in raw:
        caps = raw["capacities"]
        if not isinstance(caps, list) or not caps:
            raise _fail("analysis.capacities", f"{caps!r} is not a list", "e.g. [2, 4, 6]")
        kw["capacities"] = tuple(
            _number(c, f"analysis.capacities[{i}]", int) for i, c in enumerate(caps)
        )
        for i, c in enumerate(kw["capacities"]):
            if c < 1:
                raise _fail(f"analysis.capacities[{i}]", f"{c} < 1", "use expert slots >= 1")
    if "warmup" in raw:
        kw["warmup"] = _number(raw["warmup"], "analysis.warmup")
        if not 0 <= kw["warmup"] < 1:
            raise _fail("analysis.warmup", f"{kw['warmup']} not in [0, 1)", "give a share")
    if "confidence" in raw:
        kw["confidence"] = _number(raw["confidence"], "analysis.confidence")
        if not 0 < kw["confidence"] < 1:
            raise _fail("analysis.confidence", f"{kw['confidence']} not in (0, 1)", "e.g. 0.95")
    if "decision" in raw:
        if raw["decision"] not in DECISIONS:
            raise _fail("analysis.decision", f"{raw['decision']!r}", f"use one of {DECISIONS}")
        kw["decision"] = raw["decision"]
    if "device" in raw:
        if raw["device"] not in ("auto", "cpu", "cuda"):
            raise _fail("analysis.device", f"{raw['device']!r}", "use auto, cpu or cuda")
        kw["device"] = raw["device"]
    analysis = Analysis(**kw)
    if analysis.scatter_capacity and analysis.scatter_capacity not in analysis.capacities:
        raise _fail(
            "analysis.scatter_capacity",
            f"{analysis.scatter_capacity} is not in analysis.capacities",
            "pick one of them",
        )
    return analysis


def _check_metric(metric: Any, analysis: Analysis, where: str) -> str:
    if not isinstance(metric, str):
        raise _fail(where, f"expected a string, got {metric!r}", "e.g. lru/cap4/miss_rate")
    if metric in SCALAR_METRICS:
        return metric
    match = _CACHE_METRIC.match(metric)
    if not match:
        raise _fail(
            where,
            f"{metric!r} is not a metric",
            f"use one of {SCALAR_METRICS} or <policy>/cap<capacity>/<{'|'.join(CACHE_STATS)}>",
        )
    policy, cap, stat = match.group(1), int(match.group(2)), match.group(3)
    if policy not in analysis.policies:
        raise _fail(where, f"policy {policy!r} is not in analysis.policies", "add it there")
    if cap not in analysis.capacities:
        raise _fail(where, f"capacity {cap} is not in analysis.capacities", "add it there")
    if stat not in CACHE_STATS:
        raise _fail(where, f"statistic {stat!r} is unknown", f"use one of {CACHE_STATS}")
    return metric


def _hypotheses(raw: Any, arms: dict[str, tuple[str, ...]], baseline: str, analysis: Analysis):
    if not isinstance(raw, list) or not raw:
        raise _fail("hypotheses", "expected a non-empty list", "pre-register at least one")
    seen: dict[str, Hypothesis] = {}
    for i, item in enumerate(raw):
        where = f"hypotheses[{i}]"
        item = _mapping(item, where)
        known = {"id", "statement", "metric", "arms", "comparison", "op", "threshold"}
        known |= {"require", "of"}
        for key in item:
            if key not in known:
                raise _fail(f"{where}.{key}", "unknown field", f"use fields from {sorted(known)}")
        hid = item.get("id")
        if not isinstance(hid, str) or not _NAME.match(hid):
            raise _fail(f"{where}.id", f"{hid!r} is not a name", "e.g. H1")
        if hid in seen:
            raise _fail(f"{where}.id", f"{hid!r} is used twice", "give each hypothesis its own id")
        where = f"hypotheses[{i}] ({hid})"
        statement = item.get("statement", "")
        if not isinstance(statement, str) or not statement.strip():
            raise _fail(f"{where}.statement", "missing", "state the claim in one sentence")
        comparison = item.get("comparison")
        if comparison not in COMPARISONS:
            raise _fail(f"{where}.comparison", f"{comparison!r}", f"use one of {COMPARISONS}")
        hyp_arms = item.get("arms")
        if isinstance(hyp_arms, str):
            hyp_arms = [hyp_arms]
        if not isinstance(hyp_arms, list) or not hyp_arms:
            raise _fail(f"{where}.arms", f"{hyp_arms!r}", "list the arms it is tested on")
        for j, arm in enumerate(hyp_arms):
            if arm not in arms:
                raise _fail(f"{where}.arms[{j}]", f"{arm!r} is not an arm", f"use {sorted(arms)}")
            if arm == baseline and comparison in ("relative_change", "difference"):
                raise _fail(
                    f"{where}.arms[{j}]",
                    f"the baseline {arm!r} cannot be compared with itself",
                    "remove it or use comparison: value",
                )
        require = item.get("require", "all")
        if require not in REQUIRES:
            raise _fail(f"{where}.require", f"{require!r}", f"use one of {REQUIRES}")
        if comparison == "joint":
            of = item.get("of")
            if not isinstance(of, list) or not of:
                raise _fail(f"{where}.of", f"{of!r}", "list the ids of earlier hypotheses")
            for j, ref in enumerate(of):
                if ref not in seen or seen[ref].comparison == "joint":
                    raise _fail(
                        f"{where}.of[{j}]",
                        f"{ref!r} is not an earlier non-joint hypothesis",
                        "list ids defined above this one",
                    )
                missing = [a for a in hyp_arms if a not in seen[ref].arms]
                if missing:
                    raise _fail(f"{where}.of[{j}]", f"{ref} is not tested on {missing}", "add them")
            seen[hid] = Hypothesis(
                hid, statement.strip(), "", tuple(hyp_arms), "joint", "", 0.0, require, tuple(of)
            )
            continue
        metric = _check_metric(item.get("metric"), analysis, f"{where}.metric")
        op = item.get("op")
        if op not in OPS:
            raise _fail(f"{where}.op", f"{op!r}", f"use one of {OPS} (the side that passes)")
        threshold = _number(item.get("threshold"), f"{where}.threshold")
        seen[hid] = Hypothesis(
            hid, statement.strip(), metric, tuple(hyp_arms), comparison, op, threshold, require
        )
    return tuple(seen.values())


def parse(data: Any, path: Path | str = "<memory>") -> Prereg:
    """Validate a loaded pre-registration mapping; errors name the field and the fix."""
    data = _mapping(data, "the file")
    top = {"study", "title", "question", "model", "data", "budget", "train", "runs"}
    top |= {"analysis", "hypotheses"}
    for key in data:
        if key not in top:
            raise _fail(key, "unknown top-level field", f"use fields from {sorted(top)}")
    study = data.get("study")
    if not isinstance(study, str) or not _NAME.match(study):
        raise _fail("study", f"{study!r} is not a name", "use letters, digits, _ . -")
    model = _overrides(data.get("model"), "model")
    if not model:
        raise _fail("model", "missing", "give the model as overrides, e.g. [model=tiny]")
    data_ov = _overrides(data.get("data"), "data")
    budget = _mapping(data.get("budget"), "budget")
    if "steps" not in budget:
        raise _fail("budget.steps", "missing", "give the optimizer steps of every run")
    budget_ov = []
    for key in ("steps", "batch_size", "grad_accum"):
        if key in budget:
            value = _number(budget[key], f"budget.{key}", int)
            if value < 1:
                raise _fail(f"budget.{key}", f"{value} must be >= 1", "raise it")
            budget_ov.append(f"{key}={value}")
    for key in budget:
        if key not in ("steps", "batch_size", "grad_accum"):
            raise _fail(f"budget.{key}", "unknown field", "use steps, batch_size, grad_accum")
    train_ov = _overrides(data.get("train"), "train")
    runs = _mapping(data.get("runs"), "runs")
    for key in runs:
        if key not in ("baseline", "arms", "seeds"):
            raise _fail(f"runs.{key}", "unknown field", "use baseline, arms, seeds")
    arms_raw = _mapping(runs.get("arms"), "runs.arms")
    if not arms_raw:
        raise _fail("runs.arms", "empty", "list the baseline and at least one other arm")
    arms: dict[str, tuple[str, ...]] = {}
    for name, ov in arms_raw.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise _fail(f"runs.arms.{name}", "not a name", "use letters, digits, _ . -")
        arms[name] = _overrides(ov, f"runs.arms.{name}")
    baseline = runs.get("baseline")
    if baseline not in arms:
        raise _fail("runs.baseline", f"{baseline!r} is not an arm", f"use one of {sorted(arms)}")
    seeds = runs.get("seeds")
    if not isinstance(seeds, list) or not seeds:
        raise _fail("runs.seeds", f"{seeds!r}", "give a list of integer seeds, e.g. [0, 1]")
    seeds_t = tuple(_number(s, f"runs.seeds[{i}]", int) for i, s in enumerate(seeds))
    if len(set(seeds_t)) != len(seeds_t):
        raise _fail("runs.seeds", f"{list(seeds_t)} repeats a seed", "list each seed once")
    analysis = _analysis(_mapping(data.get("analysis", {}) or {}, "analysis"))
    hypotheses = _hypotheses(data.get("hypotheses"), arms, baseline, analysis)
    return Prereg(
        path=Path(path),
        study=study,
        title=str(data.get("title", study)),
        question=str(data.get("question", "")),
        base_overrides=(*model, *data_ov, *budget_ov, *train_ov),
        baseline=baseline,
        arms=arms,
        seeds=seeds_t,
        analysis=analysis,
        hypotheses=hypotheses,
        raw=data,
    )


def load(path: Path | str) -> Prereg:
    """Read and validate a pre-registration file."""
    path = Path(path)
    if not path.is_file():
        raise MoestackError(f"{path}: no such pre-registration file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise MoestackError(f"{path}: not valid YAML ({err})") from None
    try:
        return parse(data, path)
    except MoestackError as err:
        raise MoestackError(f"{path}: {err}") from None


# --------------------------------------------------------------------------- lock
def lock_path(path: Path | str) -> Path:
    """Where the lock of ``path`` lives: ``<file>.lock.json`` beside it."""
    path = Path(path)
    return path.with_name(path.name + LOCK_SUFFIX)


def sha256_file(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def lock(path: Path | str, force: bool = False) -> Path:
    """Validate ``path`` and record its sha256, the git commit and the UTC time; returns the lock.

    Refuses to replace an existing lock unless ``force`` (re-locking after results exist
    defeats pre-registration; the old lock's hash is kept in the new one as ``replaces``).
    """
    path = Path(path)
    spec = load(path)
    check_overrides(spec)
    target = lock_path(path)
    previous = None
    if target.exists():
        if not force:
            raise MoestackError(
                f"{target} exists: {path.name} is already locked; a pre-registration is locked "
                "once (pass --force to re-lock, and say why in the report)"
            )
        previous = json.loads(target.read_text()).get("sha256")
    folder = path.resolve().parent
    commit = _git(["rev-parse", "HEAD"], folder) or "unknown"
    status = _git(["status", "--porcelain"], folder)
    record = {
        "file": path.name,
        "study": spec.study,
        "sha256": sha256_file(path),
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "locked_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if previous:
        record["replaces"] = previous
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, target)
    log.info("locked %s: sha256 %s at commit %s", path, record["sha256"][:12], commit[:12])
    return target


def verify(path: Path | str) -> dict[str, Any]:
    """The lock record of ``path``; raises when there is none or the file changed since."""
    path = Path(path)
    target = lock_path(path)
    if not target.is_file():
        raise MoestackError(
            f"{path} is not locked ({target.name} not found); run `moestack prereg lock {path}` "
            "before running or analysing the study"
        )
    try:
        record = json.loads(target.read_text())
        locked = record["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise MoestackError(f"{target} is not a valid lock file; restore it from git") from None
    current = sha256_file(path)
    if current != locked:
        raise MoestackError(
            f"{path} changed since it was locked at {record.get('locked_at', '?')} "
            f"(sha256 {locked[:12]} in {target.name}, {current[:12]} now): the pre-registered "
            f"hypotheses no longer match; restore the locked version (git checkout {path}) or "
            "register the change as a new study with its own name and lock"
        )
    return record


# --------------------------------------------------------------------------- configs and runs
def compose_config(overrides: Sequence[str]) -> TrainConfig:
    """The TrainConfig ``moestack-train <overrides>`` would run (hydra compose over configs/)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from moestack.config import register_configs

    register_configs()
    try:
        with initialize_config_module(config_module="moestack.configs", version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides))
        return OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise MoestackError(f"overrides {list(overrides)} do not compose: {err}") from None


def check_overrides(spec: Prereg) -> None:
    """Compose every arm once, so a typo fails at lock time, naming the arm."""
    for arm in spec.arms:
        try:
            compose_config(spec.overrides(arm, spec.seeds[0]))
        except MoestackError as err:
            raise MoestackError(f"runs.arms.{arm}: {err}") from None


def default_out_dir(spec: Prereg) -> Path:
    return Path("runs") / "prereg" / spec.study


def plan(spec: Prereg, out_dir: Path | str | None = None) -> list[RunSpec]:
    """Every run of the grid, seed by seed (each seed's arms in file order), so that a study
    cut short still holds complete seeds: paired comparisons need every arm of a seed."""
    root = Path(out_dir) if out_dir else default_out_dir(spec)
    return [
        RunSpec(arm, seed, root / "runs" / f"{arm}-s{seed}", tuple(spec.overrides(arm, seed)))
        for seed in spec.seeds
        for arm in spec.arms
    ]


def is_finished(run_dir: Path) -> bool:
    return (run_dir / SUMMARY_FILE).is_file()


def _train(cfg: TrainConfig, out_dir: Path) -> dict[str, Any]:
    """moestack.train.train, imported late: torch loads only when a run trains."""
    from moestack.train import train

    return train(cfg, out_dir)


def run(
    path: Path | str,
    out_dir: Path | str | None = None,
    *,
    train_fn: Callable[[TrainConfig, Path], dict[str, Any]] | None = None,
    progress: bool = True,
) -> list[Path]:
    """Train every run of the locked study that has not finished; returns all run dirs.

    A run with ``summary.json`` is skipped; one with a checkpoint resumes from it
    (``resume=true``, same out_dir). ``train_fn`` replaces ``moestack.train.train``.
    """
    from moestack import checkpoint

    verify(path)
    spec = load(path)
    runs = plan(spec, out_dir)
    train_fn = train_fn or _train
    todo = [r for r in runs if not is_finished(r.run_dir)]
    log.info(
        "study %s: %d runs, %d finished, %d to train", spec.study, len(runs), len(runs) - len(todo),
        len(todo),
    )  # fmt: skip
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc=spec.study, unit="run")
    try:
        for item in todo:
            resume = checkpoint.latest_checkpoint(item.run_dir / "checkpoints") is not None
            overrides = [
                *item.overrides,
                f"out_dir={item.run_dir}",
                f"resume={str(resume).lower()}",
            ]
            cfg = compose_config(overrides)
            item.run_dir.mkdir(parents=True, exist_ok=True)
            (item.run_dir / "prereg_overrides.json").write_text(json.dumps(overrides, indent=2))
            log.info("%s: %s %s", item.name, "resuming" if resume else "training", item.run_dir)
            if bar is not None:
                bar.set_postfix_str(item.name)
            train_fn(cfg, item.run_dir)
            if not is_finished(item.run_dir):
                raise MoestackError(f"{item.name}: training ended without {SUMMARY_FILE}")
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return [r.run_dir for r in runs]


# --------------------------------------------------------------------------- evaluation
def analysis_key(spec: Prereg) -> str:
    """Hash of the analysis settings: a cached per-run evaluation is reused only if it matches."""
    blob = json.dumps(dataclasses.asdict(spec.analysis), sort_keys=True, default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _load_run_config(run_dir: Path) -> TrainConfig:
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise MoestackError(f"{path} not found: {run_dir} is not a finished training run")
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def evaluate_run(
    run_dir: Path, analysis: Analysis, corpora: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Perplexity and cache hit rates of a run's final checkpoint on the pre-registered batches.

    One eval-mode pass over the batches gives the cross-entropy and, through telemetry, the
    routing trace; each policy x capacity replays that trace with ``analysis.warmup``.
    ``corpora`` caches loaded corpora between runs (keyed by the data config).
    """
    import torch

    from moestack import checkpoint
    from moestack.data import eval_batches, load_corpus
    from moestack.model import MoETransformer
    from moestack.telemetry import attach, simulate
    from moestack.train import evaluate, resolve_device

    cfg = _load_run_config(run_dir)
    ckpt = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise MoestackError(f"{run_dir / 'checkpoints'} holds no checkpoint")
    step = int(checkpoint.read_meta(ckpt)["step"])
    if step != cfg.steps:
        raise MoestackError(
            f"{ckpt} is step {step}, not the final step {cfg.steps}; finish the run first"
        )
    device = resolve_device(analysis.device if analysis.device != "auto" else cfg.device)
    model = MoETransformer(cfg.model)
    checkpoint.load_model_weights(ckpt, model, cfg.model)
    model.to(device)
    corpora = {} if corpora is None else corpora
    key = repr(cfg.data)
    if key not in corpora:
        corpora[key] = load_corpus(cfg.data)
    batch_size = analysis.eval_batch_size or cfg.batch_size
    seq_len = analysis.eval_seq_len or cfg.data.seq_len
    batches = eval_batches(corpora[key].val, batch_size, seq_len, analysis.eval_batches)
    tokens = batch_size * seq_len * analysis.eval_batches
    tel = attach(
        model,
        policies=analysis.policies,
        capacities=analysis.capacities,
        max_memory_tokens=tokens + 1,
        entropy=False,
    )
    with tel, torch.no_grad():
        result = evaluate(model, batches, device)
    trace = tel.trace
    metrics: dict[str, float] = {
        "perplexity": result["eval/perplexity"],
        "val_loss": result["loss/val"],
    }
    for policy in analysis.policies:
        for cap in analysis.capacities:
            stats = simulate(trace, policy, cap, warmup=analysis.warmup, reuse=False)
            metrics[f"{policy}/cap{cap}/hit_rate"] = stats.hit_rate
            metrics[f"{policy}/cap{cap}/miss_rate"] = 1.0 - stats.hit_rate
            metrics[f"{policy}/cap{cap}/misses_per_token"] = stats.misses_per_token
    return {
        "checkpoint": str(ckpt),
        "step": step,
        "eval_tokens": tokens,
        "router": dataclasses.asdict(cfg.router),  # as trained (config.yaml), for provenance
        "top_k": cfg.model.moe.top_k,
        "num_experts": cfg.model.moe.num_experts,
        "metrics": metrics,
    }


def collect(
    spec: Prereg, out_dir: Path | str | None = None, *, evaluate: bool = True
) -> list[dict[str, Any]]:
    """One record per planned run: its arm, seed, status and metrics (evaluated, or cached).

    A finished run's evaluation is stored in ``<run>/prereg_eval.json`` with the analysis
    hash, and reused while the analysis settings are unchanged.
    """
    key = analysis_key(spec)
    corpora: dict[str, Any] = {}
    records = []
    for item in plan(spec, out_dir):
        record: dict[str, Any] = {"run": item.name, "arm": item.arm, "seed": item.seed}
        record["run_dir"] = str(item.run_dir)
        cached = item.run_dir / EVAL_FILE
        if not is_finished(item.run_dir):
            record["status"] = "missing"
        elif cached.is_file() and json.loads(cached.read_text()).get("analysis_key") == key:
            record.update(json.loads(cached.read_text()), status="done")
        elif evaluate:
            log.info("%s: evaluating the final checkpoint", item.name)
            result = evaluate_run(item.run_dir, spec.analysis, corpora)
            result.update(run=item.name, arm=item.arm, seed=item.seed, analysis_key=key)
            cached.write_text(json.dumps(result, indent=2))
            record.update(result, status="done")
        else:
            record["status"] = "not evaluated"
        records.append(record)
    return records


# --------------------------------------------------------------------------- statistics
def _t_cdf(x: float, df: int) -> float:
    """Student t CDF by Simpson integration of the density from 0 (x >= 0)."""
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    n = 4000  # even
    h = x / n
    total = 0.0
    for i in range(n + 1):
        t = i * h
        weight = 1 if i in (0, n) else (4 if i % 2 else 2)
        total += weight * (1 + t * t / df) ** (-(df + 1) / 2)
    return 0.5 + const * total * h / 3


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """Mean and two-sided t interval; with one value the interval is (nan, nan)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _compare(comparison: str, arm: float, base: float) -> float:
    if comparison == "relative_change":
        return arm / base - 1.0 if base else math.nan
    if comparison == "difference":
        return arm - base
    return arm


def _passes(value: float, op: str, threshold: float) -> bool:
    return value <= threshold if op == "<=" else value >= threshold


def evaluate_hypotheses(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hypothesis: one row per arm (estimate, CI, margin, pass) and the verdict.

    The comparison is computed per seed (arm and baseline share the seed), then averaged;
    ``margin`` is the distance from the threshold on the passing side (negative = fails).
    """
    values: dict[tuple[str, int], dict[str, float]] = {
        (r["arm"], r["seed"]): r["metrics"] for r in records if r.get("status") == "done"
    }
    conf = spec.analysis.confidence
    results: dict[str, dict[str, Any]] = {}
    for hyp in spec.hypotheses:
        rows = []
        for arm in hyp.arms:
            if hyp.comparison == "joint":
                parts = [
                    next(row for row in results[ref]["rows"] if row["arm"] == arm) for ref in hyp.of
                ]
                if any(p["pass"] is None for p in parts):
                    ok = None if all(p["pass"] is not False for p in parts) else False
                else:
                    ok = all(p["pass"] for p in parts)
                margins = [p["margin"] for p in parts if p["margin"] is not None]
                rows.append(
                    {"arm": arm, "pass": ok, "margin": min(margins) if margins else None,
                     "parts": {ref: p["pass"] for ref, p in zip(hyp.of, parts, strict=True)}}
                )  # fmt: skip
                continue
            per_seed, base_vals, arm_vals = [], [], []
            for seed in spec.seeds:
                a = values.get((arm, seed))
                b = values.get((spec.baseline, seed))
                if a is None or (b is None and hyp.comparison != "value"):
                    continue
                arm_vals.append(a[hyp.metric])
                if b is not None:
                    base_vals.append(b[hyp.metric])
                base = b[hyp.metric] if b is not None else math.nan
                per_seed.append(_compare(hyp.comparison, a[hyp.metric], base))
            row: dict[str, Any] = {"arm": arm, "n": len(per_seed), "per_seed": per_seed}
            if not per_seed or any(math.isnan(v) for v in per_seed):
                row.update({"estimate": None, "ci": [None, None], "margin": None, "pass": None})
                rows.append(row)
                continue
            est, lo, hi = mean_ci(per_seed, conf)
            margin = hyp.threshold - est if hyp.op == "<=" else est - hyp.threshold
            if spec.analysis.decision == "ci":
                bound = hi if hyp.op == "<=" else lo
                ok = None if math.isnan(bound) else _passes(bound, hyp.op, hyp.threshold)
            else:
                ok = _passes(est, hyp.op, hyp.threshold)
            ci_verdict = "n/a"
            if not math.isnan(lo):
                if _passes(hi if hyp.op == "<=" else lo, hyp.op, hyp.threshold):
                    ci_verdict = "supported"
                elif not _passes(lo if hyp.op == "<=" else hi, hyp.op, hyp.threshold):
                    ci_verdict = "refuted"
                else:
                    ci_verdict = "inconclusive"
            row.update(
                baseline_mean=sum(base_vals) / len(base_vals) if base_vals else None,
                arm_mean=sum(arm_vals) / len(arm_vals),
                estimate=est,
                ci=[None if math.isnan(lo) else lo, None if math.isnan(hi) else hi],
                margin=margin,
                ci_verdict=ci_verdict,
            )
            row["pass"] = ok
            rows.append(row)
        passes = [r["pass"] for r in rows]
        if hyp.require == "any":
            verdict = (
                "pass"
                if any(p is True for p in passes)
                else ("incomplete" if any(p is None for p in passes) else "fail")
            )
        else:
            verdict = (
                "fail"
                if any(p is False for p in passes)
                else ("incomplete" if any(p is None for p in passes) else "pass")
            )
        results[hyp.id] = {**dataclasses.asdict(hyp), "rows": rows, "verdict": verdict}
    return list(results.values())


# --------------------------------------------------------------------------- report
def _fmt(value: Any, digits: int = 4, pct: bool = False, pp: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if pct:
        return f"{100 * value:+.1f}%"
    if pp:  # a distance between two percentages: percentage points
        return f"{100 * value:+.1f} pp"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "fail")


def _claim(hyp: dict[str, Any]) -> str:
    if hyp["comparison"] == "joint":
        need = "any arm" if hyp["require"] == "any" else "every arm"
        return f"one arm passes {' and '.join(hyp['of'])} together ({need})"
    lhs = {
        "relative_change": f"{hyp['metric']} (arm / baseline - 1)",
        "difference": f"{hyp['metric']} (arm - baseline)",
        "value": hyp["metric"],
    }[hyp["comparison"]]
    pct = hyp["comparison"] == "relative_change"
    need = "any arm passing suffices" if hyp["require"] == "any" else "every arm must pass"
    return f"{lhs} {hyp['op']} {_fmt(hyp['threshold'], pct=pct)}; {need}"


def render_markdown(
    spec: Prereg,
    lock_record: dict[str, Any],
    records: Sequence[dict[str, Any]],
    hypotheses: Sequence[dict[str, Any]],
    figures: Sequence[str],
) -> str:
    """The report: provenance, the verdicts, one table per hypothesis, the runs, the figures."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    lines = [
        f"# Pre-registered study: {spec.title}",
        "",
        f"- Study `{spec.study}`, file `{spec.path.name}`, sha256 `{lock_record['sha256']}`",
        f"- Locked at {lock_record.get('locked_at')} (git commit "
        f"`{lock_record.get('git_commit')}`); the file matches its lock.",
        f"- Runs: {len(done)} of {len(records)} finished and evaluated "
        f"({len(spec.arms)} arms x {len(spec.seeds)} seeds).",
        f"- Evaluation: final checkpoint, {a.eval_batches} validation batches; cache replay "
        f"with the first {a.warmup:.0%} of each layer's requests as warm-up (not counted); "
        f"seeds paired with the baseline, mean and {a.confidence:.0%} t interval; "
        f"decision rule: {a.decision}"
        + (
            f"; with {len(spec.seeds)} seeds the interval is mean +- "
            f"{t_quantile(0.5 + a.confidence / 2, len(spec.seeds) - 1):.2f} x sd / sqrt(n)."
            if len(spec.seeds) > 1
            else "."
        ),
        "",
    ]
    if spec.question:
        lines += [f"Question: {spec.question}", ""]
    lines += ["## Runs as registered", "", f"Shared: `{' '.join(spec.base_overrides)}`", ""]
    lines += ["| arm | overrides |", "|---|---|"]
    lines += [f"| {arm} | `{' '.join(ov)}` |" for arm, ov in spec.arms.items()]
    lines += ["", f"Seeds: {', '.join(map(str, spec.seeds))}; baseline: {spec.baseline}.", ""]
    lines += ["## Verdicts", "", "| id | hypothesis | verdict |", "|---|---|---|"]
    lines += [f"| {h['id']} | {h['statement']} | **{h['verdict']}** |" for h in hypotheses]
    lines.append("")
    for h in hypotheses:
        lines += [
            f"## {h['id']}: {h['verdict']}",
            "",
            h["statement"],
            "",
            f"Test: {_claim(h)}.",
            "",
        ]
        if h["comparison"] == "joint":
            lines += ["| arm | " + " | ".join(h["of"]) + " | min margin | pass |"]
            lines += ["|---|" + "---|" * len(h["of"]) + "---|---|"]
            for row in h["rows"]:
                parts = " | ".join(_verdict(row["parts"][ref]) for ref in h["of"])
                lines.append(
                    f"| {row['arm']} | {parts} | {_fmt(row['margin'])} | {_verdict(row['pass'])} |"
                )
            lines.append("")
            continue
        pct = h["comparison"] == "relative_change"
        lines += [
            "| arm | seeds | baseline mean | arm mean | estimate | CI | threshold | margin "
            "| CI says | pass |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in h["rows"]:
            ci = row.get("ci", [None, None])
            lines.append(
                f"| {row['arm']} | {row['n']} | {_fmt(row.get('baseline_mean'))} | "
                f"{_fmt(row.get('arm_mean'))} | {_fmt(row['estimate'], pct=pct)} | "
                f"[{_fmt(ci[0], pct=pct)}, {_fmt(ci[1], pct=pct)}] | "
                f"{h['op']} {_fmt(h['threshold'], pct=pct)} | {_fmt(row['margin'], pp=pct)} | "
                f"{row.get('ci_verdict', 'n/a')} | **{_verdict(row['pass'])}** |"
            )
        lines.append("")
    metrics = ["perplexity"] + [f"{p}/cap{c}/hit_rate" for p in a.policies for c in a.capacities]
    lines += ["## Per-run results", "", "| run | status | " + " | ".join(metrics) + " |"]
    lines.append("|---|---|" + "---|" * len(metrics))
    for r in records:
        vals = [_fmt(r.get("metrics", {}).get(m)) for m in metrics]
        lines.append(f"| {r['run']} | {r['status']} | " + " | ".join(vals) + " |")
    lines.append("")
    if figures:
        lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    return "\n".join(lines)


def _arm_colors(arms: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {arm: cmap(i % 10) for i, arm in enumerate(arms)}


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def plot_scatter(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Hit rate (each policy) vs validation perplexity: one point per run, one colour per arm."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        return None
    cap = a.scatter_capacity or a.capacities[min(1, len(a.capacities) - 1)]
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(a.policies), 3.8)
    for i, policy in enumerate(a.policies):
        ax = fig.add_subplot(1, len(a.policies), i + 1)
        for arm in spec.arms:
            pts = [r for r in done if r["arm"] == arm]
            if pts:
                ax.scatter(
                    [r["metrics"]["perplexity"] for r in pts],
                    [r["metrics"][f"{policy}/cap{cap}/hit_rate"] for r in pts],
                    color=colors[arm],
                    label=arm,
                    s=36,
                )
        base = [r["metrics"]["perplexity"] for r in done if r["arm"] == spec.baseline]
        if base:
            budget = sum(base) / len(base) * 1.01
            ax.axvline(budget, color="grey", ls="--", lw=1, label="baseline +1% ppl")
        ax.set_xlabel("validation perplexity")
        ax.set_ylabel(f"{policy} hit rate, capacity {cap}")
        ax.set_title(f"{policy} cache, {cap} slots/layer")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "hit_rate_vs_perplexity.png"
    fig.savefig(path)
    return path


def plot_capacity(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Hit rate vs capacity per policy: the mean over seeds of each arm, a bar for min..max."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        return None
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(a.policies), 3.8)
    for i, policy in enumerate(a.policies):
        ax = fig.add_subplot(1, len(a.policies), i + 1)
        for arm in spec.arms:
            pts = [r for r in done if r["arm"] == arm]
            if not pts:
                continue
            ys = [[r["metrics"][f"{policy}/cap{c}/hit_rate"] for r in pts] for c in a.capacities]
            mean = [sum(y) / len(y) for y in ys]
            low = [m - min(y) for m, y in zip(mean, ys, strict=True)]
            high = [max(y) - m for m, y in zip(mean, ys, strict=True)]
            ax.errorbar(
                a.capacities,
                mean,
                yerr=[low, high],
                color=colors[arm],
                marker="o",
                capsize=3,
                label=arm,
            )
        ax.set_xlabel("cache capacity (experts per layer)")
        ax.set_ylabel("hit rate")
        ax.set_title(f"{policy}")
        ax.set_xticks(list(a.capacities))
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "hit_rate_vs_capacity.png"
    fig.savefig(path)
    return path


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def analyze(
    path: Path | str,
    out_dir: Path | str | None = None,
    report_dir: Path | str | None = None,
    *,
    evaluate: bool = True,
) -> Path:
    """Check the lock, evaluate every finished run, write the report; returns report.md.

    ``out_dir`` is the study directory given to ``run``; the report goes to ``report_dir``
    (default ``<out_dir>/report``): report.md, results.json, hit_rate_vs_perplexity.png,
    hit_rate_vs_capacity.png. Missing runs are listed and make hypotheses "incomplete".
    """
    record = verify(path)
    spec = load(path)
    root = Path(out_dir) if out_dir else default_out_dir(spec)
    report = Path(report_dir) if report_dir else root / "report"
    report.mkdir(parents=True, exist_ok=True)
    records = collect(spec, root, evaluate=evaluate)
    hypotheses = evaluate_hypotheses(spec, records)
    figures = [
        p.name
        for p in (plot_scatter(spec, records, report), plot_capacity(spec, records, report))
        if p is not None
    ]
    results = {
        "study": spec.study,
        "lock": record,
        "analysis": dataclasses.asdict(spec.analysis),
        "analyzed_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hypotheses": hypotheses,
        "runs": [
            {k: v for k, v in r.items() if k not in ("run_dir", "checkpoint", "analysis_key")}
            for r in records
        ],
    }
    (report / "results.json").write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    md = report / "report.md"
    md.write_text(render_markdown(spec, record, records, hypotheses, figures))
    log.info("report: %s", md)
    return md
