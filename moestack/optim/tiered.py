"""TieredAdamW: optimizer state sized to each parameter population (``optim=tiered``).

Why: in an MoE most parameters are experts, and each expert sees a small share of the
tokens, so full Adam state (two fp32 moments and an fp32 master: 12 bytes a parameter) is
mostly spent where it buys least. Each population (:mod:`moestack.populations`) keeps
only the state its policy names: a first moment or none (fp32 or bf16), a full or a factored
second moment (Adafactor's row and column means of g^2, each expert's matrix factored on its
own). Updates can be RMS-clipped per matrix, and with ``master="none"`` bf16 weights take
each fp32 update by unbiased stochastic rounding, with no fp32 master copy.

The equations, and why each choice the published method leaves open is made as it is, are in
docs/optim.md ("Tiered state"); tests/optim/test_tiered.py checks them against a float64
reference written out in the test. With every population at ``momentum=float32,
second_moment=full`` and clipping off, the update is torch AdamW's.

Under ``torch.distributed`` (data parallel behind DDP, which averages the gradients), each
rank keeps the state of its own whole tensors only (ZeRO-1: assigned by state bytes, the same
on every rank) and broadcasts their new weights; ``state_dict`` is collective and
layout-free (keyed by name, stacked experts one by one), so any number of ranks loads it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moestack import seeding
from moestack.populations import MASTER, POPULATIONS, ParamInfo

log = logging.getLogger(__name__)

FORMAT = "moestack-tiered-1"
_TINY = 1e-30  # the factored estimate's denominator floor (an all-zero gradient history)
_STATS = ("sq_sum", "numel", "clipped", "units")


class TieredAdamW(torch.optim.Optimizer):
    """AdamW-style updates whose state each param group's policy sizes.

    ``params``: groups as :func:`tiered_groups` makes them, each with ``params`` a list of
    ``(name, tensor)`` pairs and the keys ``population``, ``momentum``, ``second_moment``,
    ``weight_decay`` and ``stacked`` (a set of the names whose dim 0 stacks experts).
    ``master``: ``"float32"`` keeps an fp32 copy of every parameter that is not fp32 (none is
    needed for an fp32 one); ``"none"`` keeps no precision beyond bf16: each update is
    stochastically rounded to bf16, into a bf16 parameter, or onto the bf16 grid of an fp32
    one (``param_dtype=float32``: bf16 weights computed in fp32, for a CPU). ``clip_update``: the RMS threshold of each
    matrix's update (each expert's on its own; 0 = off). ``seed``: the stochastic rounding's,
    drawn from torch's generator when None (so the run's seed fixes it); it is saved with the
    state, and every rounding draws from a generator keyed by (seed, parameter, expert, step),
    so a resumed run, or one at another layout, rounds bit for bit as the uninterrupted one.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        clip_update: float = 0.0,
        master: str = "none",
        seed: int | None = None,
        process_group: Any = None,
        shard: bool = True,
        expert_offsets: dict[str, int] | None = None,
    ) -> None:
        if master not in MASTER:
            raise ValueError(f"optim.master={master!r} is unknown; use one of {MASTER}")
        if clip_update < 0:
            raise ValueError(f"optim.clip_update={clip_update} must be >= 0 (0 = off)")
        groups = list(params)
        self.names = {id(p): n for g in groups for n, p in g["params"]}
        self.info = {
            n: ParamInfo(g["population"], n in g.get("stacked", ()))
            for g in groups
            for n, _ in g["params"]
        }
        for g in groups:
            g["params"] = [p for _, p in g["params"]]
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0}
        super().__init__(groups, defaults)
        self.clip_update = float(clip_update)
        self.master = master
        self.seed = seeding.draw_seed() if seed is None else int(seed)
        self.group = process_group
        self.shard = shard
        self.offsets = dict(expert_offsets or {})
        self.owner = _assign_owners(self.param_groups, self.names, self._ranks(), master)
        self.stats = {pop: dict.fromkeys(_STATS, 0.0) for pop in POPULATIONS}
        self._buffers: dict[torch.device, Tensor] = {}
        self._scratch_numel = max(
            (q.numel() for g in self.param_groups for q in g["params"]), default=0
        )

    # -- the layout -------------------------------------------------------------------------

    def _ranks(self) -> tuple[int, int]:
        """(this rank, number of ranks) of the state's process group; (0, 1) alone or
        unsharded (expert parallelism: each rank keeps the state of the tensors it holds)."""
        if not self.shard or not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def owns(self, p: Tensor) -> bool:
        """Whether this rank keeps ``p``'s state and computes its update."""
        return self.owner[id(p)] == self._ranks()[0]

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every owned parameter with a gradient, then (several ranks) every
        parameter's new weights broadcast from its owner."""
        loss = closure() if closure is not None else None
        self.stats = {pop: dict.fromkeys(_STATS, 0.0) for pop in POPULATIONS}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.numel() and self.owns(p):  # torch skips empty ones too
                    self._update(p, group)
        self._buffers.clear()  # transient: no scratch is kept between steps
        self._share_weights()
        self._reduce_stats()
        return loss

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        """The documented update of one parameter (docs/optim.md, "Tiered state"), in few
        passes over its elements, the update built in one scratch buffer reused by every
        parameter (no temporary of a parameter's size is allocated per step)."""
        name = self.names[id(p)]
        info = self.info[name]
        st = self.state[p]
        if not st:
            self._init_state(p, group, st)
        st["step"] += 1
        t = st["step"]
        beta1, beta2 = group["betas"]
        g = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
        u = _denominator(st, g, beta2, t, group["eps"], self._scratch(p))
        if "m" in st:
            m = st["m"].float().lerp_(g, 1 - beta1)
            if m.data_ptr() != st["m"].data_ptr():  # bf16 momentum: the update uses it as kept
                m = st["m"].copy_(m).float()
            torch.div(m, u, out=u).mul_(math.sqrt(1 - beta2**t) / (1 - beta1**t))
        else:
            torch.div(g, u, out=u).mul_(math.sqrt(1 - beta2**t))
        rms, factor = _rms_and_clip(u, self.clip_update, info.stacked)
        w = st["master"] if "master" in st else p.float()
        decay = group["weight_decay"] if p.ndim >= 2 else 0.0
        if decay:
            w.mul_(1 - group["lr"] * decay)
        if factor is None:
            w.add_(u, alpha=-group["lr"])
        else:
            w.addcmul_(u, factor.reciprocal().mul_(-group["lr"]))
        self._write(p, w, name, info, t)
        self._count(info, u, rms, factor)

    def _scratch(self, p: Tensor) -> Tensor:
        """An fp32 buffer of ``p``'s shape on its device, shared by every parameter during a
        step (the size of the largest parameter; freed when the step ends)."""
        buf = self._buffers.get(p.device)
        if buf is None:
            buf = torch.empty(self._scratch_numel, dtype=torch.float32, device=p.device)
            self._buffers[p.device] = buf
        return buf[: p.numel()].view(p.shape)

    def _init_state(self, p: Tensor, group: dict[str, Any], st: dict[str, Any]) -> None:
        st["step"] = 0
        if group["momentum"] != "none":
            st["m"] = torch.zeros_like(p, dtype=getattr(torch, group["momentum"]))
        if group["second_moment"] == "factored" and p.ndim >= 2:
            st["row"] = p.new_zeros(p.shape[:-1], dtype=torch.float32)
            st["col"] = p.new_zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32)
        else:
            st["v"] = torch.zeros_like(p, dtype=torch.float32)
        if self.master == "float32" and p.dtype != torch.float32:
            st["master"] = p.detach().float()

    def _write(self, p: Tensor, w: Tensor, name: str, info: ParamInfo, step: int) -> None:
        """``w`` (fp32) into ``p``: from a master copy (or as it is, an fp32 parameter with
        ``master="float32"``) rounded to nearest; without a master, stochastically rounded
        to bf16 precision, into bf16 storage or (fp32 storage, on a CPU where bf16 arithmetic
        is slow) onto the bf16 grid; each expert of a stacked tensor from a generator of its
        own, so the draws do not depend on the layout."""
        if self.master == "float32" or p.dtype not in (torch.float32, torch.bfloat16):
            if w.data_ptr() != p.data_ptr():
                p.copy_(w)
        else:  # w is this step's own fp32 copy of p (or p itself): rounded in place
            if not info.stacked:
                round_onto_bf16_grid_(w, self._noise_bits(w.shape, w.device, f"{name}@{step}"))
            for e in range(w.shape[0] if info.stacked else 0):
                expert = e + self.offsets.get(name, 0)  # its global id
                noise = self._noise_bits(w.shape[1:], w.device, f"{name}/expert{expert}@{step}")
                round_onto_bf16_grid_(w[e], noise)
            if w.data_ptr() != p.data_ptr():
                p.copy_(w)  # exact: w is on the bf16 grid

    def _noise_bits(self, shape: torch.Size, device: torch.device, key: str) -> Tensor:
        """16 random bits per element (int32), from a generator keyed by (seed, ``key``)."""
        seed = seeding.generator(self.seed, key).initial_seed()
        gen = torch.Generator(device).manual_seed(seed)
        return torch.empty(shape, dtype=torch.int32, device=device).random_(
            0, 1 << 16, generator=gen
        )

    def _share_weights(self) -> None:
        """Several ranks: every parameter's weights from the rank that updated them."""
        rank, world = self._ranks()
        if world == 1:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    src = (
                        dist.get_global_rank(self.group, self.owner[id(p)])
                        if self.group
                        else self.owner[id(p)]
                    )
                    dist.broadcast(p.data, src=src, group=self.group)

    # -- what it reports --------------------------------------------------------------------

    def _count(self, info: ParamInfo, u: Tensor, rms: Tensor, factor: Tensor | None) -> None:
        """Add one parameter's update (its matrices' RMS before clipping, ``rms``, and their
        clip factors) to its population's statistics."""
        s = self.stats[info.population]
        units = rms.numel()
        applied = rms if factor is None else rms / factor
        s["sq_sum"] += float(applied.double().square().sum()) * (u.numel() / units)
        s["numel"] += u.numel()
        s["clipped"] += 0 if factor is None else int((factor > 1).sum())
        s["units"] += units

    def _reduce_stats(self) -> None:
        if self._ranks()[1] == 1:
            return
        flat = torch.tensor(
            [self.stats[p][k] for p in POPULATIONS for k in _STATS], dtype=torch.float64
        )
        dist.all_reduce(flat, group=self.group)
        values = iter(flat.tolist())
        self.stats = {pop: {k: next(values) for k in _STATS} for pop in POPULATIONS}

    def state_bytes(self) -> dict[str, int]:
        """Bytes of state this rank keeps between steps, per population (moments, factors,
        master copies; a parameter not yet stepped holds none)."""
        out = dict.fromkeys(POPULATIONS, 0)
        for p, st in self.state.items():
            pop = self.info[self.names[id(p)]].population
            out[pop] += sum(
                t.numel() * t.element_size() for t in st.values() if isinstance(t, Tensor)
            )
        return out

    def metrics(self) -> dict[str, float]:
        """``optim/<population>/update_rms`` (of the last step's updates, before the learning
        rate), ``.../clipped`` (the share of its matrices clipped) and ``.../state_bytes`` (all
        ranks together), for each population the model has."""
        present = {info.population for info in self.info.values()}
        held = self.state_bytes()
        if self._ranks()[1] > 1:
            flat = torch.tensor([held[p] for p in POPULATIONS], dtype=torch.float64)
            dist.all_reduce(flat, group=self.group)
            held = dict(zip(POPULATIONS, (int(x) for x in flat.tolist()), strict=True))
        out: dict[str, float] = {}
        for pop in POPULATIONS:
            if pop not in present:
                continue
            s = self.stats[pop]
            out[f"optim/{pop}/update_rms"] = (
                math.sqrt(s["sq_sum"] / s["numel"]) if s["numel"] else 0.0
            )
            out[f"optim/{pop}/clipped"] = s["clipped"] / s["units"] if s["units"] else 0.0
            out[f"optim/{pop}/state_bytes"] = float(held[pop])
        return out

    # -- the checkpoint ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The layout-free state: ``{"format", "seed", "groups", "entries"}`` (groups: each
        population's learning rate as a schedule left it), entries keyed by
        parameter name (``name/expert<e>`` for each expert of a stacked tensor). Collective
        over the ranks holding shards (every rank returns the whole state)."""
        own: dict[str, dict[str, Any]] = {}
        for p, st in self.state.items():
            name = self.names[id(p)]
            offset = self.offsets.get(name, 0)
            own.update(_entries(name, st, self.info[name].stacked, offset))
        if self._ranks()[1] > 1:
            gathered: list[Any] = [None] * self._ranks()[1]
            dist.all_gather_object(gathered, own, group=self.group)
            own = {k: v for part in gathered for k, v in part.items()}
        groups = {g["population"]: _schedule_of(g) for g in self.param_groups}
        return {
            "format": FORMAT,
            "seed": self.seed,
            "groups": groups,
            "entries": dict(sorted(own.items())),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state saved by :meth:`state_dict` at any number of ranks: each rank takes
        the entries of the parameters it owns. Raises ValueError for a state of another
        optimizer or one missing a parameter this rank owns."""
        if state_dict.get("format") != FORMAT:
            raise ValueError(
                f"optimizer state of format {state_dict.get('format')!r} is not optim=tiered's "
                f"({FORMAT}); resume with the optimizer the run was trained with"
            )
        self.seed = int(state_dict["seed"])
        for group in self.param_groups:  # the learning rate a scheduler set, as torch restores it
            group.update(state_dict.get("groups", {}).get(group["population"], {}))
        entries = state_dict["entries"]
        self.state.clear()
        for group in self.param_groups:
            for p in group["params"]:
                if self.owns(p):
                    name = self.names[id(p)]
                    stacked, offset = self.info[name].stacked, self.offsets.get(name, 0)
                    st = _from_entries(name, entries, p, stacked, offset)
                    if st is not None:
                        self.state[p] = st


