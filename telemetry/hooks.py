"""Zero-surgery routing telemetry: find a model's MoE routers, hook them, replay caches.

``attach(model)`` walks ``model.named_modules()`` and hooks every router it recognises, with
``register_forward_hook`` only (nothing in the model is edited; ``detach()`` removes every
hook). Recognised, in this order (``ROUTER_DETECTORS``):

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

``routers=[names or modules]`` hooks exactly those modules instead (outputs read as in 4).
``top_k`` / ``num_experts`` come from the router module, its block or the model config
(``num_experts_per_tok``, ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``),
unless given. A forward pre-hook on ``model`` reads the batch shape ([B, S] ``tokens`` /
``input_ids`` / ``inputs_embeds``, ``attention_mask``, ``position_ids``) to give every
token its sequence and position id; the router hooks copy the chosen expert ids (int16) and
a per-token routing-entropy sum, nothing else, and the copies reach numpy only when metrics
or the trace are read (no per-token ``.item()``, one host sync per read on CUDA).

Interval metrics (``Telemetry.interval_metrics``) replay the requests recorded since the
previous call through each configured policy and capacity, one cache per layer; cache state
persists across intervals (LRU recency, LFU counts). ``static`` and ``lru+static`` pin the
experts most used in the previous interval (the first interval: its own most used), so they
track the router as it trains. ``belady`` is the optimum of each interval alone, from empty.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from moestack.cache.policies import (
    POLICIES,
    BeladyPolicy,
    CachePolicy,
    LFUPolicy,
    LRUStaticPolicy,
    StaticPolicy,
    stack_distances,
)
from moestack.telemetry.replay import switch_counts, usage_entropy
from moestack.telemetry.trace import RoutingTrace, TraceChunk, chunk_accesses, expert_dtype

log = logging.getLogger(__name__)

_TOPK_ROUTER = re.compile(r"Top[kK]Router$")
_V4_BLOCK = re.compile(r"SparseMoeBlock$")
_GATE_BLOCK = re.compile(r"(SparseMoeBlock|MoE|Moe)$")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")
_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class RouterSpec:
    """One hooked router: where it is, what it returns, its top_k and expert count."""

    name: str
    module: nn.Module
    kind: str  # "moestack", "topk_router", "v4_gate", "gate_module", "explicit"
    top_k: int
    num_experts: int
    score: str = "softmax"  # how probabilities come from the logits: "softmax" or "sigmoid"
    expert_bytes: int | None = None


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


# (kind, what it looks for, predicate): tried in order on every module.
ROUTER_DETECTORS: tuple[
    tuple[str, str, Callable[[str, nn.Module, nn.Module | None], bool]], ...
] = (
    ("moestack", "moestack.Router modules", _is_moestack_router),
    ("topk_router", "transformers v5 modules named *TopKRouter / *TopkRouter", _is_topk_router),
    ("v4_gate", "a 'gate' nn.Linear inside a *SparseMoeBlock (transformers v4)", _is_v4_gate),
    ("gate_module", "a 'gate' module inside a *SparseMoeBlock or *MoE block", _is_gate_module),
)


def _config_value(model: nn.Module, keys: Sequence[str]) -> int | None:
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


def find_routers(
    model: nn.Module,
    routers: Sequence[str | nn.Module] | None = None,
    *,
    top_k: int | None = None,
    num_experts: int | None = None,
) -> list[RouterSpec]:
    """The model's MoE routers, in module order (one per MoE layer)."""
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}

    def parent_of(name: str) -> nn.Module | None:
        return modules.get(name.rsplit(".", 1)[0]) if "." in name else (model if name else None)

    found: list[tuple[str, nn.Module, str]] = []
    if routers is not None:
        for item in routers:
            if isinstance(item, nn.Module):
                if id(item) not in names:
                    raise ValueError(f"router module {type(item).__name__} is not inside the model")
                found.append((names[id(item)], item, "explicit"))
            elif item in modules:
                found.append((item, modules[item], "explicit"))
            else:
                close = [n for n in modules if n.endswith(str(item).rsplit(".", 1)[-1])][:5]
                raise ValueError(
                    f"routers has {item!r}, not a module name of the model; e.g. {close}"
                )
    else:
        claimed: list[str] = []
        for name, module in modules.items():
            if any(name.startswith(c + ".") for c in claimed):
                continue
            parent = parent_of(name)
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

    specs = []
    for name, module, kind in found:
        parent = parent_of(name)
        k = (
            top_k
            or _module_value([module, parent], ("top_k",))
            or _config_value(model, _TOP_K_KEYS)
        )
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
        elif hasattr(module, "e_score_correction_bias"):
            score = "sigmoid"
        else:
            score = "softmax"
        specs.append(
            RouterSpec(
                name, module, kind, int(k), int(e), score, _expert_bytes(module, parent, int(e))
            )
        )
    return specs


