"""Gradients reduced and weights gathered on the devices, for a sharded OffloadAdamW.

Why: with the collectives on the host, every rank copies all its gradients to host memory
(as fp32), the host reduce-scatters them over gloo, and the updated fp32 master weights are
all-gathered over gloo and copied back whole: N times the PCIe bytes a rank needs, an fp32
buffer of the whole model in every rank's host memory, and the slow network path. Here the
ranks reduce-scatter a flat device buffer of their gradients over the optimizer's own process
group (NCCL on GPUs; gloo in the CPU tests), so each rank copies only its 1/N shard of the
summed gradients to the host, in the gradients' dtype; after its host step it copies its
shard of the new weights back (bf16 weights as bf16) and the ranks all-gather them on the
devices into the same buffer, from which every parameter takes its weights.

The device holds one flat buffer of the gradients' dtype over every shard's slot and one of a
shard (:func:`buffer_elements`): 2 bytes a parameter, and 2 / N more, with bf16 weights.
Results: the same update as the host collectives', but for the reduction's own rounding (a
bf16 sum on the devices, as DDP's bf16 all-reduce; with fp32 gradients the same sum as
gloo's on the host), and the mean taken as the step's gradient scale (``1 / N``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moestack.optim.plan import ParamSpec, ShardPlan


def refusal(
    specs: Sequence[ParamSpec],
    *,
    num_shards: int,
    fused_step: str,
    backend: str | None,
    skip_idle_experts: bool = False,
) -> str | None:
    """Why these settings cannot reduce on the devices (None: they can)."""
    if num_shards < 2:
        return "the state is not sharded over several ranks (shard=True under torch.distributed)"
    if skip_idle_experts:  # an idle expert's shard is not stepped, so not staged for the way back
        return "skip_idle_experts leaves idle experts out of the weights the ranks gather"
    if fused_step == "off":
        return "fused_step='off' runs the reference path, which reads fp32 host gradients"
    dtypes = {s.dtype for s in specs}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16}:
        return "its parameters must all be float32 or all bfloat16"
    if len({s.device for s in specs}) != 1:
        return "its parameters must be on one device type"
    device = next(iter(specs)).device
    if backend is not None:
        needs = "gloo" if device == "cpu" else "nccl"
        if needs not in backend:
            return f"the process group's backend {backend!r} cannot reduce {device} tensors"
    return None


def buffer_elements(plan: ShardPlan) -> int:
    """Elements of the device buffers: every shard's slot, and one shard's."""
    return plan.num_shards * plan.stride + plan.stride


class DeviceComm:
    """The device buffers and collectives of one OffloadAdamW (see the module docstring).

    Args:
        plan: the optimizer's shard plan (its comm layout: shard s at ``s * stride``).
        device: where the parameters are.
        dtype: the gradients' (and weights') dtype.
        group: the process group of the device collectives (None: the default group).
    """

    def __init__(self, plan: ShardPlan, device: torch.device, dtype: torch.dtype, group: Any):
        self.plan = plan
        self.group = group
        self.full = torch.zeros(plan.num_shards * plan.stride, dtype=dtype, device=device)
        self.shard = torch.zeros(plan.stride, dtype=dtype, device=device)

    def reduce_grads(self, params: Sequence[Tensor], host_grad: Tensor) -> None:
        """Sum the ranks' gradients of ``params`` (zeros where a gradient is None) into each
        rank's shard, then copy this rank's shard to ``host_grad`` (``[stride]``)."""
        plan, full = self.plan, self.full
        for s in plan.segments:
            dst = full[plan.comm_offset(s.shard, s.off) :][: s.numel]
            grad = params[s.pidx].grad
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.reshape(-1)[s.start : s.start + s.numel])
        dist.reduce_scatter_tensor(self.shard, full, group=self.group)
        host_grad.copy_(self.shard)

    def gather_weights(self, params: Sequence[Tensor], own: Tensor, active: Sequence[bool]) -> None:
        """All-gather every rank's new weights (this rank's: ``own``, its shard's elements in
        the parameters' dtype) and copy them into the ``active`` parameters."""
        plan, full = self.plan, self.full
        n = own.numel()
        self.shard[:n].copy_(own)
        self.shard[n:].zero_()
        dist.all_gather_into_tensor(full, self.shard, group=self.group)
        for s in plan.segments:
            if active[s.pidx]:
                flat = params[s.pidx].data.view(-1)
                src = full[plan.comm_offset(s.shard, s.off) :][: s.numel]
                flat[s.start : s.start + s.numel].copy_(src)

    def buffers(self) -> dict[str, Tensor]:
        """The device buffers, by role (for memory accounting)."""
        return {"device_comm/full": self.full, "device_comm/shard": self.shard}


def backend_of(group: Any) -> str | None:
    """The backend name of ``group`` (None without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend(group)).lower()
