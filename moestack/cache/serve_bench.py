"""What serving a transformers MoE model from the expert cache is measured with
(``scripts/bench_serve.py``, whose docstring says what each figure means): the random
Qwen3-MoE model and its folder, the ceiling with every expert on the device, the probes that
count a contender's requests, hits and bytes moved, the timed decode windows and prefills
of one row, the static pins, accelerate's offload map, the cache over the host tier or the
disk, the host-to-device link's figures, and the time budget that skips the rows that would
end past it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moestack import bench
from moestack.cache import ExpertCache, offloaded
from moestack.cache.device_tier import flat_view
from moestack.cache.host_tier import HostTier
from moestack.cache.serve_report import Measure, phase_figures
from moestack.device import move_resident
from moestack.interop.hf import moe_from_hf
from moestack.interop.hf_model import HFMoEModel, load_hf_moe

log = logging.getLogger(__name__)

MIN_DECODE = 4  # timed decode steps of a window, whatever --row-seconds says


class Budget:
    """Which rows fit in ``seconds`` from ``start`` (0: every row), by the clock ``clock``
    (bench_serve.py's docstring): ``skip_reason(kind)`` before a row, ``record(kind, s)``
    after."""

    def __init__(
        self, seconds: float, start: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.seconds = seconds
        self.start = start
        self.clock = clock
        self.row_s: dict[str, list[float]] = {}
        self.prior_s: dict[str, tuple[float, str]] = {}  # a kind's first row, absolute
        self.extra_s: dict[str, tuple[float, str]] = {}  # ... over the slowest cache row

    def deadline(self) -> float | None:
        """The clock's reading at which the budget ends (None: no budget)."""
        return self.start + self.seconds if self.seconds else None

    def record(self, kind: str, seconds: float) -> None:
        self.row_s.setdefault(kind, []).append(seconds)

    def estimate(self, kind: str) -> tuple[float, str] | None:
        """Seconds a row of ``kind`` is expected to take and why; None: nothing to go by."""
        if self.row_s.get(kind):
            return max(self.row_s[kind]), f"the slowest {kind} row so far"
        if kind in self.prior_s:
            return self.prior_s[kind]
        if kind in self.extra_s and self.row_s.get("cache"):
            extra, why = self.extra_s[kind]
            return max(self.row_s["cache"]) + extra, f"the slowest cache row + {why}"
        return None

    def skip_reason(self, kind: str, always: bool = False) -> str | None:
        """Why a row of ``kind`` would end past the budget, None when it runs: always with
        ``always`` (the ceiling), and the first cache row always."""
        if not self.seconds or always or (kind == "cache" and not self.row_s.get("cache")):
            return None
        guess = self.estimate(kind)
        if guess is None:
            return None
        est, why = guess
        spent = self.clock() - self.start
        if spent + est <= self.seconds:
            return None
        return (
            f"time budget: {spent:.1f} s spent + {est:.1f} s estimated ({why}) > "
            f"--budget-s {self.seconds:g}"
        )


def fits(
    deadline: float | None, seconds: float, clock: Callable[[], float] = time.monotonic
) -> bool:
    """Whether ``seconds`` more end by ``deadline`` (None: always)."""
    return deadline is None or clock() + seconds <= deadline


# ---------------------------------------------------------------------------- the model
def qwen3_config(args: argparse.Namespace) -> Any:
    """A transformers Qwen3-MoE config of the benchmark's sizes (every layer sparse)."""
    from transformers import AutoConfig

    positions = args.prompt_tokens + args.warmup + args.repeats * args.decode_tokens + 8
    return AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=3 * args.hidden,
        moe_intermediate_size=args.expert_width,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def randomize(model: nn.Module, args: argparse.Namespace) -> None:
    """Seeded random weights (bench_serve.py's docstring): std 1/sqrt(fan_in), embedding 1,
    output projections x ``residual_update``, router rows x exp(skew x N(0, 1)), norms 1."""
    gens: dict[torch.device, torch.Generator] = {}  # one per device the weights are on
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(args.seed))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 1.0 / math.sqrt(p.shape[-1])
            if "embed_tokens" in name:
                std = 1.0
            elif name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                std *= args.residual_update
            p.normal_(0.0, std, generator=gen)
            if name.endswith("mlp.gate.weight"):  # the router [E, D]
                z = torch.randn(p.shape[0], 1, generator=gen, device=p.device)
                p.mul_(torch.exp(args.router_skew * z).to(p.dtype))


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The random Qwen3-MoE transformers model, built on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_config(args), dtype=torch.bfloat16)
    randomize(model, args)
    return model.eval()


