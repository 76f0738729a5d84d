"""The fused host step of OffloadAdamW: one pass over memory per step.

Why: the reference step (:mod:`moestack.optim.update`) makes three passes over host memory:
it packs the gradients into an fp32 buffer, runs torch's fused AdamW on the master copy, and
copies (narrowing) the master back into the parameters. The fused step reads each gradient
element once, as it arrived (fp32 or bf16), updates master weight and both moments (fp32 or
bf16) and writes the narrowed weight in the same pass, with the gradient-clipping factor
applied on the way in (so clipping costs a read for the norm, not a write). The arithmetic,
and the kernels that do it, are :mod:`moestack.kernels.host_adamw`.

Backends, chosen once per process at the first step (``fused_step`` of OffloadAdamW):
``"native"`` (the C++ kernel, built at first use), ``"compile"`` (torch.compile's CPU code
generation over each contiguous slice) and ``"auto"`` (native, else compile). When none can
be built the optimizer falls back to the reference path, saying so in one logged line.

Where the gradients come from and the weights go (the *mode*, fixed at construction):
``direct`` (one process, CPU parameters) reads ``p.grad`` and writes ``p.data`` themselves,
so nothing is packed or copied back; ``staged`` (one process, CUDA parameters) reads the
packed host gradients and writes bf16 weights into a pinned staging buffer that crosses to the
device in half the bytes of the fp32 master; ``master`` (sharded or replicated over ranks)
reads the reduced host gradients and updates master and moments only, the weights return
through the gather as in the reference path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from moestack.kernels import host_adamw, host_build
from moestack.kernels.host_adamw import (
    ALL_COMBOS,
    KERNEL_DTYPES,
    SPLIT_COMBOS,
    Combo,
    CompiledKernel,
    Kernel,
    Seg,
    coefficients,
    self_check,
)
from moestack.optim.plan import ParamSpec

log = logging.getLogger(__name__)

CHOICES = ("auto", "native", "compile", "off")
DIRECT, STAGED, MASTER = "direct", "staged", "master"
_ORDER = {"auto": ("native", "compile"), "native": ("native",), "compile": ("compile",)}
_COMPILE_HINT = 1 << 18  # elements of the slice each dtype combination is first compiled for
_PREPARED_KEPT = 16  # prepared pointer arrays kept per optimizer (one per param group in use)


# ------------------------------------------------------------- one optimizer's fused step


def choose_mode(specs: Sequence[ParamSpec], distributed: bool, num_shards: int) -> str:
    """Where gradients come from and weights go (see the module docstring)."""
    if distributed or num_shards > 1:
        return MASTER
    if all(s.device == "cpu" and s.dtype in KERNEL_DTYPES and s.contiguous for s in specs):
        return DIRECT
    if all(s.device != "cpu" for s in specs):
        return STAGED
    return MASTER


def staging_dtype_of(mode: str, specs: Sequence[ParamSpec]) -> torch.dtype | None:
    """The dtype of the weight staging buffer: staged mode narrows bf16 weights on the host
    (the others cross as fp32 master weights); None: no staging buffer."""
    bf16 = any(s.dtype == torch.bfloat16 for s in specs)
    return torch.bfloat16 if mode == STAGED and bf16 else None


def wants_split_master(requested: str, mode: str, specs: Sequence[ParamSpec]) -> bool:
    """Whether the master weights are kept split (:mod:`moestack.optim.split_master`),
    provided the native kernel loads (:func:`native_loads`; the layout of the host buffers
    depends on it): every parameter bf16, one process (direct or staged mode), and a choice
    that may run the native kernel."""
    if requested not in ("auto", "native") or mode == MASTER:
        return False
    return bool(specs) and all(s.dtype == torch.bfloat16 for s in specs)


def native_loads() -> bool:
    """Whether the native kernel builds and loads (at the first call; then remembered)."""
    return not isinstance(_native(), str)


def check_choice(fused_step: str) -> None:
    """Raise ValueError unless ``fused_step`` is one of :data:`CHOICES`."""
    if fused_step not in CHOICES:
        raise ValueError(f"fused_step={fused_step!r} is not one of {CHOICES}")


def describe(step: FusedHostStep | None) -> str:
    """The fused step's choice and mode, for the log ("off" without one)."""
    if step is None:
        return "off"
    return f"{step.requested}, {step.mode} mode{', split master' if step.split else ''}"


