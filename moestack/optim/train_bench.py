"""The training-step benchmark of the optimizers (``scripts/bench_optim.py``'s sections
gpu, train_step and delay_loss; its docstring says what each figure means): synthetic
parameters and gradients, OffloadAdamW clean-up, the GPU optimizer step time, a whole
training step of an MoE transformer (OffloadAdamW, exact and delayed, against torch AdamW
and torchao's CPUOffloadOptimizer when installed, each clipped and unclipped) with its
parts, the time the compute stream sits idle per step and the pinned copy bandwidth each
way and both at once, and the loss of the delayed update against the exact one. It reaches
into OffloadAdamW's internals (its parts are timed by wrapping them), so it lives beside
them: a rename fails its tests here rather than on a lent GPU."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moestack import bench
from moestack.config import ModelConfig, MoEConfig, OptimConfig
from moestack.model import MoETransformer
from moestack.optim import (
    OffloadAdamW,
    apply_param_dtype,
    build_optimizer,
    clip_grad_norm,
    fused,
    param_groups,
)
from moestack.optim.tiered import TieredAdamW


def make_params(
    n: float, experts: int, dtype: torch.dtype, device: str, seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Named parameters of about n elements: stacked experts w1/w2 (90%) plus dense tensors."""
    g = torch.Generator().manual_seed(seed)
    d = 256
    f = max(1, int(0.45 * n / (experts * d)))
    dense_rows = max(1, int(0.1 * n / d))
    shapes = {
        "layer.moe.w1": (experts, d, f),
        "layer.moe.w2": (experts, f, d),
        "layer.attn.weight": (dense_rows, d),
        "layer.norm.weight": (d,),
    }
    out = []
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g) * 0.02).to(dtype=dtype, device=device)
        out.append((name, torch.nn.Parameter(t)))
    return out