def tiered_groups(
    named: Iterable[tuple[str, Tensor]],
    info: dict[str, ParamInfo],
    policy: Callable[[str], Any],
    weight_decay: float,
) -> list[dict[str, Any]]:
    """One param group per population present in ``named`` (trainable ``(name, tensor)``
    pairs), each with the population's policy (``policy(population)``: a PopulationConfig)
    and decoupled weight decay (``policy.weight_decay``, else ``weight_decay``; matrices only)."""
    by_pop: dict[str, list[tuple[str, Tensor]]] = {}
    for name, p in named:
        by_pop.setdefault(info[name].population, []).append((name, p))
    groups = []
    for pop in POPULATIONS:
        if pop not in by_pop:
            continue
        rule = policy(pop)
        decay = weight_decay if rule.weight_decay is None else rule.weight_decay
        groups.append({
            "params": by_pop[pop],
            "population": pop,
            "momentum": rule.momentum,
            "second_moment": rule.second_moment,
            "weight_decay": float(decay),
            "stacked": {n for n, _ in by_pop[pop] if info[n].stacked},
        })  # fmt: skip
    return groups


def planned_state_bytes(
    named: Iterable[tuple[str, Tensor]],
    info: dict[str, ParamInfo],
    policy: Callable[[str], Any],
    master: str,
    param_dtype: torch.dtype,
) -> dict[str, int]:
    """The bytes of state :class:`TieredAdamW` keeps per population for the trainable
    ``(name, tensor)`` pairs once every one has stepped, from their shapes alone (meta
    tensors will do): what ``state_bytes`` counts, summed over the ranks."""
    out = dict.fromkeys(POPULATIONS, 0)
    for name, p in named:
        out[info[name].population] += _tensor_state_bytes(
            p.shape, policy(info[name].population), master, param_dtype
        )
    return out