def backend_of(step: FusedHostStep | None) -> str:
    """ "native", "compile", "off" (the reference path) or "pending" (not resolved yet)."""
    if step is None:
        return "off"
    return "pending" if step.kernel is None else kernel_name(step.kernel)


class FusedHostStep:
    """The fused step of one OffloadAdamW: its mode, its kernel (resolved at the first step)
    and the slices it hands the kernel.

    Args:
        requested: a :data:`CHOICES` entry other than "off".
        mode, split, staging_dtype: as the optimizer's plan decided them
            (:func:`moestack.optim.offload_plan.plan_offload`); with ``split`` the native kernel
            is loaded now.
        dtypes: the parameters' dtypes.
        moment_dtype: the dtype of the host moments.
        grad_dtype: the dtype of the packed host gradients (not in direct mode).
        kept: prepared slice lists kept (one per param group and bucket in use).
    """

    def __init__(
        self,
        requested: str,
        mode: str,
        split: bool,
        staging_dtype: torch.dtype | None,
        dtypes: Iterable[torch.dtype],
        moment_dtype: torch.dtype,
        grad_dtype: torch.dtype = torch.float32,
        kept: int = _PREPARED_KEPT,
    ) -> None:
        self.requested = requested
        self.mode = mode
        self.staging_dtype = staging_dtype
        dtypes = set(dtypes)
        if self.mode == DIRECT:
            self._combos = {(dt, moment_dtype, dt) for dt in dtypes}
        else:
            self._combos = {(grad_dtype, moment_dtype, self._out_dtype(dt)) for dt in dtypes}
        self.kernel: Kernel | None = None
        self.why_not = ""  # why the backends tried were unavailable (resolve)
        self.split = split
        if split:
            kernel = _native()
            assert not isinstance(kernel, str), kernel
            self.kernel = kernel
        self._prepared: dict[tuple[Any, ...], host_adamw.Prepared] = {}  # by _where: one a group
        self._kept = kept

    @property
    def per_param(self) -> bool:
        """Whether slices must not span parameters (they read or write the parameters)."""
        return self.mode != MASTER

    def resolve(self) -> bool:
        """Find the kernel (once); False when the reference path must run instead (then
        :attr:`why_not` says why each backend was unavailable)."""
        if self.kernel is None:
            self.kernel, self.why_not = resolve_why(self.requested, sorted(self._combos, key=str))
        return self.kernel is not None

    def _out_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype the step writes a parameter of ``dtype`` in (None: only the master)."""
        return self.staging_dtype if dtype == self.staging_dtype else None

    def run(
        self,
        spans: Sequence[tuple[int, int, int, int]],
        params: Sequence[Tensor],
        host: Any,
        steps: Sequence[int],
        hp: dict[str, float],
        scale: float,
    ) -> None:
        """Step the spans ``(pidx, x_start, off, numel)`` of one param group (from
        :func:`~moestack.optim.plan.contiguous_runs`) of the host buffers ``host``."""
        assert self.kernel is not None and host.master is not None
        coef: dict[int, tuple[float, ...]] = {}
        for pidx, *_ in spans:
            if steps[pidx] not in coef:
                coef[steps[pidx]] = coefficients(hp, steps[pidx], scale)
        coefs = [coef[steps[pidx]] for pidx, *_ in spans]
        grads = (
            {pidx: _flat_grad(params[pidx]) for pidx, *_ in spans} if self.mode == DIRECT else {}
        )
        if not isinstance(self.kernel, host_adamw.NativeKernel):
            self.kernel(self._segs(spans, params, host, grads, coefs))
            return
        key = self._where(spans, params, host, grads)
        prepared = self._prepared.get(key)
        if prepared is None:  # new slices, or they moved: rebuild
            if len(self._prepared) >= self._kept:
                self._prepared.clear()
            prepared = self._prepared[key] = self.kernel.prepare(
                self._segs(spans, params, host, grads, coefs)
            )
        self.kernel.run(prepared, coefs)

    def _segs(
        self,
        spans: Sequence[tuple[int, int, int, int]],
        params: Sequence[Tensor],
        host: Any,
        grads: dict[int, Tensor],
        coefs: Sequence[tuple[float, ...]],
    ) -> list[Seg]:
        """The slices of the spans, as tensors."""
        segs = []
        for (pidx, x0, off, n), c in zip(spans, coefs, strict=True):
            p = params[pidx]
            if self.mode == DIRECT:
                g, out = grads[pidx][x0 : x0 + n], p.data.view(-1)[x0 : x0 + n]
            else:
                g = host.grad[off : off + n]
                out = host.staging[off : off + n] if self._out_dtype(p.dtype) is not None else None
            x, m, v = (buf[off : off + n] for buf in (host.master, host.exp_avg, host.exp_avg_sq))
            segs.append(Seg(x, g, m, v, out, c))
        return segs

    def _where(
        self,
        spans: Sequence[tuple[int, int, int, int]],
        params: Sequence[Tensor],
        host: Any,
        grads: dict[int, Tensor],
    ) -> tuple[Any, ...]:
        """What the slices' addresses and dtypes depend on: the spans, the host buffers and,
        in direct mode, each parameter's data and gradient (a new ``.grad`` each backward
        may land elsewhere). Equal keys mean the prepared segments are still valid."""
        bufs = (host.master, host.exp_avg, host.exp_avg_sq, host.grad, host.staging)
        where: list[Any] = [tuple(spans)]
        where += [(t.data_ptr(), t.dtype, t.numel()) if t is not None else None for t in bufs]
        for pidx, g in grads.items():
            p = params[pidx].data
            where.append((g.data_ptr(), g.dtype, g.numel(), p.data_ptr(), p.dtype, p.numel()))
            where.append(p.is_contiguous())
        return tuple(where)


def _flat_grad(p: Tensor) -> Tensor:
    """``p.grad`` as a flat tensor the kernel takes (a view unless it must convert)."""
    g = p.grad
    assert g is not None
    if g.dtype not in KERNEL_DTYPES:
        g = g.float()
    return g.reshape(-1).contiguous()


# ------------------------------------------------------------------ choosing a backend

_STATE: dict[Any, Any] = {}  # "native" / ("compile", combo) -> kernel, or why it failed (str)
_WARNED: set[str] = set()


def resolve(requested: str, combos: Sequence[Combo]) -> Kernel | None:
    """The kernel for ``requested`` (a :data:`CHOICES` entry but "off") that handles
    ``combos``, or None: then the caller runs the reference path. Each outcome that is not
    the first choice is logged once per process, in one line."""
    return resolve_why(requested, combos)[0]


def resolve_why(requested: str, combos: Sequence[Combo]) -> tuple[Kernel | None, str]:
    """:func:`resolve`, and why each backend tried before the one returned was unavailable
    ("" when the first choice loads): "native unavailable (...); compile unavailable (...)"."""
    reasons = []
    level = logging.WARNING  # an error where a compiler is there and the native build failed
    for name in _ORDER[requested]:
        got = _native() if name == "native" else _compiled(combos)
        if not isinstance(got, str):
            if reasons:
                _warn_once(f"fused host step: {'; '.join(reasons)}; using {name}", level)
            return got, "; ".join(reasons)
        if isinstance(got, Unavailable) and got.broken:
            level = logging.ERROR
            got = f"{got}; a C++ compiler is there, so the native build is broken: report it"
        reasons.append(f"{name} unavailable ({got})")
    _warn_once(f"fused host step: {'; '.join(reasons)}; using the unfused reference path", level)
    return None, "; ".join(reasons)


def host_kernel_report() -> str:
    """One line for an environment check: whether the native kernel builds (into its cache,
    now if it was not built yet), loads and matches the formula, and which C++ compiler it is
    built with. Without it a GPU run's OffloadAdamW cannot pipeline its step (nor reduce on
    the devices) and runs the serial step instead."""
    cxx = host_build.find_compiler()
    compiler = (
        f"compiler {cxx} ({host_build.compiler_version(cxx)})"
        if cxx
        else "no C++ compiler found (set CXX, or install g++)"
    )
    got = _native()
    if isinstance(got, str):
        broken = (
            ", a broken build: report it" if isinstance(got, Unavailable) and got.broken else ""
        )
        return (
            f"native host kernel: unavailable ({got}{broken}); {compiler}; OffloadAdamW runs "
            "the serial step (no pipelined step, no device collectives)"
        )
    return f"native host kernel: loads ({got.path}); {compiler}"


def kernel_name(kernel: Kernel | None) -> str:
    """ "native", "compile", "eager" or "off" (None: the reference path)."""
    return "off" if kernel is None else getattr(kernel, "name", "eager")


class Unavailable(str):
    """Why the native kernel is unavailable (the one-line reason, a ``str``). ``broken``:
    a C++ compiler is there, yet the kernel did not build, load or pass its self-check: a
    defect of the build or the kernel to report (an error), not an environment without a
    compiler, where the fallback is the plan."""

    broken: bool

    def __new__(cls, why: str, broken: bool) -> Unavailable:
        text = super().__new__(cls, why)
        text.broken = broken
        return text


def native_broken() -> bool:
    """Whether the native kernel failed although a C++ compiler exists (:class:`Unavailable`);
    False when it loads or when there is no compiler."""
    got = _native()
    return isinstance(got, Unavailable) and got.broken


def _native() -> Kernel | str:
    if "native" not in _STATE:
        _STATE["native"] = _load_native()
    return _STATE["native"]


def _load_native() -> Kernel | Unavailable:
    """The native kernel, built, loaded and checked bitwise against the formula; or why not,
    telling a missing compiler from a failed build or self-check."""
    if not host_build.find_compiler():
        return Unavailable("RuntimeError: no C++ compiler (set CXX, or install g++)", False)
    try:
        kernel = host_adamw.load()
    except Exception as err:  # the build or the load failed: unavailable, reported as an error
        return Unavailable(_one_line(err), True)
    try:
        self_check(kernel, ALL_COMBOS)
        self_check(kernel, SPLIT_COMBOS, split=True)
    except Exception as err:  # a wrong build must not train
        return Unavailable(f"{_one_line(err)} (the library built, its self-check failed)", True)
    log.info("fused host step: native kernel %s", kernel.path)
    return kernel


def _compiled(combos: Sequence[Combo]) -> Kernel | str:
    if "compile" not in _STATE:
        try:
            _STATE["compile"] = CompiledKernel()
        except Exception as err:
            _STATE["compile"] = _one_line(err)
    kernel = _STATE["compile"]
    if isinstance(kernel, str):
        return kernel
    for combo in combos:  # compiles each dtype combination now, not in the middle of a step
        key = ("compile", combo)
        if key not in _STATE:
            try:  # the first length sets inductor's size hint: large, or it emits no threads
                self_check(kernel, [combo], n=_COMPILE_HINT)
                _STATE[key] = kernel
            except Exception as err:
                _STATE[key] = _one_line(err)
        if isinstance(_STATE[key], str):
            return _STATE[key]
    return kernel


def _warn_once(message: str, level: int = logging.WARNING) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.log(level, message)


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines() or [""]
    text = f"{type(err).__name__}: {lines[0]}"
    return text if len(text) <= 200 else text[:197] + "..."
