"""The pre-registration file format: one dataclass per part of a study file.

Each part validates itself when it is built (``__post_init__``, as moestack.config's
dataclasses do): it checks and normalises its own fields and raises one line naming the
field and the fix (``hypotheses[1] (H2).op: '<'; use one of ('<=', '>=')``). The parts
mirror the file: ``Prereg`` (the whole file) holds the overrides every run shares (``model``,
``data``, ``train``), the ``Budget``, the ``Runs``, the ``Analysis``, the ``Hypothesis`` list and
the optional ``Power`` block, builds each from its mapping (a key the part has no field for
is refused) and checks what ties them together: a hypothesis's arms, metric and rule against
the runs and the analysis, a joint hypothesis's parts, the power block's seed count.

A part built from the file knows which keys the file gave (``given``): a key written is
checked as written even where its value equals the field's default (``budget.batch_size:
null`` and ``analysis.decision_reason: ""`` are refused; left out, they mean "not set").
``parse`` builds a ``Prereg`` from a loaded YAML mapping, ``load`` from a file.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import unicodedata
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from moestack.cache.policies import POLICIES
from moestack.errors import MoestackError

# gap_fraction: (arm / base - 1) - threshold x (control / base - 1), tested against 0: the
# arm's change is at most (or at least) ``threshold`` of the baseline-to-control gap
COMPARISONS = ("relative_change", "difference", "value", "gap_fraction", "joint")
OPS = ("<=", ">=")
DECISIONS = ("mean", "ci", "noninferiority", "superiority")
ONE_SIDED = ("noninferiority", "superiority")  # the decision rules Holm's correction needs
CORRECTIONS = ("none", "holm")
REQUIRES = ("any", "all")
CACHE_STATS = ("hit_rate", "miss_rate", "misses_per_token")
SCALAR_METRICS = ("perplexity", "val_loss")
RESERVED_KEYS = ("seed", "out_dir", "resume")  # set by the runner, one value per run
# <policy>/cap<c>[/b<batch>]/<stat>; \Z: "$" lets a newline end it
_CACHE_METRIC = re.compile(r"^([a-z+]+)/cap(\d+)/(?:b(\d+)/)?([a-z_]+)\Z")
# a steered evaluation's metric: reroute<tau>/cap<c>/<stat> or bias<b>/cap<c>/<stat>
_STEERED_METRIC = re.compile(r"^((?:reroute|bias)[0-9.e+-]+)/cap(\d+)/([a-z_]+)\Z")
STEERED_STATS = (*SCALAR_METRICS, *CACHE_STATS)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")
_BUDGET = ("steps", "batch_size", "grad_accum")  # each becomes the override KEY=VALUE
_COUNTS = ("eval_batches", "eval_batch_size", "eval_seq_len", "scatter_capacity")
_DEVICES = ("auto", "cpu", "cuda")

_Part = TypeVar("_Part")


# --------------------------------------------------------------------------- checks
def _fail(field_name: str, problem: str, fix: str) -> MoestackError:
    return MoestackError(f"{field_name}: {problem}; {fix}")


def _set(part: Any, name: str, value: Any) -> None:
    """Store a checked (normalised) value on a frozen part, in its ``__post_init__``."""
    object.__setattr__(part, name, value)


def _left_out(part: Any, name: str, given: frozenset[str] | None) -> bool:
    """Whether the field ``name`` of ``part`` was left out: not among the keys of the file's
    mapping (``given``), or, for a part built in Python (``given`` None), at its default."""
    if given is not None:
        return name not in given
    default = next(f.default for f in dataclasses.fields(part) if f.name == name)
    return bool(getattr(part, name) == default)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and _NAME.match(value) is not None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected a mapping, got {type(value).__name__}", "see docs/prereg.md")
    return value


def _overrides(value: Any, where: str) -> tuple[str, ...]:
    """A list of hydra override strings, none of them setting a runner-owned key."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
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
    if not math.isfinite(value):
        raise _fail(where, f"expected a finite number, got {value!r}", "give a number")
    if kind is int and int(value) != value:
        raise _fail(where, f"expected a whole number, got {value!r}", "give an integer")
    return kind(value)


def _share(value: Any, where: str, *, zero: bool, fix: str) -> float:
    """A number in [0, 1) (``zero``: a share that may be none, a warm-up) or in (0, 1)."""
    share = _number(value, where)
    if zero and not 0 <= share < 1:
        raise _fail(where, f"{share} not in [0, 1)", fix)
    if not zero and not 0 < share < 1:
        raise _fail(where, f"{share} not in (0, 1)", fix)
    return share


