"""TieredAdamW's update in backward (``optim.update_in_backward``): each tensor stepped as
its gradient lands, and that gradient freed at once.

Why: with ``master="none"`` a bf16 expert parameter costs its weight (2 bytes), its gradient
(2 bytes) and a few hundredths of a byte of factored state. The gradients are held only
between backward and the step; stepping each tensor in its
``register_post_accumulate_grad_hook`` and dropping its gradient there means the gradients of
the whole model never exist at once: autograd runs a tensor's gradient accumulation as soon as
the node that made it is done, so what is held at a time is one node's parameter gradients (at
most a module's; a compiled block's under ``compile=true``) and any gradient a parameter used
twice waits for (a tied embedding's). :func:`held_gradient_numel` counts that bound from the
shapes.

What it asks of a run (``OptimConfig`` and the factory refuse the rest): no global gradient
clip (``optim.grad_clip=0``; ``optim.clip_update`` clips each matrix's update), one micro-batch
a step, one process. A non-finite loss steps nothing: :meth:`BackwardUpdate.backward` looks
at the loss before backward, and the trainer then skips the step and drops the gradients as
it does without this. The update is the same as ``step()``'s, bit for bit, in any order
(tests/optim/test_tiered_backward.py); the statistics are added in the step's order.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor, nn

from moestack.kernels import host_tiered
from moestack.optim.tiered_plan import Tally, count
from moestack.optim.transfer import weak_grad_hook


class BackwardUpdate:
    """The hooks of one :class:`~moestack.optim.tiered.TieredAdamW`'s parameters, armed only
    during :meth:`backward` (a plain ``loss.backward()`` leaves the gradients to ``step()``)."""

    def __init__(self, opt: Any) -> None:  # a TieredAdamW (which imports this module)
        self.opt = opt
        self.armed: dict[int, tuple[Tensor, dict[str, Any]]] = {}  # this backward's owned
        self.tallies: dict[int, Tally] = {}
        self.stepped = False  # the last backward stepped: the next step() adds to its stats
        hook = weak_grad_hook(self)  # held weakly: a dropped optimizer is freed
        handles = [p.register_post_accumulate_grad_hook(hook)
                   for group in opt.param_groups for p in group["params"]]  # fmt: skip
        weakref.finalize(self, _remove, handles)  # and its hooks taken off

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``, each owned tensor stepped as its gradient lands (a non-finite
        loss: none; its gradients are left for the caller to drop)."""
        if not bool(torch.isfinite(loss).all()):
            loss.backward()
            return
        owned = self.opt._owned()
        self.armed = {id(p): (p, group) for p, group in owned}
        self.tallies = {}
        try:
            loss.backward()
        finally:
            self.armed = {}
        self.opt.reset_stats()
        for p, _ in owned:  # in the step's order: the statistics of step(), bit for bit
            if id(p) in self.tallies:
                count(self.opt.stats, self.tallies[id(p)])
        self.stepped = True

    def _grad_hook(self, p: Tensor) -> None:
        pair = self.armed.get(id(p))
        if pair is None or p.grad is None or not p.numel():
            return
        if id(p) in self.tallies:
            raise RuntimeError(
                f"{self.opt.names[id(p)]} received a gradient twice in one backward (reentrant "
                "activation checkpointing, or a second backward through the same graph), so "
                "optim.update_in_backward stepped it on a part of its gradient; use "
                "checkpoint(use_reentrant=False), or optim.update_in_backward=false"
            )
        kernel = host_tiered.kernel_or_none() if self.opt.host_kernel else None
        with torch.no_grad():
            self.tallies[id(p)] = self.opt._step_each([pair], kernel)[0][0]
        p.grad = None


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def held_gradient_numel(
    model: nn.Module, only: Collection[str] | None = None, compiled: bool = False
) -> int:
    """The most gradient elements of ``model``'s trained parameters (those named in ``only``,
    if given) held at once when each tensor steps in backward: the largest module's (at most
    one autograd node's gradients: a linear layer's weight and bias, a MoE layer's experts;
    ``compiled``, each block compiled as one graph: the largest block's, a block being the
    parameters under one numbered module such as ``layers.3``) plus every parameter used under
    two names (a tied embedding: its gradient waits for both uses; twice itself while the
    second is added)."""
    names: dict[int, list[str]] = {}
    numel: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names.setdefault(id(p), []).append(name)
            numel[id(p)] = p.numel()
    by_unit: dict[str, int] = {}
    waiting = 0
    for pid, seen in names.items():
        if only is not None and seen[0] not in only:
            continue
        if len(seen) > 1:
            waiting += numel[pid]
        else:
            unit = _block_of(seen[0]) if compiled else seen[0].rpartition(".")[0]
            by_unit[unit] = by_unit.get(unit, 0) + numel[pid]
    return max(max(by_unit.values(), default=0) + waiting, 2 * waiting)


def _block_of(name: str) -> str:
    """The numbered module ``name`` lies under (``layers.3``), else its own module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name.rpartition(".")[0]
