"""The fused AdamW host step, one op in three implementations that agree bitwise.

OffloadAdamW's host step (:mod:`moestack.optim.fused` chooses the implementation and hands
it the slices) does, for each element, exactly these fp32 operations in this order, with no
fused multiply-add, so that the implementations agree bit for bit and the master and moments
follow ``torch.optim.AdamW`` to rounding::

    g  = grad * scale
    m  = m + (1 - beta1) * (g - m)                 # exp_avg.lerp_(g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    x  = x * (1 - lr * wd) + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
    out = x narrowed to the parameter's dtype      # bitwise x.to(torch.bfloat16)

- ``native`` (:class:`NativeKernel`): the C++ kernel ``host_adamw.cpp`` beside this file,
  built at first use (:mod:`moestack.kernels.host_build`). Why: torch.compile's CPU code for
  the step reloads its scalar coefficients on every vector iteration (its pointers are not
  ``restrict``) and cannot stream its stores: 0.69x of torch's fused in-place AdamW on one
  thread of the development machine, where this kernel reaches 1.08x (BENCHMARKS.md). With
  AVX-512 the loops are written with intrinsics: the split master's join and split (bf16
  weights plus int16 remainders, :mod:`moestack.optim.split_master`), non-temporal stores for
  narrowed weights that are written once and not read first, and software prefetch on every
  stream; otherwise the compiler vectorises plain C++. One call steps many contiguous
  segments: the elements of all segments, concatenated, go to the threads in chunks of 64K
  elements, each to the next free thread. :meth:`NativeKernel.prepare` turns the segments
  into the pointer arrays the call takes once; a step whose slices have not moved reuses
  them, so the Python around the kernel stays a small fraction of a step.
- ``compile`` (:class:`CompiledKernel`): :func:`step_formula` through torch.compile.
- eager (:func:`eager_kernel`): :func:`step_formula` in eager torch ops, the reference.
"""

from __future__ import annotations

import ctypes
import math
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from moestack.kernels import host_build

SOURCE_FILE = "host_adamw.cpp"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_MIN_COMPILED = 16  # slices shorter than this run the eager formula (no 0/1 specialisation)

_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_OUT_KINDS = {torch.float32: 1, torch.bfloat16: 2}


class Seg(NamedTuple):
    """One contiguous slice of the step: 1-D CPU tensors of equal length, and 8 coefficients.

    ``x`` is the fp32 master, or, for a split master, its int16 low halves (see
    :func:`join_master`), with the bf16 weights in ``out`` read and
    written; ``g`` the gradient (fp32 or bf16); ``m``/``v`` the moments (both fp32 or both
    bf16); ``out`` receives the updated weight in its dtype (fp32 or bf16), or is None.
    ``coef`` is :func:`coefficients`.
    """

    x: Tensor
    g: Tensor
    m: Tensor
    v: Tensor
    out: Tensor | None
    coef: tuple[float, ...]


class Prepared(NamedTuple):
    """Segments as the kernel takes them: pointers and lengths, dtype kinds (see host_adamw.cpp)."""

    ptrs: ctypes.Array
    kinds: ctypes.Array
    nseg: int


