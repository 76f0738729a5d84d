"""Router detection: find a model's MoE routers and read the experts they chose.

``find_routers(model)`` walks ``model.named_modules()`` and returns a ``RouterSpec`` for
every router it recognises, tried in this order (``ROUTER_DETECTORS``):

1. ``moestack.Router`` modules (output ``Routing``; its ``experts`` are recorded).
2. transformers v5 routers: a module whose class name ends with ``TopKRouter`` /
   ``TopkRouter`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...). They
   return ``(logits, weights, indices)``; the integer tensor with ``top_k`` columns is
   recorded (DeepSeek-V3's group-limited, bias-corrected choice included).
3. transformers v4: a ``gate`` ``nn.Linear`` inside a module whose class name ends with
   ``SparseMoeBlock``. It returns logits; the experts are ``topk(softmax(logits), top_k)``
   with the model's own ``top_k`` (renormalisation changes weights, never which experts).
4. a ``gate`` module of another type inside a ``*SparseMoeBlock`` or ``*MoE`` module (e.g.
   DeepSeek's remote-code ``MoEGate`` returning ``(indices, weights[, aux])``): the integer
   output with ``top_k`` columns is recorded, else top-k of a float [T, E] output.
5. a ``router`` child of a known family router class inside a ``*SparseMoeBlock`` / ``*MoE``
   / ``*Moe`` block, read as that family's block reads it (``_FAMILY_ROUTERS``): Llama4
   (``(scores, logits)``; experts ``topk(logits)``, sigmoid gate), AFMoE (``(logits,
   weights, indices)``; sigmoid plus a bias, ``indices`` recorded), JetMoe (``logits`` is
   the 5th output; experts ``topk(logits)``, softmax). JetMoe's attention experts (MoA) are
   not recorded.
6. Doge's product-key block (a ``*CDMoE`` with a ``router_gate`` linear): its output's
   router logits are routed again exactly as the block does.

``routers=[names or modules]`` takes exactly those modules instead (outputs read as in 4).
``top_k`` / ``num_experts`` come from the router module, its block or the model config
(``num_experts_per_tok``, ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``),
unless given; a router whose ``top_k`` or ``num_experts`` cannot be told is refused, so
every ``RouterSpec`` has both. ``extract_experts(spec, output)`` turns one router output
into expert ids [T, top_k] (and probabilities when the output has them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_TOPK_ROUTER = re.compile(r"Top[kK]Router$")
_V4_BLOCK = re.compile(r"SparseMoeBlock$")
_GATE_BLOCK = re.compile(r"(SparseMoeBlock|MoE|Moe)$")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")
_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_PRODUCT_KEY_BLOCK = re.compile(r"CDMoE$")
# router class -> (score function, index of the float [T, E] logits in its output tuple,
# index of its integer [T, top_k] expert ids or None when the block takes topk(logits)).
_FAMILY_ROUTERS: dict[str, tuple[str, int, int | None]] = {
    "Llama4Router": ("sigmoid", 1, None),  # (sparse sigmoid scores, logits); topk of logits
    "AfmoeTokenChoiceRouter": ("sigmoid", 0, 2),  # (logits, weights, indices)
    "JetMoeTopKGating": ("softmax", 4, None),  # (sorted ids, batch ids, gates, sizes, logits)
}


@dataclass
class RouterSpec:
    """One hooked router: where it is, what it returns, its top_k and expert count."""

    name: str
    module: nn.Module
    kind: str  # "moestack", "topk_router", "v4_gate", "gate_module", "family_router",
    # "product_key", "explicit"
    top_k: int
    num_experts: int
    score: str = "softmax"  # how probabilities come from the logits: "softmax" or "sigmoid"
    expert_bytes: int | None = None


# ------------------------------------------------------------------------------ detectors
def _is_moestack_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    from moestack.router import Router

    return isinstance(module, Router)


def _is_topk_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    return bool(_TOPK_ROUTER.search(type(module).__name__))


def _is_v4_gate(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    return (
        name.rsplit(".", 1)[-1] == "gate"
        and isinstance(module, nn.Linear)
        and parent is not None
        and bool(_V4_BLOCK.search(type(parent).__name__))
    )


def _is_gate_module(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    return (
        name.rsplit(".", 1)[-1] == "gate"
        and not isinstance(module, nn.Linear)
        and parent is not None
        and bool(_GATE_BLOCK.search(type(parent).__name__))
    )


def _is_family_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    return (
        name.rsplit(".", 1)[-1] == "router"
        and type(module).__name__ in _FAMILY_ROUTERS
        and parent is not None
        and bool(_GATE_BLOCK.search(type(parent).__name__))
    )


def _is_product_key_block(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    return (
        bool(_PRODUCT_KEY_BLOCK.search(type(module).__name__))
        and isinstance(getattr(module, "router_gate", None), nn.Linear)
        and isinstance(getattr(module, "num_keys", None), int)
    )


# (kind, what it looks for, predicate): tried in order on every module.
ROUTER_DETECTORS: tuple[
    tuple[str, str, Callable[[str, nn.Module, nn.Module | None], bool]], ...
] = (
    ("moestack", "moestack.Router modules", _is_moestack_router),
    ("topk_router", "transformers v5 modules named *TopKRouter / *TopkRouter", _is_topk_router),
    ("v4_gate", "a 'gate' nn.Linear inside a *SparseMoeBlock (transformers v4)", _is_v4_gate),
    ("gate_module", "a 'gate' module inside a *SparseMoeBlock or *MoE block", _is_gate_module),
    (
        "family_router",
        "a 'router' (Llama4Router, AfmoeTokenChoiceRouter, JetMoeTopKGating) inside a "
        "*SparseMoeBlock / *MoE / *Moe block",
        _is_family_router,
    ),
    (
        "product_key",
        "a product-key *CDMoE block with a 'router_gate' (Doge)",
        _is_product_key_block,
    ),
)


# ------------------------------------------------------------------------------ sizes
def _config_value(model: nn.Module, keys: Sequence[str]) -> int | None:
    """The first positive int under ``keys`` in the model's (text) config or moestack cfg."""
    for cfg in (
        getattr(model, "config", None),
        getattr(getattr(model, "config", None), "text_config", None),
    ):
        if cfg is None:
            continue
        for key in keys:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
    moe = getattr(getattr(model, "cfg", None), "moe", None)  # moestack ModelConfig
    for key in keys:
        value = getattr(moe, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _module_value(mods: Iterable[nn.Module | None], keys: Sequence[str]) -> int | None:
    """The first positive int attribute under ``keys`` of the modules, in order."""
    for mod in mods:
        for key in keys:
            value = getattr(mod, key, None) if mod is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _expert_bytes(module: nn.Module, parent: nn.Module | None, num_experts: int) -> int | None:
    """Bytes of one expert's weights, from the MoE block next to the router (if it can)."""
    if parent is None:
        return None
    w1, w2 = getattr(parent, "w1", None), getattr(parent, "w2", None)  # moestack MoE
    if isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor):
        return int((w1[0].numel() + w2[0].numel()) * w1.element_size())
    experts = getattr(parent, "experts", None)
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        return int(sum(p.numel() * p.element_size() for p in experts[0].parameters()))
    if isinstance(experts, nn.Module):
        stacked = [p for p in experts.parameters(recurse=False) if p.dim() >= 1]
        if stacked and all(p.shape[0] == num_experts for p in stacked):
            return int(sum(p[0].numel() * p.element_size() for p in stacked))
    return None