def _text(value: Any, where: str, fix: str) -> str:
    """``value`` stripped, refused (showing it) unless it is text with something in it."""
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, f"{value!r}", fix)
    return value.strip()


def _cache_metric(metric: str) -> tuple[str, int, str] | None:
    """(policy, capacity, statistic) of a cache metric name, or None: not of that form."""
    match = _CACHE_METRIC.match(metric)
    return (match.group(1), int(match.group(2)), match.group(4)) if match else None


def steered_metric(metric: str) -> tuple[str, int, str] | None:
    """(label, capacity, statistic) of a steered evaluation's metric name, or None."""
    match = _STEERED_METRIC.match(metric)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def is_quality_metric(metric: str) -> bool:
    """Whether ``metric`` measures the model's quality (perplexity or val_loss), plain or
    under a steered evaluation: what a budget hypothesis may let rise by at most its
    threshold."""
    steered = steered_metric(metric)
    return metric in SCALAR_METRICS or (steered is not None and steered[2] in SCALAR_METRICS)


def serve_batch(metric: str) -> int:
    """The batch a cache metric's replay serves (``lru/cap4/b8/miss_rate``: 8; 1 without)."""
    match = _CACHE_METRIC.match(metric)
    return int(match.group(3)) if match and match.group(3) else 1


