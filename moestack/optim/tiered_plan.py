"""TieredAdamW's C++ step of its CPU tensors, the kernel's descriptors kept from step to step.

Why: a tensor's descriptor (its pointers, layout, 12 coefficients and checks) built in Python
every step cost about 0.2 ms a step on the default model's 30 tensors, a sixth of the
kernel's own time, while a training run steps the same tensors every step. A
:class:`KernelPlan` is made from one step's jobs; at each later step it checks what may have
changed (which tensors step, the weights' and gradients' kinds, the state tensors, the
groups' settings and the clip; any change and the optimizer makes a new one) and patches only
what a step changes: the gradients' addresses, the coefficients of the learning rate and the
step count, and the stochastic rounding's noise keys, each as
:func:`moestack.kernels.host_tiered.coefficients` and :func:`~moestack.kernels.host_tiered.unit_key`
give it (tests/optim/test_tiered_kernel.py steps the same bits with the plan as without).
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from moestack.kernels import host_tiered

STATE = ("m", "v", "row", "col", "master")  # a parameter's state tensors, in Job's order
_NI, _NC = host_tiered.FIELDS, host_tiered.COEFS


@dataclass
class Native:
    """One tensor the kernel took at the step a plan is made from."""

    p: Tensor
    group: dict[str, Any]
    job: host_tiered.Job
    st: dict[str, Any]  # its optimizer state (the step count is counted on here)
    decay: float  # its weight decay (the group's, or 0 for a 1-D tensor)
    key_ids: tuple[tuple[str, int | None], ...]  # (name, global expert id or None) per unit


@dataclass(slots=True)
class _Entry:
    p: Tensor
    st: dict[str, Any]
    state: tuple[tuple[str, Tensor, int], ...]  # (key, tensor, address) of each
    numel: int  # the weights' (and gradient's) elements
    w_ptr: int
    w_dtype: Any
    g_dtype: Any
    keys: array | None  # its units' noise keys (int32), read by the kernel through fields
    key_ids: tuple[tuple[str, int | None], ...]


@dataclass(slots=True)
class _Block:
    """Entries [start, end) of one param group with one weight decay and momentum or none:
    they share the step's coefficients when their step counts agree."""

    group: dict[str, Any]
    settings: tuple[Any, ...]  # the group's betas, eps and weight decay when made
    start: int
    end: int
    decay: float
    momentum: bool