def plan_rows(
    named: list[tuple[str, Tensor]],
    info: dict[str, ParamInfo],
    cfg: Any,
    param_dtype: torch.dtype,
    ranks: int,
) -> list[tuple[str, int, str]]:
    """The memory plan's rows ``(what, bytes, formula)`` for the trained ``named`` tensors
    under ``cfg`` (OptimConfig): each population's state on the most loaded of ``ranks``
    (the optimizer's own split, :func:`assign_by_size`), then what a step allocates."""
    sizes = {n: sum(planned_state_bytes([(n, p)], info, cfg.policy, cfg.master, param_dtype)
                    .values()) for n, p in named}  # fmt: skip
    owner = assign_by_size(sizes, ranks)
    load = [sum(size for n, size in sizes.items() if owner[n] == r) for r in range(ranks)]
    heaviest = load.index(max(load)) if load else 0
    shared = f"; the most loaded of {ranks} ranks (whole tensors)" if ranks > 1 else ""
    rows = []
    for population in POPULATIONS:
        size = sum(sizes[n] for n, _ in named
                   if info[n].population == population and owner[n] == heaviest)  # fmt: skip
        rule = cfg.policy(population)
        formula = (f"momentum {rule.momentum}, second moment {rule.second_moment} (1-D: full), "
                   f"master {cfg.master}{shared}")  # fmt: skip
        if size:
            rows.append((f"optimizer state (tiered, {population})", size, formula))
    step = planned_step_bytes(named, info, cfg.policy, cfg.master, param_dtype)
    rows.append(("optimizer scratch (tiered, during a step)", step,
                 "fp32 scratch of the largest tensor + the fp32 copies and rounding noise of "
                 "the one that needs most (freed when the step ends)"))  # fmt: skip
    return rows