def _extract(spec: RouterSpec, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(expert ids [T, k], router probabilities [T, E] or None) from a router's output."""
    from moestack.router import Routing

    k, e = spec.top_k, spec.num_experts
    if isinstance(output, Routing):
        probs = output.scores
        if getattr(getattr(spec.module, "cfg", None), "score", "softmax") != "softmax":
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        return output.experts.reshape(-1, k), probs.reshape(-1, e)
    tensors = (
        [output]
        if isinstance(output, torch.Tensor)
        else [
            t
            for t in (output if isinstance(output, (tuple, list)) else ())
            if isinstance(t, torch.Tensor)
        ]
    )
    ids = next(
        (t for t in tensors if not t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == k),
        None,
    )
    logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] == e), None)
    probs = None
    if logits is not None:
        logits = logits.reshape(-1, e).float()
        if spec.score == "sigmoid":
            probs = logits.sigmoid()
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        else:
            probs = torch.softmax(logits, dim=-1)
    if ids is None:
        if probs is None:
            raise ValueError(
                f"router {spec.name!r} ({type(spec.module).__name__}) returned no integer "
                f"[T, top_k={k}] tensor and no float [T, num_experts={e}] tensor; check top_k / "
                "num_experts or name a different module in routers="
            )
        ids = torch.topk(probs, k, dim=-1).indices
    return ids.reshape(-1, k), probs


@dataclass
class _Call:
    """What the pre-hook learned about one forward call of the top model."""

    batch: int | None = None
    seq_len: int | None = None
    mask: torch.Tensor | None = None  # [B, S] attention mask
    positions: torch.Tensor | None = None  # [B or 1, S] position ids
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> ids [T, k]
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    entropy: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> sum over tokens


@dataclass
class _Acc:
    """Sums over an interval (or the whole run) for one layer."""

    tokens: int = 0
    requests: int = 0
    hits: dict[tuple[str, int], int] = field(default_factory=dict)
    requests_by: dict[tuple[str, int], int] = field(default_factory=dict)
    switch_sum: float = 0.0
    switch_pairs: int = 0
    entropy_sum: float = 0.0
    entropy_tokens: int = 0
    counts: np.ndarray | None = None
    reuse: np.ndarray | None = None


