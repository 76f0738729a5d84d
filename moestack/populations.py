"""Parameter populations: which parameters of an MoE model share an optimizer-state policy.

(A config module, with the config of the tiered optimizer's populations: it imports no
optimizer code, so that the optimizers (moestack.optim.tiered, moestack.optim.factory), their
config (moestack.optim.config) and the memory plan read it without an import cycle.)

An MoE's parameters are not alike: most are experts, each of which sees a small share of the
tokens; a few are routers, whose small weights decide every token's path; the rest is the
dense backbone and the embeddings. The tiered optimizer (:mod:`moestack.optim.tiered`) gives
each population only the state it needs, so the populations are named here once:

- ``experts``: the MoE layers' expert weights (``MoE.w1``, ``MoE.w2``), stacked ``[E, ...]``:
  each expert's matrix is a unit of its own (factored and clipped on its own);
- ``routers``: every parameter of a router module;
- ``embeddings``: the input embeddings and the output projection;
- ``adapters``: LoRA parameters (``lora`` in the name); those on the experts are stacked per
  expert like the experts;
- ``backbone``: everything else (attention, norms, dense layers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from moestack.checks import check

POPULATIONS = ("experts", "routers", "embeddings", "backbone", "adapters")
MASTER = ("float32", "none")  # optim.master: an fp32 master copy of bf16 weights, or none
MOMENTUM = ("none", "float32", "bfloat16")
SECOND_MOMENT = ("full", "factored")


@dataclass
class PopulationConfig:
    """The optimizer state one population keeps (``optim.<population>.*``)."""

    momentum: str = "float32"  # tiered: the first moment and its dtype: none, float32, bfloat16
    second_moment: str = "factored"  # tiered: full (per element, fp32) or factored (rows, cols)
    weight_decay: float | None = None  # tiered: decay on matrices; null: optim.weight_decay

    def check(self, population: str) -> None:
        """Refuse a bad value in one line naming ``optim.<population>.<field>``."""
        key = f"optim.{population}"
        check(
            self.momentum in MOMENTUM,
            f"{key}.momentum={self.momentum!r} is unknown; use one of {MOMENTUM}",
        )
        check(
            self.second_moment in SECOND_MOMENT,
            f"{key}.second_moment={self.second_moment!r} is unknown; use one of {SECOND_MOMENT}",
        )
        check(
            self.weight_decay is None or self.weight_decay >= 0,
            f"{key}.weight_decay={self.weight_decay} must be >= 0 (or null: optim.weight_decay)",
        )


def default_policy(population: str) -> PopulationConfig:
    """The state each population keeps by default: fp32 momentum and factored second moments
    for the backbone and embeddings, factored second moments alone for the experts, a full
    fp32 second moment alone for the routers, and AdamW's full state for adapters (few
    parameters, trained from zero)."""
    return {
        "experts": PopulationConfig(momentum="none", second_moment="factored"),
        "routers": PopulationConfig(momentum="none", second_moment="full"),
        "adapters": PopulationConfig(momentum="float32", second_moment="full"),
    }.get(population, PopulationConfig(momentum="float32", second_moment="factored"))


def population_field(population: str) -> Any:
    """A dataclass field defaulting to ``default_policy(population)``."""
    return dataclasses.field(default_factory=lambda: default_policy(population))


@dataclass(frozen=True)
class ParamInfo:
    """Where a parameter belongs: its population, and whether its first dimension stacks
    one unit per expert (``[E, ...]``: factored and clipped expert by expert)."""

    population: str
    stacked: bool


def classify(model: nn.Module) -> dict[str, ParamInfo]:
    """Every parameter name of ``model`` (as ``named_parameters`` gives it) -> its
    :class:`ParamInfo`, by the module that owns it: moestack's ``MoE`` and ``Router``, or
    transformers' own (an ``*Experts`` module, stacked ``[E, ...]`` in v5; a ``*TopKRouter``;
    the ``gate`` of a ``*SparseMoeBlock`` and its ``experts`` list in v4), an
    ``nn.Embedding`` or the output projection; adapters by name (``lora``)."""
    embeddings = _output_embeddings(model)
    owned: dict[int, ParamInfo] = {}
    for path, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if id(p) not in owned:
                owned[id(p)] = _population(path, module, attr, p, id(p) in embeddings)
    backbone = ParamInfo("backbone", False)
    return {name: owned.get(id(p), backbone) for name, p in model.named_parameters()}


def _population(
    path: str, module: nn.Module, attr: str, p: nn.Parameter, output_embedding: bool
) -> ParamInfo:
    """The population of parameter ``attr`` of the module at ``path``."""
    from moestack.moe import MoE  # the layer; imported here: optim is imported by its users
    from moestack.router import Router

    kind = type(module).__name__
    parts = path.split(".")
    if "lora" in attr:
        return ParamInfo("adapters", isinstance(module, MoE) and p.ndim == 3)
    if isinstance(module, MoE) or kind.endswith("Experts"):
        return ParamInfo("experts", p.ndim == 3)
    if "experts" in parts[:-1]:  # transformers v4: one module per expert
        return ParamInfo("experts", False)
    if isinstance(module, Router) or kind.endswith("Router") or parts[-1] == "gate":
        return ParamInfo("routers", False)
    if isinstance(module, nn.Embedding) or output_embedding:
        return ParamInfo("embeddings", False)
    return ParamInfo("backbone", False)


def _output_embeddings(model: nn.Module) -> set[int]:
    """The ids of the output projection's parameters (``lm_head`` or transformers'
    ``get_output_embeddings``), which belong with the embeddings."""
    found: set[int] = set()
    for name, module in model.named_modules():
        getter = getattr(module, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, nn.Module):
            found.update(id(p) for p in head.parameters())
        if name.split(".")[-1] == "lm_head":
            found.update(id(p) for p in module.parameters())
    return found
