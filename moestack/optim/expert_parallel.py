"""The optimizers of an expert-parallel run: torch AdamW's, OffloadAdamW's and TieredAdamW's,
each one :class:`~moestack.optim.container.TrainingOptimizer` to the loop.

Replicated parameters (attention, embeddings, routers, norms) are shared by all ranks, so
their gradients are averaged over the whole world; each rank's experts are shared only by the
ranks holding the same experts (the expert data-parallel group), so theirs are averaged over
that group. The global gradient norm counts each expert once. Both save one state in the
layout-free format of their optimizer, so a checkpoint written at any ``(dp, ep)`` layout
loads at any other, and into the same optimizer on one process:

- :class:`ExpertParallelAdamW`: one torch AdamW over this rank's parameters (its own experts
  only); it averages the gradients itself (``parallel.average_gradients``) and saves AdamW's
  state with every expert tensor's moments whole, as one process would.
- :class:`ExpertParallelOffload`: two OffloadAdamW, the replicated parameters' over the world
  and the experts' over their group, so a rank keeps host state only for its own experts'
  shard; it saves OffloadAdamW's own format (name-keyed, experts one by one, with global
  expert ids).
- :class:`ExpertParallelTiered`: one TieredAdamW over this rank's parameters, averaged as
  torch AdamW's; it saves TieredAdamW's own format (name-keyed, experts by global id).

A checkpoint takes ``sharded_state_dict``: the common state rank 0 writes and the parts each
rank writes of the experts it owns (:mod:`moestack.optim.expert_state`), nothing gathered.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moestack import parallel
from moestack.optim import expert_state, state_format
from moestack.optim.container import SingleOptimizer, TrainingOptimizer, names_in_order
from moestack.optim.offload import OffloadAdamW
from moestack.optim.tiered import TieredAdamW
from moestack.parallel import ExpertParallelMesh, expert_blocks

_EXPERT_KEY = re.compile(r"^(?P<name>.+)/expert(?P<e>\d+)$")


class ExpertParallelAdamW(SingleOptimizer):
    """torch AdamW over this rank's parameters under expert parallelism.

    The gradients are averaged once between two ``zero_grad`` calls, at the first
    ``clip_grad_norm`` or ``step``: backward exchanges none (so ``no_sync`` has nothing to
    skip). ``state_dict`` is AdamW's with whole expert tensors (collective over the EP
    group); ``load_state_dict`` takes such a state, saved at any layout.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        super().__init__(optimizer, model)
        self._averaged = False  # the gradients since the last zero_grad are averaged

    def _average_gradients(self) -> None:
        if not self._averaged:
            parallel.average_gradients(self.model)
            self._averaged = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._average_gradients()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._averaged = False

    def _clip(self, max_norm: float) -> float:
        self._average_gradients()
        return parallel.clip_grad_norm(self.model, max_norm)

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state with every expert tensor's moments gathered whole (collective), as
        a single process would save it."""
        return self._map_expert_state(
            super().state_dict(), lambda t, block: parallel.gather_rows(t, block.mesh)
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole AdamW state (saved at any layout), cut to this rank's experts."""
        local = self._map_expert_state(state_dict, lambda t, block: t[block.lo : block.hi].clone())
        super().load_state_dict(local)

    def sharded_state_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """AdamW's state without the experts' entries (the same on every rank: rank 0
        writes it) and, on the first replica of each expert block (``dp_rank`` 0), its
        experts' entries with their rows; nothing is exchanged."""
        local = self.optimizer.state_dict()
        blocks = self._blocks_by_position()
        common = {
            **local,
            "state": {i: e for i, e in local["state"].items() if int(i) not in blocks},
        }
        if self._mesh.dp_rank != 0:
            return common, []
        names = self._names()
        own = {names[i]: local["state"][i] for i in blocks if i in local["state"]}
        rows = {names[i]: (b.lo, b.hi) for i, b in blocks.items() if names[i] in own}
        return common, [expert_state.adamw_part(own, rows)]

    def load_sharded_state_dict(
        self, common: dict[str, Any], parts: Sequence[dict[str, Any]]
    ) -> None:
        """Load the common part and the parts holding this rank's experts (any layout),
        reading only this rank's rows of them."""
        if not parts:  # a whole state (written without parts)
            self.load_state_dict(common)
            return
        names = self._names()
        rows = {names[i]: (b.lo, b.hi) for i, b in self._blocks_by_position().items()}
        super().load_state_dict(expert_state.merge(common, parts, names, rows.get))

    @property
    def _mesh(self) -> ExpertParallelMesh:
        return expert_blocks(self.model)[0].mesh

    def _names(self) -> list[str]:
        return names_in_order(self.param_groups, self.model)

    def _blocks_by_position(self) -> dict[int, parallel.ExpertBlock]:
        """The expert block of each expert parameter, by its position in ``param_groups``."""
        where = {id(b.param): b for b in expert_blocks(self.model)}
        position = [id(p) for g in self.param_groups for p in g["params"]]
        return {i: where[pid] for i, pid in enumerate(position) if pid in where}

    def _map_expert_state(
        self, state: dict[str, Any], fn: Callable[[Tensor, parallel.ExpertBlock], Tensor]
    ) -> dict[str, Any]:
        """``state`` with ``fn(tensor, block)`` applied to the moments of expert parameters
        (torch keys its state by a parameter's position in ``param_groups``)."""
        where = {id(b.param): b for b in expert_blocks(self.model)}
        position = [id(p) for g in self.param_groups for p in g["params"]]
        out = {"param_groups": state["param_groups"], "state": dict(state["state"])}
        for idx, entry in state["state"].items():
            block = where.get(position[int(idx)])
            if block is not None:
                out["state"][idx] = {
                    k: v if k == "step" else fn(v, block) for k, v in entry.items()
                }
        return out


