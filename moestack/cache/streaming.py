"""Training with frozen experts streamed through the expert cache (``offload_experts``).

A fine-tune that trains only the routers and/or LoRA adapters (``trainable=routers``,
``lora``, ``routers+lora``) never changes the experts, so they need not be held in memory:
``attach_streaming`` writes them once into an expert store (``cache.store_dir``, default
``<run dir>/experts``; reused while it holds the same experts), releases the model's
``w1``/``w2`` (meta tensors) and gives every MoE layer a ``StreamedExperts`` back-end
(``MoE.set_experts``) that gets the experts each call uses through one ``ExpertCache``
(``cache.*``: policy, capacity, prefetch), from the store on disk (``disk``) or from every
expert read once into host memory (``host``, a ``HostTier``; the cache's slots on the
device).

The layer's autograd function (``_StreamedExpertsFn``) saves its inputs, the routing and
the adapters, never an expert weight: its forward serves the experts and computes without
a graph; its backward requests them from the cache again (so the backward runs the layers'
loads in reverse order, counted like the forward's), recomputes the layer with a graph and
differentiates it. The expert computation is the in-memory layer's own (``run_experts`` on
the cache's slots, ``CachedExperts.compute``), so routers and adapters get the gradients
of a resident run: bitwise on the CPU in float32 (tests/cache/test_streaming.py). With
``cache.prefetch`` the forward prefetches the next layer's predicted experts (its router on
this layer's input, as offloaded evaluation does) and the backward prefetches the previous
layer's, which the forward recorded exactly.

Loads from disk are checked against the store's checksums at every load
(``ExpertStore(verify_loads=True)``): a byte flipped on disk mid-run is refused naming the
file. ``StreamingState.metrics`` reports the training's own cache traffic (its forward and
backward passes, not evaluations) per step. Once trained, the run is read back from its
store (``moestack.runs.open_run_store``): ``evaluate_streamed`` serves a model whose
adapters are on its experts as training served it (``moestack eval --offload``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moestack.cache.device_tier import SLOT_ALIGN
from moestack.cache.expert_cache import CacheConfig, ExpertCache, ExpertCacheStats
from moestack.cache.host_tier import HostTier
from moestack.cache.offload import CachedExperts, cache_metrics, release_experts
from moestack.cache.policies import default_capacity
from moestack.cache.store import ExpertStore
from moestack.cache.store_format import INDEX_FILE
from moestack.errors import MoestackError
from moestack.evaluation import evaluate, greedy_generate
from moestack.lora import init_expert_adapters
from moestack.moe import EXPERT_ADAPTERS, ExpertAdapters, MoE
from moestack.router import Routing

if TYPE_CHECKING:
    from moestack.config import TrainConfig

log = logging.getLogger(__name__)

STREAMABLE = ("routers", "lora", "routers+lora")  # moestack.config.STREAMABLE_TRAINABLE
# a function giving a model's experts, (w1 [E, D, 2F], w2 [E, F, D]) per MoE layer in order
LayerSource = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]


class _Traffic:
    """The cache's counters split by phase: ``train`` (forward and backward with a graph)
    and ``other`` (evaluations without one); settled at each change of phase."""

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache
        self.phase = "train"
        self.last = cache.stats
        self.train = ExpertCacheStats()
        self.reported = ExpertCacheStats()

    def enter(self, phase: str) -> None:
        if phase != self.phase:
            self.settle()
            self.phase = phase

    def settle(self) -> None:
        now = self.cache.stats
        if self.phase == "train":
            self.train = _plus(self.train, _minus(now, self.last))
        self.last = now

    def interval(self) -> ExpertCacheStats:
        """The training's counters since the last call."""
        self.settle()
        out = _minus(self.train, self.reported)
        self.reported = dataclasses.replace(self.train)
        return out


def _minus(a: ExpertCacheStats, b: ExpertCacheStats) -> ExpertCacheStats:
    return ExpertCacheStats(
        **{f.name: getattr(a, f.name) - getattr(b, f.name) for f in dataclasses.fields(a)}
    )


def _plus(a: ExpertCacheStats, b: ExpertCacheStats) -> ExpertCacheStats:
    return ExpertCacheStats(
        **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)}
    )


