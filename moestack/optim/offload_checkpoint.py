"""OffloadAdamW's checkpoints: the full name-keyed state (collective when sharded), each
rank's own part (expert parallelism's), and loading either back.

The format is :mod:`moestack.optim.state_format`'s (keyed by parameter name, experts one
by one, so a state saved with N ranks loads with M); what is here gathers the optimizer's
host buffers over the ranks, joins split master weights (:mod:`moestack.optim.split_master`)
and puts loaded state back into this rank's shard. Every method first applies or waits for
the update in flight.

The class here is one part of :class:`moestack.optim.offload.OffloadAdamW` (a mixin): it
holds no state of its own and reads what the optimizer's constructor laid out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moestack.optim import split_master, state_format, transfer
from moestack.optim.offload_step import PendingUpdate
from moestack.optim.plan import ShardPlan


class OffloadCheckpoint:
    """The state_dict half of OffloadAdamW: save, save per rank, load."""

    # laid out by OffloadAdamW's constructor (moestack.optim.offload)
    _params: list[Tensor]
    _names: list[str]
    _index: dict[int, int]
    _is_expert: list[bool]
    _plan: ShardPlan
    _host: transfer.HostBuffers
    _side: Any
    _steps: list[int]
    _pending: Any
    _grads_ready: bool
    _stamps: dict[int, tuple[int, int]]
    _loaded_prints: dict[int, tuple[int, ...]]
    param_groups: list[dict[str, Any]]
    num_shards: int
    rank: int
    in_place: bool

    def _name_of(self, p: Tensor) -> str:
        return self._names[self._index[id(p)]]

    def state_dict(self) -> dict[str, Any]:
        """Full, name-keyed state (collective when sharded: call it on every rank).

        The format is described in :mod:`moestack.optim.state_format`. A delayed update in
        flight is applied first (:meth:`synchronize`).
        """
        self.synchronize()
        transfer.synchronize(self._side)
        if self._split and self._direct:  # writes since the last step count, as a step would
            self._take_outside_writes()
        master = self._host.master
        if self._split:  # saved as fp32, as without the split (one process: nothing to gather)
            master = split_master.joined(self._host, self._plan, self._params, self._direct)
        gathered = {
            "exp_avg": self._gathered(self._host.exp_avg),
            "exp_avg_sq": self._gathered(self._host.exp_avg_sq),
            "master": self._gathered(master),
        }
        state = state_format.pack_state(
            self._plan, self._params, self._names, self._is_expert, self._steps, gathered
        )
        groups = state_format.save_groups(self.param_groups, self._name_of)
        return state_format.assemble(groups, state)

    def own_expert_state(self) -> dict[str, Any]:
        """The entries (:meth:`state_dict`'s) of the expert units this rank's shard holds,
        keyed ``name/expert<local id>``; not collective: nothing is gathered (expert
        parallelism's checkpoints are written by the ranks owning the experts). A delayed
        update in flight is waited for on the host, its weights left to go back (over the
        ranks when sharded) at the next :meth:`synchronize` or step."""
        return state_format.pack_own_experts(
            self._plan, self._params, self._names, self._is_expert, self._steps, self._own_state()
        )

    def own_shard_state(self) -> dict[str, Any]:
        """The pieces (:func:`state_format.pack_own_shard`) of the non-expert parameters in
        this rank's shard; not collective (expert parallelism's checkpoints are written by
        the ranks holding the state; a delayed update in flight is waited for as
        :meth:`own_expert_state` does). Unsharded, rank 0 alone returns them (every rank
        holds the same)."""
        if self.num_shards == 1 and self.rank != 0:
            self.synchronize()  # unsharded: collective-free, and the update in flight ends here
            return {}
        return state_format.pack_own_shard(
            self._plan, self._params, self._names, self._is_expert, self._steps, self._own_state()
        )

    def _own_state(self) -> dict[str, Tensor | None]:
        """This rank's own state buffers, every update in flight ended first: the moments
        and the fp32 master (joined from a split one). Collective-free: sharded, a delayed
        update's weights (gathered over the ranks) are left to go back at the next
        :meth:`synchronize` or step; unsharded it is applied (nothing is gathered)."""
        if self.num_shards > 1 and isinstance(self._pending, PendingUpdate):
            self._pending.future.result()  # the host state is final; the all-gather waits
        else:
            self.synchronize()
        transfer.synchronize(self._side)
        master = self._host.master
        if self._split:
            master = split_master.joined(self._host, self._plan, self._params, self._direct)
        return {"exp_avg": self._host.exp_avg, "exp_avg_sq": self._host.exp_avg_sq,
                "master": master}  # fmt: skip

    def groups_state(self) -> dict[str, Any]:
        """:meth:`state_dict` without any entry: the param groups alone (not collective)."""
        groups = state_format.save_groups(self.param_groups, self._name_of)
        return state_format.assemble(groups, {})

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict` (any number of ranks); keep this rank's part."""
        state_format.check_format(state_dict)
        self.synchronize()  # an update in flight would write over what is loaded
        transfer.synchronize(self._side)
        state_format.restore_groups(state_dict["param_groups"], self.param_groups, self._name_of)
        state = state_dict["state"]
        targets = self._host.state()
        if self._split:  # the fp32 master is loaded whole, then split
            targets["master"] = torch.zeros(self._plan.host_size, dtype=torch.float32)
        loaded = [self._load_param(i, state, targets) for i in range(len(self._params))]
        init_master = [i for i, has in enumerate(loaded) if has is False]
        if self._split:
            with_master = [i for i, has in enumerate(loaded) if has]
            split_master.load(
                self._host, self._plan, self._params, targets["master"], with_master, self._direct
            )
        if init_master and not self.in_place:
            self._init_master(init_master)
        self._stamps = {i: (p.data_ptr(), p._version) for i, p in enumerate(self._params)}
        if self._split and self._direct:
            self._loaded_prints = {
                i: split_master.fingerprint(p) for i, p in enumerate(self._params)
            }
        self._grads_ready = False

    def _load_param(self, i: int, state: dict[str, Any], targets: dict[str, Tensor]) -> bool | None:
        """Load parameter i's saved state into ``targets``; return whether the state held its
        master weights (False: they must be taken from the parameter), None when the state
        holds nothing for it (it starts afresh)."""
        name, is_expert = self._names[i], self._is_expert[i]
        loaded = state_format.unpack_param(self._plan, state, i, name, is_expert, targets)
        if loaded is None:
            self._steps[i] = 0
            return None
        self._steps[i], has_master = loaded
        return has_master