def _settings(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(group["betas"]), group["eps"], group["weight_decay"]


Tally = tuple[str, float, float, int, int]
"""One tensor's step as its population's statistics take it: (population, the sum over its
units of their applied RMS^2, units clipped, elements, units)."""


def count(stats: dict[str, dict[str, float]], tally: Tally) -> None:
    """Add one tensor's step to its population's statistics (every step's tensors in their
    order, so a plan's statistics are those of a step without one, bit for bit)."""
    population, applied_sq, clipped, numel, units = tally
    s = stats[population]
    s["sq_sum"] += applied_sq * (numel / units)
    s["numel"] += numel
    s["clipped"] += clipped
    s["units"] += units


class KernelPlan:
    """The kernel's call for one step's CPU tensors, repeated at later steps.

    ``todo``: the ``(parameter, group)`` pairs the step stepped, of ``owned`` (all this rank
    keeps the state of, in order), with their ``populations``; ``native``: those the kernel
    took, by position in ``todo``; ``state``: the optimizer's state (each parameter's dict);
    ``seed``, ``clip``: its rounding seed and update clip. While it fits, the others of
    ``todo`` (:attr:`rest`) are stepped one by one as before."""

    def __init__(
        self, todo: list[tuple[Tensor, dict[str, Any]]], owned: list[tuple[Tensor, dict[str, Any]]],
        populations: list[str], native: dict[int, Native], state: dict[Any, dict[str, Any]],
        seed: int, clip: float,
    ) -> None:  # fmt: skip
        self.seed, self.clip = seed, clip
        self.rest = [pair for i, pair in enumerate(todo) if i not in native]
        stepped = {id(p) for p, _ in todo}
        self.absent = [p for p, _ in owned if id(p) not in stepped]
        self.states = list(state.values())  # a state replaced, added or removed: a new plan
        self.entries: list[_Entry] = []
        self.blocks: list[_Block] = []
        self.fields, self.coefs = array("q"), array("f")
        order = sorted(
            native, key=lambda i: (id(todo[i][1]), native[i].decay, native[i].job.m is None)
        )
        for i in order:
            self._add(native[i])
        entry_of, rest_of = {i: k for k, i in enumerate(order)}, iter(range(len(self.rest)))
        self.order = [  # each tensor's tally, in the step's order: (entry or -1 - rest, ...)
            (entry_of[i], pop, native[i].job.w.numel(), native[i].job.units) if i in native
            else (-1 - next(rest_of), pop, 0, 0)
            for i, pop in enumerate(populations)
        ]  # fmt: skip
        self.stats = array("d", bytes(16 * len(self.entries)))

    def _add(self, n: Native) -> None:
        fields = list(host_tiered.fields_of(n.job))
        keys = None
        if n.job.keys is not None:
            keys = array("i", n.job.keys.tolist())
            fields[host_tiered.KEYS] = keys.buffer_info()[0]
        self.fields.extend(fields)
        self.coefs.extend(n.job.coef)
        state = tuple((k, n.st[k], n.st[k].data_ptr()) for k in STATE if k in n.st)
        self.entries.append(_Entry(n.p, n.st, state, n.p.numel(), n.p.data_ptr(), n.p.dtype,
                                   n.job.g.dtype, keys, n.key_ids))  # fmt: skip
        k, momentum = len(self.entries) - 1, n.job.m is not None
        last = self.blocks[-1] if self.blocks else None
        if (
            last is None
            or last.group is not n.group
            or (last.decay, last.momentum) != (n.decay, momentum)
        ):
            last = _Block(n.group, _settings(n.group), k, k, n.decay, momentum)
            self.blocks.append(last)
        last.end = k + 1

    def fits(self, seed: int, clip: float, state: dict[Any, dict[str, Any]]) -> bool:
        """Whether this plan steps this step as a new one would: the same tensors with a
        gradient; each one's weights and gradient of the same size and dtype (the gradient
        contiguous), its weights and state tensors the same objects at the same addresses;
        the optimizer's ``state`` holding the same dicts; the same settings (the gradients'
        addresses are taken on the way). What the kernel reads and writes through its
        pointers is then where, and as large as, it was when the plan was made."""
        if seed != self.seed or clip != self.clip or len(state) != len(self.states):
            return False
        if not all(map(operator.is_, state.values(), self.states)):
            return False
        for p, _ in self.rest:
            if p.grad is None:
                return False
        for p in self.absent:
            if p.grad is not None and p.numel():
                return False
        for b in self.blocks:
            if _settings(b.group) != b.settings:
                return False
        fields = self.fields
        for k, e in enumerate(self.entries):
            p = e.p
            g = p.grad
            if (g is None or g.dtype is not e.g_dtype or not g.is_contiguous()
                    or p.data_ptr() != e.w_ptr or p.dtype is not e.w_dtype
                    or p.numel() != e.numel or g.numel() != e.numel):  # fmt: skip
                return False
            st = e.st
            for key, t, ptr in e.state:  # the same storage: a state tensor can only grow in it
                if st.get(key) is not t or t.data_ptr() != ptr:
                    return False
            fields[k * _NI + host_tiered.G] = g.data_ptr()
        return True

    def run(self, kernel: host_tiered.TieredKernel) -> None:
        """One step of every entry (right after :meth:`fits`, which took the gradients'
        addresses): the step counts counted on, the coefficients and noise keys patched, one
        kernel call."""
        for b in self.blocks:
            self._step_block(b)
        kernel.call(self.fields, self.coefs, self.stats, len(self.entries))

    def tally(self, rest: list[Tally], stats: dict[str, dict[str, float]]) -> None:
        """Add the step's tallies to ``stats`` in the step's order: the entries' from the
        kernel, the others' (``rest``, as :attr:`rest`) as given."""
        got = self.stats
        for src, population, numel, units in self.order:
            if src >= 0:
                count(stats, (population, got[2 * src], got[2 * src + 1], numel, units))
            else:
                count(stats, rest[-1 - src])

    def _step_block(self, b: _Block) -> None:
        """Count on the step of block ``b``'s entries and patch what it changes: the
        coefficients of the learning rate and step count (computed once per step count: one
        for the block unless a tensor missed steps before the plan was made) and noise keys."""
        group, coefs, first = b.group, self.coefs, host_tiered.EPS
        lr, betas, eps = group["lr"], group["betas"], group["eps"]
        done: dict[int, array] = {}
        for k in range(b.start, b.end):
            e = self.entries[k]
            t = e.st["step"] = e.st["step"] + 1
            if t not in done:
                done[t] = array("f", host_tiered.step_coefficients(lr, betas, eps, t, b.decay,
                                                                   b.momentum))  # fmt: skip
            coefs[k * _NC + first : k * _NC + first + 4] = done[t]
            if e.keys is not None:
                for u, (name, expert) in enumerate(e.key_ids):
                    e.keys[u] = host_tiered.unit_key(self.seed, name, expert, t)