def planned_step_bytes(
    named: Iterable[tuple[str, Tensor]],
    info: dict[str, ParamInfo],
    policy: Callable[[str], Any],
    master: str,
    param_dtype: torch.dtype,
) -> int:
    """The most bytes :class:`TieredAdamW` allocates during a step, freed by its end: the fp32
    scratch the size of the largest tensor, and for the tensor that needs most, the fp32
    copies of its gradient and (no master, narrower weights) of its weights, of a bf16
    momentum, and the stochastic rounding's noise (per expert of a stacked one); plus the
    row and column vectors of a factored estimate."""
    named = list(named)
    if not named:
        return 0
    extra = 0
    for name, p in named:
        numel, rule = math.prod(p.shape), policy(info[name].population)
        unit = numel // p.shape[0] if info[name].stacked and p.shape[0] else numel
        narrow = param_dtype != torch.float32
        size = 4 * numel if narrow else 0  # the gradient in fp32
        size += 4 * numel if rule.momentum == "bfloat16" else 0
        if master == "none":
            size += (4 * numel if narrow else 0) + 4 * unit  # weights in fp32; the noise
        extra = max(extra, size)
    vectors = max(16 * (math.prod(p.shape[:-1]) + math.prod(p.shape[:-2]) * p.shape[-1])
                  if len(p.shape) >= 2 else 0 for _, p in named)  # fmt: skip
    return 4 * max(math.prod(p.shape) for _, p in named) + extra + vectors


