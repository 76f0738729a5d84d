"""The pre-registration file format: the dataclasses, parsing and validation."""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moestack.cache.policies import POLICIES
from moestack.errors import MoestackError

COMPARISONS = ("relative_change", "difference", "value", "joint")
OPS = ("<=", ">=")
DECISIONS = ("mean", "ci", "noninferiority", "superiority")
CORRECTIONS = ("none", "holm")
REQUIRES = ("any", "all")
CACHE_STATS = ("hit_rate", "miss_rate", "misses_per_token")
SCALAR_METRICS = ("perplexity", "val_loss")
RESERVED_KEYS = ("seed", "out_dir", "resume")  # set by the runner, one value per run
_CACHE_METRIC = re.compile(r"^([a-z+]+)/cap(\d+)/([a-z_]+)\Z")  # \Z: "$" lets a newline end it
_NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")


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
    decision: str = ""  # its own decision rule ("" = analysis.decision)


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
    decision: str = "mean"  # "mean": the seed mean meets the threshold; "ci": the whole CI does;
    # "noninferiority"/"superiority": the one-sided bound decides, else "inconclusive"
    correction: str = "none"  # "holm": Holm over the arms of each hypothesis (one-sided rules)
    decision_reason: str = ""  # why a "mean" rule decides a budget (lock refuses it otherwise)
    scatter_capacity: int = 0  # capacity of the hit-rate-vs-perplexity scatter (0 = 2nd)
    device: str = "auto"  # where the evaluation runs


@dataclass(frozen=True)
class Power:
    """The power analysis behind the seed count: the pilot, the target, the choice and why."""

    pilot: str  # the pilot's results.json or study folder (relative to the study file)
    seeds: int  # the chosen number of seeds (must be len(runs.seeds))
    reason: str  # why that many: the pilot's sd and the seeds it needs, or the budget
    half_width: float = 0.005  # target interval half-width (0.005 = 0.5 pp of a change)
    confidence: float = 0.95  # of the two-sided t interval whose half-width is targeted


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
    power: Power | None = None

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


# Characters that are no plain text: controls (newline, tab, NUL, ESC...), line and paragraph
# separators, and the bidirectional controls that reorder what a reader sees.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL",
                  "\x1b": "an escape (ANSI)"}  # fmt: skip


def is_control(ch: str) -> bool:
    """Whether the character ``ch`` is no plain text (a control, separator or bidi control)."""
    return unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in _BIDI


def check_plain(text: str, where: str) -> str:
    """``text`` when it holds no control character (``is_control``), else one line naming
    ``where``, the character and its place."""
    for i, ch in enumerate(text):
        if is_control(ch):
            name = _CONTROL_NAMES.get(ch, "a control character")
            raise MoestackError(
                f"{where}: {name} (U+{ord(ch):04X}) at character {i + 1}; give it as one line of "
                "plain text (the lock history and the report quote it)"
            )
    return text


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
            if p not in POLICIES:
                raise _fail(
                    f"analysis.policies[{i}]", f"{p!r} is unknown", f"use one of {POLICIES}"
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
    kw.update(_rule_fields(raw))
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


def _rule_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """analysis.correction and analysis.decision_reason, checked against the decision rule."""
    kw: dict[str, Any] = {}
    if "correction" in raw:
        if raw["correction"] not in CORRECTIONS:
            raise _fail("analysis.correction", f"{raw['correction']!r}", f"use {CORRECTIONS}")
        one_sided = ("noninferiority", "superiority")
        if raw["correction"] == "holm" and raw.get("decision", "mean") not in one_sided:
            raise _fail(
                "analysis.correction",
                f"holm needs a one-sided decision, not {raw.get('decision', 'mean')!r}",
                "set analysis.decision: noninferiority or superiority",
            )
        kw["correction"] = raw["correction"]
    if "decision_reason" in raw:
        reason = raw["decision_reason"]
        if not isinstance(reason, str) or not reason.strip():
            raise _fail("analysis.decision_reason", f"{reason!r}", "say why in one sentence")
        kw["decision_reason"] = reason.strip()
    return kw


def _power(raw: Any, seeds: tuple[int, ...]) -> Power | None:
    """The optional ``power`` block: the pilot, the chosen seed count (= the seeds run) and
    why, with the target half-width and confidence of the analysis that chose it."""
    if raw is None:
        return None
    raw = _mapping(raw, "power")
    known = {f.name for f in dataclasses.fields(Power)}
    for key in raw:
        if key not in known:
            raise _fail(f"power.{key}", "unknown field", f"use fields from {sorted(known)}")
    for key in ("pilot", "reason"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            what = "the pilot's results.json or folder" if key == "pilot" else "why that many"
            raise _fail(f"power.{key}", f"{raw.get(key)!r}", f"give {what}")
    n = _number(raw.get("seeds"), "power.seeds", int)
    if n != len(seeds):
        raise _fail(
            "power.seeds", f"{n} but runs.seeds lists {len(seeds)}", "make them the same count"
        )
    kw: dict[str, Any] = {}
    if "half_width" in raw:
        kw["half_width"] = _number(raw["half_width"], "power.half_width")
        if kw["half_width"] <= 0:
            raise _fail("power.half_width", f"{kw['half_width']} <= 0", "e.g. 0.005")
    if "confidence" in raw:
        kw["confidence"] = _number(raw["confidence"], "power.confidence")
        if not 0 < kw["confidence"] < 1:
            raise _fail("power.confidence", f"{kw['confidence']} not in (0, 1)", "e.g. 0.95")
    return Power(raw["pilot"].strip(), n, raw["reason"].strip(), **kw)


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
        known |= {"require", "of", "decision"}
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
        decision = item.get("decision", "")
        if decision and decision not in DECISIONS:
            raise _fail(f"{where}.decision", f"{decision!r}", f"use one of {DECISIONS}")
        if comparison == "joint" and decision:
            raise _fail(f"{where}.decision", "a joint hypothesis has no rule", "remove it")
        if analysis.correction == "holm" and decision in ("mean", "ci"):
            raise _fail(f"{where}.decision", f"{decision!r} with holm", "use a one-sided rule")
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
            hid, statement.strip(), metric, tuple(hyp_arms), comparison, op, threshold, require,
            decision=decision,
        )  # fmt: skip
    return tuple(seen.values())


def parse(data: Any, path: Path | str = "<memory>") -> Prereg:
    """Validate a loaded pre-registration mapping; errors name the field and the fix."""
    data = _mapping(data, "the file")
    top = {"study", "title", "question", "model", "data", "budget", "train", "runs"}
    top |= {"analysis", "hypotheses", "power"}
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
        power=_power(data.get("power"), seeds_t),
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