def save_folder(model: nn.Module, root: Path) -> Path:
    """``model`` as a transformers folder (config.json, safetensors) under ``root``."""
    out = root / "model"
    model.save_pretrained(out)
    return out


def sparse_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Every sparse-MoE block of a transformers model (a ``gate`` and an ``experts`` module),
    by qualified name, in layer order."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(getattr(m, "gate", None), nn.Module)
        and isinstance(getattr(m, "experts", None), nn.Module)
    }


@torch.no_grad()
def resident_model(
    folder: Path, built: nn.Module, args: argparse.Namespace, dev: Device
) -> HFMoEModel:
    """The ceiling: ``folder`` loaded without its experts (the non-expert weights only),
    on the device, with each MoE layer's experts copied from ``built`` (the model the
    folder was saved from, still in memory) rather than read back from the folder."""
    model = load_hf_moe(folder, impl=args.impl, dtype=torch.bfloat16, experts=False)
    move_resident(model, dev.device)
    blocks = list(sparse_blocks(built).values())
    if len(blocks) != len(model.moe_layers):
        raise RuntimeError(
            f"the built model has {len(blocks)} sparse blocks, the loaded one "
            f"{len(model.moe_layers)} MoE layers"
        )
    for i, (moe, block) in enumerate(zip(model.moe_layers, blocks, strict=True)):
        src = moe_from_hf(block, impl=args.impl)
        if not torch.equal(src.router.weight, moe.router.weight.to(src.router.weight)):
            raise RuntimeError(f"layer {i}: the folder's router is not the built model's")
        moe.w1 = nn.Parameter(src.w1.to(dev.device), requires_grad=False)
        moe.w2 = nn.Parameter(src.w2.to(dev.device), requires_grad=False)
    return model


# ---------------------------------------------------------------------------- devices
class Device:
    """Synchronisation and peak memory on the benchmark's device (no-ops on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        bench.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else None

    def free(self) -> None:
        """Free what a finished contender left in reference cycles, so that the next one's
        peak is its own (on the CPU nothing is measured: skipped, a collection is slow)."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- probes
class Probe:
    """What a contender counts during a phase: ``reset()`` at its start, ``read()`` at its
    end (requests, hits, misses, bytes moved to the device, seconds waited on loads)."""

    def reset(self) -> None:
        pass

    def read(self) -> dict[str, float | None]:
        return {}


class ResidentProbe(Probe):
    """Every request hits (the experts are all on the device); counts the requests, and
    with ``record`` keeps every layer call's requests in order (``routing``: per forward,
    per layer, the experts of the flattened tokens, slots in router order)."""

    def __init__(self, model: HFMoEModel, record: bool = False) -> None:
        self.requests = 0
        self.layers = len(model.moe_layers)
        self.calls: list[list[int]] | None = [] if record else None
        self.handles = [m.router.register_forward_hook(self._count) for m in model.moe_layers]

    def _count(self, router: nn.Module, args: tuple, routing: Any) -> None:
        self.requests += routing.experts.numel()
        if self.calls is not None:
            self.calls.append(routing.experts.reshape(-1).tolist())

    def routing(self) -> list[list[list[int]]]:
        """The recorded requests: [forward][layer] -> expert ids in request order."""
        calls = self.calls or []
        return [calls[i : i + self.layers] for i in range(0, len(calls), self.layers)]

    def reset(self) -> None:
        self.requests = 0

    def read(self) -> dict[str, float | None]:
        return dict(requests=self.requests, hits=self.requests, misses=0, moved_bytes=0)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class AccelerateProbe(Probe):
    """Bytes accelerate moves: each forward of an offloaded ``experts`` module copies all
    its weights to the device (its hook), counted by a pre-forward hook of ours."""

    def __init__(self, modules: list[nn.Module], module_bytes: int) -> None:
        self.calls = 0
        self.module_bytes = module_bytes
        self.handles = [m.register_forward_pre_hook(self._count) for m in modules]

    def _count(self, module: nn.Module, args: tuple) -> None:
        self.calls += 1

    def reset(self) -> None:
        self.calls = 0

    def read(self) -> dict[str, float | None]:
        return dict(moved_bytes=self.calls * self.module_bytes, hit_rate=None)


class CacheProbe(Probe):
    """The cache's counters; bytes moved = the bytes it copied into the device tier
    (``ExpertCacheStats.bytes_to_device``, prefetches included); ``host_loads``: the experts
    read from the host tier (each then copied once), counted here."""

    def __init__(self, cache: ExpertCache, host: HostTier | None) -> None:
        self.cache = cache
        self.host = host

    def reset(self) -> None:
        self.cache.reset_stats()
        if self.host is not None:
            self.host.loads = 0

    def read(self) -> dict[str, float | None]:
        s = self.cache.stats
        out = dict(
            requests=s.requests, hits=s.hits, misses=s.misses, loads=s.loads,
            moved_bytes=s.bytes_to_device, stall_s=s.stall_s, prefetch_issued=s.prefetch_issued,
            prefetch_hits=s.prefetch_hits, prefetch_wasted=s.prefetch_wasted,
        )  # fmt: skip
        if self.host is not None:
            out["host_loads"] = self.host.loads
        return out