def _tensor_state_bytes(shape: torch.Size, rule: Any, master: str, param_dtype: torch.dtype) -> int:
    numel = math.prod(shape)
    size = 0 if rule.momentum == "none" else numel * getattr(torch, rule.momentum).itemsize
    if rule.second_moment == "factored" and len(shape) >= 2:
        lead = math.prod(shape[:-2])
        size += 4 * lead * (shape[-2] + shape[-1])
    else:
        size += 4 * numel
    if master == "float32" and param_dtype != torch.float32:
        size += 4 * numel
    return size


def stochastic_round_bf16(w: Tensor, noise: Tensor) -> Tensor:
    """fp32 ``w`` to bf16, rounded up in magnitude with probability equal to the dropped
    fraction: 16 random low bits (``noise``, int32 in [0, 2^16)) added to the bit pattern,
    then the low 16 bits cut. Unbiased: E[round(w)] = w. Non-finite values pass as they are."""
    return round_onto_bf16_grid_(w.clone(), noise).to(torch.bfloat16)


def round_onto_bf16_grid_(w: Tensor, noise: Tensor) -> Tensor:
    """:func:`stochastic_round_bf16` in place: contiguous fp32 ``w`` rounded onto the bf16
    grid (it stays fp32), with no temporary of its size (but a mask where a value is not
    finite); returns ``w``."""
    finite = bool(torch.isfinite(w.amax()) & torch.isfinite(w.amin()))  # no mask of its size
    bad = None if finite or w.numel() == 0 else ~torch.isfinite(w)
    kept = None if bad is None else w[bad]  # inf and nan pass as they are
    w.view(torch.int32).add_(noise).bitwise_and_(-65536)
    if bad is not None:
        w[bad] = kept
    return w