class NativeKernel:
    """The loaded library's step: one call for a list of :class:`Seg`."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = lib.moestack_fused_adamw
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def __call__(self, segs: Sequence[Seg]) -> None:
        """Step every segment (all threads of torch's pool, one pass over memory)."""
        self.run(self.prepare(segs), [s.coef for s in segs])

    @staticmethod
    def prepare(segs: Sequence[Seg]) -> Prepared:
        """Check the segments (:func:`check_seg`) and build the arrays the kernel reads; valid
        while the tensors stay where they are. ctypes arrays: a few microseconds, where
        torch.tensor takes tens."""
        ptrs: list[int] = []
        kinds: list[int] = []
        for s in segs:
            n = check_seg(s)
            out = s.out
            ptrs += (s.x.data_ptr(), s.g.data_ptr(), s.m.data_ptr(), s.v.data_ptr())
            ptrs += (0 if out is None or not n else out.data_ptr(), n)
            split = int(s.x.dtype == torch.int16)
            kinds += (_KINDS[s.g.dtype], _KINDS[s.m.dtype], _out_kind(out), split)
        p = (ctypes.c_int64 * len(ptrs))(*ptrs)
        k = (ctypes.c_int32 * len(kinds))(*kinds)
        return Prepared(p, k, len(segs))

    def run(self, prepared: Prepared, coefs: Sequence[tuple[float, ...]]) -> None:
        """Step prepared segments with one coefficient tuple each."""
        if len(coefs) != prepared.nseg:
            raise ValueError(f"{len(coefs)} coefficient tuples for {prepared.nseg} segments")
        if not prepared.nseg:
            return
        first = tuple(coefs[0])
        if coefs.count(first) == len(coefs):  # one step count, one schedule: the usual case
            flat: Sequence[float] = first * prepared.nseg
        else:
            flat = [value for coef in coefs for value in coef]
        if len(flat) != 8 * prepared.nseg:
            raise ValueError(f"each segment takes 8 coefficients, got {[len(c) for c in coefs]}")
        c = (ctypes.c_float * len(flat))(*flat)
        rc = self._fn(prepared.ptrs, prepared.kinds, c, prepared.nseg, torch.get_num_threads())
        if rc != 0:  # pragma: no cover - check_seg refuses what the kernel would
            raise RuntimeError(f"moestack_fused_adamw returned {rc}")


def _out_kind(out: Tensor | None) -> int:
    return 0 if out is None else _OUT_KINDS[out.dtype]


def check_seg(s: Seg) -> int:
    """The segment's length; ValueError unless the kernel can take it (it gets raw pointers)."""
    n = s.x.numel()
    split = s.x.dtype == torch.int16 and s.out is not None and s.out.dtype == torch.bfloat16
    ok = (
        (s.x.dtype == torch.float32 or split)
        and s.g.dtype in _KINDS
        and s.m.dtype in _KINDS
        and s.v.dtype == s.m.dtype
        and (s.out is None or s.out.dtype in _OUT_KINDS)
        and len(s.coef) == 8
    )
    for t in (s.x, s.g, s.m, s.v, s.out):
        if t is not None:
            ok = ok and t.device.type == "cpu" and t.is_contiguous() and t.numel() == n
    if not ok:
        tensors = [t for t in s[:5] if t is not None]
        desc = [(tuple(t.shape), t.dtype, t.device.type, t.is_contiguous()) for t in tensors]
        raise ValueError(f"fused step: segment the kernel cannot take: {desc}")
    return n


def load(extra_flags: Sequence[str] = ()) -> NativeKernel:
    """Build (or find in the cache) and load ``host_adamw.cpp``
    (:func:`moestack.kernels.host_build.load_library`); raise RuntimeError if impossible.
    ``extra_flags`` go after the build's flags (the tests build the portable loops, without
    the AVX-512 ones, with ``-mno-avx512f``)."""
    lib, path = host_build.load_library(SOURCE_FILE, "fused_adamw", extra_flags)
    return NativeKernel(lib, path)


Kernel = Callable[[Sequence[Seg]], None]
Combo = tuple[torch.dtype, torch.dtype, torch.dtype | None]  # (grad, moments, out or None)
ALL_COMBOS: tuple[Combo, ...] = tuple(
    (g, s, o) for g in KERNEL_DTYPES for s in KERNEL_DTYPES for o in (None, *KERNEL_DTYPES)
)
SPLIT_COMBOS: tuple[Combo, ...] = tuple(c for c in ALL_COMBOS if c[2] == torch.bfloat16)


# ------------------------------------------------------------------------ the arithmetic


def _update(
    x: Tensor, g: Tensor, m: Tensor, v: Tensor, h: Tensor, sqrt: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """The new (x, m, v) in fp32; ``h`` holds :func:`coefficients` as a float32 tensor."""
    g32 = g.float() * h[7]
    m0, v0 = m.float(), v.float()
    m1 = m0 + h[1] * (g32 - m0)
    v1 = v0 * h[2] + h[3] * g32 * g32
    x1 = x * h[0] + h[6] * m1 / (sqrt(v1) / h[4] + h[5])
    return x1, m1, v1


def _ieee_sqrt(t: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (what ``vsqrtps`` and inductor's code give).

    torch's eager CPU ``sqrt`` may go through a vector math library that is off by one ulp
    for some inputs; the double square root rounded to fp32 is exact.
    """
    return t.double().sqrt().float()


def _store(x: Tensor, m: Tensor, v: Tensor, out: Tensor | None, new: tuple[Tensor, ...]) -> None:
    """Write the new values; ``copy_`` narrows to bf16 with round-to-nearest-even, as
    ``.to(torch.bfloat16)`` does."""
    x1, m1, v1 = new
    x.copy_(x1)
    m.copy_(m1)
    v.copy_(v1)
    if out is not None:
        out.copy_(x1)


def step_formula(x: Tensor, g: Tensor, m: Tensor, v: Tensor, out: Tensor | None, h: Tensor) -> None:
    """One fused step of one slice in eager torch ops: the arithmetic every backend matches
    bitwise (the reference of :func:`self_check`). An int16 ``x`` is a split master's low
    halves, with its bf16 weights in ``out`` (:func:`join_master`)."""
    if x.dtype != torch.int16:
        _store(x, m, v, out, _update(x, g, m, v, h, _ieee_sqrt))
        return
    assert out is not None
    x1, m1, v1 = _update(join_master(out, x), g, m, v, h, _ieee_sqrt)
    _store(x, m, v, None, (split_master(x1, out), m1, v1))


def join_master(hi: Tensor, lo: Tensor) -> Tensor:
    """The fp32 master weights of a split master: the bf16 weights ``hi`` and the int16
    remainders ``lo`` (bits(x) - bits(hi) << 16), exactly. A negative remainder of a zero
    weight, or a positive one of an infinite weight (the weight was written to from outside
    since its remainder was computed; either would join to a NaN), counts as 0."""
    high = hi.view(torch.int16).to(torch.int32) << 16
    low = lo.to(torch.int32)
    mag = high & 0x7FFFFFFF
    invalid = ((mag == 0) & (low < 0)) | ((mag == 0x7F800000) & (low > 0))
    return (high + torch.where(invalid, 0, low)).view(torch.float32)


def split_master(x: Tensor, hi: Tensor) -> Tensor:
    """Write ``x.to(bfloat16)`` into ``hi`` and return the int16 remainders that join back to
    ``x``. Nearest-even rounding leaves remainders in [-0x8000, 0x8000]; the one that int16
    cannot hold, +0x8000 (an exact tie rounded down), becomes 0x7fff: that master weight moves
    one ulp (2^-24 relative) towards its bf16 weight, to which it still rounds. A NaN's
    remainder is the low 16 bits of the difference (its bf16 weight is a NaN, and so is every
    join with it; the kernel writes 0x7fc0 there, torch's ``copy_`` may write another NaN)."""
    hi.copy_(x)
    rem = x.view(torch.int32) - (hi.view(torch.int16).to(torch.int32) << 16)
    return rem.clamp_(max=0x7FFF).to(torch.int16)


def _compiled_formula(
    x: Tensor, g: Tensor, m: Tensor, v: Tensor, out: Tensor | None, h: Tensor
) -> None:
    """:func:`step_formula` as torch.compile sees it (its ``sqrt`` is the exact vector one)."""
    _store(x, m, v, out, _update(x, g, m, v, h, torch.sqrt))


def coefficients(hp: dict[str, float], step: int, scale: float = 1.0) -> tuple[float, ...]:
    """The 8 per-slice scalars, computed in double as torch's AdamW does, for a slice at
    ``step`` (1-based) of a group with hyper-parameters ``hp``
    (:func:`moestack.optim.update.group_hparams`); ``scale`` is the clipping factor."""
    lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    return (
        1 - lr * hp["weight_decay"],
        1 - b1,
        b2,
        1 - b2,
        math.sqrt(bc2),
        hp["eps"],
        -(lr / bc1),
        float(scale),
    )


def eager_kernel(segs: Sequence[Seg]) -> None:
    """The formula slice by slice in eager ops (the reference the backends are checked with)."""
    for s in segs:
        if s.x.numel():
            step_formula(s.x, s.g, s.m, s.v, s.out, torch.tensor(s.coef, dtype=torch.float32))


class CompiledKernel:
    """:func:`step_formula` compiled by torch.compile (inductor's vectorised, multi-threaded
    C++ for the CPU), called once per slice. Shapes are dynamic, so one compilation serves
    every length; each dtype combination gets its own copy of the function, so that each
    has its own compile cache (dynamo caches per code object, with a recompile limit)."""

    name = "compile"

    def __init__(self) -> None:
        self._fns: dict[Combo, Callable[..., None]] = {}

    def _fn(self, combo: Combo) -> Callable[..., None]:
        fn = self._fns.get(combo)
        if fn is None:
            code = _compiled_formula.__code__
            twin = types.FunctionType(
                code.replace(co_name=f"{code.co_name}_{len(self._fns)}"),
                _compiled_formula.__globals__,
            )
            # dynamic_threads: always one parallel loop, its threads chosen by OpenMP at run
            # time (torch.set_num_threads), not fixed by the thread count or length at compile
            options = {"cpp.dynamic_threads": True}
            fn = torch.compile(twin, dynamic=True, fullgraph=True, options=options)
            self._fns[combo] = fn
        return fn

    @torch.no_grad()
    def __call__(self, segs: Sequence[Seg]) -> None:
        if any(s.x.dtype != torch.float32 for s in segs):
            raise ValueError("the compiled step takes fp32 master weights, not a split master")
        for s in segs:
            n = s.x.numel()
            if n:
                combo = (s.g.dtype, s.m.dtype, None if s.out is None else s.out.dtype)
                fn = self._fn(combo) if n >= _MIN_COMPILED else step_formula
                x, g, m, v, out = (None if t is None else _alias(t) for t in s[:5])
                fn(x, g, m, v, out, torch.tensor(s.coef, dtype=torch.float32))


def _alias(t: Tensor) -> Tensor:
    """The memory of ``t`` as a tensor that is not a view: dynamo guards on a view's base
    (its shape and strides), which would recompile for every parameter shape."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def self_check(kernel: Kernel, combos: Sequence[Combo], n: int = 67, split: bool = False) -> None:
    """Raise RuntimeError unless ``kernel`` matches :func:`step_formula` bitwise on random
    slices of each dtype combination, with split master weights if ``split`` (a wrong build
    must not train)."""
    gen = torch.Generator().manual_seed(0)
    hp = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}
    coef = coefficients(hp, step=3, scale=0.5)
    for combo in combos:
        base = [torch.randn(n, generator=gen) for _ in range(3)]
        base.append(torch.rand(n, generator=gen))  # the second moment is >= 0
        want, got = _seg_of(base, combo, coef, split), _seg_of(base, combo, coef, split)
        eager_kernel([want])
        kernel([got])
        for a, b in zip(want, got, strict=True):
            if isinstance(a, Tensor) and not torch.equal(a, b):
                raise RuntimeError(f"results differ from the reference formula for {combo}")


def _seg_of(base: list[Tensor], combo: Combo, coef: tuple[float, ...], split: bool = False) -> Seg:
    """A fresh slice of dtypes ``combo`` from fp32 ``base`` = [x, g, m, v]; with ``split`` the
    master is held as bf16 weights (``out``) and int16 remainders (``x``)."""
    g_dt, s_dt, o_dt = combo
    x, g, m, v = (t.clone() for t in base)
    out = None if o_dt is None else torch.empty(x.numel(), dtype=o_dt)
    if split:
        assert out is not None and o_dt == torch.bfloat16
        x = split_master(x, out)
    return Seg(x, g.to(g_dt), m.to(s_dt), v.to(s_dt), out, coef)
