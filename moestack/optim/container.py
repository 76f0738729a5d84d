"""The optimizer a training loop holds, whatever the parallel layout.

One process, data parallel or expert parallel, torch AdamW or OffloadAdamW: the loop calls the
same methods (``moestack.optim.build_training_optimizer`` picks the implementation):

- ``forward_model``: the module to run forward and backward through (the model, or its DDP
  wrapper where DDP averages the gradients in backward);
- ``no_sync()``: a context for every accumulation micro-batch but the last, inside which
  backward starts no gradient exchange (nor copy to the host);
- ``clip_grad_norm(max_norm) -> float``: the global gradient norm before clipping, over all
  ranks with each parameter counted once (0 when ``max_norm <= 0``: clipping off);
- ``backward(loss)``: backward of the loss (an optimizer that updates in backward steps each
  tensor there, ``optim.update_in_backward``; a non-finite loss steps nothing);
- ``step()`` and ``zero_grad()``: gradients are averaged over the ranks that share each
  parameter before the update, by whichever part does it at this layout;
- ``synchronize()``: the weights of every update made are in the parameters (a delayed
  update, ``optim.update_delay``, is applied); call it before evaluating or saving the model;
- ``state_dict()`` / ``load_state_dict()``: one checkpoint format at every ``(dp, ep)``
  layout (collective under ``torch.distributed``: call them on every rank), so a run saved at
  one layout resumes at any other;
- ``sharded_state_dict()`` / ``load_sharded_state_dict()``: the same state in pieces, the
  common part (written by rank 0) and this rank's parts (its experts', its ZeRO shard of
  the replicated parameters': written by it, so expert parallelism gathers no state),
  loaded at any layout from the parts a rank needs (:mod:`moestack.optim.expert_state`).

It is a ``torch.optim.Optimizer`` so that LR schedulers drive it: ``param_groups`` are the
groups the schedule sets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moestack.optim import expert_state


class TrainingOptimizer(torch.optim.Optimizer):
    """The interface above; subclasses hold the optimizer(s) that do the work.

    ``torch.optim.Optimizer.__init__`` is not called: the parameters belong to the inner
    optimizers, whose groups, state and defaults a subclass exposes.
    """

    forward_model: nn.Module

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward inside exchanges no gradients (accumulation); nothing to skip here."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``; nothing is updated in it here."""
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to the global 2-norm ``max_norm``; return the norm before
        clipping, or 0 without measuring it when ``max_norm <= 0`` (clipping off)."""
        if max_norm <= 0:
            return 0.0
        return self._clip(max_norm)

    def _clip(self, max_norm: float) -> float:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Apply a delayed update in flight; nothing is delayed here."""

    def metrics(self) -> dict[str, float]:
        """The optimizer's own metrics of its last step (``optim/...``); none here."""
        return {}

    def sharded_state_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``(common, own)``: the state rank 0 writes and the parts this rank writes (its
        experts', its shard of the replicated state; none: []). Here all of it is common
        (collective as ``state_dict``)."""
        return self.state_dict(), []

    def load_sharded_state_dict(
        self, common: dict[str, Any], parts: Sequence[dict[str, Any]]
    ) -> None:
        """Load a state saved by ``sharded_state_dict`` at any layout: ``common`` and the
        parts holding the experts this optimizer needs (here: all of them, whole)."""
        model = getattr(self, "model", None)
        names = names_in_order(self.param_groups, model)
        params = dict(model.named_parameters()) if model else {}
        rows = {n: (0, p.shape[0]) for n, p in params.items()}
        numel = {n: p.numel() for n, p in params.items()}
        self.load_state_dict(expert_state.merge(common, parts, names, rows.get, numel.get))


class SingleOptimizer(TrainingOptimizer):
    """One inner optimizer over this rank's parameters, whose groups, state and defaults
    are this one's; subclasses add what the layout needs."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer = optimizer
        self.model = model
        self.forward_model = model

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self.optimizer.step(closure)

    def backward(self, loss: torch.Tensor) -> None:
        own = getattr(self.optimizer, "backward", None)
        if callable(own):
            own(loss)
        else:
            loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        own = getattr(self.optimizer, "synchronize", None)
        if callable(own):
            own()

    def metrics(self) -> dict[str, float]:
        own = getattr(self.optimizer, "metrics", None)
        return own() if callable(own) else {}

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


class LocalOptimizer(SingleOptimizer):
    """One optimizer over the whole model: on one process; OffloadAdamW on any number of
    ranks (it averages the gradients itself); torch AdamW under data parallelism, behind
    DDP (``ddp=True``), which averages the gradients in backward."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, ddp: bool) -> None:
        super().__init__(optimizer, model)
        self.ddp = nn.parallel.DistributedDataParallel(model) if ddp else None
        if self.ddp is not None:
            self.forward_model = self.ddp

    def no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's all-reduce or OffloadAdamW's copies to the host wait for the last
        micro-batch."""
        for owner in (self.ddp, self.optimizer):
            if owner is not None and hasattr(owner, "no_sync"):
                return owner.no_sync()
        return contextlib.nullcontext()

    def _clip(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, self.optimizer, max_norm)


def clip_grad_norm(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> float:
    """Clip gradients to a global 2-norm; the optimizer's own clip when it has one.

    Returns the norm before clipping. With :class:`OffloadAdamW` the norm is taken over the
    reduced gradients of all ranks; otherwise it is ``torch.nn.utils.clip_grad_norm_``.
    """
    own = getattr(optimizer, "clip_grad_norm_", None)
    if callable(own):
        return float(own(max_norm))
    params = [p for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def names_in_order(groups: list[dict[str, Any]], model: nn.Module | None) -> list[str] | None:
    """The names of the parameters of ``groups`` in order (torch keys its state by this
    position), from the model's ``named_parameters``; None without a model."""
    if model is None:
        return None
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in groups for p in g["params"]]