class StreamedExperts(CachedExperts):
    """The experts back-end of one layer of a training run with streamed frozen experts:
    ``CachedExperts``' computation (with the layer's expert adapters) inside
    ``_StreamedExpertsFn`` wherever a gradient is wanted."""

    def __init__(
        self,
        layer: int,
        moe: MoE,
        cache: ExpertCache,
        next_router: nn.Module | None,
        traffic: _Traffic,
        *,
        prefetch_limit: int,
    ) -> None:
        super().__init__(
            layer, moe, cache, next_router, prefetch_limit=prefetch_limit,
            cache_aware_bias=0.0, adapters=True,
        )  # fmt: skip
        self.traffic = traffic
        self.previous: StreamedExperts | None = None  # the layer before (backward prefetch)
        self.used: list[int] = []  # this layer's experts in its last forward, most used first

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        self.traffic.enter("train" if grad else "other")
        self.prefetch_next(x_TD)
        adapters = moe.expert_adapters()
        tensors = (x_TD, routing.weights, *(adapters[:4] if adapters is not None else ()))
        if not (grad and any(t.requires_grad for t in tensors)):
            return self.compute(x_TD, routing.experts, routing.weights, adapters)
        if self.cache.prefetch_enabled:
            self.used = _by_use(routing.experts, self.num_experts, self.prefetch_limit)
        scale, dropout = (adapters.scale, adapters.dropout) if adapters is not None else (0, 0)
        return _StreamedExpertsFn.apply(
            self, x_TD, routing.weights, routing.experts, scale, dropout, *tensors[2:]
        )

    def before_backward(self) -> None:
        """Counted as training traffic; prefetch the previous layer's experts, whose
        backward comes next."""
        self.traffic.enter("train")
        previous = self.previous
        if previous is not None and previous.used and self.cache.prefetch_enabled:
            self.cache.prefetch(previous.layer, previous.used)


def _by_use(experts_TK: torch.Tensor, num_experts: int, limit: int) -> list[int]:
    """The experts in ``experts_TK``, most used first, at most ``limit``."""
    counts_E = torch.bincount(experts_TK.reshape(-1), minlength=num_experts).cpu()
    order = torch.argsort(counts_E, descending=True, stable=True)
    return [int(e) for e in order.tolist() if counts_E[e] > 0][:limit]


