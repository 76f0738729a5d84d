"""The expert-parallel MoE computation: dispatch tokens to the ranks that own their experts,
run the local experts, send the results back, combine in token order.

One forward pass of one layer on one rank of an EP group of P ranks::

    sort the (token, slot) pairs by expert           -> rows grouped by owner rank
    all-gather tokens_per_expert over the EP group   -> every rank's send and receive sizes
    all-to-all (uneven splits) of the rows           -> the rows for this rank's experts
    local experts (the same grouped-GEMM impls)      -> their outputs
    all-to-all back (splits swapped)                 -> outputs in this rank's sorted order
    un-sort, weight and sum the k slots              -> y [T, D]

Autograd flows through both exchanges (the backward of an all-to-all is the all-to-all with
the splits swapped). A pair routed to an expert on this rank is "sent" to itself, which
costs a local copy, no communication. A rank that receives no rows still takes part in
every collective, so no rank waits on one that skipped.

``ExpertParallelExperts`` is this computation as an MoE layer's experts back-end
(``MoE.set_experts``; ``moestack.parallel.shard_experts`` sets it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moestack.moe import LocalExperts, MoE, check_resident, compute_dtype
from moestack.parallel.mesh import ExpertParallelMesh
from moestack.router import Routing, tokens_per_expert

# (rows x [N, D], local expert id of each row [N]) -> expert outputs [N, D]
LocalCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ExchangeStats:
    """What the all-to-alls of one rank moved since the last ``reset`` (all MoE layers)."""

    rows_sent: int = 0  # (token, slot) rows sent to other ranks, forward
    rows_received: int = 0  # rows received from other ranks, forward
    bytes_moved: int = 0  # bytes sent to other ranks, forward and backward
    seconds: float = 0.0  # wall time inside the all-to-alls, forward and backward
    layers: int = 0  # layer forward passes counted
    load_imbalance_sum: float = 0.0  # sum over layers of max / mean rows per EP rank
    loads: list[int] = field(default_factory=list)  # per EP rank, rows received (summed)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def add_layer(self, rows_per_rank: list[int]) -> None:
        self.layers += 1
        mean = sum(rows_per_rank) / len(rows_per_rank)
        self.load_imbalance_sum += max(rows_per_rank) / mean if mean > 0 else 1.0
        if not self.loads:
            self.loads = [0] * len(rows_per_rank)
        self.loads = [a + b for a, b in zip(self.loads, rows_per_rank, strict=True)]


@dataclass
class ExpertShard:
    """What an MoE layer needs to run its experts expert-parallel: the mesh, where its
    experts sit among all of them, and the counters shared by the model's layers."""

    mesh: ExpertParallelMesh
    num_experts: int  # experts of the whole layer (E)
    stats: ExchangeStats

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.mesh.ep


