"""Zero-surgery routing telemetry: hook a model's MoE routers and record their choices.

``attach(model)`` finds the routers (``moestack.telemetry.detect``: ``find_routers``) and
hooks them with ``register_forward_hook`` only (nothing in the model is edited; ``detach()``
removes every hook). A forward pre-hook on ``model`` reads the batch shape ([B, S]
``tokens`` / ``input_ids`` / ``inputs_embeds``, ``attention_mask``, ``position_ids``) to give
every token its sequence and position id; the router hooks copy the chosen expert ids (int16)
and a per-token routing-entropy sum, nothing else, and the copies reach numpy only when
metrics or the trace are read (no per-token ``.item()``, one host sync per read on CUDA).
Draining them appends to ``Telemetry.trace`` (a ``RoutingTrace``) and queues them for the
live cache replay.

Interval metrics (``Telemetry.interval_metrics``) replay the requests recorded since the
previous call through each configured policy and capacity, one cache per layer
(``moestack.telemetry.live``); ``capacity_curves`` / ``wandb_charts`` are in
``moestack.telemetry.charts``. Without ``capacities=`` the capacities are
``default_capacities(top_k)`` of the routers' largest top_k: (2, 4) for top_k = 2.

A resumed training run continues the whole run's numbers: ``Telemetry.replay_history`` feeds
the earlier trace parts (``moestack.telemetry.run_trace``) through the live caches first, and
``summary()`` lists every part (``parts``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from moestack.telemetry import charts
from moestack.telemetry.detect import ROUTER_DETECTORS, RouterSpec, extract_experts, find_routers
from moestack.telemetry.live import LiveReplay
from moestack.telemetry.run_trace import JOINED, META_START_STEP, RunTrace, TracePart, intervals
from moestack.telemetry.trace import RoutingTrace, TraceChunk, expert_dtype

__all__ = ["ROUTER_DETECTORS", "RouterSpec", "Telemetry", "attach", "find_routers"]

log = logging.getLogger(__name__)

# Recorded tokens held on the device before they are copied to numpy; with router
# probabilities (record_probs) also at most this many bytes of them.
_MAX_RAW_TOKENS = 1 << 20
_MAX_RAW_BYTES = 1 << 28
# Drained tokens (or bytes) held for the next interval's replay before they are replayed
# into the live caches early (the metrics are the same; only the memory is bounded).
_MAX_UNREAD_TOKENS = 1 << 20
_MAX_UNREAD_BYTES = 1 << 28


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


def _read_call(args: tuple, kwargs: dict) -> _Call:
    """The batch shape, attention mask and position ids of a forward call's inputs."""
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
    return call


