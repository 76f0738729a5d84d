"""The routing trace of a whole run: every part of ``<run>/trace/`` joined in training order.

A training run writes one trace part per start, ``trace/from-<start step, 7 digits>/``: a run
killed and resumed has several. Each part's ``meta`` records ``start_step`` (the step the
start began at) and ``tokens_per_step`` (the token rows rank 0 records per training step).
``load_run_trace`` joins the parts, in the order of their start steps, into one in-memory
``RoutingTrace``: each part is cut to the tokens of the steps before the next part's start
(``(next start - start) x tokens_per_step`` rows), because a part whose writer was killed after
a checkpoint may hold tokens past it, which the resumed part records again. So no token is
counted twice. Sequence ids are offset part by part so that they stay unique.

Parts written before the meta existed are joined whole, with one warning that tokens may be
counted twice; a part with no tokens (its start stopped before its first flush) is skipped
with a warning. A folder that is itself a trace (it holds ``header.json``) is one part, loaded
as it is. ``RunTrace.iter_chunks()`` streams the joined rows from the parts' files;
``RunTrace.trace`` is the join as one in-memory ``RoutingTrace`` (a single uncut part: that
part itself, read lazily). Nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moestack.telemetry.trace import HEADER_FILE, RoutingTrace, TraceChunk, TraceFormatError

__all__ = [
    "JOINED",
    "META_START_STEP",
    "META_TOKENS_PER_STEP",
    "RunTrace",
    "TracePart",
    "find_parts",
    "intervals",
    "load_history",
    "load_run_trace",
    "part_name",
    "part_step",
]

log = logging.getLogger(__name__)

META_START_STEP = "start_step"  # meta key: the training step the part's start began at
META_TOKENS_PER_STEP = "tokens_per_step"  # meta key: token rows recorded per training step
JOINED = "parts joined in training order"  # how the parts are combined, said in every output
_PART = re.compile(r"^from-(\d+)$")


def part_name(start_step: int) -> str:
    """The folder name of the trace part a start at ``start_step`` writes: from-0000042."""
    return f"from-{int(start_step):07d}"


@dataclass(frozen=True)
class TracePart:
    """One part of a run's trace: where it is, the step it starts at, the tokens kept."""

    name: str
    path: Path
    start_step: int | None  # None: not recorded (an old part not named from-<step>)
    tokens: int  # token rows the part holds
    kept: int  # of those, the rows the join uses

    @property
    def cut(self) -> int:
        """Rows past the next part's start step, left out (that part holds them)."""
        return self.tokens - self.kept

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start_step": self.start_step,
            "tokens": self.kept,
            "tokens_cut": self.cut,
        }


@dataclass
class RunTrace:
    """A run's trace parts and their join, in training order.

    ``iter_chunks()`` streams the joined rows from the parts' files (a resumed start replays
    its history this way, in bounded memory); ``trace`` is the join as one in-memory
    ``RoutingTrace``, built when first read (a single uncut part: that part itself).
    """

    root: Path
    parts: list[TracePart]
    tokens_per_step: int | None = None  # None: some part does not record it
    exact: bool = True  # False: a part without the meta was joined whole (overlap possible)
    sources: list[RoutingTrace] = field(default_factory=list, repr=False)  # one per part
    _joined: RoutingTrace | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(p.kept for p in self.parts)

    @property
    def top_k(self) -> list[int]:
        return self.sources[0].top_k

    @property
    def num_experts(self) -> list[int]:
        return self.sources[0].num_experts

    @property
    def record_probs(self) -> bool:
        return self.sources[0].record_probs

    @property
    def resume_steps(self) -> list[int]:
        """The steps where the run resumed: the start step of every part but the first."""
        return [p.start_step for p in self.parts[1:] if p.start_step is not None]

    def iter_chunks(self) -> Iterator[TraceChunk]:
        """The joined rows in training order: each part's kept rows, sequence ids offset
        past the previous parts' so that they stay unique."""
        offset = 0
        for part, trace in zip(self.parts, self.sources, strict=True):
            top = -1
            for chunk in _first_rows(trace.iter_chunks(), part.kept):
                if chunk.num_tokens:
                    top = max(top, int(chunk.seq.max()))
                    yield TraceChunk(chunk.seq + offset, chunk.pos, chunk.experts, chunk.probs)
            offset += top + 1

    @property
    def trace(self) -> RoutingTrace:
        """The join as one RoutingTrace (in memory; nothing is written)."""
        if self._joined is None:
            if len(self.sources) == 1 and self.parts[0].cut == 0:
                self._joined = self.sources[0]
            else:
                self._joined = self._materialise()
        return self._joined

    def _materialise(self) -> RoutingTrace:
        first = self.sources[0]
        joined = RoutingTrace(
            first.layer_names,
            first.top_k,
            first.num_experts,
            expert_bytes=first.expert_bytes,
            record_probs=first.record_probs,
            meta={**first.meta, "joined": JOINED, "parts": [p.to_dict() for p in self.parts]},
        )
        for chunk in self.iter_chunks():
            joined.append(chunk.seq, chunk.pos, chunk.experts, chunk.probs)
        joined.flush()
        joined.dropped_tokens = sum(t.dropped_tokens for t in self.sources)
        return joined


