"""TieredAdamW's update of one tensor, in C++ on the CPU and in torch ops elsewhere, bit for bit.

The arithmetic (docs/optim.md, "Tiered state"), for a tensor viewed as ``lead`` matrices of
``[rows, cols]`` (a 1-D tensor: one row; a full second moment: any rows of the last dim),
grouped into ``units`` (the experts of a stacked tensor, else the whole tensor: the RMS clip's
and the rounding noise's unit), every operation in fp32 with no fused multiply-add::

    factored:  row = row * b2 + tree_cols(g * g) * kr       kr = (1 - b2) / cols
               col = col * b2 + tree_rows(g * g) * kc       kc = (1 - b2) / rows
               d   = a_i * b_j + eps_s    a = sqrt(row / max(tree(row) / rows, 1e-30)), b = sqrt(col)
    full:      v   = v * b2 + ((1 - b2) * g) * g;   d = sqrt(v) + eps_s
    momentum:  m   = m + (1 - b1) * (g - m)  (rounded to bf16 when kept so);  u = (m / d) * kbias
    none:      u   = (g / d) * kbias
    per unit:  rms = sqrt(tree(u * u)) / sqrt(n);  f = max(rms / clip, 1) (clip on, else 1)
               w   = w * decay + u * ((1 / f) * (-lr))
    written:   to the master and/or the weights; without a master stochastically rounded:
               bits(w) + noise, the low 16 bits cut (non-finite values as they are)

Every sum is the halving tree ``tree`` (``x[k] + x[k + ceil(n/2)]`` until one value is left;
over the columns of each row, the rows of each column, the rows of each unit's row sums), so
its result depends on the values alone, not on a vector width or a thread count (on devices
other than the CPU the torch ops use torch's own sums: :func:`tree_sum`). The rounding
noise of element ``i`` of a unit is ``mix32(mix32(i) ^ key) >> 16``, ``key`` the unit's
(:func:`unit_key`: the seed, the parameter's name, the expert's global id, the step). The
square roots are correctly rounded (torch's through float64, as the host AdamW step's).

Why: torch's ops make about ten passes over each tensor and the Python around each (4.1x
torch's fused AdamW on the default model, BENCHMARKS.md); ``host_tiered.cpp`` steps every
tensor in one call, each row's work done while it is in cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from moestack.kernels import host_build

log = logging.getLogger(__name__)
SOURCE_FILE = "host_tiered.cpp"
FIELDS, COEFS = 14, 12  # a tensor's int64 fields and float coefficients (host_tiered.cpp's enums)
G, KEYS = 1, 7  # the fields of the gradient's and the noise keys' addresses
EPS, NEGLR = 4, 7  # the first and last coefficient a step changes (also KBIAS and DECAY)
TOGETHER = 1 << 18  # units of at least this many elements are stepped by all threads at once
_TINY = 1e-30
_KINDS = {torch.float32: 0, torch.bfloat16: 1}


class Job(NamedTuple):
    """One tensor's update: its tensors (contiguous, on one device), layout and coefficients.

    ``w`` the weights (fp32 or bf16, written); ``g`` the gradient (fp32 or bf16); ``m`` the
    first moment (fp32 or bf16) or None; ``v`` the full second moment (fp32) or, factored,
    ``row`` [lead, rows] and ``col`` [lead, cols] (fp32); ``master`` an fp32 master or None;
    ``keys`` the units' noise keys (int32, :func:`unit_key`) for stochastic rounding, else None;
    ``coef``: :func:`coefficients`."""

    w: Tensor
    g: Tensor
    m: Tensor | None
    v: Tensor | None
    row: Tensor | None
    col: Tensor | None
    master: Tensor | None
    keys: Tensor | None
    units: int
    lead: int
    rows: int
    cols: int
    coef: tuple[float, ...]


def coefficients(
    lr: float, betas: tuple[float, float], eps: float, t: int, decay: float, clip: float,
    momentum: bool, rows: int, cols: int, unit_numel: int,
) -> tuple[float, ...]:  # fmt: skip
    """The 12 scalars of :class:`Job` (host_tiered.cpp's enum B1C ... RF), in double here and
    float32 in the kernel; ``decay`` the weight decay (0 for a 1-D tensor)."""
    b1, b2 = betas
    return (
        1 - b1, b2, (1 - b2) / cols, (1 - b2) / rows,
        *step_coefficients(lr, betas, eps, t, decay, momentum),
        clip, math.sqrt(unit_numel), 1 - b2, float(rows),
    )  # fmt: skip


def step_coefficients(
    lr: float, betas: tuple[float, float], eps: float, t: int, decay: float, momentum: bool
) -> tuple[float, float, float, float]:
    """Those of :func:`coefficients` that the learning rate and the step count change, its
    [EPS, NEGLR] (eps scaled by the second moment's bias correction, the update's bias
    correction, the weight decay's factor and the step's sign and size)."""
    b1, b2 = betas
    bias2 = math.sqrt(1 - b2**t)
    return eps * bias2, bias2 / (1 - b1**t) if momentum else bias2, 1 - lr * decay, -lr


def unit_key(seed: int, name: str, expert: int | None, step: int) -> int:
    """The noise key (31 bits) of one unit: a whole tensor (``expert`` None) or one expert."""
    text = f"{seed}/{name}/{'' if expert is None else expert}@{step}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") >> 1


class TieredKernel:
    """The loaded ``host_tiered.cpp``: one call steps a list of CPU :class:`Job`."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = lib.moestack_tiered_step
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
        self._fn.restype = ctypes.c_int

    def __call__(self, jobs: Sequence[Job]) -> list[tuple[float, float]]:
        """Step every job; each one's (sum over its units of the applied RMS^2, units clipped)."""
        if not jobs:
            return []
        fields, coefs = array("q"), array("f")  # the descriptors, as the kernel reads them
        for j in jobs:
            fields.extend(fields_of(j))
            coefs.extend(j.coef)
        stats = array("d", bytes(16 * len(jobs)))
        try:
            self.call(fields, coefs, stats, len(jobs))
        except ValueError as err:
            raise ValueError(f"{err}: {_describe(jobs)}") from None
        return list(zip(stats[0::2], stats[1::2], strict=True))

    def call(self, fields: array, coefs: array, stats: array, count: int) -> None:
        """One call on ``count`` tensors' descriptors (``fields`` int64 and ``coefs`` float,
        :func:`fields_of` and :func:`coefficients` of each) into ``stats`` (2 doubles each);
        ValueError where the kernel refuses one (then it has written nothing)."""
        rc = self._fn(
            fields.buffer_info()[0], coefs.buffer_info()[0], stats.buffer_info()[0], count,
            torch.get_num_threads(), TOGETHER,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"moestack_tiered_step refused a tensor's descriptor ({rc})")


def fields_of(j: Job) -> tuple[int, ...]:
    """The kernel's int64 fields of ``j`` (host_tiered.cpp: enum W ... STATS)."""
    mk = 0 if j.m is None else 1 + _KINDS[j.m.dtype]
    kinds = _KINDS[j.g.dtype] | _KINDS[j.w.dtype] << 2 | mk << 4
    kinds |= (j.row is not None) << 6 | (j.keys is not None) << 7
    pointers = (j.w, j.g, j.m, j.v, j.row, j.col, j.master, j.keys)
    return (*(0 if t is None else t.data_ptr() for t in pointers),
            j.units, j.lead, j.rows, j.cols, kinds, 0)  # fmt: skip


def takes(j: Job) -> bool:
    """Whether the C++ kernel takes ``j``: CPU, contiguous, fp32 or bf16, a unit of whole
    matrices, and every state tensor of the size and dtype the kernel reads and writes
    through its pointer (a state restored from elsewhere that does not fit goes to the
    torch ops, which refuse it by name)."""
    n = j.lead * j.rows * j.cols
    fp32 = {"v": n, "row": j.lead * j.rows, "col": j.lead * j.cols, "master": n}
    tensors = [t for t in (j.w, j.g, j.m, j.v, j.row, j.col, j.master, j.keys) if t is not None]
    return (
        all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and j.units >= 1
        and j.lead % j.units == 0
        and j.w.numel() == n > 0
        and j.w.dtype in _KINDS
        and j.g.dtype in _KINDS
        and j.g.numel() == n
        and (j.m is None or (j.m.dtype in _KINDS and j.m.numel() == n))
        and all(
            getattr(j, name) is None
            or (getattr(j, name).dtype == torch.float32 and getattr(j, name).numel() == size)
            for name, size in fp32.items()
        )
        and (j.keys is None or (j.keys.dtype == torch.int32 and j.keys.numel() >= j.units))
    )


def _describe(jobs: Sequence[Job]) -> str:
    return str([(tuple(j.w.shape), j.w.dtype, j.g.dtype, j.units, j.lead) for j in jobs][:4])


def load() -> TieredKernel:
    """Build (or find in the cache) and load ``host_tiered.cpp``; RuntimeError if impossible."""
    lib, path = host_build.load_library(SOURCE_FILE, "tiered_step")
    return TieredKernel(lib, path)


_LOADED: dict[str, TieredKernel | str] = {}  # "kernel" -> the checked kernel, or why not


def kernel_or_none() -> TieredKernel | None:
    """The C++ kernel, built, loaded and checked bitwise against :func:`step_torch` at the
    first call (then remembered); None where it cannot be (one logged line says why: a
    warning where a compiler exists, since then the build is broken)."""
    if "kernel" not in _LOADED:
        try:
            kernel = load()
            self_check(kernel)
            _LOADED["kernel"] = kernel
            log.info("tiered step: C++ kernel %s", kernel.path)
        except Exception as err:  # unavailable: the torch ops run, with the same results
            why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            _LOADED["kernel"] = why
            level = logging.WARNING if host_build.find_compiler() else logging.INFO
            log.log(level, "tiered step: C++ kernel unavailable (%s); using torch ops", why)
    got = _LOADED["kernel"]
    return None if isinstance(got, str) else got


def self_check(kernel: TieredKernel) -> None:
    """Raise RuntimeError unless ``kernel`` steps a few seeded jobs (factored and full, with
    and without momentum, clipped, bf16 and fp32, stochastic rounding) to the bits of
    :func:`step_torch` (a wrong build must not train)."""
    gen = torch.Generator().manual_seed(0)
    for case in range(7):  # the last: one unit of TOGETHER elements, split over the threads
        jobs = [_check_job(case, gen) for _ in range(2 if case < 6 else 1)]
        twin = [Job(*(t.clone() if isinstance(t, Tensor) else t for t in j)) for j in jobs]
        kernel(jobs)
        for j in twin:
            step_torch(j)
        for a, b in zip(jobs, twin, strict=True):
            for x, y in zip(a, b, strict=True):
                if isinstance(x, Tensor) and not torch.equal(x, y):
                    raise RuntimeError(f"results differ from the torch ops in check case {case}")


def _check_job(case: int, gen: torch.Generator) -> Job:
    """A seeded job of ``case``: 3 units of [5, 37] (factored and not, momentum fp32, bf16
    or none, weights fp32 or bf16 with and without a master, clipping on and off)."""
    shape, lead, rows, cols = (3, 5, 37), 3, 5, 37
    if case == 6:  # as case 0 (factored, no momentum, stochastic into fp32), all threads at once
        side = int(TOGETHER**0.5) + 1
        shape, lead, rows, cols, case = (3, side, side), 3, side, side, 0
    factored, mk, wk = case % 2 == 0, (None, torch.float32, torch.bfloat16)[case % 3], case // 3
    w = torch.randn(shape, generator=gen).to((torch.float32, torch.bfloat16)[wk])
    g = torch.randn(shape, generator=gen)
    m = None if mk is None else torch.randn(shape, generator=gen).to(mk)
    v = None if factored else torch.rand(shape, generator=gen)
    row = torch.rand(lead, rows, generator=gen) if factored else None
    col = torch.rand(lead, cols, generator=gen) if factored else None
    master = w.float() if case == 5 else None
    keys = (
        None
        if case == 5
        else torch.randint(0, (1 << 31) - 1, (3,), generator=gen, dtype=torch.int32)
    )
    coef = coefficients(1e-2, (0.9, 0.95), 1e-8, 3, 0.1, 0.5 * (case % 2), mk is not None,
                        rows, cols, rows * cols)  # fmt: skip
    return Job(w, g, m, v, row, col, master, keys, 3, lead, rows, cols, coef)


# --------------------------------------------------------------------- the same in torch ops


def tree_sum(x: Tensor, dim: int) -> Tensor:
    """The halving tree's sum of ``x`` along ``dim`` (host_tiered.cpp: tree) on the CPU, where
    the C++ kernel's bits are to be matched; on another device torch's own sum (one launch,
    where the tree takes a few per level; not the CPU's bits)."""
    n = x.shape[dim]
    if n == 0 or x.device.type != "cpu":
        return x.sum(dim)
    if n == 1:  # a new tensor, as in every other case (callers scale the sum in place)
        return x.squeeze(dim).clone()
    while n > 1:
        half, h = n // 2, n - n // 2
        low = x.narrow(dim, 0, half) + x.narrow(dim, h, half)
        x = torch.cat([low, x.narrow(dim, half, 1)], dim) if h > half else low
        n = h
    return x.squeeze(dim)


def _sqrt(t: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (eager ``sqrt`` may be one ulp off)."""
    return t.double().sqrt().float()


def _mix32_(x: Tensor) -> Tensor:
    """host_tiered.cpp's mix32, in place, on int64 values below 2^32 (products stay below
    2^63, as both multipliers are below 2^31)."""
    x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(0xFFFFFFFF)
    x.bitwise_xor_(x >> 15).mul_(0x5BD1E995).bitwise_and_(0xFFFFFFFF)
    return x.bitwise_xor_(x >> 16)


def noise(keys: Tensor, unit_numel: int) -> Tensor:
    """The rounding noise [units, unit_numel] (int32 in [0, 2^16)) of units with ``keys``."""
    idx = _mix32_(torch.arange(unit_numel, dtype=torch.int64, device=keys.device))
    x = _mix32_(idx.unsqueeze(0) ^ keys.long().unsqueeze(1))
    del idx
    return x.bitwise_right_shift_(16).to(torch.int32)


def round_onto_bf16_grid_(w: Tensor, bits: Tensor) -> Tensor:
    """fp32 ``w`` (contiguous) rounded onto the bf16 grid in place with 16 random ``bits`` per
    element (int32 in [0, 2^16), its shape): up in magnitude with probability equal to the
    dropped fraction, so unbiased; non-finite values pass as they are. Returns ``w``."""
    finite = bool(torch.isfinite(w.amax()) & torch.isfinite(w.amin())) if w.numel() else True
    bad = None if finite else ~torch.isfinite(w)
    kept = None if bad is None else w[bad]
    w.view(torch.int32).add_(bits).bitwise_and_(-65536)
    if bad is not None:
        w[bad] = kept
    return w


def step_torch(j: Job) -> tuple[float, float]:
    """:class:`Job`'s update in torch ops (any device): the C++ kernel's results, bit for bit
    (in-place ops where a temporary can be reused: the same roundings as the out-of-place)."""
    h = torch.tensor(j.coef, dtype=torch.float32, device=j.w.device)
    b1c, b2, kr, kc, eps, kbias, decay, neg_lr, clip, sqrt_n, b2c, rows = h.unbind()
    g = j.g.float().view(j.lead, j.rows, j.cols)
    if j.row is not None and j.col is not None:
        d = _factored(g, j.row.view(j.lead, j.rows), j.col.view(j.lead, j.cols), h)
    else:
        assert j.v is not None
        v = j.v.view(j.lead, j.rows, j.cols)
        v.copy_((v * b2).add_((g * b2c).mul_(g)))
        d = _sqrt(v).add_(eps)
    if j.m is not None:
        m = j.m.view(j.lead, j.rows, j.cols)
        mf = m.float()
        m.copy_(torch.sub(g, mf).mul_(b1c).add_(mf))
        g = m.float()
    u = torch.div(g, d, out=d).mul_(kbias).view(j.units, -1, j.cols)
    rms = _sqrt(tree_sum(tree_sum(u * u, -1), -1)).div_(sqrt_n)
    factor = torch.clamp_min(rms / clip, 1.0) if j.coef[8] > 0 else torch.ones_like(rms)
    step = torch.ones_like(factor).div_(factor).mul_(neg_lr)
    w0 = j.master if j.master is not None else j.w.float()
    w = (w0.reshape(j.units, -1) * decay).add_(u.view(j.units, -1).mul_(step.unsqueeze(-1)))
    del u, d, g
    if j.keys is not None:
        round_onto_bf16_grid_(w, noise(j.keys, w.shape[1]))
    if j.master is not None:
        j.master.copy_(w.view_as(j.master))
    j.w.copy_(w.view_as(j.w))
    applied = (rms / factor).double()
    return float(applied.square().sum()), float((factor > 1).sum())


def _factored(g: Tensor, row: Tensor, col: Tensor, h: Tensor) -> Tensor:
    """Step the factored statistics ``row`` [lead, rows] and ``col`` [lead, cols] with ``g``
    [lead, rows, cols]; the denominator ``a_i b_j + eps_s`` (a new tensor of g's shape)."""
    sq = g * g
    row.copy_((row * h[1]).add_(tree_sum(sq, -1).mul_(h[2])))
    col.copy_((col * h[1]).add_(tree_sum(sq, -2).mul_(h[3])))
    del sq
    scale = torch.clamp_min(tree_sum(row, -1).div_(h[11]), _TINY)
    a, b = _sqrt(row / scale.unsqueeze(-1)), _sqrt(col)
    return (a.unsqueeze(-1) * b.unsqueeze(-2)).add_(h[4])
