"""Replay a RoutingTrace through expert-cache policies: hit rates, misses, bytes, reuse.

Each MoE layer is its own cache of ``capacity`` expert slots, fed the layer's requests in
the trace's replay order (see ``moestack.telemetry.trace``). The policies are the objects of
``moestack.cache.policies``, the same ones the real expert cache runs.

Warm-up: the first ``warmup`` requests of each layer (an int, or a fraction of the layer's
requests) go through every policy, so caches fill and ``static`` / ``lru+static`` choose
their pinned experts (unless ``static_experts`` gives them), but are not counted in the
stats. ``bytes_loaded`` is misses x the expert's size in bytes (from ``expert_bytes`` or
the trace header); 0 where the size is unknown.

Batched serving (``batch_size`` > 1): the sequences of the trace, in recording order, are
served ``batch_size`` at a time, a decode step at a time, so a layer's requests at a step are
the union of the experts its batch's sequences chose at that position (each expert once,
in the order the batch first asks for it: sequence by sequence, slot by slot;
``batched_accesses``). Batch 1 is the trace's own replay order. ``tokens`` (and so
``misses_per_token``) counts token rows, the counted share of them after the warm-up.

What a cache means on a given machine (``ServingEstimate``): a token costs ``compute_ms``
plus its expert loads, each ``expert_bytes`` over a link of ``link_gbps`` GB/s, one after
another: ``token_ms = compute_ms + misses_per_token * expert_bytes / (link_gbps * 1e6)`` and
``est_tokens_per_s = 1000 / token_ms``. It assumes no load overlaps compute (prefetch would
hide some) and that compute does not depend on the cache.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moestack.cache.policies import (
    POLICIES,
    CachePolicy,
    check_policy,
    make_policy,
    stack_distances,
)
from moestack.telemetry.trace import RoutingTrace

log = logging.getLogger(__name__)

PolicyFactory = Callable[[int, int, np.ndarray], CachePolicy]  # (layer, capacity, requests)


@dataclass
class LayerStats:
    """One layer's cache statistics over the counted (post-warm-up) requests."""

    layer: int
    capacity: int
    accesses: int
    hits: int
    misses: int
    hit_rate: float
    bytes_loaded: int


