"""The state_dict format of OffloadAdamW: name-keyed, stacked experts stored one by one.

Format: ``{"format", "version", "param_groups": [{hyper-params..., "params": [names]}],
"state": {key: {"step": int, "exp_avg", "exp_avg_sq"[, "master"]}}}`` where key is the
parameter name, or ``name/expert<e>`` for stacked expert tensors (``"layers.0.moe.w1/expert3"``),
so a state saved with N ranks loads with M ranks. ``master`` is stored only for parameters
whose dtype is not fp32. The dict holds only tensors, numbers, strings, lists and dicts, so
``torch.load(path, weights_only=True)`` reads it.

The functions here turn the flat host buffers of a :class:`~moestack.optim.plan.ShardPlan`
into entries and back; gathering the shards of other ranks is the optimizer's business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from moestack.optim.plan import ShardPlan, Unit

FORMAT = "moestack.optim.OffloadAdamW"
FORMAT_VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")

Entries = list[tuple[str, list[int]]]  # (checkpoint key, indices of the units it covers)


def entry_keys(plan: ShardPlan, pidx: int, name: str, is_expert: bool) -> Entries:
    """Checkpoint keys of parameter ``pidx`` and the indices of the units each one covers."""
    ks = plan.unit_ids(pidx)
    if is_expert:
        return [(f"{name}/expert{plan.units[k].row0}", [k]) for k in ks]
    return [(name, ks)]


def assemble(groups: list[dict[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    """The full state dict from its saved groups and entries."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "param_groups": groups, "state": state}


def pack_entries(
    plan: ShardPlan,
    entries: Entries,
    shape: Sequence[int],
    step: int,
    buffers: dict[str, Tensor],
) -> dict[str, dict[str, Any]]:
    """The entries of one parameter, cut from gathered buffers (``[num_shards * stride]``).

    ``buffers`` maps entry names (``exp_avg``, ``exp_avg_sq`` and optionally ``master``) to
    buffers; ``shape`` is one entry's shape (one expert's for stacked expert tensors).
    """
    stride = plan.stride if plan.num_shards > 1 else 0
    out: dict[str, dict[str, Any]] = {}
    for key, ks in entries:
        spans = [
            (plan.units[k].shard * stride + plan.units[k].off, plan.units[k].numel) for k in ks
        ]
        entry: dict[str, Any] = {"step": step}
        for name, buf in buffers.items():
            entry[name] = torch.cat([buf[a : a + n] for a, n in spans]).clone().view(list(shape))
        out[key] = entry
    return out


def pack_state(
    plan: ShardPlan,
    params: Sequence[Tensor],
    names: Sequence[str],
    is_expert: Sequence[bool],
    steps: Sequence[int],
    gathered: dict[str, Tensor | None],
) -> dict[str, dict[str, Any]]:
    """The ``state`` of the dict: entries of every parameter stepped at least once.

    ``gathered`` maps ``exp_avg``, ``exp_avg_sq`` and ``master`` (None without a master
    copy) to full gathered buffers; master weights are stored for non-fp32 parameters only.
    """
    state: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(params):
        if steps[i] == 0:
            continue
        buffers = saved_buffers(gathered, p)
        shape = p.shape[1:] if is_expert[i] else p.shape
        entries = entry_keys(plan, i, names[i], is_expert[i])
        state.update(pack_entries(plan, entries, shape, steps[i], buffers))
    return state


def pack_own_experts(
    plan: ShardPlan,
    params: Sequence[Tensor],
    names: Sequence[str],
    is_expert: Sequence[bool],
    steps: Sequence[int],
    local: dict[str, Tensor | None],
) -> dict[str, dict[str, Any]]:
    """The entries of the expert units in this rank's shard (``plan.my_shard``), cut from its
    own buffers ``local`` (as :func:`pack_state`'s ``gathered``, unsharded): one entry per
    expert, keyed ``name/expert<local id>``."""
    state: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(params):
        if not is_expert[i] or steps[i] == 0:
            continue
        buffers = saved_buffers(local, p)
        for key, ks in entry_keys(plan, i, names[i], True):
            u = plan.units[ks[0]]
            if u.shard != plan.my_shard:
                continue
            entry: dict[str, Any] = {"step": steps[i]}
            for n, buf in buffers.items():
                entry[n] = buf[u.off : u.off + u.numel].clone().view(list(p.shape[1:]))
            state[key] = entry
    return state


def pack_own_shard(
    plan: ShardPlan,
    params: Sequence[Tensor],
    names: Sequence[str],
    is_expert: Sequence[bool],
    steps: Sequence[int],
    local: dict[str, Tensor | None],
) -> dict[str, dict[str, Any]]:
    """The pieces of the non-expert parameters in this rank's shard, cut from its own
    buffers ``local`` (as :func:`pack_own_experts`'): one entry per parameter, flat, with
    ``"elements": [a, b]``, the range of the flattened parameter it holds (a rank's units of
    a parameter are consecutive rows, so one range)."""
    state: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(params):
        if is_expert[i] or steps[i] == 0:
            continue
        mine = [u for u in (plan.units[k] for k in plan.unit_ids(i)) if u.shard == plan.my_shard]
        if not mine:
            continue
        a, n, off = mine[0].start, sum(u.numel for u in mine), mine[0].off
        entry: dict[str, Any] = {"step": steps[i], "elements": [a, a + n]}
        for name, buf in saved_buffers(local, p).items():
            entry[name] = buf[off : off + n].clone()
        state[names[i]] = entry
    return state


