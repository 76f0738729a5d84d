"""The parts of a study file, one dataclass each: ``Hypothesis``, ``Analysis``, ``Power``,
``Selection``, ``Budget`` and ``Runs`` (``spec.Prereg`` holds them and checks what ties them
together).

Each part validates itself when it is built (``__post_init__``): it checks and normalises its
own fields and raises one line naming the field and the fix (``hypotheses[1] (H2).op: '<';
use one of ('<=', '>=')``). A part built from the file knows which keys the file gave
(``given``): a key written is checked as written even where its value equals the field's
default.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

from moestack.cache.policies import POLICIES
from moestack.prereg.fields import (
    BUDGET_KEYS,
    CACHE_STATS,
    COMPARISONS,
    CORRECTIONS,
    COUNT_KEYS,
    DECISIONS,
    DEVICES,
    ONE_SIDED,
    OPS,
    REQUIRES,
    SCALAR_METRICS,
    STEERED_STATS,
    cache_metric,
    fail,
    is_name,
    left_out,
    mapping,
    nonempty_text,
    number,
    override_list,
    set_field,
    share,
    share_window,
    steered_metric,
)


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
        if not is_name(self.id):
            raise fail(f"{where}.id", f"{self.id!r} is not a name", "e.g. H1")
        at = f"{where} ({self.id})"
        if not isinstance(self.statement, str) or not self.statement.strip():
            raise fail(f"{at}.statement", "missing", "state the claim in one sentence")
        set_field(self, "statement", self.statement.strip())
        if self.comparison not in COMPARISONS:
            raise fail(f"{at}.comparison", f"{self.comparison!r}", f"use one of {COMPARISONS}")
        arms = [self.arms] if isinstance(self.arms, str) else self.arms
        if not isinstance(arms, (list, tuple)) or not arms:
            raise fail(f"{at}.arms", f"{arms!r}", "list the arms it is tested on")
        set_field(self, "arms", tuple(arms))
        if self.decision and self.decision not in DECISIONS:
            raise fail(f"{at}.decision", f"{self.decision!r}", f"use one of {DECISIONS}")
        if self.comparison == "joint" and self.decision:
            raise fail(f"{at}.decision", "a joint hypothesis has no rule", "remove it")
        if self.require not in REQUIRES:
            raise fail(f"{at}.require", f"{self.require!r}", f"use one of {REQUIRES}")
        if self.comparison == "joint":
            self._joint(at)
        else:
            self._claim(at)
        if (self.comparison == "gap_fraction") != bool(self.control):
            fix = "name the control arm" if self.control == "" else "remove it"
            raise fail(f"{at}.control", f"{self.control!r} with {self.comparison}", fix)

    def _joint(self, at: str) -> None:
        if not isinstance(self.of, (list, tuple)) or not self.of:
            raise fail(f"{at}.of", f"{self.of!r}", "list the ids of earlier hypotheses")
        for name, value in (("of", tuple(self.of)), ("metric", ""), ("op", ""), ("decision", "")):
            set_field(self, name, value)
        set_field(self, "threshold", 0.0)

    def _claim(self, at: str) -> None:
        metric = self.metric
        if not isinstance(metric, str):
            raise fail(
                f"{at}.metric", f"expected a string, got {metric!r}", "e.g. lru/cap4/miss_rate"
            )
        if metric not in SCALAR_METRICS:
            parts = cache_metric(metric)
            steered = steered_metric(metric)
            if parts is None and steered is None:
                raise fail(
                    f"{at}.metric",
                    f"{metric!r} is not a metric",
                    f"use one of {SCALAR_METRICS}, "
                    f"<policy>/cap<capacity>/<{'|'.join(CACHE_STATS)}> or "
                    f"<reroute<tau>|bias<b>>/cap<capacity>/<{'|'.join(STEERED_STATS)}>",
                )
            if steered is not None and steered[2] not in STEERED_STATS:
                raise fail(
                    f"{at}.metric",
                    f"statistic {steered[2]!r} is unknown",
                    f"use one of {STEERED_STATS}",
                )
            if parts is not None and parts[2] not in CACHE_STATS:
                raise fail(
                    f"{at}.metric",
                    f"statistic {parts[2]!r} is unknown",
                    f"use one of {CACHE_STATS}",
                )
        if self.op not in OPS:
            raise fail(f"{at}.op", f"{self.op!r}", f"use one of {OPS} (the side that passes)")
        set_field(self, "threshold", number(self.threshold, f"{at}.threshold"))
        set_field(self, "of", ())


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
            raise fail(
                "analysis.checkpoint",
                f"{self.checkpoint!r} is not supported",
                "use 'final' (the checkpoint at step == steps)",
            )
        for name in COUNT_KEYS:
            value = number(getattr(self, name), f"analysis.{name}", int)
            low = 1 if name == "eval_batches" else 0
            if value < low:
                raise fail(f"analysis.{name}", f"{value} must be >= {low}", "raise it")
            set_field(self, name, value)
        set_field(self, "eval_windows", share_window(self.eval_windows, "analysis.eval_windows"))
        set_field(self, "policies", self._policies())
        set_field(self, "capacities", self._capacities())
        batches = self.serve_batches
        if not isinstance(batches, (list, tuple)) or not batches:
            raise fail("analysis.serve_batches", f"{batches!r} is not a list", "e.g. [1, 8, 32]")
        numbers = tuple(
            number(b, f"analysis.serve_batches[{i}]", int) for i, b in enumerate(batches)
        )
        if min(numbers) < 1:
            raise fail("analysis.serve_batches", f"{list(numbers)}", "use batch sizes >= 1")
        set_field(self, "serve_batches", numbers)
        set_field(
            self, "warmup", share(self.warmup, "analysis.warmup", zero=True, fix="give a share")
        )
        set_field(
            self,
            "confidence",
            share(self.confidence, "analysis.confidence", zero=False, fix="e.g. 0.95"),
        )
        self._check_rule(given)
        if self.device not in DEVICES:
            raise fail("analysis.device", f"{self.device!r}", "use auto, cpu or cuda")
        self._check_steering()
        if self.scatter_capacity and self.scatter_capacity not in self.capacities:
            raise fail(
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
                raise fail(f"analysis.{name}", f"{value!r} is not a list", "e.g. [0.25, 0.5]")
            kind = int if name == "steer_capacities" else float
            lists[name] = tuple(
                number(v, f"analysis.{name}[{i}]", kind) for i, v in enumerate(value)
            )
            if len(set(lists[name])) != len(lists[name]):
                raise fail(f"analysis.{name}", f"{list(value)} repeats a value", "list each once")
            set_field(self, name, lists[name])
        for i, tau in enumerate(self.reroute_taus):
            if not 0 < tau <= 1:
                raise fail(f"analysis.reroute_taus[{i}]", f"{tau} not in (0, 1]", "e.g. 0.25")
        for i, bias in enumerate(self.cache_biases):
            if bias <= 0:
                raise fail(f"analysis.cache_biases[{i}]", f"{bias} <= 0", "give a bias > 0")
        for i, cap in enumerate(self.steer_capacities):
            if cap not in self.capacities:
                raise fail(
                    f"analysis.steer_capacities[{i}]",
                    f"{cap} is not in analysis.capacities",
                    "pick some of them",
                )
        steered = self.reroute_taus or self.cache_biases
        if self.steer_capacities and not steered:
            raise fail(
                "analysis.steer_capacities",
                f"{list(self.steer_capacities)} without reroute_taus or cache_biases",
                "give the taus or biases to evaluate, or remove it",
            )
        if steered and "lru" not in self.policies:
            raise fail(
                "analysis.policies",
                f"{list(self.policies)} without lru, which steered evaluations replay",
                "add lru",
            )
        labels = [label for label, _, _ in self._steer_values()]
        if len(set(labels)) != len(labels):
            raise fail(
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
            raise fail("analysis.policies", f"{policies!r} is not a list", "e.g. [lru, static]")
        for i, p in enumerate(policies):
            if p not in POLICIES:
                raise fail(f"analysis.policies[{i}]", f"{p!r} is unknown", f"use one of {POLICIES}")
        return tuple(policies)

    def _capacities(self) -> tuple[int, ...]:
        caps = self.capacities
        if not isinstance(caps, (list, tuple)) or not caps:
            raise fail("analysis.capacities", f"{caps!r} is not a list", "e.g. [2, 4, 6]")
        out = tuple(number(c, f"analysis.capacities[{i}]", int) for i, c in enumerate(caps))
        for i, c in enumerate(out):
            if c < 1:
                raise fail(f"analysis.capacities[{i}]", f"{c} < 1", "use expert slots >= 1")
        return out

    def _check_rule(self, given: frozenset[str] | None) -> None:
        """The decision rule, its correction (Holm needs a one-sided rule) and its reason."""
        if self.decision not in DECISIONS:
            raise fail("analysis.decision", f"{self.decision!r}", f"use one of {DECISIONS}")
        if self.correction not in CORRECTIONS:
            raise fail("analysis.correction", f"{self.correction!r}", f"use {CORRECTIONS}")
        if self.correction == "holm" and self.decision not in ONE_SIDED:
            raise fail(
                "analysis.correction",
                f"holm needs a one-sided decision, not {self.decision!r}",
                "set analysis.decision: noninferiority or superiority",
            )
        if not left_out(self, "decision_reason", given):
            reason = nonempty_text(
                self.decision_reason, "analysis.decision_reason", "say why in one sentence"
            )
            set_field(self, "decision_reason", reason)


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
        set_field(
            self,
            "pilot",
            nonempty_text(self.pilot, "power.pilot", "give the pilot's results.json or folder"),
        )
        set_field(self, "reason", nonempty_text(self.reason, "power.reason", "give why that many"))
        set_field(self, "seeds", number(self.seeds, "power.seeds", int))
        half_width = number(self.half_width, "power.half_width")
        if half_width <= 0:
            raise fail("power.half_width", f"{half_width} <= 0", "e.g. 0.005")
        set_field(self, "half_width", half_width)
        set_field(
            self,
            "confidence",
            share(self.confidence, "power.confidence", zero=False, fix="e.g. 0.95"),
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
        set_field(self, "windows", share_window(self.windows, "selection.windows"))
        set_field(self, "pilot", nonempty_text(self.pilot, "selection.pilot", "name the pilot"))
        set_field(
            self, "reason", nonempty_text(self.reason, "selection.reason", "say what it chose")
        )


@dataclass(frozen=True)
class Budget:
    """The optimizer steps of every run (required) and its batch settings (left out: the
    training config's own); each becomes a ``KEY=VALUE`` override."""

    steps: int | None = None
    batch_size: int | None = None  # sequences per micro-batch
    grad_accum: int | None = None  # micro-batches per optimizer step
    given: InitVar[frozenset[str] | None] = None  # the keys the file gave (None: from Python)

    def __post_init__(self, given: frozenset[str] | None) -> None:
        if left_out(self, "steps", given):
            raise fail("budget.steps", "missing", "give the optimizer steps of every run")
        for name in BUDGET_KEYS:
            if not left_out(self, name, given):
                value = number(getattr(self, name), f"budget.{name}", int)
                if value < 1:
                    raise fail(f"budget.{name}", f"{value} must be >= 1", "raise it")
                set_field(self, name, value)

    def overrides(self) -> tuple[str, ...]:
        """``steps=N`` and each batch setting given, in the order of ``BUDGET_KEYS``."""
        return tuple(f"{n}={getattr(self, n)}" for n in BUDGET_KEYS if getattr(self, n) is not None)


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
        arms = mapping(self.arms, "runs.arms")
        if not arms:
            raise fail("runs.arms", "empty", "list the baseline and at least one other arm")
        checked: dict[str, tuple[str, ...]] = {}
        for name, overrides in arms.items():
            if not is_name(name):
                raise fail(f"runs.arms.{name}", "not a name", "use letters, digits, _ . -")
            checked[name] = override_list(overrides, f"runs.arms.{name}")
        set_field(self, "arms", checked)
        if not isinstance(self.baseline, str) or self.baseline not in checked:
            raise fail(
                "runs.baseline", f"{self.baseline!r} is not an arm", f"use one of {sorted(checked)}"
            )
        seeds = self.seeds
        if not isinstance(seeds, (list, tuple)) or not seeds:
            raise fail("runs.seeds", f"{seeds!r}", "give a list of integer seeds, e.g. [0, 1]")
        numbers = tuple(number(s, f"runs.seeds[{i}]", int) for i, s in enumerate(seeds))
        if len(set(numbers)) != len(numbers):
            raise fail("runs.seeds", f"{list(numbers)} repeats a seed", "list each seed once")
        set_field(self, "seeds", numbers)
        controls = [self.controls] if isinstance(self.controls, str) else self.controls
        if not isinstance(controls, (list, tuple)):
            raise fail("runs.controls", f"{controls!r}", "list the arms that are controls")
        for j, name in enumerate(controls):
            if name not in checked or name == self.baseline:
                raise fail(
                    f"runs.controls[{j}]",
                    f"{name!r} is not an arm other than the baseline",
                    f"use some of {sorted(set(checked) - {self.baseline})}",
                )
        set_field(self, "controls", tuple(controls))