# ------------------------------------------------------------------------------ finding
def _parent(model: nn.Module, modules: dict[str, nn.Module], name: str) -> nn.Module | None:
    return modules.get(name.rsplit(".", 1)[0]) if "." in name else (model if name else None)


def _named_routers(
    modules: dict[str, nn.Module], routers: Sequence[str | nn.Module]
) -> list[tuple[str, nn.Module, str]]:
    """(name, module, "explicit") for each router the caller named or passed."""
    names = {id(m): n for n, m in modules.items()}
    found: list[tuple[str, nn.Module, str]] = []
    for item in routers:
        if isinstance(item, nn.Module):
            if id(item) not in names:
                raise ValueError(f"router module {type(item).__name__} is not inside the model")
            found.append((names[id(item)], item, "explicit"))
        elif item in modules:
            found.append((item, modules[item], "explicit"))
        else:
            close = [n for n in modules if n.endswith(str(item).rsplit(".", 1)[-1])][:5]
            raise ValueError(f"routers has {item!r}, not a module name of the model; e.g. {close}")
    return found


def _detected_routers(
    model: nn.Module, modules: dict[str, nn.Module]
) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) of every module a detector claims; none inside a claimed one."""
    found: list[tuple[str, nn.Module, str]] = []
    claimed: list[str] = []
    for name, module in modules.items():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        parent = _parent(model, modules, name)
        for kind, _, predicate in ROUTER_DETECTORS:
            if predicate(name, module, parent):
                found.append((name, module, kind))
                claimed.append(name)
                break
    if not found:
        looked = "; ".join(what for _, what, _ in ROUTER_DETECTORS)
        raise ValueError(
            f"no MoE router found in {type(model).__name__}: looked for {looked}. Name the "
            "router modules yourself: attach(model, routers=[...]) with module names from "
            "model.named_modules() (or the modules), plus top_k= / num_experts= if the "
            "model config does not give them"
        )
    return found


def _router_spec(
    model: nn.Module,
    parent: nn.Module | None,
    found: tuple[str, nn.Module, str],
    top_k: int | None,
    num_experts: int | None,
) -> RouterSpec:
    """The RouterSpec of one found router: its top_k, expert count, score and expert size."""
    name, module, kind = found
    k = top_k or _module_value([module, parent], ("top_k",)) or _config_value(model, _TOP_K_KEYS)
    e = num_experts or _module_value([module], ("num_experts",))
    if e is None and isinstance(module, nn.Linear):
        e = module.out_features
    if e is None and isinstance(getattr(module, "weight", None), torch.Tensor):
        e = int(module.weight.shape[0])
    e = e or _config_value(model, _NUM_EXPERTS_KEYS)
    if not k or not e:
        raise ValueError(
            f"cannot tell top_k ({k}) / num_experts ({e}) of router {name!r} "
            f"({type(module).__name__}); pass attach(..., top_k=, num_experts=)"
        )
    if kind == "moestack":
        score = "routing"
    elif kind == "family_router":
        score = _FAMILY_ROUTERS[type(module).__name__][0]
    elif kind == "product_key":
        score = "product_key"
    elif hasattr(module, "e_score_correction_bias"):
        score = "sigmoid"
    else:
        score = "softmax"
    return RouterSpec(
        name, module, kind, int(k), int(e), score, _expert_bytes(module, parent, int(e))
    )


def find_routers(
    model: nn.Module,
    routers: Sequence[str | nn.Module] | None = None,
    *,
    top_k: int | None = None,
    num_experts: int | None = None,
) -> list[RouterSpec]:
    """The model's MoE routers, in module order (one per MoE layer)."""
    modules = dict(model.named_modules())
    if routers is not None:
        found = _named_routers(modules, routers)
    else:
        found = _detected_routers(model, modules)
    return [
        _router_spec(model, _parent(model, modules, item[0]), item, top_k, num_experts)
        for item in found
    ]