def part_step(path: str | os.PathLike[str]) -> int | None:
    """The start step in a part's folder name (from-0000042: 42); None for another name."""
    match = _PART.match(Path(path).name)
    return int(match.group(1)) if match else None


def find_parts(trace_root: str | os.PathLike[str]) -> list[Path]:
    """The ``from-<step>`` folders under ``trace_root`` that hold a header, by start step."""
    found = [
        (step, header.parent)
        for header in Path(trace_root).glob(f"from-*/{HEADER_FILE}")
        if (step := part_step(header.parent)) is not None and header.is_file()
    ]
    return [path for _, path in sorted(found)]


def load_history(trace_root: str | os.PathLike[str], start_step: int) -> RunTrace | None:
    """What a start at ``start_step`` continues: the parts before it, joined and cut at it;
    None when no earlier part holds tokens (a new run, or telemetry newly enabled)."""
    earlier = [
        p
        for p in find_parts(trace_root)
        if (part_step(p) or 0) < start_step and not _holds_no_tokens(p)
    ]
    if not earlier:
        return None
    return load_run_trace(trace_root, until_step=start_step)


def load_run_trace(
    trace_root: str | os.PathLike[str], *, until_step: int | None = None
) -> RunTrace:
    """The whole trace of a run: its ``trace/`` folder's parts joined (see the module doc).

    ``trace_root`` is a run's ``trace/`` folder, or one trace folder (one part).
    ``until_step`` keeps only the steps before it (a resumed start replays what came before
    its own step). Raises ``TraceFormatError`` when there is no part with tokens, when a
    part's header or meta is bad, or when the parts are not of one model.
    """
    root = Path(trace_root)
    if (root / HEADER_FILE).is_file():
        paths = [root]
    else:
        paths = find_parts(root)
        if not paths:
            raise TraceFormatError(
                f"{root}: no trace here (neither {HEADER_FILE} nor from-<step>/{HEADER_FILE}); "
                "give a run's trace/ folder or one trace folder"
            )
    if until_step is not None:  # parts named for later steps are not read
        paths = [p for p in paths if (part_step(p) or 0) < until_step or p == root]
    loaded = _load_parts(paths)
    if until_step is not None:
        loaded = [(t, s) for t, s in loaded if s is None or s < until_step]
    if not loaded:
        raise TraceFormatError(
            f"{root}: no trace part with tokens"
            + (f" before step {until_step}" if until_step is not None else "")
            + "; record a trace first"
        )
    return _join(root, loaded, until_step)


def _load_parts(paths: list[Path]) -> list[tuple[RoutingTrace, int | None]]:
    """(trace, start step) of every part that holds tokens, ordered by start step."""
    loaded = []
    for path in paths:
        if _holds_no_tokens(path):
            log.warning("%s holds no tokens (stopped before its first flush); skipped", path)
            continue
        trace = RoutingTrace.load(path)
        loaded.append((trace, _start_step(trace, path)))
    known = [s for _, s in loaded if s is not None]
    if len(set(known)) != len(known):
        raise TraceFormatError(
            f"{paths[0].parent}: two trace parts start at the same step ({sorted(known)}); "
            "keep one part per start"
        )
    return sorted(loaded, key=lambda part: -1 if part[1] is None else part[1])


def _holds_no_tokens(path: Path) -> bool:
    """Whether a part's header says it holds no tokens (a bad header: False, so that loading
    it reports what is wrong)."""
    try:
        header = json.loads((path / HEADER_FILE).read_text())
        return isinstance(header, dict) and header.get("num_tokens") == 0
    except (OSError, ValueError):
        return False


def _meta_count(trace: RoutingTrace, key: str, minimum: int) -> int | None:
    """A count the part's meta records (None when absent), refused when not an int."""
    value = trace.meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceFormatError(
            f"{trace.path / HEADER_FILE}: field 'meta.{key}' must be an int >= {minimum}, got "
            f"{value!r}; the trace is damaged or was not written by moestack; re-record it"
        )
    return value