class ExpertParallelExperts:
    """The experts back-end of an MoE layer whose experts are spread over an EP group: the
    layer's ``w1``/``w2`` hold this rank's experts only (``shard``), tokens travel to the
    ranks owning their experts and back (``expert_parallel_experts``). Only the local expert
    computation is recomputed under checkpointing (``LocalExperts.run``), never the
    exchanges."""

    def __init__(self, shard: ExpertShard) -> None:
        self.shard = shard

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        check_resident(moe, x_TD)

        def local_experts(x_ND: torch.Tensor, local_ids_N: torch.Tensor) -> torch.Tensor:
            ones_N1 = x_ND.new_ones(x_ND.shape[0], 1, dtype=torch.float32)
            return LocalExperts.run(moe, x_ND, local_ids_N[:, None], ones_N1)

        x_TD = x_TD.to(compute_dtype(x_TD, moe.w1))  # the exchanges carry what is computed
        params = tuple(getattr(moe, name) for name in moe.expert_tensor_names())
        return expert_parallel_experts(
            x_TD, routing.experts, routing.weights, self.shard, local_experts, params
        )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable; counts bytes and time."""

    @staticmethod
    def forward(
        ctx: Any, x_ND: torch.Tensor, send: list[int], recv: list[int], shard: ExpertShard
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.shard = send, recv, shard
        return _exchange(x_ND, send, recv, shard)

    @staticmethod
    def backward(ctx: Any, grad_ND: torch.Tensor) -> tuple:
        return _exchange(grad_ND, ctx.recv, ctx.send, ctx.shard), None, None, None


def _exchange(
    x_ND: torch.Tensor, send: list[int], recv: list[int], shard: ExpertShard
) -> torch.Tensor:
    """Rows ``x[sum(send[:j]) : sum(send[:j+1])]`` go to EP rank j; returns the rows received,
    ordered by source rank."""
    x_ND = x_ND.contiguous()
    out = x_ND.new_empty(sum(recv), *x_ND.shape[1:])
    start = time.perf_counter()
    dist.all_to_all_single(out, x_ND, recv, send, group=shard.mesh.ep_group)
    stats, me = shard.stats, shard.mesh.ep_rank
    stats.seconds += time.perf_counter() - start
    row_bytes = math.prod(x_ND.shape[1:]) * x_ND.element_size()
    stats.bytes_moved += (sum(send) - send[me]) * row_bytes
    return out


def expert_parallel_experts(
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    shard: ExpertShard,
    local_experts: LocalCompute,
    params: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` with the experts spread
    over the EP group; ``local_experts`` runs this rank's experts on the rows it receives,
    whose weights are ``params``."""
    mesh, num_tokens, top_k = shard.mesh, experts_TK.shape[0], experts_TK.shape[1]
    local, me = shard.local_experts, mesh.ep_rank
    flat_N = experts_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)  # pairs grouped by expert, so by owner
    counts_E = tokens_per_expert(flat_N, shard.num_experts)
    counts_PE = _gather_counts(counts_E, mesh)  # every rank's counts: one host sync
    counts_PPL = counts_PE.view(mesh.ep, mesh.ep, local)  # [source, owner, local expert]
    send = counts_PPL[me].sum(-1).tolist()
    recv = counts_PPL[:, me].sum(-1).tolist()
    _count_layer(shard.stats, counts_PPL, send, recv, me)
    x_ND = _AllToAll.apply(x_TD[order_N // top_k], send, recv, shard)
    local_ids_N = torch.repeat_interleave(
        torch.arange(local, device=x_TD.device).repeat(mesh.ep),
        counts_PPL[:, me].reshape(-1).to(x_TD.device),
    )
    y_local_ND = _in_graph(local_experts(x_ND, local_ids_N), x_ND, *params)
    y_ND = _AllToAll.apply(y_local_ND, recv, send, shard)
    y_TKD = y_ND.new_empty(y_ND.shape).index_copy_(0, order_N, y_ND)
    y_TKD = y_TKD.view(num_tokens, top_k, y_ND.shape[-1])
    return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)


def _in_graph(y: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
    """``y``, attached to the autograd graph of ``sources`` if it fell out of it.

    A rank that receives no rows computes an empty output with no graph (nothing to
    multiply); its all-to-all back would then have no backward, and every other rank would
    wait for it forever in theirs. Whether a graph is needed is decided by the sources,
    which require grad on every rank alike."""
    needs = [s for s in sources if s.requires_grad]
    if y.requires_grad or not needs or not torch.is_grad_enabled():
        return y
    return y + sum(s.sum() * 0 for s in needs)


def _gather_counts(counts_E: torch.Tensor, mesh: ExpertParallelMesh) -> torch.Tensor:
    """``[P, E]`` tokens per expert of every rank of the EP group, on the host."""
    parts = [torch.empty_like(counts_E) for _ in range(mesh.ep)]
    dist.all_gather(parts, counts_E.contiguous(), group=mesh.ep_group)
    out = torch.stack(parts)
    return out.cpu()


def _count_layer(
    stats: ExchangeStats, counts_PPL: torch.Tensor, send: list[int], recv: list[int], me: int
) -> None:
    stats.rows_sent += sum(send) - send[me]
    stats.rows_received += sum(recv) - recv[me]
    stats.add_layer(counts_PPL.sum(dim=(0, 2)).tolist())
