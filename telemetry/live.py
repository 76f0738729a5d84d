"""Live interval metrics: replay the requests recorded during training through expert caches.

A ``LiveReplay`` is fed the recorded chunks (``replay(chunks)``) and keeps, per MoE layer, one
cache per configured policy and capacity, plus sums over the current interval and the whole
run (``LayerAcc``). ``end_interval()`` turns the interval's sums into flat metrics
(``interval_metrics``) and starts the next interval.

Cache state persists across intervals (LRU recency, LFU counts). LRU of every capacity comes
from shared stack distances. ``static`` and ``lru+static`` pin the experts most used in the
previous interval (the first interval: its own most used, so that interval only warms them
and is not scored), so they track the router as it trains. ``belady`` is the optimum of each
interval alone, from empty. Policies are built by ``moestack.cache.policies``
(``policy_from_counts``), the same objects the real expert cache and ``simulate`` run.

Default capacities (``live_capacities``): ``default_capacities(top_k)`` of the largest
``top_k`` among the routers, i.e. (2, 4) for top_k = 2. The largest, because one capacity
applies to every layer and a cache smaller than a layer's ``top_k`` cannot hold one token's
experts. Every ``RouterSpec`` that ``find_routers`` returns has a ``top_k`` (it refuses
routers whose ``top_k`` it cannot tell); only hand-built specs can lack one (top_k < 1, or no
routers at all, where nothing is replayed): then top_k = 1 is assumed, the smallest valid
routing, which gives capacities (1, 2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moestack.cache.policies import (
    BeladyPolicy,
    CachePolicy,
    LRUStaticPolicy,
    check_policy,
    default_capacities,
    policy_from_counts,
    stack_distances,
    top_keys,
)
from moestack.telemetry.detect import RouterSpec
from moestack.telemetry.replay import switch_counts, usage_entropy
from moestack.telemetry.trace import TraceChunk, chunk_accesses

# How many intervals of per-layer hit rates are kept for the charts.
HISTORY_INTERVALS = 1000


def live_capacities(routers: Sequence[RouterSpec]) -> tuple[int, ...]:
    """The capacities replayed when none are given (see the module docstring)."""
    top_k = max((s.top_k for s in routers if s.top_k >= 1), default=1)
    return tuple(default_capacities(top_k))


@dataclass
class LayerAcc:
    """Sums over an interval (or the whole run) for one layer."""

    tokens: int = 0
    requests: int = 0
    hits: dict[tuple[str, int], int] = field(default_factory=dict)  # (policy, capacity) ->
    requests_by: dict[tuple[str, int], int] = field(default_factory=dict)  # scored requests
    tokens_by: dict[tuple[str, int], int] = field(default_factory=dict)  # scored tokens
    switch_sum: float = 0.0
    switch_pairs: int = 0
    entropy_sum: float = 0.0
    entropy_tokens: int = 0
    counts: np.ndarray | None = None  # requests per expert
    reuse: np.ndarray | None = None  # LRU stack distance histogram; last entry: first requests


@dataclass
class _LayerChunk:
    """One layer's share of the chunks being replayed, ready to add to the accumulators."""

    tokens: int
    requests: int
    switch_sum: float
    switch_pairs: int
    counts: np.ndarray
    reuse: np.ndarray
    hits: dict[tuple[str, int], int]