@dataclass
class CacheStats:
    """Replay result of one policy and capacity over every layer of a trace."""

    policy: str
    capacity: int
    accesses: int
    hits: int
    misses: int
    hit_rate: float
    bytes_loaded: int
    tokens: int  # counted token rows (the layer with the most)
    misses_per_token: float  # misses summed over layers, per token
    layers: list[LayerStats] = field(default_factory=list)
    # reuse_distance_hist[l][d]: requests whose LRU stack distance is d (distinct other
    # experts since the same expert's last request); the last entry counts first requests.
    reuse_distance_hist: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0  # time spent in the policy
    accesses_per_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ServingEstimate:
    """The tokens/s a cache's misses allow on a machine: ``expert_bytes`` per expert load, a
    link of ``link_gbps`` GB/s (10^9 bytes/s), ``compute_ms`` of compute per token."""

    expert_bytes: float
    link_gbps: float
    compute_ms: float

    def __post_init__(self) -> None:
        for name in ("expert_bytes", "link_gbps", "compute_ms"):
            value = getattr(self, name)
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if name == "compute_ms":  # 0: the loads alone (token_ms stays > 0: N, G > 0)
                if not (ok and math.isfinite(value) and value >= 0):
                    raise ValueError(f"{name}={value!r} must be a finite number >= 0")
            elif not (ok and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive finite number")

    def token_ms(self, misses_per_token: float) -> float:
        """Milliseconds per token: compute plus ``misses_per_token`` serial expert loads
        (``expert_bytes / (link_gbps * 1e9)`` s = ``expert_bytes / (link_gbps * 1e6)`` ms each)."""
        return self.compute_ms + misses_per_token * self.expert_bytes / (self.link_gbps * 1e6)

    def est_tokens_per_s(self, misses_per_token: float) -> float:
        """``1000 / token_ms(misses_per_token)``; ``math.inf`` where that is 0 (no compute
        and no misses)."""
        token_ms = self.token_ms(misses_per_token)
        return 1000.0 / token_ms if token_ms > 0 else math.inf


def _resolve_warmup(warmup: int | float, n: int) -> int:
    if isinstance(warmup, float):
        if not 0.0 <= warmup < 1.0:
            raise ValueError(f"warmup={warmup} as a fraction must be in [0, 1)")
        return int(warmup * n)
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0 requests (or a fraction in [0, 1))")
    return min(int(warmup), n)


def reuse_histogram(requests: np.ndarray, num_experts: int, skip: int = 0) -> list[int]:
    """Histogram of LRU stack distances 0..E-1 of ``requests[skip:]``, plus first requests."""
    hist = np.zeros(num_experts + 1, dtype=np.int64)
    if requests.size == 0:
        return hist.tolist()
    dist, _ = stack_distances(requests, np.full(0, -1, dtype=np.int64), 0)
    dist = dist[skip:]
    cold = dist < 0
    hist[:num_experts] = np.bincount(dist[~cold], minlength=num_experts)[:num_experts]
    hist[num_experts] = int(cold.sum())
    return hist.tolist()


def simulate(
    trace: RoutingTrace,
    policy: str | PolicyFactory = "lru",
    capacity: int | None = 4,
    *,
    capacity_bytes: int | None = None,
    expert_bytes: int | Sequence[int] | None = None,
    warmup: int | float = 0.1,
    static_experts: Sequence[Sequence[int]] | None = None,
    num_pinned: int | None = None,
    layers: Sequence[int] | None = None,
    max_accesses: int | None = None,
    reuse: bool = True,
    batch_size: int = 1,
) -> CacheStats:
    """Replay ``trace`` through ``policy`` with ``capacity`` expert slots per layer.

    ``policy`` is a name from ``POLICIES`` or a factory ``(layer, capacity, requests) ->
    CachePolicy``. ``capacity_bytes`` (instead of ``capacity``) gives a per-layer byte budget,
    turned into slots with the expert size. ``static_experts[l]`` pins those experts of
    layer l for "static" / "lru+static". ``max_accesses`` replays only each layer's first
    requests (belady on huge traces). ``reuse`` adds the reuse-distance histograms.
    ``batch_size`` serves that many sequences together (the module docstring).
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a whole number >= 1")
    name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    if isinstance(policy, str):
        check_policy(policy, "policy")
    layer_ids = list(range(trace.num_layers)) if layers is None else list(layers)
    sizes = _expert_sizes(trace, expert_bytes)
    if trace.num_tokens == 0:
        raise _nothing_to_replay(trace, layer_ids)
    runs = [
        _replay_layer(
            trace, layer, sizes[layer], policy, capacity, capacity_bytes, warmup,
            static_experts, num_pinned, max_accesses, reuse, batch_size,
        )
        for layer in layer_ids
    ]  # fmt: skip
    if sum(run.requested for run in runs) == 0:
        raise _nothing_to_replay(trace, layer_ids)
    stats = [run.stats for run in runs]
    hists = [run.hist for run in runs if run.hist is not None]
    seconds = sum((run.seconds for run in runs), 0.0)
    tokens = max([0, *(run.tokens for run in runs)])
    replayed = sum(run.replayed for run in runs)
    return _total_stats(
        name,
        stats[0].capacity if stats else int(capacity or 0),
        stats,
        hists,
        tokens,
        seconds,
        replayed,
    )


@dataclass(frozen=True)
class _LayerRun:
    """What replaying one layer gave: its stats, its reuse histogram (None unless asked),
    the seconds the policy took, the tokens its counted requests cover, and its requests
    replayed and in the trace."""

    stats: LayerStats
    hist: list[int] | None
    seconds: float
    tokens: int
    replayed: int
    requested: int


def _replay_layer(
    trace: RoutingTrace,
    layer: int,
    size: int | None,
    policy: str | PolicyFactory,
    capacity: int | None,
    capacity_bytes: int | None,
    warmup: int | float,
    static_experts: Sequence[Sequence[int]] | None,
    num_pinned: int | None,
    max_accesses: int | None,
    reuse: bool,
    batch_size: int,
) -> _LayerRun:
    """Replay layer ``layer``'s requests (``size``: its expert's bytes, None if unknown)
    through a fresh policy; the arguments are ``simulate``'s."""
    requests, rows = _layer_requests(trace, layer, batch_size)
    requested = int(requests.size)
    if max_accesses is not None:
        requests = requests[:max_accesses]
    cap = _layer_capacity(capacity, capacity_bytes, size, layer)
    skip = _resolve_warmup(warmup, requests.size)
    pol = _layer_policy(policy, layer, cap, requests, skip, static_experts, num_pinned)
    start = time.perf_counter()
    hits_mask = pol.access_many(requests)
    seconds = time.perf_counter() - start
    counted = hits_mask[skip:]
    hits = int(counted.sum())
    misses = int(counted.size - hits)
    rate = _rate(hits, counted.size)
    stats = LayerStats(layer, cap, int(counted.size), hits, misses, rate, misses * (size or 0))
    tokens = _counted_tokens(rows, counted.size, requests.size, trace.top_k[layer])
    hist = reuse_histogram(requests, trace.num_experts[layer], skip) if reuse else None
    return _LayerRun(stats, hist, seconds, tokens, int(requests.size), requested)


