"""Routing steered toward a cache as a decoder serving one stream would see it.

``moestack eval --offload`` steers a whole forward against the resident set of the moment
the layer is reached, which is what a prefill of many tokens sees. A study's question is
what a cache serving one stream token by token gains: there a token is steered against
the experts its layer's cache holds after the tokens before it. ``stream_steered`` does
that inside an ordinary forward, without a store: each layer keeps an LRU cache of
``capacity`` experts (the replay's own ``LRUPolicy``), and its router's tokens, in stream
order (sequence by sequence, position by position), are steered one at a time:

- ``cache_aware_bias``: a token with a pick that is not resident is selected again with the
  bias added to the resident experts (``Router.select``, as the offloaded path does);
- ``reroute_tau``: then each pick still not resident goes to the best-scoring resident
  expert not yet picked whose score is at least ``(1 - tau) * p_top``
  (``moestack.cache.rerouting``; the same rule, one token at a time);

and the token's served experts then enter the cache in slot order. Causal attention makes
this exact for a decoder: a layer's input at position t depends only on positions <= t, so
steering a layer's tokens in order and then running the layer on them all gives what
token-by-token decoding would. The telemetry trace of such a forward holds the served
experts, so replaying it through LRU at ``capacity`` gives the steered misses.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moestack.cache.replacement import LRUPolicy
from moestack.router import Router, Routing


@dataclass(frozen=True)
class Steering:
    """One steered evaluation: the cache it steers toward and how."""

    capacity: int  # expert slots per layer of the LRU cache the tokens are steered toward
    reroute_tau: float = 0.0  # reroute non-resident picks within (1 - tau) of the top score
    cache_aware_bias: float = 0.0  # added to the resident experts' scores before the top k

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"steering capacity={self.capacity} must be >= 1 expert slot")
        if not 0 <= self.reroute_tau <= 1:  # NaN fails this too
            raise ValueError(f"reroute_tau={self.reroute_tau} must be in [0, 1]")
        if not (math.isfinite(self.cache_aware_bias) and self.cache_aware_bias >= 0):
            raise ValueError(f"cache_aware_bias={self.cache_aware_bias} must be finite and >= 0")


def rerouted_picks(
    picks: list[int], scores_E: np.ndarray, resident: list[int], tau: float
) -> list[int]:
    """One token's picks with each non-resident one replaced, in pick order, by the best
    resident expert left that is not picked and scores at least ``(1 - tau) * p_top``."""
    if tau == 0:
        return picks
    floor = np.float32(1 - tau) * scores_E.max()
    held = set(resident)
    candidates = sorted(
        (e for e in resident if e not in picks and scores_E[e] >= floor),
        key=lambda e: -scores_E[e],
    )
    out, taken = list(picks), 0
    for slot, expert in enumerate(picks):
        if expert not in held and taken < len(candidates):
            out[slot] = candidates[taken]
            taken += 1
    return out


def biased_picks(
    picks: list[int], rank_E: np.ndarray, resident: list[int], bias: float
) -> list[int]:
    """One token's top k with ``bias`` added to the resident experts (``rank_E``: what the
    router's top k is taken of, ``Router.selection_scores``), best first, as ``Router.select``
    with that bias chooses: the k best of the resident experts (raised by the bias, in
    float32 as the router adds it) and the token's own picks that are not resident (no
    other expert can outrank those)."""
    held = set(resident)
    raised_E = rank_E.copy()
    raised_E[resident] += np.float32(bias)
    value = raised_E.tolist()
    pool = [*resident, *(e for e in picks if e not in held)]
    pool.sort(key=lambda e: -value[e])
    return pool[: len(picks)]


def steer_stream(
    router: Router, routing: Routing, cache: LRUPolicy, steering: Steering
) -> torch.Tensor:
    """The experts ``[T, k]`` served to ``routing``'s tokens, steered one token at a time
    toward ``cache`` (which they then update, in stream order)."""
    if routing.experts.numel() == 0:
        return routing.experts
    scores_TE = routing.scores.detach().float()
    scores = scores_TE.cpu().numpy()
    rank = router.selection_scores(scores_TE).cpu().numpy() if steering.cache_aware_bias else None
    rows = routing.experts.detach().cpu().tolist()
    tau, bias = steering.reroute_tau, steering.cache_aware_bias
    for t, picks in enumerate(rows):
        if all(cache.contains(e) for e in picks):
            for expert in picks:
                cache.access(expert)
            continue
        resident = cache.resident()
        if bias:
            picks = biased_picks(picks, rank[t], resident, bias)
        if tau:
            picks = rerouted_picks(picks, scores[t], resident, tau)
        rows[t] = picks
        for expert in picks:
            cache.access(expert)
    return torch.tensor(rows, dtype=routing.experts.dtype, device=routing.experts.device)


def _hook(cache: LRUPolicy, steering: Steering) -> Any:
    def hook(router: Router, args: tuple, routing: Routing) -> Routing:
        experts_TK = steer_stream(router, routing, cache, steering)
        weights_TK = router.weights_of(routing.scores, experts_TK)
        return Routing(routing.logits, weights_TK, experts_TK, routing.scores)

    return hook


@contextlib.contextmanager
def stream_steered(model: nn.Module, steering: Steering) -> Iterator[list[LRUPolicy]]:
    """Inside the block, every moestack router of ``model`` steers its tokens toward its
    layer's LRU cache (the module docstring); yields the caches, one per layer. The hooks
    run before any other (telemetry records the served experts) and are removed on exit."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no moestack Router: steered evaluation needs "
            "moestack's routers (a transformers model's are not steered)"
        )
    caches = [LRUPolicy(steering.capacity) for _ in routers]
    handles = [
        r.register_forward_hook(_hook(c, steering), prepend=True)
        for r, c in zip(routers, caches, strict=True)
    ]
    try:
        yield caches
    finally:
        for handle in handles:
            handle.remove()
