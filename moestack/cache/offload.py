"""Offloaded inference: run a MoETransformer whose expert weights live only in a store + cache.

``offloaded(model, cache)`` releases every MoE layer's stacked ``w1``/``w2`` (they become
meta tensors: no memory, and any use raises) and sets each layer's experts back-end
(``MoE.set_experts``) to ``CachedExperts``, which

1. requests the layer's experts from the ``ExpertCache`` in trace replay order (the tokens
   of the flattened ``[B*S]`` batch in order, a token's k slots in router order, one layer
   call after another), so the cache's hits and misses equal ``moestack.telemetry.simulate``
   on the trace of the same run;
2. calls the same expert function the in-memory layer uses (``moestack.moe.run_experts``)
   on the cache's device slots as they are (``ExpertCache.serve``: views of one buffer, no
   copy of a resident expert) with each expert id mapped to its slot by a table on the
   device: the stable sort keeps each expert's rows in the same order, so every output row
   is the same product of the same weights and outputs are bitwise equal;
3. with ``prefetch``, first applies the *next* layer's router to this layer's input to
   predict that layer's experts and starts reading them in the background.

``cache_aware_bias > 0`` adds that bias to the router scores of the experts resident in the
cache when the layer is reached, through ``Router.select``'s extra bias (selection only;
combine weights stay the router's scores, as in cache-conditional routing); ``reroute_tau >
0`` then replaces each pick that is still not resident by a resident expert scoring within
``(1 - tau)`` of the token's best (:mod:`moestack.cache.rerouting`). On exit every layer gets
its earlier back-end back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from moestack.cache.expert_cache import CacheConfig, ExpertCache
from moestack.cache.policies import default_capacity
from moestack.cache.rerouting import reroute
from moestack.cache.store import ExpertStore
from moestack.errors import MoestackError
from moestack.evaluation import evaluate, greedy_generate, prompt_tokens
from moestack.moe import ExpertAdapters, MoE, compute_dtype, run_experts
from moestack.router import Router, Routing

log = logging.getLogger(__name__)


def _resident_bias(
    scores_TE: torch.Tensor, resident: list[int], bias: float
) -> torch.Tensor | None:
    """``[E]``: ``bias`` on the experts resident in the cache, 0 elsewhere (None if none)."""
    if not resident or bias == 0:
        return None
    bias_E = torch.zeros(scores_TE.shape[-1], dtype=scores_TE.dtype, device=scores_TE.device)
    bias_E[resident] = bias
    return bias_E


def check_servable(moe: MoE, layer: int) -> None:
    """Refuse a layer whose experts an expert store cannot serve whole: LoRA adapters on
    them live in the model, not in the store."""
    if moe.expert_adapters() is not None:
        raise MoestackError(
            f"MoE layer {layer} carries LoRA adapters on its experts, which an expert store "
            "does not hold: merge them first (moestack.lora.merge_adapters; moestack export "
            "RUN OUT writes a transformers run merged) and serve the merged experts"
        )


class CachedExperts:
    """The experts back-end of one layer whose experts come from an expert cache (set with
    ``MoE.set_experts`` by ``offloaded``)."""

    def __init__(
        self,
        layer: int,
        moe: MoE,
        cache: ExpertCache,
        next_router: Router | None,
        *,
        prefetch_limit: int,
        cache_aware_bias: float,
        adapters: bool = False,
    ) -> None:
        """``adapters=True``: the layer's LoRA adapters on its experts are applied on top of
        the served experts (training with streamed experts); else a layer carrying them is
        refused (``check_servable``)."""
        if not adapters:
            check_servable(moe, layer)
        self.layer = layer
        self.cache = cache
        self.impl = moe.cfg.impl
        self.num_experts = moe.cfg.num_experts
        self.top_k = moe.cfg.top_k
        self.next_router = next_router
        self.prefetch_limit = prefetch_limit
        self.cache_aware_bias = cache_aware_bias

    def predict_next(self, x_TD: torch.Tensor) -> list[int]:
        """The next layer's experts as its router would pick them for ``x_TD``, most used
        first, at most ``prefetch_limit``."""
        router = self.next_router
        assert router is not None
        _, scores_TE = router.score(x_TD)
        bias_E = None
        if self.cache_aware_bias:
            resident = self.cache.resident(self.layer + 1)
            bias_E = _resident_bias(scores_TE, resident, self.cache_aware_bias)
        _, experts_TK = router.select(scores_TE, bias_E)
        counts_E = torch.bincount(experts_TK.reshape(-1), minlength=router.num_experts).cpu()
        order = torch.argsort(counts_E, descending=True, stable=True)
        return [int(e) for e in order.tolist() if counts_E[e] > 0][: self.prefetch_limit]

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.prefetch_next(x_TD)
        return self.compute(x_TD, routing.experts, routing.weights, None)

    def prefetch_next(self, x_TD: torch.Tensor) -> None:
        """Start loading the next layer's predicted experts (with a prefetching cache)."""
        if self.next_router is not None and self.cache.prefetch_enabled:
            with torch.no_grad():  # a prediction: nothing to differentiate
                self.cache.prefetch(self.layer + 1, self.predict_next(x_TD))

    def compute(
        self,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        adapters: ExpertAdapters | None,
    ) -> torch.Tensor:
        """The experts ``experts_TK`` (requested from the cache in trace replay order) applied
        to ``x_TD`` and combined with ``weights_TK``, on the cache's slots (``serve``), with
        ``adapters`` (indexed by expert id) laid out in the slots' order."""
        requests = experts_TK.reshape(-1).tolist()  # trace replay order (the routing sync)
        served = self.cache.serve(self.layer, requests)
        device = x_TD.device
        w1, w2 = served.weights["w1"].to(device), served.weights["w2"].to(device)
        lut_E = served.lut_E.to(device)  # expert -> slot, on the device
        # adapters' dropout draws its mask over the rows sorted by expert: they must be in
        # the in-memory layer's order (expert ids), not in the slots'
        dropout = adapters is not None and adapters.dropout > 0
        if compute_dtype(x_TD, w1) != w1.dtype or self.impl == "megablocks" or dropout:
            w1, w2, lut_E = _used_rows(w1, w2, lut_E, requests)
        args = (x_TD, w1, w2, lut_E[experts_TK], weights_TK, self.impl)
        if adapters is None:
            return run_experts(*args)
        return run_experts(*args, _adapters_in_rows(adapters, lut_E, requests, w1.shape[0]))