def _denominator(
    st: dict[str, Any], g: Tensor, beta2: float, t: int, eps: float, out: Tensor
) -> Tensor:
    """Update the second-moment state with ``g``; write ``sqrt(v) + eps * sqrt(1 - beta2^t)``
    into ``out`` and return it: ``sqrt(v_hat) + eps`` times ``sqrt(1 - beta2^t)`` (that scale
    is folded into the update's, as torch's AdamW folds it). ``v`` is the full estimate or
    the factored one, ``r_i c_j / mean(r)``, whose square root is taken of the row and
    column vectors only (``g^2`` is formed in ``out``, which the estimate then takes)."""
    eps_scaled = eps * math.sqrt(1 - beta2**t)
    if "v" in st:
        v = st["v"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        return torch.sqrt(v, out=out).add_(eps_scaled)
    row, col = st["row"], st["col"]
    sq = torch.mul(g, g, out=out)
    row.mul_(beta2).add_(sq.sum(dim=-1), alpha=(1 - beta2) / g.shape[-1])
    col.mul_(beta2).add_(sq.sum(dim=-2), alpha=(1 - beta2) / g.shape[-2])
    scale = row.mean(dim=-1, keepdim=True).clamp_min_(_TINY)
    a = (row / scale).sqrt_().view(-1, g.shape[-2], 1)
    b = col.sqrt().view(-1, 1, g.shape[-1])
    torch.bmm(a, b, out=out.view(-1, g.shape[-2], g.shape[-1]))  # the outer product r c
    return out.add_(eps_scaled)


def _rms_and_clip(u: Tensor, threshold: float, stacked: bool) -> tuple[Tensor, Tensor | None]:
    """Each matrix's (each expert's) RMS of ``u``, and with clipping on the factor (>= 1,
    broadcastable to ``u``) that brings it to at most ``threshold``; None with clipping off."""
    units = u.shape[0] if stacked else 1
    flat = u.view(units, -1)
    rms = torch.linalg.vector_norm(flat, dim=1).div_(math.sqrt(flat.shape[1]))
    rms = rms.view((units,) + (1,) * (u.ndim - 1) if stacked else (1,) * u.ndim)
    if threshold <= 0:
        return rms, None
    return rms, (rms / threshold).clamp_min_(1.0)


def _schedule_of(group: dict[str, Any]) -> dict[str, float]:
    """What a learning-rate schedule sets in a param group (restored with the state)."""
    return {k: float(group[k]) for k in ("lr", "initial_lr") if k in group}


def _entries(
    name: str, st: dict[str, Any], stacked: bool, offset: int = 0
) -> Iterator[tuple[str, dict[str, Any]]]:
    """A parameter's state as saved: one entry, or one per expert of a stacked tensor, keyed
    by its global id (``offset``: that of this rank's first expert)."""
    tensors = {k: v.detach().to("cpu", copy=True) for k, v in st.items() if isinstance(v, Tensor)}
    if not stacked:
        yield name, {"step": st["step"], **tensors}
        return
    for e in range(next(iter(tensors.values())).shape[0]):
        yield (
            f"{name}/expert{e + offset}",
            {"step": st["step"], **{k: v[e].clone() for k, v in tensors.items()}},
        )


def _from_entries(
    name: str, entries: dict[str, Any], p: Tensor, stacked: bool, offset: int = 0
) -> dict[str, Any] | None:
    """The state of ``p`` from saved entries (None: never stepped when saved)."""
    keys = [f"{name}/expert{offset + e}" for e in range(p.shape[0])] if stacked else [name]
    have = [k in entries for k in keys]
    if not any(have):
        return None
    if not all(have):
        missing = keys[have.index(False)]
        raise ValueError(
            f"optimizer state has no entry {missing!r}; it was saved for another model"
        )
    parts = [entries[k] for k in keys]
    st: dict[str, Any] = {"step": int(parts[0]["step"])}
    for k in (k for k in parts[0] if k != "step"):
        value = torch.stack([e[k] for e in parts]) if stacked else parts[0][k]
        st[k] = value.to(p.device)
    return st


def _assign_owners(
    groups: list[dict[str, Any]], names: dict[int, str], ranks: tuple[int, int], master: str
) -> dict[int, int]:
    """Each parameter's owning rank, balanced by the state it keeps
    (:func:`assign_by_size`), so every rank computes the same."""
    sizes = {}
    for g in groups:
        for p in g["params"]:
            rule = SimpleNamespace(momentum=g["momentum"], second_moment=g["second_moment"])
            sizes[names[id(p)]] = (id(p), _tensor_state_bytes(p.shape, rule, master, p.dtype))
    owner_of = assign_by_size({n: size for n, (_, size) in sizes.items()}, ranks[1])
    return {pid: owner_of[n] for n, (pid, _) in sizes.items()}


def assign_by_size(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Each name's rank: the largest first (ties by name), each to the least loaded rank
    (ties to the lowest): the ZeRO split of tiered's state, which the plan repeats."""
    load = [0] * world
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += sizes[name]
    return owner
