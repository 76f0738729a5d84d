"""Host <-> device transfers for OffloadAdamW: pinned buffers, the side stream, dtype casts.

The optimizer state lives in host memory, pinned when CUDA is present so that copies can be
asynchronous. With ``overlap``, gradient copies to the host and weight copies back run on a
side stream; the compute stream waits on an event, the host does not.

On CUDA, 16-bit parameters and gradients change dtype on the device, through one fp32
scratch per device of at most ``_XFER_CHUNK`` elements (64 MiB): the host only runs the
AdamW step, and no copy needs a device temporary as large as the tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestack.optim.plan import Segment, ShardPlan

# Elements per device-side dtype conversion between 16-bit device tensors and the fp32 host
# buffers: the device holds one fp32 scratch of at most this size (64 MiB).
_XFER_CHUNK = 1 << 24

ScratchFn = Callable[[torch.device], Tensor]
CopyFn = Callable[..., None]  # (dst, src, non_blocking=...): copy_to_host/copy_to_device bound


@dataclass
class HostBuffers:
    """The flat host buffers of one rank's shard (see :class:`ShardPlan` for the layout)."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    master: Tensor | None  # fp32 master weights; None when the parameters are stepped in place
    grad: Tensor | None  # this rank's averaged gradients (``comm`` itself when not sharded)
    comm: Tensor | None  # every shard's slot: packed gradients, then gathered weights

    def state(self) -> dict[str, Tensor]:
        """The buffers a checkpoint holds: the moments, and the master weights when kept."""
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            out["master"] = self.master
        return out

    def by_role(self) -> dict[str, Tensor]:
        """Every buffer, by role (for memory accounting)."""
        out = self.state()
        if self.comm is not None:
            out["grad_comm"] = self.comm
            if self.grad is not self.comm:
                assert self.grad is not None
                out["grad_shard"] = self.grad
        return out


def alloc_host_buffers(
    plan: ShardPlan, moment_dtype: torch.dtype, in_place: bool, params: Sequence[Tensor]
) -> HostBuffers:
    """Zeroed host buffers: moments, and master weights, gradients and the communication
    buffer unless stepping in place. Pinned when some parameter is on a CUDA device."""
    pin = torch.cuda.is_available() and any(p.device.type == "cuda" for p in params)

    def host(n: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=pin)

    size = plan.host_size
    exp_avg, exp_avg_sq = host(size, moment_dtype), host(size, moment_dtype)
    if in_place:
        return HostBuffers(exp_avg, exp_avg_sq, master=None, grad=None, comm=None)
    master = host(size)
    if plan.num_shards > 1:
        comm = host(plan.num_shards * plan.stride)
        grad = host(plan.stride)
    else:
        comm = host(plan.total)
        grad = comm
    return HostBuffers(exp_avg, exp_avg_sq, master=master, grad=grad, comm=comm)


def side_stream(params: Sequence[Tensor], overlap: bool) -> torch.cuda.Stream | None:
    """The stream for overlapped copies (on the first CUDA parameter's device), or None."""
    cuda_devs = [p.device for p in params if p.is_cuda]
    return torch.cuda.Stream(device=cuda_devs[0]) if (cuda_devs and overlap) else None