def _adapters_in_rows(
    adapters: ExpertAdapters, lut_E: torch.Tensor, requests: list[int], rows: int
) -> ExpertAdapters:
    """The adapters of the requested experts moved to their experts' rows of the served
    weights (``lut_E``: expert -> row), zeros in the other ``rows``: differentiable, so each
    used expert's adapter gets exactly the gradient its rows give (the others none)."""
    used = sorted(set(requests))
    used_U = torch.tensor(used, dtype=torch.int64).to(lut_E.device, non_blocking=True)
    rows_U = lut_E[used_U]

    def place(a_E: torch.Tensor) -> torch.Tensor:
        zeros = a_E.new_zeros((rows, *a_E.shape[1:]))
        return zeros.index_copy(0, rows_U, a_E.index_select(0, used_U))

    return adapters._replace(**{f: place(getattr(adapters, f)) for f in adapters._fields[:4]})


def _used_rows(
    w1_SDF2: torch.Tensor, w2_SFD: torch.Tensor, lut_E: torch.Tensor, requests: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Only the slots of the requested experts, in expert order, and the table remapped to
    them: where the expert computation would cast (autocast) or copy (megablocks) its
    weights, so that it touches this call's experts and not every resident one."""
    used = sorted(set(requests))
    used_U = torch.tensor(used, dtype=lut_E.dtype).to(lut_E.device, non_blocking=True)
    rows_U = lut_E[used_U]
    remap_E = torch.full_like(lut_E, -1)
    remap_E[used_U] = torch.arange(len(used), dtype=lut_E.dtype, device=lut_E.device)
    return w1_SDF2.index_select(0, rows_U), w2_SFD.index_select(0, rows_U), remap_E


def release_experts(model: nn.Module) -> None:
    """Drop the in-memory expert weights: each MoE's w1/w2 becomes a meta tensor (same
    shape, no memory). Move the model to its device *before* this; reload with
    ``restore_experts``."""
    for moe in _moe_layers(model):
        for name in ("w1", "w2"):
            old = getattr(moe, name)
            if old.device.type != "meta":
                meta = torch.empty(old.shape, dtype=old.dtype, device="meta")
                setattr(moe, name, nn.Parameter(meta, requires_grad=False))


def restore_experts(model: nn.Module, store: ExpertStore, device: str | torch.device) -> None:
    """Load every expert back from ``store`` into the stacked w1/w2 parameters."""
    for layer, moe in enumerate(_moe_layers(model)):
        experts = [store.load(layer, e) for e in range(store.num_experts)]
        moe.w1 = nn.Parameter(torch.stack([x["w1"] for x in experts]).to(device))
        moe.w2 = nn.Parameter(torch.stack([x["w2"] for x in experts]).to(device))


def _moe_layers(model: nn.Module) -> list[MoE]:
    layers = getattr(model, "moe_layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .moe_layers; pass a MoETransformer")
    return list(layers)


def _check_store(model: nn.Module, store: ExpertStore) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        store.check_model(cfg)
    elif len(_moe_layers(model)) != store.num_layers:
        raise MoestackError(
            f"expert store {store.path} has {store.num_layers} layers, the model "
            f"{len(_moe_layers(model))}"
        )


@contextlib.contextmanager
def offloaded(
    model: nn.Module,
    cache: ExpertCache,
    *,
    cache_aware_bias: float = 0.0,
    reroute_tau: float = 0.0,
    prefetch_limit: int | None = None,
) -> Iterator[nn.Module]:
    """Run ``model`` with its experts served by ``cache`` inside the block (routing steered
    to the resident experts by ``cache_aware_bias`` and ``reroute_tau``, module docstring).

    The in-memory expert weights are released (``release_experts``) and stay released on
    exit; each layer's earlier experts back-end comes back and the router hooks are removed
    on exit.
    """
    if cache_aware_bias < 0:
        raise ValueError(f"cache_aware_bias={cache_aware_bias} must be >= 0")
    if not 0 <= reroute_tau <= 1:
        raise ValueError(f"reroute_tau={reroute_tau} must be in [0, 1]")
    _check_store(model, cache.store)
    layers = _moe_layers(model)
    release_experts(model)
    limit = prefetch_limit if prefetch_limit is not None else cache.capacity
    handles = []
    earlier = [moe.experts_backend for moe in layers]
    try:
        for i, moe in enumerate(layers):
            nxt = layers[i + 1].router if i + 1 < len(layers) else None
            moe.set_experts(
                CachedExperts(
                    i, moe, cache, nxt, prefetch_limit=limit, cache_aware_bias=cache_aware_bias
                )
            )
            if cache_aware_bias or reroute_tau:
                hook = _cache_aware_hook(cache, i, cache_aware_bias, reroute_tau)
                handles.append(moe.router.register_forward_hook(hook, prepend=True))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for moe, backend in zip(layers, earlier, strict=True):
            moe.set_experts(backend)


def _cache_aware_hook(cache: ExpertCache, layer: int, bias: float, tau: float = 0.0) -> Any:
    """Router forward hook: re-select the top k with ``bias`` added to resident experts, then
    reroute the picks still missing (``tau``; :mod:`moestack.cache.rerouting`)."""

    def hook(router: Router, args: tuple, routing: Routing) -> Routing:
        resident = cache.resident(layer)
        bias_E = _resident_bias(routing.scores, resident, bias)
        if bias_E is not None:
            weights_TK, experts_TK = router.select(routing.scores, bias_E)
            routing = Routing(routing.logits, weights_TK, experts_TK, routing.scores)
        if tau and resident:
            resident_E = torch.zeros(routing.scores.shape[-1], dtype=torch.bool)
            resident_E[resident] = True
            experts_TK = reroute(routing.scores, routing.experts, resident_E, tau)
            weights_TK = router.weights_of(routing.scores, experts_TK)
            routing = Routing(routing.logits, weights_TK, experts_TK, routing.scores)
        return routing

    return hook


def _as_cache(
    model: nn.Module,
    store_or_cache: ExpertStore | ExpertCache,
    device: torch.device,
    cache_cfg: CacheConfig | None,
    pinned: Sequence[Sequence[int]] | None,
) -> tuple[ExpertCache, bool]:
    """The cache to use and whether this call owns (and must close) it."""
    if isinstance(store_or_cache, ExpertCache):
        return store_or_cache, False
    if not isinstance(store_or_cache, ExpertStore):
        raise ValueError(
            f"store_or_cache is a {type(store_or_cache).__name__}; pass an ExpertStore or an "
            "ExpertCache"
        )
    cfg = cache_cfg if cache_cfg is not None else CacheConfig()
    top_k = _moe_layers(model)[0].cfg.top_k
    capacity = None if cfg.capacity_bytes else (cfg.capacity or default_capacity(top_k))
    cache = ExpertCache(
        store_or_cache,
        capacity,
        cfg.policy,
        device=device,
        prefetch=cfg.prefetch,
        capacity_bytes=cfg.capacity_bytes or None,
        pinned=pinned,
        warmup=cfg.warmup,
        top_k=top_k,
    )
    return cache, True


COUNTER_LEGEND = (
    "cache/requests: expert requests, one per token and routing slot in each MoE layer; "
    "cache/hits, cache/misses: the requests the device tier held or did not hold (counted by "
    "the policy, one per request, as `moestack simulate` counts them); cache/loads: experts "
    "copied into the device tier to serve misses (from a prefetch, the host tier or the disk; "
    "an expert missed twice in one layer call is loaded once); cache/host_hits, "
    "cache/prefetch_hits: loads served by the host tier or by a prefetch; cache/bytes_read: "
    "bytes read from the expert store on disk, prefetches included; cache/bytes_to_device: "
    "bytes copied into the device tier (one copy per expert loaded), prefetches included"
)  # what cache_metrics' counters count (ExpertCacheStats), one line for `eval --offload`


def cache_metrics(cache: ExpertCache, seconds: float, tokens: int) -> dict[str, float]:
    """The cache's counters (``COUNTER_LEGEND`` says what each counts) as ``cache/*``
    metrics, with its capacity, misses per token and the evaluation's time and speed."""
    stats = cache.stats.as_dict()
    out = {f"cache/{k}": float(v) for k, v in stats.items()}
    out["cache/capacity"] = float(cache.capacity)
    out["cache/misses_per_token"] = stats["misses"] / tokens if tokens else 0.0
    out["eval/seconds"] = seconds
    out["eval/tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return out


def evaluate_offloaded(
    model: nn.Module,
    store_or_cache: ExpertStore | ExpertCache,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: str | torch.device,
    cache: CacheConfig | None = None,
    *,
    cache_aware_bias: float = 0.0,
    reroute_tau: float = 0.0,
    pinned: Sequence[Sequence[int]] | None = None,
    prefetch_limit: int | None = None,
) -> dict[str, float]:
    """Validation loss/perplexity (``moestack.evaluation.evaluate``) with experts served from
    the store through a cache, plus the cache's statistics and tokens/s.

    Given an ExpertStore, a cache is built on ``device`` from ``cache`` (policy, capacity or
    capacity_bytes, warmup, prefetch; capacity 0 = 2 x top_k; default ``CacheConfig()``) and
    ``pinned`` (per layer, for the static policies); given an ExpertCache, those are ignored.
    The model must be on ``device`` already; its expert weights are released (see
    ``release_experts``).
    """
    device = torch.device(device)
    expert_cache, owned = _as_cache(model, store_or_cache, device, cache, pinned)
    tokens = sum(int(inputs.numel()) for inputs, _ in batches)
    try:
        with offloaded(
            model, expert_cache, cache_aware_bias=cache_aware_bias, reroute_tau=reroute_tau,
            prefetch_limit=prefetch_limit,
        ):  # fmt: skip
            start = time.perf_counter()
            result = evaluate(model, list(batches), device)
            seconds = time.perf_counter() - start
        return {**result, **cache_metrics(expert_cache, seconds, tokens)}
    finally:
        if owned:
            expert_cache.close()


@torch.no_grad()
def generate_offloaded(
    model: nn.Module,
    store_or_cache: ExpertStore | ExpertCache,
    prompt: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    device: str | torch.device,
    cache: CacheConfig | None = None,
    *,
    cache_aware_bias: float = 0.0,
    reroute_tau: float = 0.0,
    pinned: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Greedy generation of ``max_new_tokens`` after ``prompt`` (token ids) with offloaded
    experts, the cache built as in ``evaluate_offloaded`` (``greedy_generate``: with
    moestack's model, the prompt once, then one token per forward through its KV cache, so
    each decode step requests top_k experts per layer, until the sequence passes
    max_seq_len). Returns ``{"tokens": new ids, **cache metrics}``."""
    device = torch.device(device)
    prompt = prompt_tokens(prompt, max_new_tokens, device)  # refused before any set-up
    expert_cache, owned = _as_cache(model, store_or_cache, device, cache, pinned)
    try:
        with offloaded(
            model, expert_cache, cache_aware_bias=cache_aware_bias, reroute_tau=reroute_tau
        ):
            start = time.perf_counter()
            new = greedy_generate(model, prompt, max_new_tokens, device)
            seconds = time.perf_counter() - start
        return {"tokens": new, **cache_metrics(expert_cache, seconds, len(new))}
    finally:
        if owned:
            expert_cache.close()
