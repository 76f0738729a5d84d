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
from moestack.kernels import host_tiered
from moestack.optim.tiered_backward import BackwardUpdate
from moestack.optim.tiered_bytes import assign_by_size, tensor_state_bytes
from moestack.optim.tiered_plan import STATE, KernelPlan, Native, Tally, count
from moestack.populations import MASTER, POPULATIONS, ParamInfo

log = logging.getLogger(__name__)

FORMAT = "moestack-tiered-1"
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
    state, and every rounding's bits are a hash of (seed, parameter, expert, step, element)
    (:mod:`moestack.kernels.host_tiered`), so a resumed run, or one at another layout, rounds
    bit for bit as the uninterrupted one. ``host_kernel``: step CPU tensors with the C++
    kernel where it loads (False: torch ops everywhere; the two give the same bits).
    ``update_in_backward``: :meth:`backward` steps each tensor as its gradient lands and frees
    that gradient (:mod:`moestack.optim.tiered_backward`; one process). ``offload``: the state
    of parameters off the CPU lives in (pinned) host memory, each tensor's copied to its
    device for its update and back (``optim.offload=cpu``).
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
        host_kernel: bool = True,
        update_in_backward: bool = False,
        offload: bool = False,
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
        self.reset_stats()
        self.host_kernel = host_kernel
        self.offload = offload
        self._plan: KernelPlan | None = None  # the kernel's descriptors, kept between steps
        self._owned_by: dict[tuple[Any, ...], list[tuple[Tensor, dict[str, Any]]]] = {}
        self._layouts: dict[tuple[Any, ...], tuple[int, int, int, int, bool]] = {}
        if update_in_backward and self._ranks()[1] > 1:
            raise ValueError(
                f"optim.update_in_backward=true steps one process's tensors in its backward, "
                f"not {self._ranks()[1]} ranks' shards; use optim.update_in_backward=false"
            )
        self._backward = BackwardUpdate(self) if update_in_backward else None

    # -- the layout -------------------------------------------------------------------------

    def _ranks(self) -> tuple[int, int]:
        """(this rank, number of ranks) of the state's process group; (0, 1) alone or
        unsharded (expert parallelism: each rank keeps the state of the tensors it holds)."""
        if not self.shard or not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _owned(self) -> list[tuple[Tensor, dict[str, Any]]]:
        """The ``(parameter, group)`` pairs whose state this rank keeps, in order (remembered
        while the rank and the groups' lists of parameters are the same)."""
        key = (self._ranks()[0], *((id(g["params"]), len(g["params"])) for g in self.param_groups))
        if key not in self._owned_by:
            self._owned_by = {key: [(p, group) for group in self.param_groups
                                    for p in group["params"] if self.owner[id(p)] == key[0]]}  # fmt: skip
        return self._owned_by[key]

    def owns(self, p: Tensor) -> bool:
        """Whether this rank keeps ``p``'s state and computes its update."""
        return self.owner[id(p)] == self._ranks()[0]

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every owned parameter with a gradient (the C++ kernel steps those on
        the CPU in one call, through a :class:`~moestack.optim.tiered_plan.KernelPlan` made at
        the first step and kept while it fits; torch ops the others, to the same bits), then
        (several ranks) every parameter's new weights broadcast from its owner."""
        loss = closure() if closure is not None else None
        if self._backward is not None and self._backward.stepped:
            self._backward.stepped = False  # its tensors stepped: their statistics are kept
        else:
            self.reset_stats()
        owned = self._owned()
        kernel = host_tiered.kernel_or_none() if self.host_kernel else None
        plan = self._plan
        if kernel is not None and plan is not None and plan.fits(self.seed, self.clip_update,
                                                                  self.state):  # fmt: skip
            plan.run(kernel)
            plan.tally(self._step_each(plan.rest, kernel)[0], self.stats)
        else:
            todo = [(p, group) for p, group in owned if p.grad is not None and p.numel()]
            tallies, native = self._step_each(todo, kernel)
            for tally in tallies:
                count(self.stats, tally)
            pops = [t[0] for t in tallies]
            self._plan = (KernelPlan(todo, owned, pops, native, self.state, self.seed,
                                     self.clip_update) if native else None)  # fmt: skip
        self._share_weights()
        self._reduce_stats()
        return loss

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``; with ``update_in_backward`` each tensor steps as its gradient
        lands (then ``step()`` steps only what is left: nothing, in a training step)."""
        if self._backward is None:
            loss.backward()
        else:
            self._backward.backward(loss)

    def reset_stats(self) -> None:
        """Start a step's statistics (each population's update RMS and clipped share)."""
        self.stats = {pop: dict.fromkeys(_STATS, 0.0) for pop in POPULATIONS}

    def _step_each(
        self, todo: list[tuple[Tensor, dict[str, Any]]], kernel: host_tiered.TieredKernel | None
    ) -> tuple[list[Tally], dict[int, Native]]:
        """Step ``todo`` (``(parameter, group)`` pairs): the kernel those it takes, in one call,
        torch ops the others. Returns each one's tally, in order, and what the kernel took, by
        position, for a plan (those whose job holds their own gradient: not a converted copy)."""
        jobs = [self._job(p, group) for p, group in todo]
        took = [kernel is not None and host_tiered.takes(j) for j in jobs]
        done = iter(kernel([j for j, n in zip(jobs, took, strict=True) if n]) if kernel else [])
        tallies: list[Tally] = []
        native = {}
        for i, ((p, group), job, on_host) in enumerate(zip(todo, jobs, took, strict=True)):
            name = self.names[id(p)]
            applied_sq, clipped = next(done) if on_host else _step_torch(job)
            tallies.append((self.info[name].population, applied_sq, clipped, job.w.numel(),
                            job.units))  # fmt: skip
            if on_host and job.g is p.grad:
                decay = group["weight_decay"] * self._layout(p, name, "row" in self.state[p])[4]
                ids = self._key_ids(name, job.units) if job.keys is not None else ()
                native[i] = Native(p, group, job, self.state[p], decay, ids)
        return tallies, native

    def _job(self, p: Tensor, group: dict[str, Any]) -> host_tiered.Job:
        """The documented update of one parameter (docs/optim.md, "Tiered state") as the
        kernels take it: its tensors, its layout (units: its experts, else itself) and its
        coefficients at its next step."""
        name = self.names[id(p)]
        st = self.state[p]
        if not st:
            self._init_state(p, group, st)
        st["step"] += 1
        t = st["step"]
        g = p.grad if p.grad.dtype in (torch.float32, torch.bfloat16) else p.grad.float()
        units, lead, rows, cols, decays = self._layout(p, name, "row" in st)
        coef = host_tiered.coefficients(
            group["lr"], group["betas"], group["eps"], t, group["weight_decay"] * decays,
            self.clip_update, "m" in st, rows, cols, p.numel() // units,
        )  # fmt: skip
        keys = None
        if self.master == "none" and p.dtype in (torch.float32, torch.bfloat16):
            keys = torch.tensor([host_tiered.unit_key(self.seed, n, e, t)
                                 for n, e in self._key_ids(name, units)],
                                dtype=torch.int32, device=p.device)  # fmt: skip
        return host_tiered.Job(
            p, g.contiguous(), st.get("m"), st.get("v"), st.get("row"), st.get("col"),
            st.get("master"), keys, units, lead, rows, cols, coef,
        )  # fmt: skip

    def _key_ids(self, name: str, units: int) -> tuple[tuple[str, int | None], ...]:
        """What each unit's noise key hashes besides the seed and step: the name and the
        expert's global id (None for a tensor that is one unit)."""
        if not self.info[name].stacked:
            return ((name, None),)
        offset = self.offsets.get(name, 0)
        return tuple((name, e + offset) for e in range(units))

    def _layout(self, p: Tensor, name: str, factored: bool) -> tuple[int, int, int, int, bool]:
        """(units, lead, rows, cols, decays) of ``p`` as host_tiered.Job takes them (its units:
        its experts, else itself); remembered (a step asks for every parameter's)."""
        key = (id(p), p.shape, factored)
        if key not in self._layouts:
            units = p.shape[0] if self.info[name].stacked else 1
            if factored:
                lead, rows, cols = math.prod(p.shape[:-2]), p.shape[-2], p.shape[-1]
            else:
                cols = p.shape[-1] if p.ndim else 1
                lead, rows = units, p.numel() // (units * cols)
            self._layouts[key] = (units, lead, rows, cols, p.ndim >= 2)
        return self._layouts[key]

    def _init_state(self, p: Tensor, group: dict[str, Any], st: dict[str, Any]) -> None:
        st["step"] = 0
        on = {"device": "cpu" if self.offload else p.device}  # made where it is kept
        if group["momentum"] != "none":
            st["m"] = p.new_zeros(p.shape, dtype=getattr(torch, group["momentum"]), **on)
        if group["second_moment"] == "factored" and p.ndim >= 2:
            st["row"] = p.new_zeros(p.shape[:-1], dtype=torch.float32, **on)
            st["col"] = p.new_zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32, **on)
        else:
            st["v"] = p.new_zeros(p.shape, dtype=torch.float32, **on)
        if self.master == "float32" and p.dtype != torch.float32:
            st["master"] = p.detach().float().to(on["device"]).contiguous()
        st.update({k: self._placed(v, p) for k, v in st.items() if isinstance(v, Tensor)})

    def _placed(self, t: Tensor, p: Tensor) -> Tensor:
        """State tensor ``t`` of ``p`` where it is kept: beside ``p``, or offloaded (``p`` off
        the CPU) in host memory, pinned where CUDA is."""
        if not self.offload or p.device.type == "cpu":
            return t.to(p.device)
        t = t.to("cpu")
        return t.pin_memory() if p.device.type == "cuda" else t

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
        self._plan = None
        for group in self.param_groups:
            for p in group["params"]:
                if self.owns(p):
                    name = self.names[id(p)]
                    stacked, offset = self.info[name].stacked, self.offsets.get(name, 0)
                    st = _from_entries(name, entries, p, stacked, offset)
                    if st is not None:
                        self.state[p] = {k: self._placed(v, p) if isinstance(v, Tensor) else v
                                         for k, v in st.items()}  # fmt: skip


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


def _step_torch(job: host_tiered.Job) -> tuple[float, float]:
    """``host_tiered.step_torch`` on the weights' device: state kept elsewhere (offloaded) is
    copied there for this tensor's update and back, so one tensor's is in flight at a time."""
    held = {k: getattr(job, k) for k in STATE if getattr(job, k) is not None}
    moved = {k: t.to(job.w.device) for k, t in held.items()}
    out = host_tiered.step_torch(job._replace(**moved))
    for k, t in held.items():
        if moved[k] is not t:
            t.copy_(moved[k])
    return out


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
            sizes[names[id(p)]] = (id(p), tensor_state_bytes(p.shape, rule, master, p.dtype))
    owner_of = assign_by_size({n: size for n, (_, size) in sizes.items()}, ranks[1])
    return {pid: owner_of[n] for n, (pid, _) in sizes.items()}
