"""OffloadAdamW's gradients: from the parameters to the host, reduced, measured and scaled.

One step reads the averaged gradients of this rank's shard on the host. They get there by
the hooks that copy each gradient as backward produces it (:meth:`_grad_hook`: on a side
stream, or bucket by bucket in the pipelined step), by :meth:`_sync_grads`, which packs
what no hook sent and reduces over the ranks (on the host, or on the devices), and are
measured and scaled for clipping (:meth:`clip_grad_norm_`). Every copy between host and
device goes through :meth:`_to_host` / :meth:`_to_device` (:mod:`moestack.optim.transfer`).

The class here is one part of :class:`moestack.optim.offload.OffloadAdamW` (a mixin): it
holds no state of its own and reads what the optimizer's constructor laid out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from moestack.optim import buckets, collectives, device_comm, fused, transfer, update
from moestack.optim.plan import ShardPlan, Unit


class OffloadGradients:
    """The gradient half of OffloadAdamW: hooks, reduction, norm and scaling, transfers."""

    # laid out by OffloadAdamW's constructor (moestack.optim.offload)
    _params: list[Tensor]
    _names: list[str]
    _index: dict[int, int]
    _plan: ShardPlan
    _host: transfer.HostBuffers
    _pipe: buckets.Pipeline | None
    _dcomm: device_comm.DeviceComm | None
    _fused: fused.FusedHostStep | None
    _side: Any
    _scratch: transfer.DeviceScratch
    _ranks: Any
    _dist: bool
    _grad_scale: float
    _grads_ready: bool
    _defer_copies: bool  # inside no_sync()
    _hooked: list[bool]  # the gradients a hook has sent this step
    _active: list[bool]  # the parameters with a gradient this step
    _idle: set[int]  # the plan's units skipped this step (idle experts)
    in_place: bool
    num_shards: int
    skip_idle_experts: bool

    def _grad_hook(self, p: Tensor) -> None:
        """Post-accumulate-grad hook (CUDA): start this gradient's copy to the host."""
        i = self._index[id(p)]
        if self._defer_copies:  # inside no_sync(): a later backward copies the sum
            self._hooked[i] = False
            return
        if self._pipe is not None:
            self._land_grad(i, p)
            return
        assert self._side is not None and self._host.comm is not None
        grad = p.grad
        if grad is None:
            return
        transfer.wait_for_compute(self._side, p.device)
        with transfer.on_stream(self._side):
            transfer.pack_grad(self._host.comm, self._plan, i, grad.view(-1), True, self._to_host)
            grad.record_stream(self._side)
        self._hooked[i] = True
        self._grads_ready = False

    def _grads_of(self, pidxs: Sequence[int]) -> tuple[list[int], list[Tensor]]:
        """Those of parameters ``pidxs`` that have a gradient, and their gradients."""
        have = [i for i in pidxs if self._params[i].grad is not None]
        return have, [self._params[i].grad for i in have]  # type: ignore[misc]

    def _sync_grads(self) -> None:
        """Make the averaged gradients of this rank's shard ready on the host."""
        if self._grads_ready:
            return
        if self._pipe is not None:
            self._active = [p.grad is not None for p in self._params]
            outside = [
                i for i, a in enumerate(self._active) if a and self._pipe.bucket_of[i] is None
            ]
            if outside:
                raise RuntimeError(
                    f"{self._names[outside[0]]!r} has a gradient but was frozen when the "
                    "optimizer was built, so the pipelined step has no bucket for it; build "
                    "the optimizer after setting requires_grad"
                )
            self._land_remaining()
            self._idle = set()
            self._grads_ready = True
            return
        self._resolve_fused()
        self._active = collectives.any_rank([p.grad is not None for p in self._params], self._ranks)
        self._grad_scale = 1.0
        if self._dcomm is not None:  # summed on the devices; the step takes the mean
            assert self._host.grad is not None
            self._dcomm.reduce_grads(self._params, self._host.grad)
            self._grad_scale = 1.0 / self.num_shards
        elif not self.in_place and not self._direct:
            assert self._host.comm is not None and self._host.grad is not None
            self._pack_remaining_grads()
            collectives.average_grads(
                self._host.comm, self._host.grad, self.num_shards > 1, self._ranks
            )
        self._idle = (
            update.idle_experts(self._plan, self._active, self._unit_grad)
            if self.skip_idle_experts
            else set()
        )
        self._grads_ready = True

    def _resolve_fused(self) -> None:
        """Choose the fused step's kernel (at the first step); without one, run the reference
        path from now on, with the gradient buffers the direct mode did without."""
        if self._fused is not None and not self._fused.resolve():
            self._fused = None
            transfer.for_reference_path(self._host, self._plan, self._params)

    def _pack_remaining_grads(self) -> None:
        """Wait for the copies the hooks started; copy every gradient they did not."""
        assert self._host.comm is not None
        transfer.synchronize(self._side)
        for i, p in enumerate(self._params):
            if self._hooked[i] and p.grad is not None:
                continue
            flat = p.grad.view(-1) if p.grad is not None else None
            transfer.pack_grad(self._host.comm, self._plan, i, flat, False, self._to_host)
        self._hooked = [False] * len(self._params)

    def _unit_grad(self, u: Unit) -> Tensor:
        if self.in_place or self._direct:
            g = self._params[u.pidx].grad
            assert g is not None
            return g.view(-1)[u.start : u.start + u.numel]
        assert self._host.grad is not None
        return self._host.grad[u.off : u.off + u.numel]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradients to a global 2-norm of ``max_norm``; return the norm.

        Call this instead of ``torch.nn.utils.clip_grad_norm_``: the norm is taken after the
        cross-rank reduction, over every shard, and the gradients the step consumes are scaled
        (when state is offloaded, the device ``.grad`` is left as it is: the fused step
        applies the factor as it reads the gradients, the reference path scales its host
        copy). Same formula as torch: ``coef = min(1, max_norm / (norm + 1e-6))``.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported; OffloadAdamW clips 2-norms")
        total = self.grad_norm()
        self.scale_grads(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The 2-norm of the averaged gradients over every shard, as the step will read them
        (the first half of ``clip_grad_norm_``; expert parallelism combines two of them)."""
        self._sync_grads()
        if self._pipe is not None:  # the buckets' norms, taken on the device as they landed
            return self._pipe.total_norm() * self._grad_scale
        if not self._dist:  # one process: the gradients on the devices are the averaged ones
            norms = update.param_norms([p.grad for p in self._params])
            return update.total_norm(norms) * self._grad_scale
        assert self._host.grad is not None
        local = update.sum_of_squares(self._host.grad[: self._plan.own_size])
        if self.num_shards > 1:
            collectives.sum_over_ranks(local, self._ranks)
        total = local.sqrt()
        if self._fused is not None:  # the norm of the gradients as the step will read them
            total = total * self._grad_scale
        return total

    @torch.no_grad()
    def scale_grads(self, coef: Tensor | float) -> None:
        """Multiply the gradients the next step consumes by ``coef`` (the second half of
        ``clip_grad_norm_``)."""
        self._sync_grads()
        if self._pipe is not None and any(self._pipe.submitted):
            raise RuntimeError(
                "the gradients cannot be scaled: their buckets' updates have started "
                "(update_in_backward=True); build the optimizer without it to clip"
            )
        if self.in_place:
            torch._foreach_mul_([p.grad for p in self._params if p.grad is not None], coef)
        elif self._fused is not None:
            self._grad_scale *= float(coef)
        else:  # the reference path reads its host copy, scaled here; the factor is kept
            assert self._host.grad is not None  # for the norm of the device gradients
            self._host.grad.mul_(coef)
            self._grad_scale *= float(coef)

    def _xfer_buffer(self, device: torch.device) -> Tensor:
        """The fp32 device scratch through which 16-bit tensors change dtype on the device."""
        return self._scratch.get(device)

    def _to_host(self, dst: Tensor, src: Tensor, non_blocking: bool) -> None:
        """fp32 host ``dst`` <- ``src`` (see :func:`moestack.optim.transfer.copy_to_host`)."""
        transfer.copy_to_host(dst, src, non_blocking, self._xfer_buffer)

    def _to_device(self, dst: Tensor, src: Tensor, non_blocking: bool) -> None:
        """``dst`` <- fp32 host ``src`` (see :func:`moestack.optim.transfer.copy_to_device`)."""
        transfer.copy_to_device(dst, src, non_blocking, self._xfer_buffer)