class Telemetry:
    """Hooks on a model's routers, a RoutingTrace, and cache replay metrics."""

    def __init__(
        self,
        model: nn.Module,
        specs: list[RouterSpec],
        *,
        policies: Sequence[str] = ("lru", "static"),
        capacities: Sequence[int] = (2, 4),
        record_probs: bool = False,
        trace_dir: str | None = None,
        chunk_tokens: int = 1 << 18,
        max_memory_tokens: int = 1 << 20,
        entropy: bool = True,
    ) -> None:
        for p in policies:
            if p not in POLICIES:
                raise ValueError(f"policies has {p!r}; use names from {POLICIES}")
        for c in capacities:
            if int(c) < 1:
                raise ValueError(f"capacities has {c}; each must be >= 1 expert slot per layer")
        if not policies or not capacities:
            raise ValueError("give at least one policy and one capacity")
        self.model = model
        self.routers = specs
        self.policies = tuple(policies)
        self.capacities = tuple(int(c) for c in capacities)
        self.record_probs = record_probs
        self.compute_entropy = entropy
        self.keep_trace = bool(trace_dir) or max_memory_tokens > 0
        self.trace = RoutingTrace(
            [s.name for s in specs],
            [s.top_k for s in specs],
            [s.num_experts for s in specs],
            expert_bytes=[s.expert_bytes for s in specs],
            record_probs=record_probs,
            path=trace_dir or None,
            chunk_tokens=chunk_tokens,
            max_memory_tokens=None if trace_dir else max_memory_tokens,
            meta={"model": type(model).__name__, "router_kinds": [s.kind for s in specs]},
        )
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._active = True
        self._call = _Call()
        self._raw: list[tuple[np.ndarray, np.ndarray, _Call]] = []  # finished forward calls
        self._raw_tokens = 0
        self._unread: list[TraceChunk] = []  # drained chunks not yet replayed
        self._next_seq = 0
        self._last_call: tuple[int, np.ndarray] | None = None  # (batch, seq ids) of last call
        self._hook_errors = 0
        self._fallback_warned = False
        # Replay state, one entry per layer.
        n = len(specs)
        self._lru_last = [np.full(0, -1, dtype=np.int64) for _ in range(n)]
        self._lru_tick = [0] * n
        self._policy: dict[tuple[int, str, int], CachePolicy] = {}
        self._interval = [_Acc() for _ in range(n)]
        self._total = [_Acc() for _ in range(n)]
        self._history: list[tuple[int, list[float]]] = []  # (step, per-layer primary hit rate)
        self._intervals = 0
        self._replay_s = 0.0
        self._hook()

    # ------------------------------------------------------------------ hooks
    def _hook(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post_hook))
        for layer, spec in enumerate(self.routers):
            self._handles.append(spec.module.register_forward_hook(self._router_hook(layer, spec)))

    def detach(self) -> None:
        """Remove every hook this Telemetry added; recorded data stays readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._finish_call()
        self._drain()

    def close(self) -> None:
        """Detach and write out the trace."""
        self.detach()
        self.trace.flush()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside (e.g. evaluation passes)."""
        was, self._active = self._active, False
        try:
            yield
        finally:
            self._active = was

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active:
            return
        try:
            self._finish_call()
            call = _Call()
            x = None
            for key in ("input_ids", "tokens", "inputs_embeds", "idx"):
                if isinstance(kwargs.get(key), torch.Tensor):
                    x = kwargs[key]
                    break
            if x is None and args and isinstance(args[0], torch.Tensor):
                x = args[0]
            if x is not None and x.dim() >= 1:
                embeds = kwargs.get("inputs_embeds") is x
                shape = x.shape[:-1] if embeds else x.shape
                if len(shape) == 1:
                    shape = (1, shape[0])
                if len(shape) == 2:
                    call.batch, call.seq_len = int(shape[0]), int(shape[1])
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                call.mask = mask.detach()
            positions = kwargs.get("position_ids")
            if isinstance(positions, torch.Tensor) and positions.dim() == 2:
                call.positions = positions.detach()
            elif isinstance(kwargs.get("cache_position"), torch.Tensor):
                call.positions = kwargs["cache_position"].detach().reshape(1, -1)
            self._call = call
        except Exception:  # never break the model's forward
            self._hook_failed()

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._active:
            self._finish_call()
            self._call = _Call()

    def _router_hook(self, layer: int, spec: RouterSpec) -> Callable[..., None]:
        dtype = torch.int16 if expert_dtype(spec.num_experts) == np.int16 else torch.int32

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._active:
                return
            try:
                with torch.no_grad():
                    ids, probs = _extract(spec, output)
                    if layer in self._call.layers:  # a new forward without the top model
                        self._finish_call()
                    call = self._call
                    call.layers[layer] = ids.detach().to(dtype)
                    if probs is not None:
                        probs = probs.detach()
                        if self.compute_entropy:
                            call.entropy[layer] = torch.special.entr(probs.float()).sum()
                        if self.record_probs:
                            call.probs[layer] = probs.to(torch.float16)
            except Exception:
                self._hook_failed()

        return hook

    def _hook_failed(self) -> None:
        self._hook_errors += 1
        if self._hook_errors == 1:
            log.exception("telemetry hook failed; this forward pass is not recorded")

    # ------------------------------------------------------------------ collection
    def _finish_call(self) -> None:
        """Turn the current forward call into sequence / position ids and queue it."""
        call = self._call
        self._call = _Call(call.batch, call.seq_len, call.mask, call.positions)
        if not call.layers:
            return
        sizes = {t.shape[0] for t in call.layers.values()}
        if len(sizes) != 1:
            log.warning("routers saw different token counts %s in one forward; skipped", sizes)
            return
        n = sizes.pop()
        b, s = call.batch, call.seq_len
        if b is None or s is None or b * s != n:
            if not self._fallback_warned:
                log.warning(
                    "telemetry: routers saw %d tokens but the batch shape is %s; each forward is "
                    "recorded as one sequence",
                    n,
                    (b, s),
                )
                self._fallback_warned = True
            b, s = 1, n
            call.mask = call.positions = None
        if call.positions is not None:
            pos = call.positions.to("cpu", torch.int64).expand(b, s).numpy().astype(np.int32)
        else:
            pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
        if self._last_call is not None and self._last_call[0] == b and pos.size and pos.min() > 0:
            seq_ids = self._last_call[1]  # continuation of the same sequences (KV cache)
        else:
            seq_ids = np.arange(self._next_seq, self._next_seq + b, dtype=np.int64)
            self._next_seq += b
        self._last_call = (b, seq_ids)
        if call.mask is not None:
            pos = np.where(call.mask.to("cpu").numpy().reshape(b, s) > 0, pos, -1).astype(np.int32)
        seq = np.repeat(seq_ids, s)
        self._raw.append((seq, pos.reshape(-1), call))
        self._raw_tokens += n
        if self._raw_tokens >= (1 << 20):  # bound memory held on the device
            self._drain()

    def _drain(self) -> None:
        """Copy queued calls to numpy: into the trace and the unreplayed list."""
        for seq, pos, call in self._raw:
            n = seq.shape[0]
            experts = []
            for layer, spec in enumerate(self.routers):
                ids = call.layers.get(layer)
                if ids is None:
                    experts.append(
                        np.full((n, spec.top_k), -1, dtype=expert_dtype(spec.num_experts))
                    )
                else:
                    experts.append(ids.cpu().numpy())
            probs = None
            if self.record_probs:
                probs = [
                    call.probs[i].cpu().numpy()
                    if i in call.probs
                    else np.zeros((n, s.num_experts), dtype=np.float16)
                    for i, s in enumerate(self.routers)
                ]
            chunk = TraceChunk(seq, pos, experts, probs)
            if self.keep_trace:
                self.trace.append(seq, pos, experts, probs)
            self._unread.append(chunk)
            for layer, ent in call.entropy.items():
                for acc in (self._interval[layer], self._total[layer]):
                    acc.entropy_sum += float(ent)
                    acc.entropy_tokens += n
        self._raw.clear()
        self._raw_tokens = 0

    # ------------------------------------------------------------------ replay
    def _update(self) -> None:
        """Replay every drained, unreplayed chunk through the configured caches."""
        self._finish_call()
        self._drain()
        if not self._unread:
            return
        chunks, self._unread = self._unread, []
        start = time.perf_counter()
        for layer, spec in enumerate(self.routers):
            requests = np.concatenate([chunk_accesses(c, layer) for c in chunks])
            counts = np.bincount(requests, minlength=spec.num_experts)[: spec.num_experts]
            dist, self._lru_last[layer] = stack_distances(
                requests, self._lru_last[layer], self._lru_tick[layer]
            )
            self._lru_tick[layer] += requests.size
            reuse = np.zeros(spec.num_experts + 1, dtype=np.int64)
            cold = dist < 0
            reuse[: spec.num_experts] = np.bincount(dist[~cold], minlength=spec.num_experts)[
                : spec.num_experts
            ]
            reuse[-1] = cold.sum()
            tokens = sum(int((c.pos >= 0).sum()) for c in chunks if c.experts[layer].size)
            sw_sum, sw_pairs = 0.0, 0
            for c in chunks:
                s, p = switch_counts(c.experts[layer], c.seq, c.pos)
                sw_sum += s
                sw_pairs += p
            hits: dict[tuple[str, int], int] = {}
            for name in self.policies:
                for cap in self.capacities:
                    hit = self._replay(layer, name, cap, requests, dist, counts)
                    if hit is not None:
                        hits[(name, cap)] = hit
            for acc in (self._interval[layer], self._total[layer]):
                acc.tokens += tokens
                acc.requests += int(requests.size)
                acc.switch_sum += sw_sum
                acc.switch_pairs += sw_pairs
                for key, h in hits.items():  # a policy's warm-up chunk is not counted
                    acc.hits[key] = acc.hits.get(key, 0) + h
                    acc.requests_by[key] = acc.requests_by.get(key, 0) + int(requests.size)
                acc.counts = counts if acc.counts is None else acc.counts + counts
                acc.reuse = reuse if acc.reuse is None else acc.reuse + reuse
        self._replay_s += time.perf_counter() - start

    def _replay(
        self,
        layer: int,
        name: str,
        cap: int,
        requests: np.ndarray,
        dist: np.ndarray,
        counts: np.ndarray,
    ) -> int | None:
        """Hits of one policy on this chunk; None for the warm-up chunk of a pinned policy."""
        if name == "lru":  # LRU of every capacity from the shared stack distances
            return int(((dist >= 0) & (dist < cap)).sum())
        if name == "belady":
            return int(BeladyPolicy(cap, requests).access_many(requests).sum())
        key = (layer, name, cap)
        policy = self._policy.get(key)
        if policy is None:
            if name == "lfu":
                policy = LFUPolicy(cap)
            elif name == "static":
                policy = StaticPolicy(cap, _top(counts, cap))
            elif cap >= 2:
                policy = LRUStaticPolicy(cap, _top(counts, cap // 2), num_pinned=cap // 2)
            else:
                policy = LRUStaticPolicy(cap, (), num_pinned=0)
            self._policy[key] = policy
            if name != "lfu":
                # The pins were chosen from these very requests: replay them to warm the
                # cache, but scoring them would be hindsight (simulate() does the same
                # with its uncounted warm-up window).
                policy.access_many(requests)
                return None
        return int(policy.access_many(requests).sum())

    # ------------------------------------------------------------------ outputs
    def interval_metrics(self, step: int | None = None) -> dict[str, float]:
        """Flat metrics over the requests since the previous call (empty dict if none).

        Keys: ``telemetry/<policy>/cap<c>/{hit_rate,misses_per_token}``,
        ``telemetry/layer<l>/<policy>/cap<c>/hit_rate``, ``telemetry/{hit_rate,
        misses_per_token}`` (first policy and capacity), ``telemetry/{routing_entropy,
        usage_entropy,switch_rate}`` and per-layer twins, ``telemetry/tokens``,
        ``telemetry/replay_ms``.
        """
        before = self._replay_s
        self._update()
        accs, self._interval = self._interval, [_Acc() for _ in self.routers]
        if not any(a.requests for a in accs):
            return {}
        out = _metrics(accs, self.policies, self.capacities)
        out["telemetry/replay_ms"] = 1000.0 * (self._replay_s - before)
        primary = (self.policies[0], self.capacities[0])
        self._history.append(
            (
                self._intervals if step is None else int(step),
                [_ratio(a.hits.get(primary, 0), a.requests_by.get(primary, 0)) for a in accs],
            )
        )
        del self._history[:-1000]
        self._intervals += 1
        for (layer, _name, _cap), policy in self._policy.items():  # re-pin for the next interval
            counts = accs[layer].counts
            if counts is None or not isinstance(policy, LRUStaticPolicy):
                continue
            if policy.num_pinned:
                policy.pin(_top(counts, policy.num_pinned))
        self._last_interval = accs
        return out

    def summary(self) -> dict[str, Any]:
        """Whole-run numbers: hit rates per policy and capacity, usage, switch rate, entropy."""
        self._update()
        flat = (
            _metrics(self._total, self.policies, self.capacities)
            if any(a.requests for a in self._total)
            else {}
        )
        return {
            "routers": [s.name for s in self.routers],
            "router_kinds": [s.kind for s in self.routers],
            "top_k": [s.top_k for s in self.routers],
            "num_experts": [s.num_experts for s in self.routers],
            "expert_bytes": [s.expert_bytes for s in self.routers],
            "tokens": max((a.tokens for a in self._total), default=0),
            "requests": sum(a.requests for a in self._total),
            "metrics": flat,
            "expert_usage": [
                (a.counts.tolist() if a.counts is not None else [0] * s.num_experts)
                for a, s in zip(self._total, self.routers, strict=True)
            ],
            "reuse_distance_hist": [
                (a.reuse.tolist() if a.reuse is not None else []) for a in self._total
            ],
            "trace_tokens": self.trace.num_tokens,
            "dropped_tokens": self.trace.dropped_tokens,
            "replay_seconds": self._replay_s,
            "hook_errors": self._hook_errors,
        }

    def usage(self, interval: bool = False) -> np.ndarray:
        """Expert usage counts [layers, max experts] over the run (or the last interval)."""
        self._update()
        accs = getattr(self, "_last_interval", self._total) if interval else self._total
        width = max(s.num_experts for s in self.routers)
        out = np.zeros((len(self.routers), width), dtype=np.int64)
        for i, a in enumerate(accs):
            if a.counts is not None:
                out[i, : a.counts.size] = a.counts
        return out

    def capacity_curves(self) -> dict[str, list[float]]:
        """Hit rate vs capacity 1..E over the run: LRU (exact, from stack distances) and
        'static-oracle' (the run's most used experts pinned, compulsory misses ignored)."""
        self._update()
        width = max(s.num_experts for s in self.routers)
        lru_hits = np.zeros(width)
        static_hits = np.zeros(width)
        total = 0
        for a in self._total:
            if a.reuse is None or a.counts is None:
                continue
            cum = np.cumsum(a.reuse[:-1])
            lru_hits[: cum.size] += cum
            lru_hits[cum.size :] += cum[-1] if cum.size else 0
            top = np.cumsum(np.sort(a.counts)[::-1])
            static_hits[: top.size] += top
            static_hits[top.size :] += top[-1] if top.size else 0
            total += a.requests
        scale = 1.0 / total if total else 0.0
        return {
            "capacity": list(range(1, width + 1)),
            "lru": (lru_hits * scale).tolist(),
            "static-oracle": (static_hits * scale).tolist(),
        }

    def wandb_charts(self) -> dict[str, Any]:
        """wandb objects for a dashboard; pass to ``wandb.log`` (imports wandb lazily)."""
        import wandb

        from moestack.telemetry.report import usage_heatmap_rgb

        curves = self.capacity_curves()
        charts: dict[str, Any] = {
            "telemetry/charts/hit_rate_vs_capacity": wandb.plot.line_series(
                xs=curves["capacity"],
                ys=[curves["lru"], curves["static-oracle"]],
                keys=["lru", "static-oracle"],
                title="Hit rate vs cache capacity (experts per layer)",
                xname="capacity",
            )
        }
        if self._history:
            steps = [h[0] for h in self._history]
            ys = [[h[1][i] for h in self._history] for i in range(len(self.routers))]
            name, cap = self.policies[0], self.capacities[0]
            charts["telemetry/charts/layer_hit_rate"] = wandb.plot.line_series(
                xs=steps,
                ys=ys,
                keys=[f"layer{i}" for i in range(len(self.routers))],
                title=f"Per-layer hit rate ({name}, capacity {cap})",
                xname="step",
            )
        charts["telemetry/charts/expert_usage"] = wandb.Image(
            usage_heatmap_rgb(self.usage()), caption="expert usage share (layers x experts)"
        )
        return charts


def _top(counts: np.ndarray, n: int) -> list[int]:
    keys = np.flatnonzero(counts > 0)
    order = np.lexsort((keys, -counts[keys]))
    return [int(k) for k in keys[order][:n]]


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else 0.0


def _metrics(
    accs: list[_Acc], policies: Sequence[str], capacities: Sequence[int]
) -> dict[str, float]:
    out: dict[str, float] = {}
    tokens = max((a.tokens for a in accs), default=0)
    for name in policies:
        for cap in capacities:
            key = (name, cap)
            hits = sum(a.hits.get(key, 0) for a in accs)
            reqs = sum(a.requests_by.get(key, 0) for a in accs)
            if reqs == 0:  # nothing scored yet (a pinned policy's warm-up interval)
                continue
            out[f"telemetry/{name}/cap{cap}/hit_rate"] = _ratio(hits, reqs)
            out[f"telemetry/{name}/cap{cap}/misses_per_token"] = _ratio(reqs - hits, tokens)
            for layer, a in enumerate(accs):
                if a.requests_by.get(key, 0):
                    out[f"telemetry/layer{layer}/{name}/cap{cap}/hit_rate"] = _ratio(
                        a.hits.get(key, 0), a.requests_by[key]
                    )
    first = f"telemetry/{policies[0]}/cap{capacities[0]}"
    if f"{first}/hit_rate" in out:
        out["telemetry/hit_rate"] = out[f"{first}/hit_rate"]
        out["telemetry/misses_per_token"] = out[f"{first}/misses_per_token"]
    ent, use, sw = [], [], []
    for layer, a in enumerate(accs):
        if a.entropy_tokens:
            e = a.entropy_sum / a.entropy_tokens
            out[f"telemetry/layer{layer}/routing_entropy"] = e
            ent.append(e)
        if a.counts is not None:
            u = usage_entropy(a.counts)
            out[f"telemetry/layer{layer}/usage_entropy"] = u
            use.append(u)
        if a.switch_pairs:
            s = a.switch_sum / a.switch_pairs
            out[f"telemetry/layer{layer}/switch_rate"] = s
            sw.append(s)
    for key, values in (("routing_entropy", ent), ("usage_entropy", use), ("switch_rate", sw)):
        if values:
            out[f"telemetry/{key}"] = float(np.mean(values))
    out["telemetry/tokens"] = float(tokens)
    return {k: (float(v) if math.isfinite(v) else 0.0) for k, v in out.items()}


def attach(
    model: nn.Module,
    *,
    policies: Sequence[str] = ("lru", "static"),
    capacities: Sequence[int] = (2, 4),
    routers: Sequence[str | nn.Module] | None = None,
    top_k: int | None = None,
    num_experts: int | None = None,
    record_probs: bool = False,
    trace_dir: str | None = None,
    chunk_tokens: int = 1 << 18,
    max_memory_tokens: int = 1 << 20,
    entropy: bool = True,
) -> Telemetry:
    """Hook ``model``'s MoE routers; returns a Telemetry (also a context manager).

    ``trace_dir`` streams the trace to that directory (``chunk_tokens`` rows per file);
    without it the trace stays in memory, at most ``max_memory_tokens`` rows (0: keep none,
    metrics only). ``entropy=False`` skips the per-token routing-entropy sum in the hook.
    """
    specs = find_routers(model, routers, top_k=top_k, num_experts=num_experts)
    log.info(
        "telemetry: hooked %d routers (%s) of %s",
        len(specs),
        ", ".join(sorted({s.kind for s in specs})),
        type(model).__name__,
    )
    return Telemetry(
        model,
        specs,
        policies=policies,
        capacities=capacities,
        record_probs=record_probs,
        trace_dir=trace_dir,
        chunk_tokens=chunk_tokens,
        max_memory_tokens=max_memory_tokens,
        entropy=entropy,
    )
