"""The experts' part of an optimizer state, saved by the ranks that own those experts.

Under expert parallelism a checkpoint's optimizer state is written in pieces: the *common*
part (every replicated parameter's state, the param groups) once, by rank 0, and the experts'
state by the ranks that hold them, one *part* per writing rank, so no rank ever gathers
another rank's experts. A part is a plain dict (``torch.load(weights_only=True)`` reads it):

- ``{"kind": "offload", "state": {"name/expert<e>": entry}}``: OffloadAdamW's entries
  (:mod:`moestack.optim.state_format`) of the experts the rank owns, ``e`` the global id;
- ``{"kind": "adamw", "rows": {name: [lo, hi]}, "state": {name: entry}}``: torch AdamW's
  entry of each expert tensor (``step``, ``exp_avg``, ``exp_avg_sq``), rows ``[lo, hi)``
  of the whole tensor (its experts ``lo`` to ``hi - 1``);
- ``{"kind": "offload_shard", "state": {name: entry}}``: a rank's ZeRO shard of
  OffloadAdamW's state of the replicated parameters, each entry flat with ``"elements":
  [a, b]``, the range of the flattened parameter it holds (sharded over every rank, this
  state too is written by the ranks that hold it: nothing is gathered);
- ``{"kind": "tiered", "entries": {"name/expert<e>": entry}}``: TieredAdamW's entries
  (:mod:`moestack.optim.tiered`) of the experts the rank holds, ``e`` the global id.

:func:`merge` turns the common part and any parts back into one state in the optimizer's
own format, with the rows a reader holds: whole tensors for one process, a rank's block
under expert parallelism, so a state saved at one layout loads at any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from moestack.optim import state_format
from moestack.optim.tiered import FORMAT as TIERED_FORMAT

OFFLOAD = "offload"
ADAMW = "adamw"
OFFLOAD_SHARD = "offload_shard"
TIERED = "tiered"
_KINDS = (OFFLOAD, ADAMW, OFFLOAD_SHARD, TIERED)

Rows = tuple[int, int]


def offload_part(entries: dict[str, Any]) -> dict[str, Any]:
    """A part holding OffloadAdamW entries keyed ``name/expert<global id>``."""
    return {"kind": OFFLOAD, "state": entries}


def shard_part(entries: dict[str, Any]) -> dict[str, Any]:
    """A part holding a rank's pieces of OffloadAdamW's replicated parameters' state
    (:func:`moestack.optim.state_format.pack_own_shard`)."""
    return {"kind": OFFLOAD_SHARD, "state": entries}


def tiered_part(entries: dict[str, Any]) -> dict[str, Any]:
    """A part holding TieredAdamW entries keyed ``name/expert<global id>``."""
    return {"kind": TIERED, "entries": entries}


def adamw_part(entries: dict[str, dict[str, Any]], rows: dict[str, Rows]) -> dict[str, Any]:
    """A part holding torch AdamW's entry of each expert tensor ``name`` (its rows
    ``rows[name]`` of the whole tensor)."""
    return {"kind": ADAMW, "rows": {n: list(r) for n, r in rows.items()}, "state": entries}


def merge(
    common: dict[str, Any],
    parts: Sequence[dict[str, Any]],
    names: Sequence[str] | None = None,
    rows_of: Callable[[str], Rows | None] = lambda name: None,
    numel_of: Callable[[str], int | None] = lambda name: None,
) -> dict[str, Any]:
    """One state in the optimizer's own format from the ``common`` part and ``parts``.

    TieredAdamW's (its format key): the parts' expert entries are added as they are (it
    loads the entries of the tensors it holds). OffloadAdamW's (its format key): the parts'
    expert entries are added as they are (the optimizer keeps the experts it owns), the shard parts' pieces joined into
    each parameter's flat entry (``numel_of(name)``: its elements, to refuse a missing
    piece; None: not checked). torch AdamW's: ``names`` are the parameter
    names in the optimizer's order (torch keys its state by position); each expert tensor's
    entry is assembled from the parts' rows, the rows ``rows_of(name)`` (None: all of them).
    Raises ValueError naming a part of another kind or an expert the parts do not hold."""
    for part in parts:
        if part.get("kind") not in _KINDS:
            raise ValueError(f"optimizer part of kind {part.get('kind')!r}, not one of {_KINDS}")
    if common.get("format") == state_format.FORMAT:
        return _merge_offload(common, parts, numel_of)
    if common.get("format") == TIERED_FORMAT:  # layout-free: the parts' entries joined
        entries = dict(common["entries"])
        for part in parts:
            _check_kind(part, TIERED)
            entries.update(part["entries"])
        return {**common, "entries": dict(sorted(entries.items()))}
    if names is None:
        raise ValueError("merging torch AdamW parts needs the parameter names in order")
    return _merge_adamw(common, parts, names, rows_of)


def _merge_offload(
    common: dict[str, Any],
    parts: Sequence[dict[str, Any]],
    numel_of: Callable[[str], int | None],
) -> dict[str, Any]:
    state = dict(common["state"])
    pieces: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for part in parts:
        if part["kind"] == OFFLOAD_SHARD:
            for name, entry in part["state"].items():
                a, b = entry["elements"]
                rest = {k: v for k, v in entry.items() if k != "elements"}
                pieces.setdefault(name, []).append((int(a), int(b), rest))
            continue
        _check_kind(part, OFFLOAD)
        state.update(part["state"])
    for name, held in pieces.items():
        held.sort(key=lambda piece: piece[0])
        numel = numel_of(name)
        want = (0, numel if numel is not None else max(b for _, b, _ in held))
        state[name] = _entry_rows(name, held, want, what="elements")
    return {**common, "state": state}


def _merge_adamw(
    common: dict[str, Any],
    parts: Sequence[dict[str, Any]],
    names: Sequence[str],
    rows_of: Callable[[str], Rows | None],
) -> dict[str, Any]:
    held: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for part in parts:
        _check_kind(part, ADAMW)
        for name, entry in part["state"].items():
            lo, hi = part["rows"][name]
            held.setdefault(name, []).append((int(lo), int(hi), entry))
    position = {name: i for i, name in enumerate(names)}
    state = dict(common["state"])
    for name, pieces in held.items():
        if name not in position:
            raise ValueError(f"optimizer part holds {name!r}, which this optimizer does not")
        pieces.sort(key=lambda piece: piece[0])
        state[position[name]] = _entry_rows(name, pieces, rows_of(name))
    return {**common, "state": state}


def _entry_rows(
    name: str,
    pieces: list[tuple[int, int, dict[str, Any]]],
    want: Rows | None,
    what: str = "experts",
) -> dict[str, Any]:
    """The entry of ``name`` over rows ``want`` (None: all the pieces hold), cut and joined
    from the pieces (each only as far as it is read: a memory-mapped part stays on disk);
    ``what`` the rows are, for the error naming a missing piece."""
    lo, hi = want if want is not None else (pieces[0][0], max(p[1] for p in pieces))
    entry: dict[str, Any] = {}
    covered, gap_end = lo, hi
    for plo, phi, piece in pieces:
        a, b = max(lo, plo, covered), min(hi, phi)
        if a >= b:
            continue
        if a != covered:  # rows covered..a - 1 are in no piece
            gap_end = a
            break
        for key, value in piece.items():
            if key == "step":
                entry["step"] = value.clone() if isinstance(value, Tensor) else value
            else:
                entry.setdefault(key, []).append(value[a - plo : b - plo])
        covered = b
    if covered != hi:
        raise ValueError(
            f"the checkpoint's optimizer parts do not hold {what} {covered}..{gap_end - 1} of "
            f"{name!r}: a rank's file is missing"
        )
    return {k: v if k == "step" else torch.cat(v).clone() for k, v in entry.items()}


def _check_kind(part: dict[str, Any], kind: str) -> None:
    if part["kind"] != kind:
        raise ValueError(
            f"an optimizer part of kind {part['kind']!r} beside a {kind!r} state: the "
            "checkpoint was written by another optimizer; resume with its optim.name"
        )