class ExpertParallelTiered(ExpertParallelAdamW):
    """TieredAdamW over this rank's parameters under expert parallelism: each rank keeps
    the state of the tensors it holds (its own experts' and the replicated ones'), the
    gradients averaged as for torch AdamW. Its state is layout-free already (experts keyed
    by global id): ``state_dict`` gathers every rank's entries into the whole state
    (collective), ``sharded_state_dict`` leaves each rank's experts with it (a checkpoint's
    rank files), and any layout, one process included, loads the entries it holds."""

    optimizer: TieredAdamW

    def state_dict(self) -> dict[str, Any]:
        local = self.optimizer.state_dict()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local["entries"])
        entries = {k: v for part in gathered for k, v in part.items()}  # replicated: the same
        return {**local, "entries": dict(sorted(entries.items()))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def sharded_state_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The replicated tensors' entries (the same on every rank: rank 0 writes them) and,
        on the first replica of each expert block (``dp_rank`` 0), its experts' entries
        (keyed by global id); nothing is exchanged."""
        local = self.optimizer.state_dict()
        sharded = self.optimizer.offsets  # the sharded tensors' names -> their first global id
        experts = {
            k: v for k, v in local["entries"].items()
            if (m := _EXPERT_KEY.match(k)) and m["name"] in sharded
        }  # fmt: skip
        common = {**local, "entries": {k: v for k, v in local["entries"].items()
                                       if k not in experts}}  # fmt: skip
        own = [expert_state.tiered_part(experts)] if self._mesh.dp_rank == 0 else []
        return common, own

    def load_sharded_state_dict(
        self, common: dict[str, Any], parts: Sequence[dict[str, Any]]
    ) -> None:
        """Load the common part and the parts holding this rank's experts (any layout)."""
        self.optimizer.load_state_dict(expert_state.merge(common, parts))

    def metrics(self) -> dict[str, float]:
        return self.optimizer.metrics()


class ExpertParallelOffload(TrainingOptimizer):
    """Two OffloadAdamW behind the one interface the loop uses.

    ``param_groups`` are the replicated optimizer's (the LR scheduler sets them; each step
    copies their hyper-parameters to the experts' groups, so both always agree).
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        model: nn.Module,
        mesh: ExpertParallelMesh,
        make: Callable[[list[dict[str, Any]], Any], OffloadAdamW],
    ) -> None:
        self.mesh = mesh
        self.slots = expert_slots(model)  # sharded expert tensor name -> (first id, count)
        self.group_names = [[name for name, _ in g["params"]] for g in groups]
        self.replicated = make(_split(groups, self.slots, experts=False), None)
        expert_groups = _split(groups, self.slots, experts=True)
        # the experts' optimizer holds only the groups with experts (torch refuses an empty
        # group among named ones); group_of_expert_group[i] is its group i's index in ours
        self.group_of_expert_group = [i for i, g in enumerate(expert_groups) if g["params"]]
        expert_groups = [expert_groups[i] for i in self.group_of_expert_group]
        self.experts = make(expert_groups, mesh.expert_dp_group) if expert_groups else None
        self.forward_model = model
        self.defaults = self.replicated.defaults
        self.state: dict[Any, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.replicated.param_groups

    @property
    def _parts(self) -> list[OffloadAdamW]:
        return [o for o in (self.replicated, self.experts) if o is not None]

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("ExpertParallelOffload.step takes no closure")
        if self.experts is not None:
            for mine, i in zip(self.experts.param_groups, self.group_of_expert_group, strict=True):
                theirs = self.param_groups[i]
                mine.update({k: v for k, v in theirs.items() if k not in ("params", "param_names")})
        for part in self._parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self._parts:
            part.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Apply both parts' delayed updates in flight (``optim.update_delay``)."""
        for part in self._parts:
            part.synchronize()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self._parts:
                stack.enter_context(part.no_sync())
            yield

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip to the global 2-norm, each expert counted once: the replicated norm (equal
        on every rank) and the experts' norms summed over the EP group."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported; OffloadAdamW clips 2-norms")
        replicated = float(self.replicated.grad_norm()) ** 2
        own = float(self.experts.grad_norm()) ** 2 if self.experts is not None else 0.0
        squares = torch.tensor([replicated, own], dtype=torch.float64)
        total = parallel.global_grad_norm(squares, self.mesh).to(torch.float32)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for part in self._parts:
            part.scale_grads(coef)
        return total

    def _clip(self, max_norm: float) -> float:
        return float(self.clip_grad_norm_(max_norm))

    # ------------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """One OffloadAdamW state for the whole model (collective over all ranks)."""
        merged = self.replicated.state_dict()
        own = {}
        if self.experts is not None:
            for key, entry in self.experts.state_dict()["state"].items():
                name, e = _split_key(key)
                own[f"{name}/expert{e + self.slots[name][0]}"] = entry
        gathered: list[Any] = [None] * self.mesh.ep
        dist.all_gather_object(gathered, own, group=self.mesh.ep_group)
        for entries in gathered:
            merged["state"].update(entries)
        for group, names in zip(merged["param_groups"], self.group_names, strict=True):
            group["params"] = list(names)
        return merged

    def sharded_state_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The param groups (every parameter named), and this rank's parts: its own expert
        entries (global ids) and its ZeRO shard of the replicated parameters' state. Not
        collective: no state leaves its rank."""
        common = self.replicated.groups_state()
        for group, names in zip(common["param_groups"], self.group_names, strict=True):
            group["params"] = list(names)
        own, shard = self._own_expert_entries(), self.replicated.own_shard_state()
        parts = [expert_state.offload_part(own)] if own else []
        return common, parts + ([expert_state.shard_part(shard)] if shard else [])

    def load_sharded_state_dict(
        self, common: dict[str, Any], parts: Sequence[dict[str, Any]]
    ) -> None:
        """Load the common part, the replicated state's shard parts and the parts holding
        this rank's experts (saved at any layout)."""
        numel = {n: p.numel() for n, p in self.forward_model.named_parameters()}
        self.load_state_dict(expert_state.merge(common, parts, numel_of=numel.get))

    def _own_expert_entries(self) -> dict[str, Any]:
        """This rank's expert entries, keyed by global expert id."""
        if self.experts is None:
            return {}
        own = {}
        for key, entry in self.experts.own_expert_state().items():
            name, e = _split_key(key)
            own[f"{name}/expert{e + self.slots[name][0]}"] = entry
        return own

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole-model OffloadAdamW state saved at any layout; keep this rank's part."""
        state_format.check_format(state_dict)
        self.replicated.load_state_dict(self._replicated_part(state_dict))
        if self.experts is not None:
            self.experts.load_state_dict(self._expert_part(state_dict))

    def _replicated_part(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        names = {n for g in self.group_names for n in g} - set(self.slots)
        state = {k: v for k, v in state_dict["state"].items() if _split_key(k)[0] in names}
        return _with(state_dict, state, lambda n: n in names)

    def _expert_part(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        state = {}
        for key, entry in state_dict["state"].items():
            name, e = _split_key(key)
            if name in self.slots:
                first, count = self.slots[name]
                if e is None:
                    raise ValueError(
                        f"optimizer state {key!r}: expert tensors are saved per expert"
                    )
                if first <= e < first + count:
                    state[f"{name}/expert{e - first}"] = entry
        part = _with(state_dict, state, lambda n: n in self.slots)
        part["param_groups"] = [part["param_groups"][i] for i in self.group_of_expert_group]
        return part


def expert_slots(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Name of every sharded expert tensor -> (global id of its first expert here, count)."""
    owner = {id(b.param): (b.lo, b.hi - b.lo) for b in expert_blocks(model)}
    return {n: owner[id(p)] for n, p in model.named_parameters() if id(p) in owner}


def _split(groups: list[dict[str, Any]], slots: dict[str, Any], experts: bool) -> list[dict]:
    """The param groups with only the expert tensors (``experts``) or only the others."""
    return [
        dict(g, params=[(n, p) for n, p in g["params"] if (n in slots) == experts]) for g in groups
    ]


def _split_key(key: str) -> tuple[str, int | None]:
    """``"name/expert3"`` -> ("name", 3); ``"name"`` -> ("name", None)."""
    match = _EXPERT_KEY.match(key)
    return (match["name"], int(match["e"])) if match else (key, None)


def _with(state_dict: dict[str, Any], state: dict[str, Any], keep: Callable[[str], bool]) -> dict:
    groups = [
        dict(g, params=[n for n in g["params"] if keep(n)]) for g in state_dict["param_groups"]
    ]
    return {**state_dict, "param_groups": groups, "state": state}