# ------------------------------------------------------------------------------ outputs
def _output_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


def _probabilities(spec: RouterSpec, logits: torch.Tensor) -> torch.Tensor:
    """Router probabilities [T, E] from float logits, with the router's score function."""
    logits = logits.reshape(-1, spec.num_experts).float()
    if spec.score == "sigmoid":
        probs = logits.sigmoid()
        return probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
    return torch.softmax(logits, dim=-1)


def _family_router_experts(
    spec: RouterSpec, output: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A family router's output read as its block reads it (see ``_FAMILY_ROUTERS``)."""
    _, logits_at, ids_at = _FAMILY_ROUTERS[type(spec.module).__name__]
    logits_TE = output[logits_at].reshape(-1, spec.num_experts)
    # without an ids output, the block routes on topk of the raw logits (dim 1 of [T, E])
    topk_TK = torch.topk(logits_TE, spec.top_k, dim=1).indices if ids_at is None else None
    ids_TK = output[ids_at] if ids_at is not None else topk_TK
    return ids_TK.reshape(-1, spec.top_k), _probabilities(spec, logits_TE)


def _product_key_experts(spec: RouterSpec, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Doge's routing redone from its block's ``(hidden, router_logits [2, T, keys])`` output.

    The same steps as the block: top-keys of each half, every pair's summed score, top_k
    of those. Probabilities are the softmax over all keys x keys pair scores when that
    grid is every expert, else None.
    """
    logits_2TN = output[1]
    keys, k = int(logits_2TN.shape[-1]), spec.top_k
    (scores_x, scores_y), (indices_x, indices_y) = logits_2TN.topk(keys, dim=-1)
    all_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)
    all_indices = (indices_x.unsqueeze(-1) * keys + indices_y.unsqueeze(-2)).flatten(-2)
    position_indices = all_scores.topk(k, dim=-1).indices
    ids_TK = all_indices.gather(-1, position_indices)
    probs = None
    if keys * keys == spec.num_experts:
        pair_TE = (logits_2TN[0].unsqueeze(-1) + logits_2TN[1].unsqueeze(-2)).flatten(-2)
        probs = torch.softmax(pair_TE.float(), dim=-1)
    return ids_TK.reshape(-1, k), probs


def extract_experts(spec: RouterSpec, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(expert ids [T, k], router probabilities [T, E] or None) from a router's output."""
    from moestack.router import Routing

    if spec.kind == "family_router":
        return _family_router_experts(spec, output)
    if spec.kind == "product_key":
        return _product_key_experts(spec, output)
    k, e = spec.top_k, spec.num_experts
    if isinstance(output, Routing):
        probs = output.scores
        if getattr(getattr(spec.module, "cfg", None), "score", "softmax") != "softmax":
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        return output.experts.reshape(-1, k), probs.reshape(-1, e)
    tensors = _output_tensors(output)
    ids = next(
        (t for t in tensors if not t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == k),
        None,
    )
    logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] == e), None)
    probs = None if logits is None else _probabilities(spec, logits)
    if ids is None:
        if probs is None:
            raise ValueError(
                f"router {spec.name!r} ({type(spec.module).__name__}) returned no integer "
                f"[T, top_k={k}] tensor and no float [T, num_experts={e}] tensor; check top_k / "
                "num_experts or name a different module in routers="
            )
        ids = torch.topk(probs, k, dim=-1).indices
    return ids.reshape(-1, k), probs
