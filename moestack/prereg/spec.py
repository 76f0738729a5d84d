"""The pre-registration file: ``Prereg`` (the whole study file), ``RunSpec`` (one run of its
grid), and ``parse``/``load`` that build a ``Prereg`` from a mapping or a file.

``Prereg`` holds the overrides every run shares (``model``, ``data``, ``train``) and the parts
of the file (``parts``: the ``Budget``, the ``Runs``, the ``Analysis``, the ``Hypothesis``
list, the optional ``Power`` and ``Selection`` blocks), builds each from its mapping (a key
the part has no field for is refused) and checks what ties them together: a hypothesis's
arms, metric and rule against the runs and the analysis, a joint hypothesis's parts, the
power block's seed count. Errors are one line naming the field and the fix
(``hypotheses[1] (H2).op: '<'; use one of ('<=', '>=')``).

A part built from the file knows which keys the file gave (``given``): a key written is
checked as written even where its value equals the field's default (``budget.batch_size:
null`` and ``analysis.decision_reason: ""`` are refused; left out, they mean "not set").
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moestack.errors import MoestackError
from moestack.prereg.fields import (
    BUDGET_KEYS,
    build_part,
    cache_metric,
    fail,
    is_name,
    left_out,
    override_list,
    serve_batch,
    set_field,
    steered_metric,
)
from moestack.prereg.parts import Analysis, Budget, Hypothesis, Power, Runs, Selection


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
        if not is_name(self.study):
            raise fail("study", f"{self.study!r} is not a name", "use letters, digits, _ . -")
        set_field(self, "path", Path(self.path))
        set_field(self, "model", override_list(self.model, "model"))
        if not self.model:
            raise fail("model", "missing", "give the model as overrides, e.g. [model=tiny]")
        set_field(self, "data", override_list(self.data, "data"))
        set_field(
            self,
            "budget",
            build_part(Budget, self.budget, "budget", fix="use " + ", ".join(BUDGET_KEYS)),
        )
        set_field(self, "train", override_list(self.train, "train"))
        set_field(
            self, "runs", build_part(Runs, self.runs, "runs", fix="use baseline, arms, seeds")
        )
        set_field(self, "analysis", build_part(Analysis, self.analysis or {}, "analysis"))
        set_field(self, "hypotheses", self._hypotheses())
        title = self.study if left_out(self, "title", given) else self.title
        set_field(self, "title", str(title))
        set_field(self, "question", str(self.question))
        if self.power is not None:
            set_field(self, "power", build_part(Power, self.power, "power"))
            self._check_power(self.power)
        if self.selection is not None:
            set_field(self, "selection", build_part(Selection, self.selection, "selection"))
            self._check_selection(self.selection)

    def _check_selection(self, selection: Selection) -> None:
        """Refuse a test split that reads windows the settings were tuned on."""
        (a, b), (c, d) = selection.windows, self.analysis.eval_windows
        if a < d and c < b:
            raise fail(
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
            raise fail("hypotheses", "expected a non-empty list", "pre-register at least one")
        seen: dict[str, Hypothesis] = {}
        for i, item in enumerate(items):
            where = f"hypotheses[{i}]"
            hyp = build_part(Hypothesis, item, where, where=where)
            if hyp.id in seen:
                raise fail(
                    f"{where}.id", f"{hyp.id!r} is used twice", "give each hypothesis its own id"
                )
            self._check_hypothesis(hyp, f"{where} ({hyp.id})", seen)
            seen[hyp.id] = hyp
        return tuple(seen.values())

    def _check_hypothesis(self, hyp: Hypothesis, at: str, earlier: dict[str, Hypothesis]) -> None:
        """What ``hyp`` refers to: its arms (the baseline is no arm of a comparison with
        itself), its rule under Holm, the earlier hypotheses a joint one joins, and the
        policy and capacity of a cache metric (the analysis must replay them)."""
        self._check_arms(hyp, at)
        if self.analysis.correction == "holm" and hyp.decision in ("mean", "ci"):
            raise fail(f"{at}.decision", f"{hyp.decision!r} with holm", "use a one-sided rule")
        if hyp.comparison == "joint":
            self._check_joint(hyp, at, earlier)
        elif (parts := cache_metric(hyp.metric)) is not None:
            self._check_cache_metric(hyp.metric, parts, at)
        elif (steered := steered_metric(hyp.metric)) is not None:
            self._check_steered_metric(steered, at)

    def _check_arms(self, hyp: Hypothesis, at: str) -> None:
        """A gap_fraction's control is a control outside the arms; every arm is one of the
        study's, the baseline none of a comparison with itself."""
        if hyp.comparison == "gap_fraction" and (
            hyp.control not in self.runs.controls or hyp.control in hyp.arms
        ):
            raise fail(
                f"{at}.control",
                f"{hyp.control!r} is not a control outside the hypothesis's arms",
                f"use one of runs.controls {list(self.runs.controls)}",
            )
        for j, arm in enumerate(hyp.arms):
            if not isinstance(arm, str) or arm not in self.arms:
                raise fail(f"{at}.arms[{j}]", f"{arm!r} is not an arm", f"use {sorted(self.arms)}")
            if arm == self.baseline and hyp.comparison in (
                "relative_change",
                "difference",
                "gap_fraction",
            ):
                raise fail(
                    f"{at}.arms[{j}]",
                    f"the baseline {arm!r} cannot be compared with itself",
                    "remove it or use comparison: value",
                )

    @staticmethod
    def _check_joint(hyp: Hypothesis, at: str, earlier: dict[str, Hypothesis]) -> None:
        """A joint hypothesis joins earlier non-joint ones, each tested on all its arms."""
        for j, ref in enumerate(hyp.of):
            if not isinstance(ref, str) or ref not in earlier or earlier[ref].comparison == "joint":
                raise fail(
                    f"{at}.of[{j}]",
                    f"{ref!r} is not an earlier non-joint hypothesis",
                    "list ids defined above this one",
                )
            missing = [a for a in hyp.arms if a not in earlier[ref].arms]
            if missing:
                raise fail(f"{at}.of[{j}]", f"{ref} is not tested on {missing}", "add them")

    def _check_cache_metric(self, metric: str, parts: tuple[str, int, str], at: str) -> None:
        """A cache metric's policy, capacity and serving batch are among those replayed."""
        policy, cap, _ = parts
        if policy not in self.analysis.policies:
            raise fail(
                f"{at}.metric", f"policy {policy!r} is not in analysis.policies", "add it there"
            )
        if cap not in self.analysis.capacities:
            raise fail(
                f"{at}.metric", f"capacity {cap} is not in analysis.capacities", "add it there"
            )
        batch = serve_batch(metric)
        if batch != 1 and batch not in self.analysis.serve_batches:
            raise fail(
                f"{at}.metric",
                f"batch {batch} is not in analysis.serve_batches",
                "add it there",
            )

    def _check_steered_metric(self, steered: tuple[str, int, str], at: str) -> None:
        """A steered metric's value and capacity are among the analysis's steered evaluations."""
        known = {(label, cap) for label, cap, _, _ in self.analysis.steered()}
        if steered[:2] not in known:
            names = sorted(f"{label}/cap{cap}" for label, cap in known) or "none"
            raise fail(
                f"{at}.metric",
                f"{steered[0]} at capacity {steered[1]} is not a steered evaluation "
                f"(the analysis has {names})",
                "add its value to analysis.reroute_taus or cache_biases and its capacity "
                "to analysis.steer_capacities",
            )

    def _check_power(self, power: Power) -> None:
        if power.seeds != len(self.seeds):
            raise fail(
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


def parse(data: Any, path: Path | str = "<memory>") -> Prereg:
    """Validate a loaded pre-registration mapping; errors name the field and the fix."""
    return build_part(Prereg, data, "", path=Path(path), raw=data)


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