def on_stream(side: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """Run the enclosed copies on ``side``, or on the current stream when it is None."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def wait_for_compute(side: torch.cuda.Stream, device: torch.device) -> None:
    """Order ``side`` after the work queued so far on ``device``'s current stream."""
    side.wait_stream(torch.cuda.current_stream(device))


def release_to_compute(side: torch.cuda.Stream) -> None:
    """Make the compute stream wait for ``side``'s copies; the host does not wait."""
    event = torch.cuda.Event()
    event.record(side)
    torch.cuda.current_stream(side.device).wait_event(event)


def synchronize(side: torch.cuda.Stream | None) -> None:
    """Block the host until ``side``'s copies are done (no-op without a side stream)."""
    if side is not None:
        side.synchronize()


class DeviceScratch:
    """The fp32 device scratch, one per device, through which 16-bit tensors change dtype.

    Allocated on first use, ``min(largest parameter on the device, _XFER_CHUNK)`` elements.
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._params = params
        self.buffers: dict[torch.device, Tensor] = {}

    def get(self, device: torch.device) -> Tensor:
        """The scratch of ``device``, allocated on first use."""
        buf = self.buffers.get(device)
        if buf is None:
            largest = max(p.numel() for p in self._params if p.device == device)
            buf = torch.empty(min(largest, _XFER_CHUNK), dtype=torch.float32, device=device)
            self.buffers[device] = buf
        return buf


def copy_to_host(dst: Tensor, src: Tensor, non_blocking: bool, scratch: ScratchFn) -> None:
    """fp32 host ``dst`` <- ``src``; a 16-bit CUDA ``src`` is widened on the device.

    Why: torch widens a cross-device copy into a temporary as large as ``src``; the
    chunked scratch bounds that device memory. Every use of the scratch is on one
    stream (the side stream, or the current one without overlap), so reuse is ordered.
    """
    if not _cast_on_device(src, dst):
        dst.copy_(src, non_blocking=non_blocking)
        return
    buf = scratch(src.device)
    for a in range(0, src.numel(), buf.numel()):
        b = min(a + buf.numel(), src.numel())
        tmp = buf[: b - a]
        tmp.copy_(src[a:b])
        dst[a:b].copy_(tmp, non_blocking=non_blocking)


def copy_to_device(dst: Tensor, src: Tensor, non_blocking: bool, scratch: ScratchFn) -> None:
    """16-bit or fp32 ``dst`` <- fp32 host ``src``; narrowing runs on the device.

    Why: torch narrows a host-to-device copy on the host into a pageable temporary,
    which costs a host pass and turns the copy synchronous; here the fp32 words cross
    PCIe from the (pinned) buffer and a device kernel narrows them.
    """
    if not _cast_on_device(dst, src):
        dst.copy_(src, non_blocking=non_blocking)
        return
    buf = scratch(dst.device)
    for a in range(0, src.numel(), buf.numel()):
        b = min(a + buf.numel(), src.numel())
        tmp = buf[: b - a]
        tmp.copy_(src[a:b], non_blocking=non_blocking)
        dst[a:b].copy_(tmp)


def pack_grad(
    comm: Tensor,
    plan: ShardPlan,
    pidx: int,
    flat: Tensor | None,
    non_blocking: bool,
    to_host: CopyFn,
) -> None:
    """Copy parameter ``pidx``'s flat gradient into its slots of the host buffer ``comm``
    (every shard's slot, see :meth:`ShardPlan.comm_offset`); zeros there without one."""
    for s in plan.segs_of[pidx]:
        base = plan.comm_offset(s.shard, s.off)
        dst = comm[base : base + s.numel]
        if flat is None:
            dst.zero_()
        else:
            to_host(dst, flat[s.start : s.start + s.numel], non_blocking=non_blocking)


def return_weights(
    params: Sequence[Tensor],
    plan: ShardPlan,
    src: Tensor,
    active: Sequence[bool],
    idle: dict[int, list[tuple[int, int]]] | None,
    side: torch.cuda.Stream | None,
    to_device: CopyFn,
) -> None:
    """Copy the updated fp32 weights ``src`` (laid out as ``comm``) into the active params.

    ``idle`` maps a parameter to the ``(start, numel)`` ranges of experts left as they are.
    With a side stream the copies run there, after the compute stream's queued work (it may
    still read the old weights), and the compute stream waits for them; the host does not:
    the next step synchronises the side stream before it touches the host buffers again.
    """
    if side is not None:
        wait_for_compute(side, side.device)
    with on_stream(side):
        for s in plan.segments:
            if not active[s.pidx]:
                continue
            flat = params[s.pidx].data.view(-1)
            base = plan.comm_offset(s.shard, s.off)
            if idle is not None and idle.get(s.pidx):
                _copy_skipping(plan, flat, src, s, base, idle[s.pidx], side, to_device)
                continue
            to_device(
                flat[s.start : s.start + s.numel],
                src[base : base + s.numel],
                non_blocking=side is not None,
            )
    if side is not None:
        release_to_compute(side)


def _copy_skipping(
    plan: ShardPlan,
    flat: Tensor,
    src: Tensor,
    s: Segment,
    base: int,
    idle: list[tuple[int, int]],
    side: torch.cuda.Stream | None,
    to_device: CopyFn,
) -> None:
    """Copy a segment back unit by unit, leaving out skipped (idle) experts."""
    skip = {start for start, _ in idle}
    for k in plan.my_units:
        u = plan.units[k]
        if u.pidx != s.pidx or u.start in skip:
            continue
        if s.start <= u.start < s.start + s.numel:
            a = base + (u.start - s.start)
            to_device(
                flat[u.start : u.start + u.numel],
                src[a : a + u.numel],
                non_blocking=side is not None,
            )


def _cast_on_device(device_side: Tensor, host_side: Tensor) -> bool:
    """Whether a copy between a device tensor and an fp32 host buffer changes dtype on a GPU."""
    return device_side.is_cuda and device_side.dtype != host_side.dtype