def set_grads(params: list[tuple[str, torch.Tensor]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype=p.dtype, device=p.device)


def gpu_step_time(n: float, experts: int, reps: int) -> dict[str, Any]:
    """CUDA: step time of OffloadAdamW (host state) against fused torch AdamW on the device.

    Gradients are set by hand, so no backward hook starts their copies: this times the
    optimizer step with the synchronous gradient copy (the overlap shows in train_step).
    """
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for name in ("offload", "device_adamw_fused"):
        base = bench.fresh_cuda_memory()
        params = make_params(n, experts, torch.bfloat16, "cuda")
        if name == "offload":
            opt: torch.optim.Optimizer = OffloadAdamW(params)
        else:
            master = [torch.nn.Parameter(p.detach().float()) for _, p in params]
            opt = torch.optim.AdamW(master, fused=True)
            params = [(k, m) for (k, _), m in zip(params, master, strict=True)]
        set_grads(params, 3)
        times = bench.times(opt.step, "cuda", warmup=1, repeats=reps)
        out[f"{name}_step_ms"] = 1e3 * statistics.median(times)
        out[f"{name}_peak_device_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        release(opt)
        del opt, params
    bench.fresh_cuda_memory()
    return out


def release(opt: Any) -> None:
    """Unhook an OffloadAdamW from its parameters (its delayed update applied first), so
    that dropping both frees them."""
    sync = getattr(opt, "synchronize", None)
    if callable(sync):
        sync()
    remove = getattr(opt, "remove_hooks", None)
    if callable(remove):
        remove()


# The training-step contenders: name -> (optimizer, update_delay, clipped, OffloadAdamW's
# other settings). Each runs clipped and unclipped (like for like: a clipped contender is
# compared with clipped device AdamW, an unclipped one with unclipped). torchao copies the
# gradients to the host inside backward, so its clip is taken where its step reads them:
# the host copies, once landed, and the small parameters it keeps on the device
# (_torchao_clip). offload_adamw is the pipelined exact step (the default on a GPU; its next
# forward waits per layer, as the trainer sets it up); _serial the one-pass step before it;
# _in_backward updates each bucket as it lands (unclipped only); tiered_in_backward each
# tensor as its gradient lands, freeing it (optim.update_in_backward, unclipped only).
TRAIN_CONTENDERS: dict[str, tuple[str, int, bool, dict[str, Any]]] = {
    "adamw": ("adamw", 0, True, {}),
    "adamw_unclipped": ("adamw", 0, False, {}),
    "tiered": ("tiered", 0, True, {}),  # optim=tiered's defaults: bf16 weights, no master
    "tiered_offload": ("tiered", 0, True, {"offload": "cpu"}),  # its state in host memory
    "tiered_in_backward_unclipped": (
        "tiered",
        0,
        False,
        {"update_in_backward": True, "grad_clip": 0.0},
    ),  # fmt: skip
    "offload_adamw": ("offload_adamw", 0, True, {}),
    "offload_adamw_unclipped": ("offload_adamw", 0, False, {}),
    "offload_adamw_serial": ("offload_adamw", 0, True, {"pipeline": False}),
    "offload_adamw_in_backward_unclipped": (
        "offload_adamw",
        0,
        False,
        {"update_in_backward": True},
    ),
    "offload_adamw_delayed": ("offload_adamw", 1, True, {}),
    "offload_adamw_delayed_unclipped": ("offload_adamw", 1, False, {}),
    "torchao_cpu_offload": ("torchao", 0, True, {}),
    "torchao_cpu_offload_unclipped": ("torchao", 0, False, {}),
}


def _train_model(device: torch.device, impl: str) -> tuple[ModelConfig, int, int]:
    """The benchmark's model config, batch and sequence length on ``device``."""
    if device.type == "cuda":  # configs/model/m137.yaml: 137M parameters, 64 experts top-8
        cfg = ModelConfig(
            d_model=384, n_layers=8, n_heads=6, max_seq_len=1024, moe=MoEConfig(64, 8, 224, impl)
        )
        return cfg, 16, 1024
    # a dry run of the same code, small enough for a CPU
    cfg = ModelConfig(
        d_model=64, n_layers=2, n_heads=2, max_seq_len=64, moe=MoEConfig(8, 2, 64, impl)
    )
    return cfg, 4, 64


def _build_contender(
    name: str, model_cfg: ModelConfig, device: torch.device
) -> tuple[torch.nn.Module, Any, bool, torch.dtype]:
    """A fresh model (seed 0) on ``device`` and contender ``name``'s optimizer over it."""
    kind, delay, clip, settings = TRAIN_CONTENDERS[name]
    tiered = settings if kind == "tiered" else {}
    cfg = OptimConfig(
        name="adamw" if kind == "torchao" else kind, lr=1e-3, update_delay=delay, **tiered
    )
    torch.manual_seed(0)
    model = MoETransformer(model_cfg).to(device)
    dtype = apply_param_dtype(model, cfg, device)
    if kind == "torchao":  # its intended use: fp32 weights, state on the host
        opt = _torchao_offload()(model.parameters(), torch.optim.AdamW, lr=1e-3)
    elif kind == "offload_adamw":
        if settings.get("update_in_backward") and device.type != "cuda":
            settings = {**settings, "pipeline": True}  # the CPU dry run: forced on
        groups = param_groups(model, cfg.weight_decay)
        opt = OffloadAdamW(groups, lr=1e-3, betas=cfg.betas, update_delay=delay, **settings)
        opt.wait_per_layer(model)  # as moestack.optim.build_training_optimizer does
    else:
        opt = build_optimizer(model, cfg)
    return model, opt, clip, dtype


def _torchao_clip(opt: Any, max_norm: float) -> float:
    """Clip a torchao CPUOffloadOptimizer's gradients where its step reads them: the host
    copies its backward hooks queued (waited for first) and the device gradients of the
    small parameters it steps on the device; one 2-norm over both, torch's formula."""
    for landed in opt.queue.values():
        landed.synchronize()
    params = [opt.param_d2h_map[p] for p in opt.queue]
    params += [p for g in opt.d_param_groups for p in g["params"] if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def _is_torchao(opt: Any) -> bool:
    cls = _torchao_offload()
    return cls is not None and isinstance(opt, cls)


def _step_fn(
    model: torch.nn.Module,
    opt: Any,
    clip: bool,
    tokens: torch.Tensor,
    probe: _IdleProbe | None = None,
) -> Any:
    """One training step of ``model`` on ``tokens`` (bf16 autocast on CUDA): its loss. With
    ``probe``, the clip and the optimizer step are bracketed by its events."""
    cuda = tokens.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    torchao = _is_torchao(opt)

    def update() -> None:
        if clip and torchao:
            _torchao_clip(opt, 1.0)
        elif clip:
            clip_grad_norm(model, opt, 1.0)
        opt.step()

    held = update if probe is None else probe.wrap(update)

    def step() -> float:
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        if isinstance(opt, TieredAdamW):  # optim.update_in_backward steps there
            opt.backward(loss)
        else:
            loss.backward()
        held()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


class _IdleProbe:
    """The time the compute stream sits idle where an optimizer holds it up, from CUDA
    events: around each call it wraps (the clip and step, a pipelined bucket's release in
    the next forward, a wait for a bucket's update in backward's hooks) an event is recorded
    on the calling thread's current stream (the compute stream) before and after. The time
    between the two on the GPU is the time the stream waited for the optimizer there: the
    host blocked or the stream waited on a copy's event, beyond the work queued before (the
    few small kernels the optimizer queues there in between count too). Calls nested in a
    wrapped call count once."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, Any]] = []
        self._spare: list[Any] = []
        self._inside = threading.local()

    def _event(self) -> Any:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def wrap(self, fn: Any) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            if getattr(self._inside, "on", False):
                return fn(*args, **kw)
            self._inside.on = True
            before = self._event()
            before.record()
            try:
                return fn(*args, **kw)
            finally:
                after = self._event()
                after.record()
                self._inside.on = False
                self._pairs.append((before, after))

        return run

    def take_ms(self) -> float:
        """The idle milliseconds bracketed since the last call (the device synchronised)."""
        torch.cuda.synchronize()
        pairs, self._pairs = self._pairs, []
        total = sum(before.elapsed_time(after) for before, after in pairs)
        self._spare.extend(e for pair in pairs for e in pair)
        return total


def compute_idle(
    model: torch.nn.Module, opt: Any, clip: bool, tokens: torch.Tensor, reps: int
) -> float:
    """CUDA: the median milliseconds per training step the compute stream sits idle waiting
    for an offloading optimizer (:class:`_IdleProbe`), over ``reps`` extra steps."""
    probe = _IdleProbe()
    step = _step_fn(model, opt, clip, tokens, probe)
    inner = getattr(opt, "optimizer", opt)
    pipe = getattr(inner, "_pipe", None)
    hooked = ("release", "wait_update") if pipe is not None else ()
    for attr in hooked:
        setattr(pipe, attr, probe.wrap(getattr(pipe, attr)))
    per_step = []
    try:
        step()  # the first probed forward's waits belong to an unprobed step
        probe.take_ms()
        for _ in range(reps):
            step()
            per_step.append(probe.take_ms())
    finally:
        for attr in hooked:
            delattr(pipe, attr)  # the class's methods again
    return statistics.median(per_step)


def pinned_copy_bandwidth(mib: int = 256, reps: int = 5) -> dict[str, Any]:
    """CUDA: GB/s of copies between pinned host memory and the device, host-to-device and
    device-to-host each alone, then both at once on two streams (as the pipelined step
    runs gradients out beside weights back), timed with CUDA events; best of ``reps``
    copies of ``mib`` MiB each way."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    n = mib * 2**20
    to_dev = (torch.empty(n, dtype=torch.uint8, device="cuda"),
              torch.empty(n, dtype=torch.uint8, pin_memory=True))  # fmt: skip
    to_host = (torch.empty(n, dtype=torch.uint8, pin_memory=True),
               torch.empty(n, dtype=torch.uint8, device="cuda"))  # fmt: skip
    streams = {"h2d": torch.cuda.Stream(), "d2h": torch.cuda.Stream()}
    pairs = {"h2d": to_dev, "d2h": to_host}

    def copies(ways: Sequence[str]) -> dict[str, float]:
        """Seconds of one copy each way of ``ways``, all started at once."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = {}
        for way in ways:
            stream = streams[way]
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst, src = pairs[way]
                dst.copy_(src, non_blocking=True)
                ends[way] = torch.cuda.Event(enable_timing=True)
                ends[way].record(stream)
        torch.cuda.synchronize()
        return {way: start.elapsed_time(end) / 1e3 for way, end in ends.items()}

    out: dict[str, Any] = {"MiB": mib}
    for ways in (["h2d"], ["d2h"], ["h2d", "d2h"]):
        copies(ways)  # warm-up
        best = [copies(ways) for _ in range(reps)]
        together = len(ways) > 1
        for way in ways:
            s = min(b[way] for b in best)
            out[f"{way}{'_while_both' if together else ''}_GBps"] = n / s / 1e9
        if together:
            out["both_total_GBps"] = 2 * n / min(max(b.values()) for b in best) / 1e9
    del to_dev, to_host
    return out


def train_step_time(device: torch.device, reps: int, impl: str) -> dict[str, Any]:
    """Whole training steps, OffloadAdamW (exact and delayed) against torch AdamW and
    torchao, clipped and unclipped, as moestack.train runs them."""
    model_cfg, batch, seq = _train_model(device, impl)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 256, (batch, seq + 1), generator=g).to(device)
    out: dict[str, Any] = {"device": str(device), "tokens_per_step": batch * seq, "impl": impl}
    out.update({f"pinned_{k}": v for k, v in pinned_copy_bandwidth().items()})
    contenders = [n for n in TRAIN_CONTENDERS if not n.startswith("torchao")]
    if device.type == "cuda" and _torchao_offload() is not None:
        contenders += [n for n in TRAIN_CONTENDERS if n.startswith("torchao")]
    elif device.type == "cuda":
        out["torchao_skipped"] = "torchao is not importable (carry its wheel)"
    out["host_kernel"] = fused.host_kernel_report()
    for name in contenders:
        got: dict[str, Any] = {}
        try:
            _time_contender(name, model_cfg, device, tokens, reps, got)
        except Exception as exc:  # reported with its reason; the other contenders still run
            got[f"{name}_error"] = _one_line(exc)
        out.update(got)
    out["contenders"] = contenders
    for name in contenders:
        like = "adamw_unclipped" if name.endswith("unclipped") else "adamw"
        if name in (like, "adamw") or f"{name}_step_ms" not in out:
            continue
        if f"{like}_step_ms" not in out:  # the baseline failed: its error says why
            continue
        out[f"{name}_vs_{like}_step_time"] = out[f"{name}_step_ms"] / out[f"{like}_step_ms"]
        if device.type == "cuda":
            out[f"{name}_vs_{like}_peak_memory"] = (
                out[f"{name}_peak_device_MiB"] / out[f"{like}_peak_device_MiB"]
            )
    return out


def _one_line(exc: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}"


def how_it_runs(name: str, opt: Any) -> dict[str, Any]:
    """How contender ``name``'s optimizer runs its step: ``pipelined`` (OffloadAdamW's
    buckets; None for the others), ``host_step`` (the host kernel: "native", "compile", "off"
    for the reference path, "in_place"; "none" for AdamW on the device, "torchao" for
    torchao's host AdamW) and, where OffloadAdamW fell back to its serial step, why."""
    inner = getattr(opt, "optimizer", opt)
    if isinstance(inner, OffloadAdamW):
        out = {f"{name}_pipelined": inner.pipelined, f"{name}_host_step": inner.host_step}
        if inner.serial_reason:
            out[f"{name}_serial_reason"] = inner.serial_reason
        return out
    host = "torchao" if _is_torchao(opt) else "none"
    return {f"{name}_pipelined": None, f"{name}_host_step": host}


def _time_contender(
    name: str, model_cfg: ModelConfig, device: torch.device, tokens: torch.Tensor, reps: int,
    out: dict[str, Any],
) -> None:  # fmt: skip
    """Contender ``name``'s training step into ``out`` (what it measured stays there if it
    fails): how it runs (:func:`how_it_runs`), median time, peak device memory, first and
    last loss; OffloadAdamW's parts; an offloading optimizer's idle compute stream (CUDA)."""
    base = bench.fresh_cuda_memory() if device.type == "cuda" else 0
    model, opt, clip, dtype = _build_contender(name, model_cfg, device)
    out.update(how_it_runs(name, opt))
    try:
        step = _step_fn(model, opt, clip, tokens)
        losses = [step(), step()]  # warm-up: lazy state, kernel compilation
        out.update(how_it_runs(name, opt))  # the host kernel is chosen at the first step
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # the peak of steady-state steps
        times = bench.times(lambda: losses.append(step()), device, repeats=reps)
        numel = sum(p.numel() for p in model.parameters())
        out["params"] = numel
        out[f"{name}_step_ms"] = 1e3 * statistics.median(times)
        out[f"{name}_param_dtype"] = str(dtype).removeprefix("torch.")
        out[f"{name}_loss_first_last"] = [losses[0], losses[-1]]
        if device.type == "cuda":
            out[f"{name}_peak_device_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, OffloadAdamW):
            out.update(offload_step_parts(inner, step, device, reps, prefix=f"{name}_part_"))
        offloads = isinstance(inner, OffloadAdamW) or _is_torchao(opt)
        if device.type == "cuda" and offloads:
            idle = compute_idle(model, opt, clip, tokens, min(reps, 3))  # within the phase cap
            out[f"{name}_compute_idle_ms"] = idle
    finally:
        release(opt)  # its hooks off the parameters: the model and it are freed with this frame


DELAY_LOSS_MODES = ("offload_adamw", "offload_adamw_delayed")
DELAY_LOSS_MIN_STEPS = 10  # the loss compared is the mean of the last 10 steps


def delayed_loss(
    device: torch.device, steps: int, impl: str, budget_s: float = 0.0
) -> dict[str, Any]:
    """The loss of ``steps`` training steps with the delayed update against the exact one
    (same model, seed and batches; clipped): the last 10 steps' mean of each, and their
    relative difference (the issue's target: within 1%). With ``budget_s`` (seconds, 0:
    none) the exact mode stops once half of it is spent (after 10 steps at least) and the
    delayed mode runs as many steps: ``steps`` says how many both ran, ``steps_requested``
    how many were asked for. A mode that fails is reported (``<mode>_error``), with no
    comparison."""
    model_cfg, batch, seq = _train_model(device, impl)
    out: dict[str, Any] = {"steps_requested": steps, "budget_s": budget_s}
    start = time.monotonic()
    for name in DELAY_LOSS_MODES:
        deadline = start + budget_s / 2 if budget_s and name == DELAY_LOSS_MODES[0] else None
        try:
            losses, how = _losses_of(name, model_cfg, device, (batch, seq), steps, deadline)
        except Exception as exc:
            out[f"{name}_error"] = _one_line(exc)
            continue
        steps = len(losses)  # the next mode runs as many
        out.update(how)
        out[f"{name}_steps"] = steps
        out[f"{name}_last10_loss"] = statistics.mean(losses[-DELAY_LOSS_MIN_STEPS:])
    out["steps"] = steps
    out["cut_by_budget"] = steps < out["steps_requested"]
    out["seconds"] = time.monotonic() - start
    if all(f"{name}_last10_loss" in out for name in DELAY_LOSS_MODES):
        exact, delayed = (out[f"{name}_last10_loss"] for name in DELAY_LOSS_MODES)
        out["delayed_vs_exact_loss"] = delayed / exact - 1.0
    return out


def _losses_of(
    name: str, model_cfg: ModelConfig, device: torch.device, shape: tuple[int, int], steps: int,
    deadline: float | None,
) -> tuple[list[float], dict[str, Any]]:  # fmt: skip
    """The loss of each training step of contender ``name`` on the delay_loss batches (seed
    1), ``steps`` of them or, with ``deadline`` (time.monotonic()), those made before it
    (:data:`DELAY_LOSS_MIN_STEPS` at least); and how it ran (:func:`how_it_runs`)."""
    batch, seq = shape
    model, opt, clip, _ = _build_contender(name, model_cfg, device)
    try:
        g = torch.Generator().manual_seed(1)
        losses: list[float] = []
        for k in range(steps):
            late = deadline is not None and time.monotonic() > deadline
            if late and k >= DELAY_LOSS_MIN_STEPS:
                break
            tokens = torch.randint(1, 256, (batch, seq + 1), generator=g).to(device)
            losses.append(_step_fn(model, opt, clip, tokens)())
        return losses, how_it_runs(name, opt)
    finally:
        release(opt)


def offload_step_parts(
    opt: OffloadAdamW, step: Any, device: torch.device, reps: int, prefix: str
) -> dict[str, float]:
    """Where an OffloadAdamW training step's time goes, in extra steps after the timed ones:
    the gradient clip on the host (its 2-norm, including the wait for the gradients' copies
    when it comes first), waiting for those copies otherwise, the host update, the weights'
    return (to the end of its copies: a device synchronise is added there), and the rest of
    the step (forward and backward). Median milliseconds per step over ``reps`` steps.

    With a delayed update the host update runs in the optimizer's worker thread, beside the
    rest (it is reported, not subtracted from the rest), and ``wait_update`` is the step's
    wait for the update in flight with the return of its weights. So it does in the
    pipelined step, bucket by bucket, where ``release`` is the time the host waits for a
    bucket's update to end before the compute stream may wait for its weights (at the end
    of the step, or in the next forward: then it counts in the next step's time)."""
    parts = {"clip": "clip_grad_norm_", "wait_grads": "_sync_grads",
             "host_update": "_step_spans", "return_weights": "_return_weights"}  # fmt: skip
    owners: dict[str, Any] = dict.fromkeys(parts, opt)
    if opt.update_delay:  # the pipelined delayed step waits bucket by bucket
        parts["wait_update"] = "_send_pending" if opt.pipelined else "synchronize"
        owners["wait_update"] = opt
    if opt.pipelined:
        parts["release"], owners["release"] = "release", opt._pipe
    overlapped = {"host_update"} if (opt.update_delay or opt.pipelined) else set()
    timer = _PartTimer(device)
    for part, attr in parts.items():
        setattr(owners[part], attr, timer.wrap(getattr(owners[part], attr), part))
    rows: dict[str, list[float]] = {part: [] for part in (*parts, "rest")}
    try:
        for _ in range(reps):
            timer.per_step.clear()
            total = bench.seconds(step, device)
            with timer.lock:
                for part in parts:
                    rows[part].append(timer.per_step.get(part, 0.0))
                serial = sum(t for part, t in timer.per_step.items() if part not in overlapped)
            rows["rest"].append(total - serial)
    finally:
        for part, attr in parts.items():
            delattr(owners[part], attr)  # the class's methods again
    return {f"{prefix}{part}_ms": 1e3 * statistics.median(v) for part, v in rows.items()}


class _PartTimer:
    """Seconds spent in each wrapped part during a step (``per_step``, by part), from any
    thread; a part called inside another counts as the outer one's time; the weights'
    return and the wait for an update are timed to the end of their copies on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.per_step: dict[str, float] = {}
        self.lock = threading.Lock()
        self._nesting = threading.local()

    def wrap(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            if getattr(self._nesting, "part", None):
                return fn(*args, **kw)
            self._nesting.part = part
            t0 = time.perf_counter()
            try:
                result = fn(*args, **kw)
                if self.device.type == "cuda" and part in ("return_weights", "wait_update"):
                    torch.cuda.synchronize()
            finally:
                self._nesting.part = None
            with self.lock:
                self.per_step[part] = self.per_step.get(part, 0.0) + time.perf_counter() - t0
            return result

        return run


def _torchao_offload() -> Any:
    """torchao's CPUOffloadOptimizer (the field's baseline, DESIGN.md), when installed."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception:  # not installed, or built for another torch
        return None
    return CPUOffloadOptimizer


def train_table(rows: dict[str, Any]) -> str:
    """The train_step section's contenders as one table (the script prints it): step time,
    against AdamW on the device (like for like: clipped against clipped), whether the step
    ran pipelined, which host kernel ran it, and the error of a contender that failed."""
    head = ("contender", "step ms", "x AdamW", "pipelined", "host step", "error")
    lines = ["  {:<38} {:>8} {:>8} {:>9} {:<9} {}".format(*head)]
    for name in rows.get("contenders", []):
        like = "adamw_unclipped" if name.endswith("unclipped") else "adamw"
        ms, ratio = rows.get(f"{name}_step_ms"), rows.get(f"{name}_vs_{like}_step_time")
        pipelined = rows.get(f"{name}_pipelined")
        why = rows.get(f"{name}_error") or rows.get(f"{name}_serial_reason", "")
        lines.append(
            f"  {name:<38} {'-' if ms is None else f'{ms:.4g}':>8} "
            f"{'-' if ratio is None else f'{ratio:.3g}x':>8} "
            f"{'-' if pipelined is None else str(pipelined):>9} "
            f"{rows.get(f'{name}_host_step', '-'):<9} {why}"
        )
    return "\n".join(lines) + "\n"