def saved_buffers(buffers: dict[str, Tensor | None], p: Tensor) -> dict[str, Tensor]:
    """The buffers an entry of parameter ``p`` holds: those kept, but the master weights of
    an fp32 parameter (they are the parameter)."""
    return {
        n: buf
        for n, buf in buffers.items()
        if buf is not None and not (n == "master" and p.dtype == torch.float32)
    }


def unpack_param(
    plan: ShardPlan,
    state: dict[str, Any],
    pidx: int,
    name: str,
    is_expert: bool,
    targets: dict[str, Tensor],
) -> tuple[int, bool] | None:
    """Copy this rank's part of parameter ``pidx``'s saved entries into ``targets``.

    Returns ``(step, has_master)``, or None when the state holds nothing for the parameter:
    its moments are then zeroed. See :func:`unpack_entry` for ``targets``.
    """
    entries = entry_keys(plan, pidx, name, is_expert)
    saved = find_entries(state, entries, name)
    if saved is None:
        for k in plan.my_units:
            u = plan.units[k]
            if u.pidx == pidx:
                for n in MOMENTS:
                    targets[n][u.off : u.off + u.numel].zero_()
        return None
    has_master = False
    for entry, (_, ks) in zip(saved, entries, strict=True):
        units = [plan.units[k] for k in ks]
        has_master = unpack_entry(entry, units, plan.my_shard, targets)
    return int(saved[0]["step"]), has_master


def find_entries(state: dict[str, Any], entries: Entries, name: str) -> list[dict[str, Any]] | None:
    """The saved entries of one parameter, or None when the state has none of them.

    Raises ValueError when only some are there (a stacked tensor with a different number
    of experts).
    """
    have = [key in state for key, _ in entries]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(
            f"checkpoint has only some experts of {name!r}; "
            "was it saved with a different number of experts?"
        )
    return [state[key] for key, _ in entries]


def unpack_entry(
    entry: dict[str, Any], units: Sequence[Unit], my_shard: int, targets: dict[str, Tensor]
) -> bool:
    """Copy this rank's units of one saved entry into ``targets`` (flat shard buffers).

    ``targets`` maps ``exp_avg``, ``exp_avg_sq`` and, where a master copy is kept,
    ``master`` to the rank's buffers. Returns whether the entry holds master weights.
    """
    flat = {n: entry[n].reshape(-1) for n in (*MOMENTS, "master") if n in entry}
    has_master = "master" in flat
    copies = {n: buf for n, buf in targets.items() if n in MOMENTS or has_master}
    pos = 0
    for u in units:
        if u.shard == my_shard:
            sl = slice(u.off, u.off + u.numel)
            for n, buf in copies.items():
                buf[sl].copy_(flat[n][pos : pos + u.numel])
        pos += u.numel
    return has_master


def check_format(state_dict: dict[str, Any]) -> None:
    """Raise ValueError unless ``state_dict`` is in this format (not a torch optimizer's)."""
    if state_dict.get("format") != FORMAT:
        raise ValueError(
            f"not an OffloadAdamW state (format={state_dict.get('format')!r}); torch "
            "optimizer states are keyed by index and cannot be mapped onto names"
        )


def save_groups(
    param_groups: list[dict[str, Any]], name_of: Callable[[Tensor], str]
) -> list[dict[str, Any]]:
    """The param groups as plain values, their tensors replaced by parameter names."""
    groups = []
    for group in param_groups:
        g = {k: _plain(v) for k, v in group.items() if k not in ("params", "param_names")}
        g["params"] = [name_of(p) for p in group["params"]]
        groups.append(g)
    return groups


def restore_groups(
    saved: list[dict[str, Any]],
    param_groups: list[dict[str, Any]],
    name_of: Callable[[Tensor], str],
) -> None:
    """Check the saved groups name the same parameters; set their hyper-parameters."""
    if len(saved) != len(param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved)} param groups, this optimizer "
            f"{len(param_groups)}; build it with the same grouping"
        )
    for old, group in zip(saved, param_groups, strict=True):
        names = [name_of(p) for p in group["params"]]
        if list(old["params"]) != names:
            missing = sorted(set(names) ^ set(old["params"]))[:5]
            raise ValueError(f"param names differ from the checkpoint's, e.g. {missing}")
        for k, val in old.items():
            if k != "params":
                group[k] = tuple(val) if k == "betas" else val


def _plain(value: Any) -> Any:
    """Hyper-parameter values as weights_only-loadable plain objects (tuples -> lists)."""
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 else value.detach().cpu().clone()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