# ---------------------------------------------------------------------------- serving
LM = Callable[..., Any]


def step(lm: LM, ids_1S: torch.Tensor, past: Any) -> tuple[torch.Tensor, Any]:
    """One forward with transformers' KV cache: the greedy next token [1, 1] and the cache."""
    out = lm(input_ids=ids_1S, past_key_values=past, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values


def measure(
    probe: Probe, dev: Device, before: Callable[[], None], run: Callable[[], int]
) -> Measure:
    """One timed repeat: ``before`` (untimed), then ``run`` (returns its tokens) timed to
    its end on the device, with the probe's counters and the peak device memory."""
    before()
    dev.sync()
    dev.reset_peak()
    probe.reset()
    start = time.perf_counter()
    tokens = run()
    dev.sync()
    seconds = time.perf_counter() - start
    return Measure(probe.read(), tokens, seconds, dev.peak())


@torch.no_grad()
def serve(
    lm: LM, probe: Probe, prompts: dict[str, torch.Tensor], args: argparse.Namespace, dev: Device,
    before_phase: Callable[[], None] = lambda: None, warmup: int | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Warm-up, timed decode windows, timed prefills (bench_serve.py's docstring); the row's
    figures. ``before_phase`` runs before each timed repeat; ``warmup`` replaces ``args.warmup``; a
    repeat after the first runs only when the slowest so far (a decode window and a
    prefill) ends by ``deadline`` (``time.monotonic``; None: every repeat)."""
    warmup = args.warmup if warmup is None else warmup
    t0 = time.perf_counter()
    tok, past = step(lm, prompts["a"], None)
    dev.sync()
    prefill_s = time.perf_counter() - t0  # untimed: what a timed prefill is expected to take
    tokens = [tok]
    for _ in range(warmup):
        tok, past = step(lm, tok, past)
        tokens.append(tok)
    window_s = args.row_seconds / args.repeats

    def window() -> int:
        nonlocal tok, past
        steps, start = 0, time.perf_counter()
        while steps < args.decode_tokens and (
            steps < MIN_DECODE or time.perf_counter() - start < window_s
        ):
            tok, past = step(lm, tok, past)
            tokens.append(tok)
            steps += 1
        return steps

    decode: list[Measure] = []
    while len(decode) < args.repeats and (
        not decode or fits(deadline, max(m.seconds for m in decode) + prefill_s)
    ):
        decode.append(measure(probe, dev, before_phase, window))
    kv_tokens = past.get_seq_length()
    if kv_tokens != prompts["a"].shape[1] + warmup + sum(m.tokens for m in decode):
        raise RuntimeError(f"the KV cache holds {kv_tokens} tokens: it was not used")
    del past, tok

    def prefill() -> int:
        step(lm, prompts["b"], None)
        return prompts["b"].shape[1]

    prefills: list[Measure] = []
    while len(prefills) < args.repeats and (
        not prefills or fits(deadline, max(m.seconds for m in prefills))
    ):
        prefills.append(measure(probe, dev, before_phase, prefill))
    return {
        "decode": phase_figures(decode, args.repeats),
        "prefill": phase_figures(prefills, args.repeats),
        "decoded": torch.cat(tokens, 1)[0].tolist(),
    }


# ---------------------------------------------------------------------------- contenders
def capacities(experts: int, top_k: int) -> dict[str, int]:
    """The cache sizes of issue 31: k, 2k, 25% and 50% of a layer's experts."""
    sizes = {"k": top_k, "2k": 2 * top_k, "25%": experts // 4, "50%": experts // 2}
    return {label: max(top_k, min(size, experts)) for label, size in sizes.items()}


def calibration_pins(
    model: HFMoEModel, prompt: torch.Tensor, sizes: list[int]
) -> dict[int, list[list[int]]]:
    """Per capacity, per layer: the most requested experts on ``prompt`` (static pins)."""
    counts = [torch.zeros(m.router.num_experts, dtype=torch.long) for m in model.moe_layers]

    def hook(i: int) -> Callable[..., None]:
        def count(router: nn.Module, args: tuple, routing: Any) -> None:
            flat = routing.experts.reshape(-1).cpu()
            counts[i] += torch.bincount(flat, minlength=counts[i].numel())

        return count

    handles = [m.router.register_forward_hook(hook(i)) for i, m in enumerate(model.moe_layers)]
    try:
        with torch.no_grad():
            model.hf(input_ids=prompt, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    order = [torch.argsort(c, descending=True, stable=True).tolist() for c in counts]
    return {size: [sorted(o[:size]) for o in order] for size in sizes}


def expert_offload_map(model: nn.Module, device: Any) -> dict[str, Any]:
    """accelerate's ``device_map``: each sparse block's ``experts`` module on "cpu", every
    other module on ``device``; refuses a module it cannot place whole."""
    experts = {f"{name}.experts" if name else "experts" for name in sparse_blocks(model)}
    if not experts:
        raise SystemExit("bench_serve: the transformers model has no sparse-MoE block")
    out: dict[str, Any] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        direct = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if direct:
            raise SystemExit(f"bench_serve: {prefix or 'the model'} holds tensors beside experts")
        for child, sub in module.named_children():
            name = f"{prefix}.{child}" if prefix else child
            if name in experts:
                out[name] = "cpu"
            elif any(e.startswith(name + ".") for e in experts):
                visit(name, sub)
            else:
                out[name] = device

    visit("", model)
    return out


def load_offloaded(folder: Path, device_map: dict[str, Any]) -> tuple[nn.Module, str]:
    """transformers' model of ``folder`` placed by ``device_map`` as users load it
    (``from_pretrained(device_map=...)``, which hands the "cpu" modules to accelerate's
    offload hooks); should that fail, the same hooks placed by ``accelerate.dispatch_model``
    on the model loaded in host memory. Returns the model and how it was loaded."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch.bfloat16, local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, **kwargs)
        return model, "from_pretrained(device_map)"
    except Exception as err:  # noqa: BLE001 (a version difference: the fallback says which)
        first = f"{type(err).__name__}: {err}".splitlines()[0]
        log.warning(
            "accelerate: from_pretrained(device_map) failed (%s); dispatch_model instead", first
        )
    from accelerate import dispatch_model

    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return dispatch_model(model, device_map=device_map), f"dispatch_model ({first})"


def device_slots(cache: ExpertCache) -> dict[str, int]:
    """The expert slots the cache's device tier holds, as ``ExpertCache`` allocates them
    (docs/cache.md): layers x capacity resident, top_k spare (a call's experts the policy
    does not keep), and the prefetch slots (top_k, with prefetch)."""
    resident = cache.num_layers * cache.capacity
    spare = max(1, cache.top_k or 1)
    prefetch = cache.prefetch_slots
    total = resident + spare + prefetch
    return dict(resident=resident, spare=spare, prefetch=prefetch, total=total)


@contextlib.contextmanager
def cache_over(
    model: HFMoEModel, store: Any, policy: str, capacity: int, prefetch: bool,
    pins: list[list[int]] | None, dev: Device,
) -> Iterator[ExpertCache]:  # fmt: skip
    """An ExpertCache on the device serving ``model``'s experts inside the block."""
    cache = ExpertCache(
        store, capacity, policy, device=dev.device, prefetch=prefetch,
        pinned=pins if policy == "static" else None, top_k=model.cfg.moe.top_k,
    )  # fmt: skip
    try:
        with offloaded(model, cache):
            yield cache
    finally:
        cache.close()


def link_figures(host: HostTier, dev: Device, samples: int = 16) -> dict[str, float | None]:
    """One expert's copy from the host tier to the device, as the cache makes it (its one
    flat buffer, one copy), timed to its end: the median seconds and the GB/s it implies;
    and the GB/s of a copy from pageable host memory (what accelerate copies from), which
    estimates accelerate's row (None on the CPU)."""
    if not dev.cuda:
        return {"expert_load_s": None, "h2d_gbps": None, "pageable_gbps": None}
    times = []
    slot = torch.empty(host.expert_bytes, dtype=torch.uint8, device=dev.device)
    for i in range(samples + 2):
        flat = flat_view(host.load(0, i % host.num_experts))
        assert flat is not None, "the host tier holds each expert as one buffer"
        times.append(bench.seconds(partial(slot.copy_, flat, non_blocking=True), dev.device))
    del slot
    host.loads = 0
    median = sorted(times[2:])[samples // 2]
    pageable = torch.ones(8 * host.expert_bytes, dtype=torch.uint8)  # touched: no page faults
    target = torch.empty_like(pageable, device=dev.device)
    copies = bench.times(partial(target.copy_, pageable), dev.device, repeats=5)
    del pageable, target
    return {
        "expert_load_s": median,
        "h2d_gbps": host.expert_bytes / median / 1e9,
        "pageable_gbps": 8 * host.expert_bytes / statistics.median(copies[1:]) / 1e9,
    }