def _part(cls: type[_Part], value: Any, at: str, *, fix: str = "", **extra: Any) -> _Part:
    """``value`` as a ``cls``: itself when it is one, else built from the file's mapping at
    ``at`` ("" for the file itself). A key ``cls`` has no field for is refused (``fix``,
    default: its fields); a field without a default that the file leaves out reads as None,
    so that the field's own check names it; ``extra`` are fields that come from elsewhere
    than the file (the file's path)."""
    if isinstance(value, cls):
        return value
    raw = _mapping(value, at or "the file")
    fields = [f for f in dataclasses.fields(cls) if f.name not in extra]
    names = [f.name for f in fields]
    for key in raw:
        if key not in names:
            problem = "unknown field" if at else "unknown top-level field"
            raise _fail(
                f"{at}.{key}" if at else str(key),
                problem,
                fix or f"use fields from {sorted(names)}",
            )
    needed = {
        f.name: None
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if "given" in inspect.signature(cls).parameters:
        extra = {**extra, "given": frozenset(raw)}
    return cls(**{**needed, **raw}, **extra)


# --------------------------------------------------------------------------- the parts
@dataclass(frozen=True, kw_only=True)
class Hypothesis:
    """One pre-registered claim: ``comparison(metric of arm, of baseline) op threshold``.

    A joint hypothesis (comparison "joint") names the hypotheses ``of`` that one arm must
    pass together; it has no metric, op, threshold or rule of its own (set to "", "", 0.0,
    ""). ``where`` names it in errors (``hypotheses[2]``). What the hypothesis refers to (its
    arms, the cache metric's policy and capacity, the earlier hypotheses it joins) is
    checked by the study it belongs to (``Prereg``).
    """

    id: str
    statement: str
    metric: str  # "perplexity", "val_loss" or "<policy>/cap<c>/<hit_rate|miss_rate|...>"
    arms: tuple[str, ...]  # the arms it is tested on, one table row each
    # relative_change (arm/base - 1), difference (arm - base), value, gap_fraction (the
    # change against the baseline-to-control gap, see COMPARISONS), joint
    comparison: str
    op: str  # "<=" or ">=": the side of the threshold that passes
    threshold: float
    require: str = "all"  # "any" arm passing suffices, or "all" must pass
    of: tuple[str, ...]  # joint: the hypotheses one arm must pass together (others: ())
    decision: str = ""  # its own decision rule ("" = analysis.decision)
    control: str = ""  # gap_fraction: the control arm whose gap to the baseline is the unit
    where: InitVar[str] = "hypothesis"

    def __post_init__(self, where: str) -> None:
        if not _is_name(self.id):
            raise _fail(f"{where}.id", f"{self.id!r} is not a name", "e.g. H1")
        at = f"{where} ({self.id})"
        if not isinstance(self.statement, str) or not self.statement.strip():
            raise _fail(f"{at}.statement", "missing", "state the claim in one sentence")
        _set(self, "statement", self.statement.strip())
        if self.comparison not in COMPARISONS:
            raise _fail(f"{at}.comparison", f"{self.comparison!r}", f"use one of {COMPARISONS}")
        arms = [self.arms] if isinstance(self.arms, str) else self.arms
        if not isinstance(arms, (list, tuple)) or not arms:
            raise _fail(f"{at}.arms", f"{arms!r}", "list the arms it is tested on")
        _set(self, "arms", tuple(arms))
        if self.decision and self.decision not in DECISIONS:
            raise _fail(f"{at}.decision", f"{self.decision!r}", f"use one of {DECISIONS}")
        if self.comparison == "joint" and self.decision:
            raise _fail(f"{at}.decision", "a joint hypothesis has no rule", "remove it")
        if self.require not in REQUIRES:
            raise _fail(f"{at}.require", f"{self.require!r}", f"use one of {REQUIRES}")
        if self.comparison == "joint":
            self._joint(at)
        else:
            self._claim(at)
        if (self.comparison == "gap_fraction") != bool(self.control):
            fix = "name the control arm" if self.control == "" else "remove it"
            raise _fail(f"{at}.control", f"{self.control!r} with {self.comparison}", fix)

    def _joint(self, at: str) -> None:
        if not isinstance(self.of, (list, tuple)) or not self.of:
            raise _fail(f"{at}.of", f"{self.of!r}", "list the ids of earlier hypotheses")
        for name, value in (("of", tuple(self.of)), ("metric", ""), ("op", ""), ("decision", "")):
            _set(self, name, value)
        _set(self, "threshold", 0.0)

    def _claim(self, at: str) -> None:
        metric = self.metric
        if not isinstance(metric, str):
            raise _fail(
                f"{at}.metric", f"expected a string, got {metric!r}", "e.g. lru/cap4/miss_rate"
            )
        if metric not in SCALAR_METRICS:
            parts = _cache_metric(metric)
            steered = steered_metric(metric)
            if parts is None and steered is None:
                raise _fail(
                    f"{at}.metric",
                    f"{metric!r} is not a metric",
                    f"use one of {SCALAR_METRICS}, "
                    f"<policy>/cap<capacity>/<{'|'.join(CACHE_STATS)}> or "
                    f"<reroute<tau>|bias<b>>/cap<capacity>/<{'|'.join(STEERED_STATS)}>",
                )
            if steered is not None and steered[2] not in STEERED_STATS:
                raise _fail(
                    f"{at}.metric",
                    f"statistic {steered[2]!r} is unknown",
                    f"use one of {STEERED_STATS}",
                )
            if parts is not None and parts[2] not in CACHE_STATS:
                raise _fail(
                    f"{at}.metric",
                    f"statistic {parts[2]!r} is unknown",
                    f"use one of {CACHE_STATS}",
                )
        if self.op not in OPS:
            raise _fail(f"{at}.op", f"{self.op!r}", f"use one of {OPS} (the side that passes)")
        _set(self, "threshold", _number(self.threshold, f"{at}.threshold"))
        _set(self, "of", ())


@dataclass(frozen=True)
class Analysis:
    """How each run is evaluated and how seeds combine (fixed before any run)."""

    checkpoint: str = "final"  # only the final checkpoint (step == steps) is evaluated
    eval_batches: int = 16  # validation batches (moestack.data.eval_batches, fixed windows)
    eval_batch_size: int = 0  # sequences per batch (0 = the run's batch_size)
    eval_seq_len: int = 0  # tokens per sequence (0 = the run's data.seq_len)
    eval_windows: tuple[float, float] = (0.0, 1.0)  # the share [lo, hi) of the validation
    # split whose windows are evaluated: the test split, apart from selection.windows
    policies: tuple[str, ...] = ("lru", "static")
    capacities: tuple[int, ...] = (2, 4, 6)  # expert slots per layer
    # batch sizes the caches are also replayed at (a batch's requests per layer and step are
    # the union of its sequences' experts: moestack.telemetry.replay); metrics of batch b>1
    # are named <policy>/cap<c>/b<b>/<stat>; batch 1 is always replayed (no b in the name)
    serve_batches: tuple[int, ...] = (1,)
    warmup: float = 0.1  # share of each layer's requests that warms the cache, not counted
    confidence: float = 0.95  # two-sided t interval over seeds
    decision: str = "mean"  # "mean": the seed mean meets the threshold; "ci": the whole CI does;
    # "noninferiority"/"superiority": the one-sided bound decides, else "inconclusive"
    correction: str = "none"  # "holm": Holm over the arms of each hypothesis (one-sided rules)
    decision_reason: str = ""  # why a "mean" rule decides a budget (lock refuses it otherwise)
    scatter_capacity: int = 0  # capacity of the hit-rate-vs-perplexity scatter (0 = 2nd)
    # Steered evaluations (moestack.cache.steering: one stream, each token steered toward its
    # layer's LRU cache of each steer capacity): training-free rerouting at each tau in
    # (0, 1], moestack's cache-aware bias at each value > 0; one more evaluation pass each
    # (value x capacity), metrics reroute<tau>/cap<c>/<stat> and bias<b>/cap<c>/<stat> with
    # stat one of perplexity, val_loss, hit_rate, miss_rate, misses_per_token
    reroute_taus: tuple[float, ...] = ()
    cache_biases: tuple[float, ...] = ()
    steer_capacities: tuple[int, ...] = ()  # some of analysis.capacities (empty: the smallest)
    device: str = "auto"  # where the evaluation runs
    given: InitVar[frozenset[str] | None] = None  # the keys the file gave (None: from Python)

    def __post_init__(self, given: frozenset[str] | None) -> None:
        if self.checkpoint != "final":
            raise _fail(
                "analysis.checkpoint",
                f"{self.checkpoint!r} is not supported",
                "use 'final' (the checkpoint at step == steps)",
            )
        for name in _COUNTS:
            value = _number(getattr(self, name), f"analysis.{name}", int)
            low = 1 if name == "eval_batches" else 0
            if value < low:
                raise _fail(f"analysis.{name}", f"{value} must be >= {low}", "raise it")
            _set(self, name, value)
        _set(self, "eval_windows", _windows(self.eval_windows, "analysis.eval_windows"))
        _set(self, "policies", self._policies())
        _set(self, "capacities", self._capacities())
        batches = self.serve_batches
        if not isinstance(batches, (list, tuple)) or not batches:
            raise _fail("analysis.serve_batches", f"{batches!r} is not a list", "e.g. [1, 8, 32]")
        numbers = tuple(
            _number(b, f"analysis.serve_batches[{i}]", int) for i, b in enumerate(batches)
        )
        if min(numbers) < 1:
            raise _fail("analysis.serve_batches", f"{list(numbers)}", "use batch sizes >= 1")
        _set(self, "serve_batches", numbers)
        _set(self, "warmup", _share(self.warmup, "analysis.warmup", zero=True, fix="give a share"))
        _set(
            self,
            "confidence",
            _share(self.confidence, "analysis.confidence", zero=False, fix="e.g. 0.95"),
        )
        self._check_rule(given)
        if self.device not in _DEVICES:
            raise _fail("analysis.device", f"{self.device!r}", "use auto, cpu or cuda")
        self._check_steering()
        if self.scatter_capacity and self.scatter_capacity not in self.capacities:
            raise _fail(
                "analysis.scatter_capacity",
                f"{self.scatter_capacity} is not in analysis.capacities",
                "pick one of them",
            )

    def _check_steering(self) -> None:
        """The steered evaluations: taus in (0, 1], biases > 0, capacities analysed."""
        lists = {}
        for name in ("reroute_taus", "cache_biases", "steer_capacities"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise _fail(f"analysis.{name}", f"{value!r} is not a list", "e.g. [0.25, 0.5]")
            kind = int if name == "steer_capacities" else float
            lists[name] = tuple(
                _number(v, f"analysis.{name}[{i}]", kind) for i, v in enumerate(value)
            )
            if len(set(lists[name])) != len(lists[name]):
                raise _fail(f"analysis.{name}", f"{list(value)} repeats a value", "list each once")
            _set(self, name, lists[name])
        for i, tau in enumerate(self.reroute_taus):
            if not 0 < tau <= 1:
                raise _fail(f"analysis.reroute_taus[{i}]", f"{tau} not in (0, 1]", "e.g. 0.25")
        for i, bias in enumerate(self.cache_biases):
            if bias <= 0:
                raise _fail(f"analysis.cache_biases[{i}]", f"{bias} <= 0", "give a bias > 0")
        for i, cap in enumerate(self.steer_capacities):
            if cap not in self.capacities:
                raise _fail(
                    f"analysis.steer_capacities[{i}]",
                    f"{cap} is not in analysis.capacities",
                    "pick some of them",
                )
        steered = self.reroute_taus or self.cache_biases
        if self.steer_capacities and not steered:
            raise _fail(
                "analysis.steer_capacities",
                f"{list(self.steer_capacities)} without reroute_taus or cache_biases",
                "give the taus or biases to evaluate, or remove it",
            )
        if steered and "lru" not in self.policies:
            raise _fail(
                "analysis.policies",
                f"{list(self.policies)} without lru, which steered evaluations replay",
                "add lru",
            )
        labels = [label for label, _, _ in self._steer_values()]
        if len(set(labels)) != len(labels):
            raise _fail(
                "analysis.reroute_taus" if self.reroute_taus else "analysis.cache_biases",
                f"values whose metrics would be named alike ({labels})",
                "give values that differ in their first 6 significant digits",
            )

    def steered(self) -> tuple[tuple[str, int, float, float], ...]:
        """Each steered evaluation as (label, capacity, reroute tau, cache-aware bias); its
        metrics are ``<label>/cap<capacity>/<stat>``."""
        values = self._steer_values()
        if not values:
            return ()
        caps = self.steer_capacities or (min(self.capacities),)
        return tuple((label, c, tau, bias) for label, tau, bias in values for c in caps)

    def _steer_values(self) -> list[tuple[str, float, float]]:
        """(label, tau, bias) of each steering value: the label names its metrics."""
        values = [(f"reroute{t:g}", t, 0.0) for t in self.reroute_taus]
        return values + [(f"bias{b:g}", 0.0, b) for b in self.cache_biases]

    def _policies(self) -> tuple[str, ...]:
        policies = self.policies
        if not isinstance(policies, (list, tuple)) or not policies:
            raise _fail("analysis.policies", f"{policies!r} is not a list", "e.g. [lru, static]")
        for i, p in enumerate(policies):
            if p not in POLICIES:
                raise _fail(
                    f"analysis.policies[{i}]", f"{p!r} is unknown", f"use one of {POLICIES}"
                )
        return tuple(policies)

    def _capacities(self) -> tuple[int, ...]:
        caps = self.capacities
        if not isinstance(caps, (list, tuple)) or not caps:
            raise _fail("analysis.capacities", f"{caps!r} is not a list", "e.g. [2, 4, 6]")
        out = tuple(_number(c, f"analysis.capacities[{i}]", int) for i, c in enumerate(caps))
        for i, c in enumerate(out):
            if c < 1:
                raise _fail(f"analysis.capacities[{i}]", f"{c} < 1", "use expert slots >= 1")
        return out

    def _check_rule(self, given: frozenset[str] | None) -> None:
        """The decision rule, its correction (Holm needs a one-sided rule) and its reason."""
        if self.decision not in DECISIONS:
            raise _fail("analysis.decision", f"{self.decision!r}", f"use one of {DECISIONS}")
        if self.correction not in CORRECTIONS:
            raise _fail("analysis.correction", f"{self.correction!r}", f"use {CORRECTIONS}")
        if self.correction == "holm" and self.decision not in ONE_SIDED:
            raise _fail(
                "analysis.correction",
                f"holm needs a one-sided decision, not {self.decision!r}",
                "set analysis.decision: noninferiority or superiority",
            )
        if not _left_out(self, "decision_reason", given):
            reason = _text(
                self.decision_reason, "analysis.decision_reason", "say why in one sentence"
            )
            _set(self, "decision_reason", reason)


@dataclass(frozen=True)
class Power:
    """The power analysis behind the seed count: the pilot, the target, the choice and why.

    That ``seeds`` is the number of seeds the study runs is checked by the study (``Prereg``).
    """

    pilot: str  # the pilot's results.json or study folder (relative to the study file)
    seeds: int  # the chosen number of seeds (must be len(runs.seeds))
    reason: str  # why that many: the pilot's sd and the seeds it needs, or the budget
    half_width: float = 0.005  # target interval half-width (0.005 = 0.5 pp of a change)
    confidence: float = 0.95  # of the two-sided t interval whose half-width is targeted

    def __post_init__(self) -> None:
        _set(
            self,
            "pilot",
            _text(self.pilot, "power.pilot", "give the pilot's results.json or folder"),
        )
        _set(self, "reason", _text(self.reason, "power.reason", "give why that many"))
        _set(self, "seeds", _number(self.seeds, "power.seeds", int))
        half_width = _number(self.half_width, "power.half_width")
        if half_width <= 0:
            raise _fail("power.half_width", f"{half_width} <= 0", "e.g. 0.005")
        _set(self, "half_width", half_width)
        _set(
            self,
            "confidence",
            _share(self.confidence, "power.confidence", zero=False, fix="e.g. 0.95"),
        )


@dataclass(frozen=True)
class Selection:
    """Where the arms' settings (loss weights) were chosen, apart from the test: a pilot
    evaluated on ``windows``, a share of the validation split the confirmatory evaluation
    (``analysis.eval_windows``) does not read; the lock refuses the two overlapping."""

    windows: tuple[float, float]  # the tuning split: share [lo, hi) of the validation split
    pilot: str  # the pilot that chose them (its results, or a note of where it ran)
    reason: str  # what it chose and why

    def __post_init__(self) -> None:
        _set(self, "windows", _windows(self.windows, "selection.windows"))
        _set(self, "pilot", _text(self.pilot, "selection.pilot", "name the pilot"))
        _set(self, "reason", _text(self.reason, "selection.reason", "say what it chose"))


def _windows(value: Any, where: str) -> tuple[float, float]:
    """A share ``[lo, hi)`` of the validation split: two numbers, 0 <= lo < hi <= 1."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _fail(where, f"{value!r}", "give [lo, hi], shares of the validation split")
    lo, hi = (_number(v, f"{where}[{i}]") for i, v in enumerate(value))
    if not 0 <= lo < hi <= 1:
        raise _fail(where, f"[{lo}, {hi}]", "give 0 <= lo < hi <= 1")
    return (float(lo), float(hi))


@dataclass(frozen=True)
class Budget:
    """The optimizer steps of every run (required) and its batch settings (left out: the
    training config's own); each becomes a ``KEY=VALUE`` override."""

    steps: int | None = None
    batch_size: int | None = None  # sequences per micro-batch
    grad_accum: int | None = None  # micro-batches per optimizer step
    given: InitVar[frozenset[str] | None] = None  # the keys the file gave (None: from Python)

    def __post_init__(self, given: frozenset[str] | None) -> None:
        if _left_out(self, "steps", given):
            raise _fail("budget.steps", "missing", "give the optimizer steps of every run")
        for name in _BUDGET:
            if not _left_out(self, name, given):
                value = _number(getattr(self, name), f"budget.{name}", int)
                if value < 1:
                    raise _fail(f"budget.{name}", f"{value} must be >= 1", "raise it")
                _set(self, name, value)

    def overrides(self) -> tuple[str, ...]:
        """``steps=N`` and each batch setting given, in the order of ``_BUDGET``."""
        return tuple(f"{n}={getattr(self, n)}" for n in _BUDGET if getattr(self, n) is not None)


@dataclass(frozen=True)
class Runs:
    """The grid: the arms (name -> its overrides), the baseline every comparison is made
    against, the seeds every arm runs, and which arms are controls (models that show what
    the experts buy: as few experts as the cache holds, a dense model of the same active
    size; the report states every arm's change in units of their gap to the baseline)."""

    baseline: str
    arms: dict[str, tuple[str, ...]]
    seeds: tuple[int, ...]
    controls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        arms = _mapping(self.arms, "runs.arms")
        if not arms:
            raise _fail("runs.arms", "empty", "list the baseline and at least one other arm")
        checked: dict[str, tuple[str, ...]] = {}
        for name, overrides in arms.items():
            if not _is_name(name):
                raise _fail(f"runs.arms.{name}", "not a name", "use letters, digits, _ . -")
            checked[name] = _overrides(overrides, f"runs.arms.{name}")
        _set(self, "arms", checked)
        if not isinstance(self.baseline, str) or self.baseline not in checked:
            raise _fail(
                "runs.baseline", f"{self.baseline!r} is not an arm", f"use one of {sorted(checked)}"
            )
        seeds = self.seeds
        if not isinstance(seeds, (list, tuple)) or not seeds:
            raise _fail("runs.seeds", f"{seeds!r}", "give a list of integer seeds, e.g. [0, 1]")
        numbers = tuple(_number(s, f"runs.seeds[{i}]", int) for i, s in enumerate(seeds))
        if len(set(numbers)) != len(numbers):
            raise _fail("runs.seeds", f"{list(numbers)} repeats a seed", "list each seed once")
        _set(self, "seeds", numbers)
        controls = [self.controls] if isinstance(self.controls, str) else self.controls
        if not isinstance(controls, (list, tuple)):
            raise _fail("runs.controls", f"{controls!r}", "list the arms that are controls")
        for j, name in enumerate(controls):
            if name not in checked or name == self.baseline:
                raise _fail(
                    f"runs.controls[{j}]",
                    f"{name!r} is not an arm other than the baseline",
                    f"use some of {sorted(set(checked) - {self.baseline})}",
                )
        _set(self, "controls", tuple(controls))


@dataclass(frozen=True, kw_only=True)
class Prereg:
    """A validated pre-registration file: one field per part of the file, plus its path and
    the mapping it was read from (``raw``)."""

    path: Path
    study: str  # a name: letters, digits, _ . - (the default output is runs/prereg/<study>)
    title: str | None = None  # free text (None: the study's name)
    question: str = ""  # free text, shown in the report
    model: tuple[str, ...]  # moestack-train overrides: the model (at least one) ...
    data: tuple[str, ...] = ()  # ... the data
    budget: Budget
    train: tuple[str, ...] = ()  # ... the other train settings
    runs: Runs
    analysis: Analysis = field(default_factory=Analysis)
    hypotheses: tuple[Hypothesis, ...]
    power: Power | None = None
    selection: Selection | None = None  # where the arms' settings were tuned, apart from the test
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    given: InitVar[frozenset[str] | None] = None  # the keys the file gave (None: from Python)

    def __post_init__(self, given: frozenset[str] | None) -> None:
        if not _is_name(self.study):
            raise _fail("study", f"{self.study!r} is not a name", "use letters, digits, _ . -")
        _set(self, "path", Path(self.path))
        _set(self, "model", _overrides(self.model, "model"))
        if not self.model:
            raise _fail("model", "missing", "give the model as overrides, e.g. [model=tiny]")
        _set(self, "data", _overrides(self.data, "data"))
        _set(self, "budget", _part(Budget, self.budget, "budget", fix="use " + ", ".join(_BUDGET)))
        _set(self, "train", _overrides(self.train, "train"))
        _set(self, "runs", _part(Runs, self.runs, "runs", fix="use baseline, arms, seeds"))
        _set(self, "analysis", _part(Analysis, self.analysis or {}, "analysis"))
        _set(self, "hypotheses", self._hypotheses())
        title = self.study if _left_out(self, "title", given) else self.title
        _set(self, "title", str(title))
        _set(self, "question", str(self.question))
        if self.power is not None:
            _set(self, "power", _part(Power, self.power, "power"))
            self._check_power(self.power)
        if self.selection is not None:
            _set(self, "selection", _part(Selection, self.selection, "selection"))
            self._check_selection(self.selection)

    def _check_selection(self, selection: Selection) -> None:
        """Refuse a test split that reads windows the settings were tuned on."""
        (a, b), (c, d) = selection.windows, self.analysis.eval_windows
        if a < d and c < b:
            raise _fail(
                "selection.windows",
                f"[{a}, {b}) overlaps analysis.eval_windows [{c}, {d})",
                "the confirmatory test must not read the windows the settings were chosen "
                "on: give disjoint shares of the validation split",
            )

    @property
    def base_overrides(self) -> tuple[str, ...]:
        """The overrides every run shares: model, data, budget and train, in that order."""
        return (*self.model, *self.data, *self.budget.overrides(), *self.train)

    @property
    def baseline(self) -> str:
        return self.runs.baseline

    @property
    def arms(self) -> dict[str, tuple[str, ...]]:
        """Arm name -> its overrides."""
        return self.runs.arms

    @property
    def seeds(self) -> tuple[int, ...]:
        return self.runs.seeds

    def overrides(self, arm: str, seed: int) -> list[str]:
        """The moestack-train overrides of one run (out_dir and resume added by the runner)."""
        return [*self.base_overrides, *self.arms[arm], f"seed={seed}"]

    def _hypotheses(self) -> tuple[Hypothesis, ...]:
        """Each hypothesis built (it checks itself), then checked against the study."""
        items = self.hypotheses
        if not isinstance(items, (list, tuple)) or not items:
            raise _fail("hypotheses", "expected a non-empty list", "pre-register at least one")
        seen: dict[str, Hypothesis] = {}
        for i, item in enumerate(items):
            where = f"hypotheses[{i}]"
            hyp = _part(Hypothesis, item, where, where=where)
            if hyp.id in seen:
                raise _fail(
                    f"{where}.id", f"{hyp.id!r} is used twice", "give each hypothesis its own id"
                )
            self._check_hypothesis(hyp, f"{where} ({hyp.id})", seen)
            seen[hyp.id] = hyp
        return tuple(seen.values())

    def _check_hypothesis(self, hyp: Hypothesis, at: str, earlier: dict[str, Hypothesis]) -> None:
        """What ``hyp`` refers to: its arms (the baseline is no arm of a comparison with
        itself), its rule under Holm, the earlier hypotheses a joint one joins, and the
        policy and capacity of a cache metric (the analysis must replay them)."""
        if hyp.comparison == "gap_fraction" and (
            hyp.control not in self.runs.controls or hyp.control in hyp.arms
        ):
            raise _fail(
                f"{at}.control",
                f"{hyp.control!r} is not a control outside the hypothesis's arms",
                f"use one of runs.controls {list(self.runs.controls)}",
            )
        for j, arm in enumerate(hyp.arms):
            if not isinstance(arm, str) or arm not in self.arms:
                raise _fail(f"{at}.arms[{j}]", f"{arm!r} is not an arm", f"use {sorted(self.arms)}")
            if arm == self.baseline and hyp.comparison in (
                "relative_change",
                "difference",
                "gap_fraction",
            ):
                raise _fail(
                    f"{at}.arms[{j}]",
                    f"the baseline {arm!r} cannot be compared with itself",
                    "remove it or use comparison: value",
                )
        if self.analysis.correction == "holm" and hyp.decision in ("mean", "ci"):
            raise _fail(f"{at}.decision", f"{hyp.decision!r} with holm", "use a one-sided rule")
        if hyp.comparison == "joint":
            for j, ref in enumerate(hyp.of):
                if (
                    not isinstance(ref, str)
                    or ref not in earlier
                    or earlier[ref].comparison == "joint"
                ):
                    raise _fail(
                        f"{at}.of[{j}]",
                        f"{ref!r} is not an earlier non-joint hypothesis",
                        "list ids defined above this one",
                    )
                missing = [a for a in hyp.arms if a not in earlier[ref].arms]
                if missing:
                    raise _fail(f"{at}.of[{j}]", f"{ref} is not tested on {missing}", "add them")
        elif (parts := _cache_metric(hyp.metric)) is not None:
            policy, cap, _ = parts
            if policy not in self.analysis.policies:
                raise _fail(
                    f"{at}.metric", f"policy {policy!r} is not in analysis.policies", "add it there"
                )
            if cap not in self.analysis.capacities:
                raise _fail(
                    f"{at}.metric", f"capacity {cap} is not in analysis.capacities", "add it there"
                )
            batch = serve_batch(hyp.metric)
            if batch != 1 and batch not in self.analysis.serve_batches:
                raise _fail(
                    f"{at}.metric",
                    f"batch {batch} is not in analysis.serve_batches",
                    "add it there",
                )
        elif (steered := steered_metric(hyp.metric)) is not None:
            known = {(label, cap) for label, cap, _, _ in self.analysis.steered()}
            if steered[:2] not in known:
                names = sorted(f"{label}/cap{cap}" for label, cap in known) or "none"
                raise _fail(
                    f"{at}.metric",
                    f"{steered[0]} at capacity {steered[1]} is not a steered evaluation "
                    f"(the analysis has {names})",
                    "add its value to analysis.reroute_taus or cache_biases and its capacity "
                    "to analysis.steer_capacities",
                )

    def _check_power(self, power: Power) -> None:
        if power.seeds != len(self.seeds):
            raise _fail(
                "power.seeds",
                f"{power.seeds} but runs.seeds lists {len(self.seeds)}",
                "make them the same count",
            )


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


# --------------------------------------------------------------------------- plain text
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


# --------------------------------------------------------------------------- reading
def parse(data: Any, path: Path | str = "<memory>") -> Prereg:
    """Validate a loaded pre-registration mapping; errors name the field and the fix."""
    return _part(Prereg, data, "", path=Path(path), raw=data)


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
