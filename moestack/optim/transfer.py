"""Host <-> device transfers for OffloadAdamW: pinned buffers, the side stream, dtype casts.

The optimizer state lives in host memory, pinned when CUDA is present so that copies can be
asynchronous: every buffer is a view of one host block, page-locked in place, so the bytes
held are the bytes counted (:func:`carve`). With ``overlap``, gradient copies to the host
and weight copies back run on a side stream; the compute stream waits on an event, the host
does not.

On CUDA, 16-bit parameters and gradients change dtype on the device, through one fp32
scratch per device of at most ``_XFER_CHUNK`` elements (64 MiB): the host only runs the
AdamW step, and no copy needs a device temporary as large as the tensor.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moestack.optim.plan import ParamSpec, Segment, ShardPlan

log = logging.getLogger(__name__)

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
    master: Tensor | None  # fp32 master weights (int16 remainders when split); None in place
    grad: Tensor | None  # this rank's averaged gradients (``comm`` itself when not sharded)
    comm: Tensor | None  # every shard's slot: packed gradients, then gathered weights
    staging: Tensor | None = None  # bf16 weights the fused step narrowed for the device
    spare_grad: Tensor | None = None  # delayed updates: the gradient buffer not in use now

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
        if self.grad is not None and self.grad is not self.comm:
            out["grad_shard"] = self.grad
        if self.staging is not None:
            out["weight_staging"] = self.staging
        if self.spare_grad is not None:
            out["grad_spare"] = self.spare_grad
        return out

    def swap_grads(self) -> Tensor:
        """Delayed updates: hand out the gradient buffer as it is (the update in flight reads
        it) and put the spare in its place, where the next gradients are packed and reduced.
        Returns the buffer handed out."""
        assert self.grad is not None and self.spare_grad is not None
        current = self.grad
        if self.comm is current:  # not sharded: the gradients are packed into it directly
            self.comm = self.spare_grad
        self.grad, self.spare_grad = self.spare_grad, current
        return current


Sizes = dict[str, tuple[int, torch.dtype]]  # buffer role -> (elements, dtype)


def host_buffer_sizes(
    plan: ShardPlan,
    moment_dtype: torch.dtype,
    in_place: bool,
    pack: bool = True,
    staging_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype = torch.float32,
    spare_grad: bool = False,
    grad_dtype: torch.dtype = torch.float32,
    comm_on_host: bool = True,
) -> Sizes:
    """Elements and dtype of every host buffer of one rank, by the role
    :meth:`HostBuffers.by_role` names it: the moments; unless stepping in place, the master
    weights (fp32, or the int16 remainders of a split master,
    :mod:`moestack.optim.split_master`) and (with ``pack``) the gradient and communication
    buffers; a weight staging buffer of ``staging_dtype`` if given; with ``spare_grad`` (delayed
    updates) a second gradient buffer, so the next step's gradients land beside the ones the
    update in flight reads. The gradient buffers are fp32 but where ``grad_dtype`` says
    otherwise (a pipelined step's bf16 gradients, :mod:`moestack.optim.buckets`). Without
    ``comm_on_host`` (collectives on the devices, :mod:`moestack.optim.device_comm`) a sharded
    rank holds its gradient shard only, not every shard's slot."""
    size = plan.host_size
    sizes = {"exp_avg": (size, moment_dtype), "exp_avg_sq": (size, moment_dtype)}
    if in_place:
        return sizes
    sizes["master"] = (size, master_dtype)
    if pack:
        comm, grad = pack_buffer_sizes(plan)
        if not comm_on_host and grad is not None:
            sizes["grad_shard"] = (grad, grad_dtype)
            if spare_grad:
                sizes["grad_spare"] = (grad, grad_dtype)
            return _with_staging(sizes, size, staging_dtype)
        sizes["grad_comm"] = (comm, grad_dtype)
        if grad is not None:
            sizes["grad_shard"] = (grad, grad_dtype)
        if spare_grad:
            sizes["grad_spare"] = (comm if grad is None else grad, grad_dtype)
    return _with_staging(sizes, size, staging_dtype)


def _with_staging(sizes: Sizes, size: int, staging_dtype: torch.dtype | None) -> Sizes:
    if staging_dtype is not None:
        sizes["weight_staging"] = (size, staging_dtype)
    return sizes


def pack_buffer_sizes(plan: ShardPlan) -> tuple[int, int | None]:
    """Elements of the fp32 communication buffer (every shard's slot) and of this rank's
    gradient shard (None when not sharded: the communication buffer is the shard)."""
    if plan.num_shards > 1:
        return plan.num_shards * plan.stride, plan.stride
    return plan.total, None


def alloc_host_buffers(sizes: Sizes, pin: Sequence[torch.device]) -> HostBuffers:
    """Zeroed host buffers of :func:`host_buffer_sizes`, sliced from one host block
    (:func:`carve`), pinned for copies with the CUDA devices ``pin`` (none: not pinned)."""
    bufs = carve(sizes, pin)
    comm = bufs.get("grad_comm")  # None with the collectives on the devices
    return HostBuffers(
        bufs["exp_avg"],
        bufs["exp_avg_sq"],
        master=bufs.get("master"),
        grad=bufs.get("grad_shard", comm),
        comm=comm,
        staging=bufs.get("weight_staging"),
        spare_grad=bufs.get("grad_spare"),
    )


def pinned(params: Sequence[Tensor]) -> tuple[torch.device, ...]:
    """The CUDA devices of ``params``, for which the host buffers are pinned (empty, so
    false, when there is none)."""
    if not torch.cuda.is_available():
        return ()
    return tuple(sorted({p.device for p in params if p.device.type == "cuda"}, key=str))


def alloc_pack_buffers(plan: ShardPlan, pin: Sequence[torch.device]) -> tuple[Tensor, Tensor]:
    """The fp32 communication buffer (every shard's slot) and this rank's gradient shard
    (the same tensor when not sharded), from one host block (:func:`carve`)."""
    comm_size, grad_size = pack_buffer_sizes(plan)
    sizes = {"grad_comm": (comm_size, torch.float32)}
    if grad_size is not None:
        sizes["grad_shard"] = (grad_size, torch.float32)
    bufs = carve(sizes, pin)
    return bufs["grad_comm"], bufs.get("grad_shard", bufs["grad_comm"])


# ------------------------------------------------------------------- one host block
# Why one block: torch's pinned allocator (CachingHostAllocator) rounds every request up to
# a power of two (c10::llvm::PowerOf2Ceil, unless PYTORCH_ALLOC_CONF sets
# pinned_max_round_threshold_mb), so buffers pinned one by one took up to twice their bytes
# (1.96x for the 137M model's). The buffers are views of one plain host block instead,
# page-locked in place with cudaHostRegister: the bytes held are the bytes counted (the
# buffers' sum, plus at most ALIGN_BYTES - 1 of padding before each).

ALIGN_BYTES = 64  # each buffer starts on a cache line (and an AVX-512 vector)


def block_layout(sizes: Sizes) -> tuple[dict[str, int], int]:
    """The byte offset of each buffer of ``sizes`` in one block (in their order, each
    aligned to :data:`ALIGN_BYTES`) and the block's bytes."""
    offsets, end = {}, 0
    for role, (n, dtype) in sizes.items():
        start = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        offsets[role] = start
        end = start + n * dtype.itemsize
    return offsets, end


def carve(sizes: Sizes, pin: Sequence[torch.device] = ()) -> dict[str, Tensor]:
    """Zeroed flat buffers of ``sizes`` (role -> (elements, dtype)), each a view of one host
    block (:func:`block_layout`), pinned for copies with the CUDA devices ``pin``."""
    offsets, nbytes = block_layout(sizes)
    block = torch.zeros(nbytes, dtype=torch.uint8)
    if pin:
        block = pin_block(block, pin)
    return {
        role: block[offsets[role] : offsets[role] + n * dtype.itemsize].view(dtype)
        for role, (n, dtype) in sizes.items()
    }


def pin_block(block: Tensor, devices: Sequence[torch.device]) -> Tensor:
    """``block`` page-locked in place (``cudaHostRegister``), unregistered when its memory is
    freed, after ``devices`` finished what they had queued (a copy may still read or write
    it); where registering fails, a copy from torch's pinned allocator (rounded up, see
    above), saying so once."""
    if block.numel() == 0:
        return block
    try:
        _register(block.data_ptr(), block.numel())
    except Exception as err:  # no CUDA runtime call, or the driver refused
        _warn_rounded(block.numel(), err)
        return block.pin_memory()
    done = weakref.finalize(block.untyped_storage(), _unregister, block.data_ptr(), tuple(devices))
    done.atexit = False  # at exit the memory goes with the process (and CUDA may be gone)
    return block


_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as cudaHostAlloc's
_ROUNDED_WARNED: list[bool] = []


def _register(ptr: int, nbytes: int) -> None:
    """``cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable)``; RuntimeError on failure."""
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")


def _unregister(ptr: int, devices: tuple[torch.device, ...]) -> None:
    """Undo :func:`_register` once ``devices`` are done with the memory (a finalizer: it
    logs a failure, never raises)."""
    try:
        for device in devices:
            torch.cuda.synchronize(device)
        code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if code != 0:
            log.warning("cudaHostUnregister of the host buffers failed with CUDA error %d", code)
    except Exception as err:
        log.warning("unpinning the host buffers failed: %s: %s", type(err).__name__, err)


def _warn_rounded(nbytes: int, err: BaseException) -> None:
    if not _ROUNDED_WARNED:
        _ROUNDED_WARNED.append(True)
        rounded = 1 << max(nbytes - 1, 0).bit_length()
        log.warning(
            "host buffers: page-locking in place failed (%s: %s); pinned through torch's "
            "allocator instead, which holds %d bytes for %d",
            *(type(err).__name__, err, rounded, nbytes),
        )


def in_place_possible(specs: Sequence[ParamSpec], distributed: bool) -> bool:
    """Whether the parameters themselves can be stepped, without a master copy: fp32,
    contiguous CPU parameters and no distributed run (host and device are one memory)."""
    return not distributed and all(
        s.device == "cpu" and s.dtype == torch.float32 and s.contiguous for s in specs
    )


def choose_in_place(requested: bool | None, specs: Sequence[ParamSpec], distributed: bool) -> bool:
    """Whether to step the parameters themselves, without a master copy (see OffloadAdamW's
    ``in_place``): when :func:`in_place_possible`, unless ``requested`` is False."""
    possible = in_place_possible(specs, distributed)
    if requested and not possible:
        raise ValueError(
            "in_place=True needs fp32, contiguous CPU parameters and no distributed run; "
            "use in_place=None to let the optimizer decide"
        )
    return possible if requested is None else (requested and possible)


def init_master(
    master: Tensor, plan: ShardPlan, params: Sequence[Tensor], pidxs: list[int]
) -> None:
    """Copy parameters ``pidxs`` (this rank's units of them) into the fp32 master buffer."""
    want = set(pidxs)
    for k in plan.my_units:
        u = plan.units[k]
        if u.pidx in want:
            src = params[u.pidx].detach().reshape(-1)[u.start : u.start + u.numel]
            master[u.off : u.off + u.numel].copy_(src)


def for_reference_path(host: HostBuffers, plan: ShardPlan, params: Sequence[Tensor]) -> None:
    """Give ``host`` what the reference path needs and a fused step did without: the
    gradient buffers (the direct mode reads ``p.grad``), and no staging buffer."""
    host.staging = None
    if host.comm is None:
        host.comm, host.grad = alloc_pack_buffers(plan, pinned(params))


def weak_grad_hook(opt: Any) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook that calls ``opt._grad_hook`` while ``opt`` is alive.

    The hooks hold the optimizer weakly: a hook registry lives in C++, out of reach of
    Python's garbage collector, so a strong reference would keep a dropped optimizer (and
    its device scratch) alive as long as the parameters.
    """
    ref = weakref.ref(opt)

    def hook(p: Tensor) -> None:
        live = ref()
        if live is not None:
            live._grad_hook(p)

    return hook


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


def copies_done(side: torch.cuda.Stream | None) -> Any:
    """An event recorded on the side stream after the copies queued there (None without
    one): a delayed update waits on it before it writes the host buffers they read."""
    if side is None:
        return None
    event = host_event()
    event.record(side)
    return event


def host_event() -> torch.cuda.Event:
    """A CUDA event a host thread waits on (``Event.synchronize``). ``blocking=True`` creates
    it with ``cudaEventBlockingSync``: ``cudaEventSynchronize`` then puts the waiting thread
    to sleep until the event completes, where a default event has it busy-wait, spinning a
    core the host update and the main thread need. (torch's docstring says ``wait()`` blocks;
    ``wait()`` is a stream's device-side wait, which the flag does not change.)"""
    return torch.cuda.Event(blocking=True)


def casts_on_device(device: str, dtype: torch.dtype, host_dtype: torch.dtype) -> bool:
    """Whether a copy between a ``dtype`` tensor on a ``device`` device (its type) and a
    ``host_dtype`` host buffer changes dtype on the device (through the scratch)."""
    return device == "cuda" and dtype != host_dtype


def scratch_elements(largest: int) -> int:
    """Elements of a device's fp32 scratch, for its largest parameter of ``largest``."""
    return min(largest, _XFER_CHUNK)


def device_scratch_sizes(
    specs: Sequence[ParamSpec], copies: bool, host_dtype: torch.dtype = torch.float32
) -> dict[str, int]:
    """Elements of the fp32 scratch each device type will hold (allocated at the first copy
    that changes dtype there): where ``copies`` (gradients are packed to the host and
    weights copied back) and some parameter there is not of the host gradients' dtype
    (``host_dtype``)."""
    if not copies:
        return {}
    devices = {s.device for s in specs if casts_on_device(s.device, s.dtype, host_dtype)}
    return {d: scratch_elements(max(s.numel for s in specs if s.device == d)) for d in devices}


class DeviceScratch:
    """The fp32 device scratch, one per device, through which 16-bit tensors change dtype.

    Allocated on first use, :func:`scratch_elements` of the largest parameter on the device.
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._params = params
        self.buffers: dict[torch.device, Tensor] = {}

    def get(self, device: torch.device) -> Tensor:
        """The scratch of ``device``, allocated on first use."""
        buf = self.buffers.get(device)
        if buf is None:
            largest = max(p.numel() for p in self._params if p.device == device)
            buf = torch.empty(scratch_elements(largest), dtype=torch.float32, device=device)
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
    staged: Tensor | None = None,
) -> None:
    """Copy the updated fp32 weights ``src`` (laid out as ``comm``) into the active params;
    parameters of ``staged``'s dtype take their (already narrowed) weights from it instead.

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
            buf = staged if staged is not None and staged.dtype == flat.dtype else src
            base = plan.comm_offset(s.shard, s.off)
            if idle is not None and idle.get(s.pidx):
                _copy_skipping(plan, flat, buf, s, base, idle[s.pidx], side, to_device)
                continue
            to_device(
                flat[s.start : s.start + s.numel],
                buf[base : base + s.numel],
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
    """Whether a copy between a device tensor and a host buffer changes dtype on a GPU."""
    return casts_on_device(device_side.device.type, device_side.dtype, host_side.dtype)