def _start_step(trace: RoutingTrace, path: Path) -> int | None:
    """The part's start step: its meta, else its folder name, else None."""
    step = _meta_count(trace, META_START_STEP, 0)
    return step if step is not None else part_step(path)


def _layout(trace: RoutingTrace) -> tuple:
    return (trace.layer_names, trace.top_k, trace.num_experts, trace.record_probs)


def _join(
    root: Path, loaded: list[tuple[RoutingTrace, int | None]], until_step: int | None
) -> RunTrace:
    """The RunTrace of the parts, each cut before the next part's start step."""
    first = loaded[0][0]
    for trace, _ in loaded[1:]:
        if _layout(trace) != _layout(first):
            raise TraceFormatError(
                f"{trace.path / HEADER_FILE}: its layers (names, top_k, num_experts, "
                f"record_probs) differ from {first.path}'s; these parts are not one run's trace"
            )
    rates = [_meta_count(t, META_TOKENS_PER_STEP, 1) for t, _ in loaded]
    tokens_per_step = rates[0] if None not in rates and len(set(rates)) == 1 else None
    ends = [s for _, s in loaded[1:]] + [until_step]
    limits = [
        _rows_before(trace, start, end, rate)
        for (trace, start), end, rate in zip(loaded, ends, rates, strict=True)
    ]
    exact = all(
        limit is not None for limit, end in zip(limits, ends, strict=True) if end is not None
    )
    if not exact:
        log.warning(
            "%s: a trace part does not record its start step and tokens per step (written "
            "before they were recorded): joined whole, so tokens a killed start recorded past "
            "its checkpoint may be counted twice",
            root,
        )
    parts = [
        _part(trace, start, trace.num_tokens if limit is None else min(limit, trace.num_tokens))
        for (trace, start), limit in zip(loaded, limits, strict=True)
    ]
    sources = [trace for trace, _ in loaded]
    return RunTrace(root, parts, tokens_per_step, exact, sources)


def _rows_before(
    trace: RoutingTrace, start: int | None, end: int | None, rate: int | None
) -> int | None:
    """Rows of the part's steps before ``end`` (None: keep the whole part)."""
    if end is None or start is None or rate is None:
        return None
    wanted = (end - start) * rate
    if trace.num_tokens < wanted:
        log.warning(
            "%s holds %d tokens, fewer than the %d of steps %d-%d (%d a step): some steps of "
            "that start were not recorded",
            trace.path,
            trace.num_tokens,
            wanted,
            start,
            end - 1,
            rate,
        )
    return wanted


def _part(trace: RoutingTrace, start: int | None, kept: int) -> TracePart:
    path = trace.path or Path()
    return TracePart(path.name, path, start, trace.num_tokens, kept)


def _first_rows(chunks: Iterator[TraceChunk], limit: int | None) -> Iterator[TraceChunk]:
    """The chunks' first ``limit`` rows (every row: None), the last chunk sliced."""
    left = limit
    for chunk in chunks:
        if left is not None and left <= 0:
            return
        if left is not None and chunk.num_tokens > left:
            chunk = _slice(chunk, 0, left)
        if left is not None:
            left -= chunk.num_tokens
        yield chunk


def intervals(chunks: Iterator[TraceChunk], size: int | None) -> Iterator[list[TraceChunk]]:
    """The chunks in groups of ``size`` rows (the last may hold fewer; None: one group),
    chunks sliced at the boundaries."""
    if size is not None and size < 1:
        raise ValueError(f"interval_tokens={size} must be >= 1 token rows (or None)")
    group: list[TraceChunk] = []
    held = 0
    for chunk in chunks:
        while size is not None and held + chunk.num_tokens >= size:
            take = size - held
            group.append(_slice(chunk, 0, take))
            yield group
            group, held = [], 0
            chunk = _slice(chunk, take, chunk.num_tokens)
        if chunk.num_tokens:
            group.append(chunk)
            held += chunk.num_tokens
    if group:
        yield group


def _slice(chunk: TraceChunk, start: int, stop: int) -> TraceChunk:
    """Rows ``start:stop`` of a chunk."""
    cut = slice(start, stop)
    probs = None if chunk.probs is None else [p[cut] for p in chunk.probs]
    return TraceChunk(chunk.seq[cut], chunk.pos[cut], [e[cut] for e in chunk.experts], probs)