class Telemetry:
    """Hooks on a model's routers, a RoutingTrace, and cache replay metrics."""

    def __init__(
        self,
        model: nn.Module,
        specs: list[RouterSpec],
        *,
        policies: Sequence[str] = ("lru", "static"),
        capacities: Sequence[int] | None = None,
        record_probs: bool = False,
        trace_dir: str | None = None,
        chunk_tokens: int = 1 << 18,
        max_memory_tokens: int = 1 << 20,
        entropy: bool = True,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self._live = LiveReplay(specs, policies, capacities)  # checks policies / capacities
        self.model = model
        self.routers = specs
        self.policies = self._live.policies
        self.capacities = self._live.capacities
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
            meta={
                "model": type(model).__name__,
                "router_kinds": [s.kind for s in specs],
                **(meta or {}),
            },
        )
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._active = True
        self._call = _Call()
        self._raw: list[tuple[np.ndarray, np.ndarray, _Call]] = []  # finished forward calls
        self._raw_tokens = 0
        self._raw_bytes = 0
        self._unread: list[TraceChunk] = []  # drained chunks not yet replayed
        self._unread_tokens = 0
        self._unread_bytes = 0
        self._in_call = False  # the top model's forward started and has not returned
        self._next_seq = 0
        self._last_call: tuple[int, np.ndarray] | None = None  # (batch, seq ids) of last call
        self._hook_errors = 0
        self._fallback_warned = False
        self._history: list[TracePart] = []  # earlier parts of the run, replayed first
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
        self._drop_unfinished()
        self._finish_call()
        self._drain()

    def flush(self) -> int:
        """Put every token recorded so far into the trace on disk; returns its token count.

        For a training loop's checkpoints: call it between forward passes (e.g. when a
        checkpoint is saved) and the trace folder then holds every token of every forward
        recorded before the call, as complete chunk files listed in ``header.json``,
        fsynced: a run killed afterwards leaves a trace that loads with those tokens. Hooks
        stay attached; recording and interval metrics go on unchanged (the flushed tokens
        are still replayed by the next ``interval_metrics``). Cost: one device-to-host copy
        of the queued router outputs, one chunk file of the rows since the last chunk (none
        if there are none), a header rewrite and four fsyncs. Without ``trace_dir`` the
        rows are gathered in memory and 0 is returned. Safe to call after ``close()``.
        """
        self._drop_unfinished()
        self._finish_call()
        self._drain()
        return self.trace.flush()

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
            self._drop_unfinished()  # the previous forward raised before it returned
            self._finish_call()
            self._call = _read_call(args, kwargs)
            self._in_call = True
        except Exception:  # never break the model's forward
            self._hook_failed()

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._active:
            return
        self._in_call = False
        try:
            self._finish_call()
        except Exception:  # never break the model's forward
            self._hook_failed()
        self._call = _Call()

    def _drop_unfinished(self) -> None:
        """Forget the rows of a forward that started but never returned (it raised)."""
        if self._in_call:
            self._in_call = False
            if self._call.layers:
                log.warning("telemetry: a forward pass raised; its routing is not recorded")
            self._call = _Call()

    def _router_hook(self, layer: int, spec: RouterSpec) -> Callable[..., None]:
        dtype = torch.int16 if expert_dtype(spec.num_experts) == np.int16 else torch.int32

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._active:
                return
            try:
                with torch.no_grad():
                    ids, probs = extract_experts(spec, output)
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
        seq, pos = self._token_ids(call, b, s)
        self._raw.append((seq, pos, call))
        self._raw_tokens += n
        if self.record_probs:
            self._raw_bytes += sum(t.numel() * t.element_size() for t in call.probs.values())
        if self._raw_tokens >= _MAX_RAW_TOKENS or self._raw_bytes >= _MAX_RAW_BYTES:
            self._drain()  # bound memory held on the device

    def _token_ids(self, call: _Call, b: int, s: int) -> tuple[np.ndarray, np.ndarray]:
        """(sequence ids int64 [b*s], positions int32 [b*s], -1 for padding) of a call."""
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
            mask = call.mask.to("cpu").numpy()
            if mask.ndim == 2 and mask.shape[1] > s:  # decoding with a KV cache: [B, past + s]
                mask = mask[:, -s:]
            pos = np.where(mask.reshape(b, s) > 0, pos, -1).astype(np.int32)
        return np.repeat(seq_ids, s), pos.reshape(-1)

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
            self._unread_tokens += n
            self._unread_bytes += _chunk_bytes(chunk)
            for layer, ent in call.entropy.items():
                self._live.add_entropy(layer, float(ent), n)
        self._raw.clear()
        self._raw_tokens = self._raw_bytes = 0
        full = self._unread_tokens >= _MAX_UNREAD_TOKENS or self._unread_bytes >= _MAX_UNREAD_BYTES
        if full and self._live.replays_in_pieces:
            self._replay_unread()

    def _replay_unread(self) -> None:
        """Replay the drained chunks into the live caches (same metrics, memory freed)."""
        chunks, self._unread = self._unread, []
        self._unread_tokens = self._unread_bytes = 0
        self._live.replay(chunks)

    def _update(self) -> None:
        """Replay every drained, unreplayed chunk through the configured caches."""
        if not self._in_call:  # an unfinished forward is dropped or completed later
            self._finish_call()
        self._drain()
        self._replay_unread()

    # ------------------------------------------------------------------ a resumed run
    def replay_history(self, history: RunTrace, *, interval_tokens: int | None = None) -> int:
        """Replay a resumed run's earlier parts through the live caches; returns their tokens.

        Call it before the first recorded forward, with the parts cut at this start's step
        (``load_history(root, start)``; the rows stream from the parts' files): the caches
        then stand where the run stood at the resume step, and interval metrics and
        ``summary()`` cover the whole run.
        The tokens are not written into this Telemetry's trace (they are on disk already).
        ``interval_tokens`` replays them in the intervals the earlier starts logged (None:
        one interval), so that pinned policies re-pin as they did; their metrics are not
        returned again. Routing entropy needs router probabilities, which the trace holds
        only with ``record_probs``: without them it covers this start's tokens alone.
        """
        if self._raw or self._unread or self.trace.num_tokens or self._live.intervals:
            raise ValueError(
                "replay_history() must come before the first recorded forward and interval; "
                "call it right after attach()"
            )
        self._check_history(history)
        started = time.perf_counter()
        rate, done = history.tokens_per_step, 0
        first = history.parts[0].start_step or 0
        for chunks in intervals(history.iter_chunks(), interval_tokens):
            self._live.replay(chunks)
            if self.compute_entropy and history.record_probs:
                self._add_entropy(chunks)
            done += sum(c.num_tokens for c in chunks)
            self._live.end_interval(first + done // rate if rate else None)
        self._history = list(history.parts)
        log.info(
            "telemetry: replayed the run's %d earlier tokens (%s, %s) in %.2f s",
            done,
            ", ".join(p.name for p in history.parts),
            JOINED,
            time.perf_counter() - started,
        )
        return done

    def _check_history(self, history: RunTrace) -> None:
        want = ([s.top_k for s in self.routers], [s.num_experts for s in self.routers])
        if (history.top_k, history.num_experts) != want:
            raise ValueError(
                f"{history.root}: the earlier trace has top_k {history.top_k} and num_experts "
                f"{history.num_experts} per layer, this model {want[0]} and {want[1]}; it is "
                "not this run's trace"
            )

    def _add_entropy(self, chunks: list[TraceChunk]) -> None:
        """Routing-entropy sums of recorded router probabilities (as the hook takes them)."""
        for chunk in chunks:
            for layer, probs in enumerate(chunk.probs or []):
                p = probs.astype(np.float64)
                ent = -(p * np.log(np.where(p > 0, p, 1.0))).sum()
                self._live.add_entropy(layer, float(ent), chunk.num_tokens)

    def parts(self) -> list[dict[str, Any]]:
        """The run's trace parts this Telemetry covers: the replayed ones, then its own."""
        own = {
            "name": self.trace.path.name if self.trace.path is not None else None,
            "start_step": self.trace.meta.get(META_START_STEP),
            "tokens": self.trace.num_tokens,
            "tokens_cut": 0,
        }
        return [p.to_dict() for p in self._history] + [own]

    # ------------------------------------------------------------------ outputs
    def interval_metrics(self, step: int | None = None) -> dict[str, float]:
        """Flat metrics over the requests since the previous call (empty dict if none).

        Keys: ``telemetry/<policy>/cap<c>/{hit_rate,misses_per_token}``,
        ``telemetry/layer<l>/<policy>/cap<c>/hit_rate``, ``telemetry/{hit_rate,
        misses_per_token}`` (first policy and capacity), ``telemetry/{routing_entropy,
        usage_entropy,switch_rate}`` and per-layer twins, ``telemetry/tokens``,
        ``telemetry/replay_ms``.
        """
        before = self._live.replay_seconds
        self._update()
        out = self._live.end_interval(step)
        if out:
            out["telemetry/replay_ms"] = 1000.0 * (self._live.replay_seconds - before)
        return out

    def summary(self) -> dict[str, Any]:
        """Whole-run numbers: hit rates per policy and capacity, usage, switch rate, entropy."""
        self._update()
        out = self._live.summary()
        parts = self.parts()
        out["trace_tokens"] = sum(p["tokens"] for p in parts)
        out["parts"] = parts
        if self._history:
            out["parts_joined"] = JOINED
        out["dropped_tokens"] = self.trace.dropped_tokens
        out["replay_seconds"] = self._live.replay_seconds
        out["hook_errors"] = self._hook_errors
        return out

    def usage(self, interval: bool = False) -> np.ndarray:
        """Expert usage counts [layers, max experts] over the run (or the last interval)."""
        self._update()
        return self._live.usage(interval)

    def capacity_curves(self) -> dict[str, list[float]]:
        """Hit rate vs capacity 1..E over the run: LRU (exact, from stack distances) and
        'static-oracle' (the run's most used experts pinned, compulsory misses ignored)."""
        self._update()
        return charts.capacity_curves(self._live)

    def wandb_charts(self) -> dict[str, Any]:
        """wandb objects for a dashboard; pass to ``wandb.log`` (imports wandb lazily)."""
        self._update()
        return charts.wandb_charts(self._live)


def _chunk_bytes(chunk: TraceChunk) -> int:
    arrays = [chunk.seq, chunk.pos, *chunk.experts, *(chunk.probs or [])]
    return sum(a.nbytes for a in arrays)


def attach(
    model: nn.Module,
    *,
    policies: Sequence[str] = ("lru", "static"),
    capacities: Sequence[int] | None = None,
    routers: Sequence[str | nn.Module] | None = None,
    top_k: int | None = None,
    num_experts: int | None = None,
    record_probs: bool = False,
    trace_dir: str | None = None,
    chunk_tokens: int = 1 << 18,
    max_memory_tokens: int = 1 << 20,
    entropy: bool = True,
    meta: dict[str, Any] | None = None,
) -> Telemetry:
    """Hook ``model``'s MoE routers; returns a Telemetry (also a context manager).

    ``capacities`` (expert slots per layer, every policy replayed at each) default to
    ``default_capacities(top_k)`` of the routers' largest top_k. ``trace_dir`` streams the
    trace to that directory (``chunk_tokens`` rows per file); without it the trace stays in
    memory, at most ``max_memory_tokens`` rows (0: keep none, metrics only).
    Recorded rows wait on the device for at most 2^20 tokens (with ``record_probs`` also at
    most 256 MiB of probabilities); copied rows wait for the next interval's replay for at
    most 2^20 tokens or 256 MiB, then are replayed early with the same metrics (except
    with ``belady``, the optimum of a whole interval).
    ``entropy=False`` skips the per-token routing-entropy sum in the hook. ``meta`` is added
    to the trace header's meta (training records ``start_step`` and ``tokens_per_step``
    there, so that ``load_run_trace`` can join a resumed run's parts).
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
        meta=meta,
    )