def _layer_requests(
    trace: RoutingTrace, layer: int, batch_size: int
) -> tuple[np.ndarray, int | None]:
    """The layer's requests in replay order, and the token rows they serve when that is not
    the requests per top-k (batched: the union loses the count; None otherwise)."""
    if batch_size == 1:
        return trace.accesses(layer), None
    return batched_accesses(trace, layer, batch_size)


def _layer_policy(
    policy: str | PolicyFactory,
    layer: int,
    cap: int,
    requests: np.ndarray,
    skip: int,
    static_experts: Sequence[Sequence[int]] | None,
    num_pinned: int | None,
) -> CachePolicy:
    """The cache policy of one layer: a named one, or the factory's."""
    if not isinstance(policy, str):
        return policy(layer, cap, requests)
    pinned = None if static_experts is None else list(static_experts[layer])
    return _named_policy(policy, cap, requests, skip, pinned, num_pinned)


def _counted_tokens(rows: int | None, counted: int, requests: int, top_k: int) -> int:
    """Token rows behind the ``counted`` (post-warm-up) of ``requests`` requests: counted /
    top_k, or, batched, the counted share of the ``rows``."""
    if rows is None:
        return counted // max(top_k, 1)
    return round(rows * counted / requests) if requests else 0


def batched_accesses(trace: RoutingTrace, layer: int, batch_size: int) -> tuple[np.ndarray, int]:
    """The layer's requests when ``batch_size`` sequences are served together (the module
    docstring), and the token rows they serve. Padding rows and layers that did not run are
    skipped, as in ``RoutingTrace.accesses``."""
    experts_NK = trace.experts(layer).astype(np.int64)
    seq_N, pos_N = trace.sequence_ids(), trace.position_ids()
    keep = pos_N >= 0
    experts_NK, seq_N, pos_N = experts_NK[keep], seq_N[keep], pos_N[keep]
    _, first = np.unique(seq_N, return_index=True)
    order_of_seq = {s: i for i, s in enumerate(seq_N[np.sort(first)].tolist())}
    batch_N = np.array([order_of_seq[s] // batch_size for s in seq_N.tolist()], dtype=np.int64)
    # rows grouped by (batch, position), stably: a step's sequences keep recording order
    rows = np.lexsort((pos_N, batch_N))
    out: list[int] = []
    step_key = None
    seen: set[int] = set()
    for row in rows.tolist():
        key = (batch_N[row], pos_N[row])
        if key != step_key:
            step_key, seen = key, set()
        for expert in experts_NK[row].tolist():
            if expert >= 0 and expert not in seen:
                seen.add(expert)
                out.append(expert)
    return np.asarray(out, dtype=np.int64), int(keep.sum())


def _nothing_to_replay(trace: RoutingTrace, layer_ids: list[int]) -> ValueError:
    """The refusal of a replay that would count nothing (and report a hit rate of 0)."""
    if trace.num_tokens == 0:
        return ValueError(
            f"{trace!r} holds no tokens: nothing to replay; record a trace first (and flush() "
            "or close() its Telemetry)"
        )
    return ValueError(
        f"{trace!r} has no expert requests in layers {layer_ids} (every token is padding or "
        "those layers did not run): nothing to replay; pass layers= that ran"
    )


def _named_policy(
    name: str,
    capacity: int,
    requests: np.ndarray,
    skip: int,
    pinned: list[int] | None,
    num_pinned: int | None,
) -> CachePolicy:
    """The policy ``name`` for one layer's ``requests``, of which the first ``skip`` warm up."""
    return make_policy(
        name,
        capacity,
        pinned=pinned if name in ("static", "lru+static") else None,
        # static policies need at least one warm-up request to choose their pins
        warmup=0 if pinned is not None else max(skip, 1),
        num_pinned=num_pinned,
        future=requests if name == "belady" else None,
    )


def _total_stats(
    name: str,
    capacity: int,
    stats: list[LayerStats],
    hists: list[list[int]],
    tokens: int,
    seconds: float,
    replayed: int,
) -> CacheStats:
    """The CacheStats summing the layers' stats."""
    hits = sum(s.hits for s in stats)
    accesses = sum(s.accesses for s in stats)
    misses = accesses - hits
    return CacheStats(
        policy=name,
        capacity=capacity,
        accesses=accesses,
        hits=hits,
        misses=misses,
        hit_rate=_rate(hits, accesses),
        bytes_loaded=sum(s.bytes_loaded for s in stats),
        tokens=int(tokens),
        misses_per_token=misses / tokens if tokens else 0.0,
        layers=stats,
        reuse_distance_hist=hists,
        seconds=seconds,
        accesses_per_s=(replayed / seconds) if seconds > 0 else 0.0,
    )


def sweep(
    trace: RoutingTrace,
    policies: Sequence[str] = POLICIES,
    capacities: Sequence[int] | None = None,
    **kwargs: Any,
) -> list[CacheStats]:
    """``simulate`` for every policy and capacity (default 1..max experts): hit rate vs size."""
    if capacities is None:
        capacities = range(1, max(trace.num_experts) + 1)
    out = []
    for name in policies:
        for cap in capacities:
            if name == "lru+static" and cap < 2:
                continue  # needs a pinned and an LRU slot
            out.append(simulate(trace, name, cap, reuse=False, **kwargs))
    return out


def _rate(hits: int, total: int) -> float:
    return hits / total if total else 0.0


def _expert_sizes(
    trace: RoutingTrace, expert_bytes: int | Sequence[int] | None
) -> list[int | None]:
    if expert_bytes is None:
        return list(trace.expert_bytes)
    if isinstance(expert_bytes, (int, np.integer)):
        return [int(expert_bytes)] * trace.num_layers
    sizes = list(expert_bytes)
    if len(sizes) != trace.num_layers:
        raise ValueError(
            f"expert_bytes has {len(sizes)} entries; give one per layer ({trace.num_layers})"
        )
    return sizes


def _layer_capacity(
    capacity: int | None, capacity_bytes: int | None, size: int | None, layer: int
) -> int:
    if capacity_bytes is None:
        if capacity is None:
            raise ValueError("give capacity= (expert slots per layer) or capacity_bytes=")
        return int(capacity)
    if not size:
        raise ValueError(
            f"capacity_bytes={capacity_bytes} needs the expert size of layer {layer}: pass "
            "expert_bytes= (the trace does not record it)"
        )
    slots = int(capacity_bytes) // int(size)
    if slots < 1:
        raise ValueError(
            f"capacity_bytes={capacity_bytes} holds no expert of layer {layer} ({size} bytes "
            "each); raise it"
        )
    return slots


# --------------------------------------------------------------------------- routing metrics
def switch_counts(experts: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> tuple[float, int]:
    """Expert switches between consecutive tokens of a sequence.

    Returns (sum over consecutive pairs of the share of the k experts that changed, pairs).
    A pair is rows i, i+1 of the same sequence with positions p, p+1, both valid.
    """
    if experts.shape[0] < 2:
        return 0.0, 0
    k = experts.shape[1]
    a, b = experts[:-1], experts[1:]
    pair = (seq[1:] == seq[:-1]) & (pos[1:] == pos[:-1] + 1) & (pos[:-1] >= 0)
    pair &= (a >= 0).all(axis=1) & (b >= 0).all(axis=1)
    if not pair.any():
        return 0.0, 0
    a, b = a[pair], b[pair]
    same = (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)
    return float((1.0 - same / k).sum()), int(pair.sum())


def usage_entropy(counts: np.ndarray) -> float:
    """Entropy of the expert-load distribution over log(E): 1.0 is perfectly balanced."""
    total = counts.sum()
    if total == 0 or counts.size < 2:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum() / np.log(counts.size))