class LiveReplay:
    """Per-layer caches and accumulators for the recorded requests of a Telemetry."""

    def __init__(
        self,
        routers: Sequence[RouterSpec],
        policies: Sequence[str],
        capacities: Sequence[int] | None = None,
    ) -> None:
        if capacities is None:
            capacities = live_capacities(routers)
        for p in policies:
            check_policy(p, "policies")
        for c in capacities:
            if int(c) < 1:
                raise ValueError(f"capacities has {c}; each must be >= 1 expert slot per layer")
        if not policies or not capacities:
            raise ValueError("give at least one policy and one capacity")
        self.routers = list(routers)
        self.policies = tuple(policies)
        self.capacities = tuple(int(c) for c in capacities)
        n = len(self.routers)
        self._lru_last = [np.full(0, -1, dtype=np.int64) for _ in range(n)]
        self._lru_tick = [0] * n
        self._policy: dict[tuple[int, str, int], CachePolicy] = {}
        self._warming: set[tuple[int, str, int]] = set()  # pinned policies warmed at interval end
        self._tail: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * n
        self.interval = [LayerAcc() for _ in range(n)]
        self.total = [LayerAcc() for _ in range(n)]
        self.last_interval: list[LayerAcc] | None = None
        self.history: list[tuple[int, list[float]]] = []  # (step, per-layer primary hit rate)
        self.intervals = 0
        self.replay_seconds = 0.0

    @property
    def replays_in_pieces(self) -> bool:
        """Whether an interval may be replayed in several pieces with the same metrics
        (belady is the optimum of the whole interval, so it needs the interval at once)."""
        return "belady" not in self.policies

    # ------------------------------------------------------------------ input
    def add_entropy(self, layer: int, entropy_sum: float, tokens: int) -> None:
        """Add one forward's routing-entropy sum over ``tokens`` tokens of ``layer``."""
        for acc in (self.interval[layer], self.total[layer]):
            acc.entropy_sum += entropy_sum
            acc.entropy_tokens += tokens

    def replay(self, chunks: Sequence[TraceChunk]) -> None:
        """Replay ``chunks`` (in recording order) through every layer's caches."""
        if not chunks:
            return
        start = time.perf_counter()
        for layer, spec in enumerate(self.routers):
            part = self._replay_layer(layer, spec, chunks)
            for acc in (self.interval[layer], self.total[layer]):
                _accumulate(acc, part)
        self.replay_seconds += time.perf_counter() - start

    def _replay_layer(
        self, layer: int, spec: RouterSpec, chunks: Sequence[TraceChunk]
    ) -> _LayerChunk:
        e = spec.num_experts
        requests = np.concatenate([chunk_accesses(c, layer) for c in chunks])
        counts = np.bincount(requests, minlength=e)[:e]
        dist, self._lru_last[layer] = stack_distances(
            requests, self._lru_last[layer], self._lru_tick[layer]
        )
        self._lru_tick[layer] += requests.size
        reuse = np.zeros(e + 1, dtype=np.int64)
        cold = dist < 0
        reuse[:e] = np.bincount(dist[~cold], minlength=e)[:e]
        reuse[-1] = cold.sum()
        tokens = sum(int((c.pos >= 0).sum()) for c in chunks if c.experts[layer].size)
        sw_sum, sw_pairs = 0.0, 0
        for c in chunks:
            s, p = switch_counts(c.experts[layer], c.seq, c.pos)
            sw_sum += s
            sw_pairs += p
            s, p = self._boundary_switch(layer, c)
            sw_sum += s
            sw_pairs += p
        hits: dict[tuple[str, int], int] = {}
        for name in self.policies:
            for cap in self.capacities:
                hit = self._policy_hits(layer, name, cap, requests, dist, counts)
                if hit is not None:
                    hits[(name, cap)] = hit
        return _LayerChunk(tokens, int(requests.size), sw_sum, sw_pairs, counts, reuse, hits)

    def _boundary_switch(self, layer: int, chunk: TraceChunk) -> tuple[float, int]:
        """The switch of the pair (previous chunk's last row, this chunk's first row): a
        forward call (a decode step) that continues the sequence of the one before."""
        if chunk.num_tokens == 0:
            return 0.0, 0
        tail, ids = self._tail[layer], chunk.experts[layer]
        self._tail[layer] = (chunk.seq[-1:], chunk.pos[-1:], ids[-1:])
        if tail is None:
            return 0.0, 0
        seq, pos, last = tail
        return switch_counts(
            np.concatenate([last, ids[:1]]),
            np.concatenate([seq, chunk.seq[:1]]),
            np.concatenate([pos, chunk.pos[:1]]),
        )

    def _policy_hits(
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
            if name != "lfu":
                # The pins are chosen from this whole interval's requests at its end and
                # warmed on them (``_warm``), but scoring them would be hindsight
                # (simulate() does the same with its uncounted warm-up window).
                self._warming.add(key)
                return None
            policy = self._policy[key] = policy_from_counts(name, cap, counts)
        return int(policy.access_many(requests).sum())

    def _warm(self, accs: list[LayerAcc]) -> None:
        """Build the pinned policies whose warm-up interval ends now: pins from its usage,
        cache state as after its requests (every pin loaded; the LRU part holding the most
        recently requested other experts, in that order)."""
        for layer, name, cap in sorted(self._warming):
            counts = accs[layer].counts
            if counts is None:
                counts = np.zeros(self.routers[layer].num_experts, dtype=np.int64)
            policy = self._policy[(layer, name, cap)] = policy_from_counts(name, cap, counts)
            used = np.flatnonzero(counts > 0)
            last = self._lru_last[layer]
            used = used[used < last.size]
            order = used[np.argsort(last[used], kind="stable")]  # least recent first
            pins = set(policy.pinned or ())
            rest = [int(k) for k in order if int(k) not in pins]
            policy.access_many(np.array(sorted(pins) + rest, dtype=np.int64))
        self._warming.clear()

    # ------------------------------------------------------------------ outputs
    def end_interval(self, step: int | None = None) -> dict[str, float]:
        """Flat metrics of the interval that ends now (empty if it saw no requests); re-pins
        the pinned policies on its usage and starts the next interval."""
        accs, self.interval = self.interval, [LayerAcc() for _ in self.routers]
        self._warm(accs)
        if not any(a.requests for a in accs):
            return {}
        out = interval_metrics(accs, self.policies, self.capacities)
        primary = (self.policies[0], self.capacities[0])
        self.history.append(
            (
                self.intervals if step is None else int(step),
                [_ratio(a.hits.get(primary, 0), a.requests_by.get(primary, 0)) for a in accs],
            )
        )
        del self.history[:-HISTORY_INTERVALS]
        self.intervals += 1
        for (layer, _name, _cap), policy in self._policy.items():  # pins for the next interval
            counts = accs[layer].counts
            if counts is None or not isinstance(policy, LRUStaticPolicy):
                continue
            if policy.num_pinned:
                policy.pin(top_keys(counts, policy.num_pinned))
        self.last_interval = accs
        return out

    def summary(self) -> dict[str, Any]:
        """Whole-run numbers: the routers, hit rates per policy and capacity, usage, reuse."""
        total = self.total
        flat = (
            interval_metrics(total, self.policies, self.capacities)
            if any(a.requests for a in total)
            else {}
        )
        return {
            "routers": [s.name for s in self.routers],
            "router_kinds": [s.kind for s in self.routers],
            "top_k": [s.top_k for s in self.routers],
            "num_experts": [s.num_experts for s in self.routers],
            "expert_bytes": [s.expert_bytes for s in self.routers],
            "tokens": max((a.tokens for a in total), default=0),
            "requests": sum(a.requests for a in total),
            "metrics": flat,
            "expert_usage": [
                (a.counts.tolist() if a.counts is not None else [0] * s.num_experts)
                for a, s in zip(total, self.routers, strict=True)
            ],
            "reuse_distance_hist": [
                (a.reuse.tolist() if a.reuse is not None else []) for a in total
            ],
        }

    def usage(self, interval: bool = False) -> np.ndarray:
        """Expert usage counts [layers, max experts] over the run (or the last interval)."""
        accs = self.total
        if interval and self.last_interval is not None:
            accs = self.last_interval
        width = max(s.num_experts for s in self.routers)
        out = np.zeros((len(self.routers), width), dtype=np.int64)
        for i, a in enumerate(accs):
            if a.counts is not None:
                out[i, : a.counts.size] = a.counts
        return out


def _accumulate(acc: LayerAcc, part: _LayerChunk) -> None:
    acc.tokens += part.tokens
    acc.requests += part.requests
    acc.switch_sum += part.switch_sum
    acc.switch_pairs += part.switch_pairs
    for key, h in part.hits.items():  # a policy's warm-up chunk is not counted
        acc.hits[key] = acc.hits.get(key, 0) + h
        acc.requests_by[key] = acc.requests_by.get(key, 0) + part.requests
        acc.tokens_by[key] = acc.tokens_by.get(key, 0) + part.tokens
    acc.counts = part.counts if acc.counts is None else acc.counts + part.counts
    acc.reuse = part.reuse if acc.reuse is None else acc.reuse + part.reuse


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else 0.0


def _hit_rate_metrics(
    accs: list[LayerAcc], policies: Sequence[str], capacities: Sequence[int]
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in policies:
        for cap in capacities:
            key = (name, cap)
            hits = sum(a.hits.get(key, 0) for a in accs)
            reqs = sum(a.requests_by.get(key, 0) for a in accs)
            if reqs == 0:  # nothing scored yet (a pinned policy's warm-up interval)
                continue
            tokens = max(a.tokens_by.get(key, 0) for a in accs)  # the tokens scored
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
    return out


def _routing_metrics(accs: list[LayerAcc]) -> dict[str, float]:
    out: dict[str, float] = {}
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
    return out


def interval_metrics(
    accs: list[LayerAcc], policies: Sequence[str], capacities: Sequence[int]
) -> dict[str, float]:
    """Flat ``telemetry/...`` metrics of per-layer sums (see ``Telemetry.interval_metrics``)."""
    tokens = max((a.tokens for a in accs), default=0)
    out = _hit_rate_metrics(accs, policies, capacities)
    out.update(_routing_metrics(accs))
    out["telemetry/tokens"] = float(tokens)
    return {k: (float(v) if math.isfinite(v) else 0.0) for k, v in out.items()}