class _StreamedExpertsFn(torch.autograd.Function):
    """One MoE layer's experts with no expert weight kept for backward: the forward saves
    ``x``, the routing and the adapters; the backward serves the experts again, recomputes
    the layer with a graph (same autocast, same dropout draws) and differentiates it."""

    @staticmethod
    def forward(  # noqa: PLR0913 (autograd passes the inputs positionally)
        ctx: Any,
        backend: StreamedExperts,
        x_TD: torch.Tensor,
        weights_TK: torch.Tensor,
        experts_TK: torch.Tensor,
        scale: float,
        dropout: float,
        *adapter_tensors: torch.Tensor,
    ) -> torch.Tensor:
        ctx.backend, ctx.scale, ctx.dropout = backend, scale, dropout
        ctx.device = x_TD.device
        ctx.autocast = _autocast_state(x_TD.device)
        ctx.rng = _rng_state(x_TD.device) if dropout else None
        ctx.save_for_backward(x_TD, weights_TK, experts_TK, *adapter_tensors)
        adapters = ExpertAdapters(*adapter_tensors, scale, dropout) if adapter_tensors else None
        return backend.compute(x_TD, experts_TK, weights_TK, adapters)

    @staticmethod
    def backward(ctx: Any, dy_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_TD, weights_TK, experts_TK, *adapter_tensors = ctx.saved_tensors
        backend: StreamedExperts = ctx.backend
        backend.before_backward()
        needs = (ctx.needs_input_grad[1], ctx.needs_input_grad[2], *ctx.needs_input_grad[6:])
        leaves = [
            t.detach().requires_grad_(need)
            for t, need in zip((x_TD, weights_TK, *adapter_tensors), needs, strict=True)
        ]
        with torch.enable_grad(), _autocast(ctx.device, ctx.autocast), _rng(ctx.device, ctx.rng):
            adapters = (
                ExpertAdapters(*leaves[2:], ctx.scale, ctx.dropout) if adapter_tensors else None
            )
            y_TD = backend.compute(leaves[0], experts_TK, leaves[1], adapters)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(y_TD, wanted, dy_TD, allow_unused=True))
        out = [next(grads) if t.requires_grad else None for t in leaves]
        return (None, out[0], out[1], None, None, None, *out[2:])


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    kind = device.type
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def _autocast(device: torch.device, state: tuple[bool, torch.dtype]) -> Any:
    enabled, dtype = state
    return torch.autocast(device.type, dtype=dtype, enabled=enabled)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> Iterator:
    """The forward's random state inside (its dropout draws again), the caller's after."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


@dataclasses.dataclass
class StreamingState:
    """A training run's streamed experts: the store, the tier the cache reads
    (the store, or a ``HostTier`` with ``offload_experts=host``), the cache and the
    layers' back-ends."""

    mode: str
    store: ExpertStore
    cache: ExpertCache
    backends: list[StreamedExperts]
    traffic: _Traffic
    hooks: list[Any] = dataclasses.field(default_factory=list)

    def metrics(self, steps: int = 1) -> dict[str, float]:
        """The training's cache traffic since the last call, per step over ``steps`` steps
        (evaluations excluded): ``cache/bytes_moved`` (bytes copied into the cache's slots:
        from disk or the host tier), ``cache/bytes_read`` (from the disk), ``cache/loads``,
        ``cache/requests``, ``cache/hit_rate`` (over the interval) and ``cache/stall_s``
        (seconds waited on reads)."""
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        d = self.traffic.interval()
        return {
            "cache/bytes_moved": d.bytes_to_device / steps,
            "cache/bytes_read": d.bytes_read / steps,
            "cache/loads": d.loads / steps,
            "cache/requests": d.requests / steps,
            "cache/hit_rate": d.hit_rate,
            "cache/stall_s": d.stall_s / steps,
        }

    def close(self) -> None:
        """Stop the cache's prefetch threads and close the store's files (the layers keep
        their back-ends: the model is of no more use)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        self.cache.close()
        self.store.close()


@contextlib.contextmanager
def experts_left_out(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, ``model``'s state dict leaves out every MoE layer's ``w1``/``w2``: for loading
    a checkpoint of a streamed run (which holds no experts) into a model whose experts are
    the frozen ones already (built from the seed or read from the model folder)."""
    handles = [moe.register_state_dict_post_hook(_drop_experts) for moe in model.moe_layers]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _drop_experts(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
    for name in ("w1", "w2"):
        state.pop(prefix + name, None)


def _drop_streamed(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
    """State-dict post-hook of a streamed layer: its experts are in the store, not in the
    model (meta tensors), so its state dict (a checkpoint's weights) leaves them out."""
    for name in ("w1", "w2"):
        tensor = state.get(prefix + name)
        if tensor is not None and tensor.is_meta:
            del state[prefix + name]


def store_path(cfg: TrainConfig, out_dir: str | Path) -> Path:
    """Where a run's streamed experts are stored: ``cache.store_dir`` or
    ``<out_dir>/experts``."""
    return Path(cfg.cache.store_dir) if cfg.cache.store_dir else Path(out_dir) / "experts"


def check_streamable(cfg: TrainConfig, world_size: int) -> None:
    """Refuse, in one line, a run whose experts cannot be streamed: experts that train, or
    several processes (every rank would write the same store); the trainer asks before its
    start writes anything."""
    mode = cfg.offload_experts
    if mode != "off" and cfg.trainable not in STREAMABLE:
        raise MoestackError(
            f"offload_experts={mode} streams frozen experts, but trainable={cfg.trainable} "
            "trains them; use trainable=routers, lora or routers+lora"
        )
    if mode != "off" and world_size > 1:
        raise MoestackError(
            f"offload_experts={mode} runs in one process for now (every rank would write the "
            f"same expert store); this run has {world_size}: train on one process, or with "
            "offload_experts=off"
        )


def attach_streaming(
    model: nn.Module,
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    layers: LayerSource | None = None,
) -> StreamingState | None:
    """Stream ``model``'s frozen experts through an expert cache from now on (None with
    ``offload_experts=off``); call it once the model is on its device in its final dtype
    and frozen, before the optimizer is built. The experts are written to the store first
    (or a store of the same experts is reused), then released from memory. A model whose
    experts were never in memory (meta) takes ``layers``: a function giving its
    ``(w1, w2)`` one layer at a time (``drawn_expert_layers``, ``iter_hf_expert_layers``),
    called at most twice (their digest, then the store's write), so no more than one
    layer's experts is ever in memory; without it, the store must be there already."""
    mode = cfg.offload_experts
    if mode == "off":
        return None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    check_streamable(cfg, world)
    moes = list(model.moe_layers)
    device = next(p.device for p in model.parameters() if not p.is_meta)
    store = frozen_store(moes, store_path(cfg, out_dir), cfg.model, layers)
    release_experts(model)
    tier = (
        HostTier.read(store, pin=device.type == "cuda", progress=False) if mode == "host" else store
    )
    cache = _cache_of(tier, cfg.cache, moes[0].cfg.top_k, device)
    backends = _streamed_backends(moes, cache)
    state = StreamingState(mode, store, cache, backends, backends[0].traffic)
    for moe, backend in zip(moes, backends, strict=True):
        moe.set_experts(backend)
        state.hooks.append(moe.register_state_dict_post_hook(_drop_streamed))
    log.info(
        "offload_experts=%s: %d MoE layers' experts streamed from %s through a %s cache of %d "
        "experts per layer", mode, len(moes), store.path, cache.policy_name, cache.capacity,
    )  # fmt: skip
    return state


def _cache_of(
    tier: ExpertStore | HostTier, cache_cfg: CacheConfig, top_k: int, device: torch.device
) -> ExpertCache:
    """The expert cache ``cache_cfg`` describes (policy, capacity or capacity_bytes, prefetch,
    warm-up; capacity 0: ``default_capacity``) over ``tier``, its slots on ``device``."""
    capacity = None if cache_cfg.capacity_bytes else (cache_cfg.capacity or default_capacity(top_k))
    return ExpertCache(
        tier, capacity, cache_cfg.policy, device=device, prefetch=cache_cfg.prefetch,
        capacity_bytes=cache_cfg.capacity_bytes or None, warmup=cache_cfg.warmup, top_k=top_k,
    )  # fmt: skip


def _streamed_backends(moes: list[MoE], cache: ExpertCache) -> list[StreamedExperts]:
    """A ``StreamedExperts`` per layer over ``cache``, each knowing the layer before it
    (the backward's prefetch), counting into one ``_Traffic``."""
    traffic = _Traffic(cache)
    backends: list[StreamedExperts] = []
    for i, moe in enumerate(moes):
        nxt = moes[i + 1].router if i + 1 < len(moes) else None
        backend = StreamedExperts(i, moe, cache, nxt, traffic, prefetch_limit=cache.capacity)
        backend.previous = backends[-1] if backends else None
        backends.append(backend)
    return backends


@contextlib.contextmanager
def _served_with_adapters(
    model: nn.Module, store: ExpertStore, cache_cfg: CacheConfig, device: torch.device
) -> Iterator[ExpertCache]:
    """Inside, ``model`` (its experts released, on ``device``) gets its experts from ``store``
    through an expert cache of ``cache_cfg``, with the LoRA adapters on them applied as
    training applied them (``StreamedExperts``): offloaded evaluation of a streamed run whose
    adapters are on its experts, which ``cache.offloaded`` refuses (an expert store does not
    hold them). Yields the cache (its counters); on exit the layers get their earlier
    back-ends back and the cache is closed."""
    moes = list(model.moe_layers)
    cache = _cache_of(store, cache_cfg, moes[0].cfg.top_k, device)
    earlier = [moe.experts_backend for moe in moes]
    try:
        for moe, backend in zip(moes, _streamed_backends(moes, cache), strict=True):
            moe.set_experts(backend)
        yield cache
    finally:
        for moe, backend in zip(moes, earlier, strict=True):
            moe.set_experts(backend)
        cache.close()


def evaluate_streamed(
    model: nn.Module,
    store: ExpertStore,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    cache_cfg: CacheConfig,
    prompt: Sequence[int] = (),
    max_new_tokens: int = 0,
) -> tuple[dict[str, float], list[int]]:
    """``evaluate_offloaded``'s metrics (the validation loss, the cache's counters, time) and
    the ``max_new_tokens`` ids ``greedy_generate`` appends to ``prompt`` (none for 0), for a
    model whose LoRA adapters are on its experts (a streamed run's): the experts served from
    ``store`` through a cache of ``cache_cfg``, the adapters applied as in training."""
    tokens = sum(int(inputs.numel()) for inputs, _ in batches)
    with torch.no_grad(), _served_with_adapters(model, store, cache_cfg, device) as cache:
        start = time.perf_counter()
        result = evaluate(model, list(batches), device)
        result.update(cache_metrics(cache, time.perf_counter() - start, tokens))
        new = greedy_generate(model, prompt, max_new_tokens, device) if max_new_tokens else []
    return result, new


def experts_digest(layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """BLAKE2b of every layer's ``w1``/``w2`` (shapes, dtype and bytes), taken one layer at
    a time: what the store of a run's frozen experts was written from."""
    h = hashlib.blake2b(digest_size=32)
    for w1, w2 in layers:
        for t in (w1, w2):
            host = t.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"{tuple(t.shape)} {t.dtype};".encode())
            h.update(memoryview(host.view(torch.uint8).numpy()))
    return "experts blake2b:" + h.hexdigest()


def resident_layers(moes: list[MoE]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The layers' experts as they are in memory."""
    return ((moe.w1.detach(), moe.w2.detach()) for moe in moes)


def drawn_expert_layers(
    model: nn.Module, seed: int, dtype: torch.dtype | None = None
) -> LayerSource:
    """For moestack's own model built with ``experts_on_meta=True``: a function giving each
    layer's ``(w1, w2)`` as the whole build draws them from ``seed``
    (``MoETransformer.init_weights``), in ``dtype`` (default: the meta tensors'), one layer
    at a time."""
    std = model.cfg.init_std

    def layers() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i, moe in enumerate(model.moe_layers):
            meta = moe.w1, moe.w2
            moe.w1 = nn.Parameter(torch.empty(meta[0].shape), requires_grad=False)
            moe.w2 = nn.Parameter(torch.empty(meta[1].shape), requires_grad=False)
            try:
                moe.init_experts(seed, f"layers.{i}.moe", std)
                drawn = (
                    moe.w1.detach().to(dtype or meta[0].dtype),
                    moe.w2.detach().to(dtype or meta[1].dtype),
                )
            finally:
                moe.w1, moe.w2 = meta
            yield drawn

    return layers


def expert_source(
    model: nn.Module, cfg: TrainConfig, cast: Callable[[torch.Tensor], torch.Tensor] | None
) -> LayerSource:
    """The experts of a model built with them on meta (a streamed run's), one layer at a time
    as the resident run holds them: moestack's own drawn from the run's seed, a transformers
    folder's read from it; each passed through ``cast`` (the parameters' dtype rule,
    ``moestack.optim.param_cast``; None: kept in fp32), so the store holds the resident
    run's experts bit for bit."""
    from moestack.interop.hf_experts import iter_hf_expert_layers

    def layers() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if cfg.model.is_transformers:
            raw = iter_hf_expert_layers(cfg.model.pretrained_path, torch.float32)
        else:
            raw = drawn_expert_layers(model, cfg.seed, torch.float32)()
        for w1, w2 in raw:
            yield (w1, w2) if cast is None else (cast(w1), cast(w2))

    return layers


def materialize_expert_adapters(model: nn.Module, seed: int) -> int:
    """Give the LoRA adapters of experts built on meta (``lora.add_adapters`` follows the
    experts' device) host memory and draw them as the whole build does
    (``lora.init_expert_adapters``): a model whose experts stay in the store still trains
    their adapters. Returns how many adapter tensors it materialised."""
    made = 0
    for moe in model.moe_layers:
        if moe.expert_adapters() is None:
            continue
        for name in EXPERT_ADAPTERS:
            param = getattr(moe, name)
            if param.is_meta:
                real = torch.empty(param.shape, dtype=param.dtype)
                setattr(moe, name, nn.Parameter(real, requires_grad=param.requires_grad))
                made += 1
    if made:
        init_expert_adapters(model, seed)
    return made


def frozen_store(
    moes: list[MoE], path: Path, model_cfg: Any, layers: LayerSource | None = None
) -> ExpertStore:
    """The store of these layers' experts at ``path``, every load checked against its
    checksums: the one there when it holds the same experts (refused when it holds others:
    never silently replaced), else written from the layers in memory or from ``layers``
    (``attach_streaming``). Experts neither in memory nor given take the store there as it
    is."""
    resident = not any(moe.w1.is_meta or moe.w2.is_meta for moe in moes)
    make = (lambda: resident_layers(moes)) if resident else layers
    source = experts_digest(make()) if make is not None else None
    if (path / INDEX_FILE).is_file():
        try:
            store = ExpertStore(path, model_cfg, verify_loads=True)
        except MoestackError as err:
            if make is None:
                raise
            log.warning("rewriting expert store %s: %s", path, err)
        else:
            if source is None or store.meta.get("source") == source:
                return store
            store.close()
            raise MoestackError(
                f"expert store {path} was written from other experts than this model's "
                f"({str(store.meta.get('source'))[:32]}..., the model's {source[:32]}...): a "
                "run's frozen experts never change, so a resumed run whose experts differ "
                "(another model folder, or experts not read) would train on the wrong ones; "
                f"delete {path} to write it from this model, or use another cache.store_dir"
            )
    if make is None:
        raise MoestackError(
            f"the model's experts are not in memory and {path} holds no expert store: write "
            "one from its weights first (ExpertStore.write_layers), or pass layers="
        )
    ExpertStore.write_layers(
        make(), path, model_cfg=model_cfg, meta={"source": source}, overwrite=True
    ).close()
    return ExpertStore(path, model_cfg, verify_loads=True)


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """What streaming a run's frozen experts holds where (``stream_plan``), in bytes."""

    experts: int  # every routed expert: left out of the model's weights, in the store
    slots: int  # the cache's slot buffer on the device (all layers)
    working_set: int  # at most, while one layer computes: its experts beyond the free slots
    host: int  # offload_experts=host: the host tier (every expert)
    disk: int  # the store's tensor data (headers and index aside)


def stream_plan(cfg: TrainConfig, expert_bytes: int, tokens: int, cuda: bool) -> StreamPlan | None:
    """The memory of ``cfg``'s streamed experts (None with ``offload_experts=off``), for a
    memory plan: ``expert_bytes`` is one expert's ``w1`` + ``w2`` as the run holds them,
    ``tokens`` a micro-batch's tokens on this rank, ``cuda`` whether the device is a GPU
    (bf16 autocast: a layer casts the call's experts). The working set is a buffer of every
    expert the call uses (when they do not fit in the free slots), plus their copy in
    expert order where ``lora.dropout > 0`` or autocast casts them, plus the cast copy."""
    if cfg.offload_experts == "off":
        return None
    moe = cfg.model.moe
    capacity = cfg.cache.capacity or default_capacity(moe.top_k)
    if cfg.cache.capacity_bytes:
        capacity = cfg.cache.capacity_bytes // expert_bytes
    slot = -(-expert_bytes // SLOT_ALIGN) * SLOT_ALIGN
    count = cfg.model.n_layers * capacity + moe.top_k + (moe.top_k if cfg.cache.prefetch else 0)
    used = min(moe.num_experts, tokens * moe.top_k)
    ordered = cuda or (cfg.trainable.endswith("lora") and cfg.lora.dropout > 0)
    working = used * (slot + (expert_bytes if ordered else 0) + (expert_bytes // 2 if cuda else 0))
    every = cfg.model.n_layers * moe.num_experts
    pinned = 1 << max(expert_bytes - 1, 0).bit_length()  # torch's page-locked blocks
    host = every * (pinned if cuda else expert_bytes) if cfg.offload_experts == "host" else 0
    return StreamPlan(every * expert_bytes, count * slot, working, host, every * expert_bytes)
