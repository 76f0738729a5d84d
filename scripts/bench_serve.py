"""Serving a transformers MoE model from moestack's expert cache, against every expert on the
device (the ceiling) and against accelerate's CPU offload (the baseline users run): decode
and prefill tokens/s, peak device memory, bytes moved per token and hit rate (issue 31).

The model is built offline, on the benchmark's device: a Qwen3-MoE model of random weights
with Qwen3-30B-A3B's layers (128 experts, top-8, hidden 2048, expert width 768, 32 query and
4 key-value heads of 128; bf16), ``--layers`` of them, and a smaller vocabulary (``--vocab``:
the embedding is not what is measured). It is saved once as a transformers folder
(``save_pretrained``: what the accelerate baseline loads, as users do). The ceiling is that
folder loaded without its experts (``load_hf_moe(folder, experts=False)``: the small
non-expert weights) with the experts taken from the model still in memory (``moe_from_hf``),
so the experts are never read back from the folder; the expert store on the local disk is
written from the ceiling (``ExpertStore.write``) and read once into pinned host memory
(``HostTier.read``). After the ceiling's row its experts are released and the same model is
served by every cache row (no other load). Weights: std 1/sqrt(fan_in), the embedding std 1,
the output projections (attention ``o_proj``, the experts' ``down_proj``) scaled by
``--residual-update``, so that each block changes the residual stream by about that
fraction, as in a trained model (it is what lets a layer's input predict the next layer's
experts); each router row scaled by exp(``--router-skew`` x N(0, 1)) (0: every expert about
equally popular, as load balancing trains for; larger: a few popular experts).

Contenders, one after another in this process, each with only its own weights on the
device (``torch.cuda.max_memory_allocated`` is that contender's):

- ``resident``: every expert resident on the device (the ceiling);
- ``cache``: the same model, its experts served by an ``ExpertCache``
  (``moestack.cache.offloaded``) over the experts in pinned host memory, at k, 2k, 25% and
  50% of a layer's experts, policies lru and static (pins: each layer's most requested
  experts on a calibration prompt through the ceiling), prefetch off and on (the next
  layer's router applied to this layer's input: ``CachedExperts``). The cache's device tier
  holds layers x capacity resident slots, top_k spare slots (a call's experts the policy
  does not keep) and, with prefetch, top_k prefetch slots, one expert each; the row records
  the count (``device_slots``);
- ``accelerate``: transformers' ``from_pretrained`` with accelerate's ``device_map`` putting
  every sparse block's ``experts`` module on "cpu" (moved to the device at each forward,
  all of a layer's experts, and dropped after: one layer's experts on the device at a
  time); skipped, with the reason, where accelerate is not importable or there is no CUDA
  device (on the CPU nothing is offloaded);
- ``disk``: the cache at 2k over the store on the local disk (no host tier), its files'
  pages dropped from the page cache (``posix_fadvise`` DONTNEED) before each timed repeat.

Rows are measured in ``ROWS`` order, the ones issue 31's targets judge first: the ceiling;
LRU at 2k without and with prefetch, then at 25% (the prefetch target at 2k, the 2x target
at 25%); accelerate (the 25% target's baseline); static at 2k and 25%; the disk tier; LRU
and static at k and 50%. The table prints them by tier, policy and size.

Each row: a warm-up (prefill of prompt A, ``--warmup`` decode steps), then ``--repeats``
timed decode windows back to back in one generation (transformers' KV cache: one token per
forward, batch 1; each window up to ``--decode-tokens`` tokens or ``--row-seconds /
--repeats`` seconds, at least 4 tokens), then ``--repeats`` timed prefills of a fresh prompt
B (batch 1, ``--prompt-tokens``). Per phase: the median tokens/s of its repeats and their
range; the peak device memory (the largest of the repeats); from the counts summed over the
repeats, bytes moved host to device per token (cache: the bytes it copied into its device
tier, prefetches included, ``ExpertCacheStats.bytes_to_device``; accelerate: every
offloaded experts module's bytes at each of its forwards), the hit rate (the policy's: a
request per token and slot; the ceiling's is 1) and the seconds the serving thread waited
on expert loads (``ExpertCacheStats.stall_s``: reads and waits on the host; the copies
themselves run on the device's copy stream, so on a GPU this is not the miss time). The
decoded tokens are compared with the ceiling's (same weights, same prompt): the cache must
give the same tokens. ``--record-routing`` keeps the ceiling's routing in its row, so that
the cache rows' hits and misses can be replayed independently.

Time budget (``--budget-s``, counted from the start of ``main``; 0: none): the ceiling and
the first cache row always run; any other row runs when the seconds spent plus its estimate
end inside the budget. The estimate is the slowest row of its own kind so far (a cache row
from cache rows only: a slow accelerate row does not hold back the cache rows); accelerate's
first row: its load (twice the folder's save time: the load also fuses the per-expert
tensors on the host) plus its forwards, each moving every layer's experts at the pageable
copy rate measured beside the link (two of warm-up, then per repeat a decode window of at
least 4 forwards and a prefill); the disk tier's first row: the
slowest cache row plus, per repeat, a decode window of ``--row-seconds / --repeats`` and a
prefill reading every expert from the disk at an assumed ``DISK_GBPS``. Within a row, a
repeat after the first runs only when the slowest repeat so far (a decode window plus a
prefill) still ends inside the budget; each phase says how many repeats ran of how many
were wanted. Skipped rows stay in the table and in the JSON (``rows`` and ``skipped``) with
the reason. The default 3 layers are sized for gpu_check's 80 s cap with ``--budget-s 55``
(docs/cache.md, "Benchmark": the time model and the speeds assumed).

How much of the miss time prefetch hides, per policy and capacity, from the decode rows
with prefetch off and on: ``hidden_wall = (s_off - s_on) / miss`` (s: the median seconds per
decode token; ``miss``: the load time of the misses per token without prefetch, printed as
it is used: on a GPU over the host tier, misses per token x one expert's measured copy time
(basis "link"), else the seconds per token the serving thread waited on loads (basis
"stall"); prefetch's own cost, the prediction and the wasted loads, counts against it) and
``hidden_stall = 1 - stall_on / stall_off`` (the load time the serving thread still waits
for on the host). ``hidden_wall`` is n/a, with the reason, unless both rows have two repeats
or more and ``miss`` is at least ``NOISE_FACTOR`` x the timing noise (the ranges of the two
rows' seconds per token over their repeats, summed: the most the difference of the medians
is off within what the repeats show, so the figure is good to +-1/NOISE_FACTOR) and at least
``MISS_SHARE`` of ``s_off`` (drift between two rows measured at different moments is not in
their ranges). Outside [0, 1] it is clipped, the raw value kept with a note.
``hidden_stall`` is n/a by the same rule, with ``stall_off`` as the divisor and the ranges of
the two rows' stall per token over their repeats as the noise (no ``MISS_SHARE`` rule: the
ratio takes no difference of whole token times, which drift between the rows moves). Issue 31's
targets are judged on ``hidden_wall`` at 2k and on the median decode tokens/s at 25% over
accelerate's; the device memory is printed beside the latter as measured, with the cache's
slot count, not judged: the cache holds layers x capacity experts where accelerate holds
one layer's, so which is smaller depends on the layer count.

    python scripts/bench_serve.py [--layers 3] [--json out.json]          # on a GPU
    python scripts/bench_serve.py --tiny --device cpu --json out.json     # toy sizes, CPU

The JSON is written after every row; ``--only`` runs the rows whose names start with one of
its comma-separated prefixes (the others are listed as skipped). A failed row is recorded
with its error and the exit status is 1; an interrupt (gpu_check's time cap) still prints
the table of the rows measured.

The experts' host tier is ``moestack.cache.host_tier.HostTier``: read once, ahead, and
shared by every cache row. The model is a transformers one (issue 31 asks for the model
users serve), decoded with transformers' KV cache; moestack's own model decodes with its
``KVCache`` (``generate_offloaded``) in the same pattern, one token per forward.
The first layer is never prefetched (``CachedExperts`` predicts layer i + 1 from layer i),
so at most (layers - 1) / layers of the misses can be predicted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_cache import drop_pages  # scripts/ is on sys.path when this file runs
from bench_serve_report import (
    MISS_SHARE,
    NOISE_FACTOR,
    Measure,
    brief,
    finish,
    phase_figures,
    print_table,
    print_targets,
)
from torch import nn

from moestack.atomic import write_text
from moestack.cache import ExpertCache, ExpertStore, offloaded
from moestack.cache.device_tier import flat_view
from moestack.cache.host_tier import HostTier
from moestack.cache.offload import release_experts
from moestack.interop.hf import moe_from_hf
from moestack.interop.hf_model import HFMoEModel, load_hf_moe
from moestack.runs import move_resident

# Qwen3-30B-A3B's layers (config.json of the published model), and toy sizes for the CPU.
FULL = dict(
    layers=3, experts=128, top_k=8, hidden=2048, expert_width=768, heads=32, kv_heads=4,
    head_dim=128, vocab=32768, prompt_tokens=512, decode_tokens=32, warmup=4, repeats=3,
)  # fmt: skip
TINY = dict(
    layers=2, experts=32, top_k=2, hidden=64, expert_width=32, heads=4, kv_heads=2,
    head_dim=16, vocab=512, prompt_tokens=32, decode_tokens=6, warmup=2, repeats=3,
)  # fmt: skip
MIN_DECODE = 4  # timed decode steps of a window, whatever --row-seconds says
DISK_CAPACITY = "2k"
DISK_GBPS = 2.0  # assumed read rate of the local disk, for the disk tier's first estimate


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class RowSpec:
    """One row of the plan: its kind (what its time is estimated from) and cache fields."""

    name: str
    kind: str  # resident, cache, accelerate, disk
    policy: str | None = None
    label: str | None = None  # capacity: k, 2k, 25%, 50%
    prefetch: bool = False

    @property
    def tier(self) -> str:
        return {"resident": "device", "accelerate": "cpu", "cache": "host"}.get(self.kind, "disk")


def cache_spec(tier: str, policy: str, label: str, prefetch: bool) -> RowSpec:
    name = f"{'cache' if tier == 'host' else 'disk'} {policy} {label}"
    kind = "cache" if tier == "host" else "disk"
    return RowSpec(name + ("+prefetch" if prefetch else ""), kind, policy, label, prefetch)


def row_plan() -> list[RowSpec]:
    """Every row in the order it is measured: issue 31's key comparisons first (module
    docstring), each capacity without then with prefetch."""

    def pair(tier: str, policy: str, label: str) -> list[RowSpec]:
        return [cache_spec(tier, policy, label, prefetch) for prefetch in (False, True)]

    return [
        RowSpec("resident", "resident"),
        *pair("host", "lru", "2k"), *pair("host", "lru", "25%"),
        RowSpec("accelerate", "accelerate"),
        *pair("host", "static", "2k"), *pair("host", "static", "25%"),
        *pair("disk", "lru", DISK_CAPACITY),
        *pair("host", "lru", "k"), *pair("host", "lru", "50%"),
        *pair("host", "static", "k"), *pair("host", "static", "50%"),
    ]  # fmt: skip


ROWS = row_plan()


class Budget:
    """Which rows fit in ``seconds`` from ``start`` (0: every row), by the clock ``clock``
    (module docstring): ``skip_reason(kind)`` before a row, ``record(kind, s)`` after."""

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
    """Seeded random weights (module docstring): std 1/sqrt(fan_in), embedding 1, output
    projections x ``residual_update``, router rows x exp(skew x N(0, 1)), norms 1."""
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
        if self.cuda:
            torch.cuda.synchronize(self.device)

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
    """Warm-up, timed decode windows, timed prefills (module docstring); the row's figures.
    ``before_phase`` runs before each timed repeat; ``warmup`` replaces ``args.warmup``; a
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


def resident_row(
    model: HFMoEModel, probe: ResidentProbe, prompts: dict[str, torch.Tensor],
    args: argparse.Namespace, dev: Device, deadline: float | None,
) -> dict[str, Any]:  # fmt: skip
    """The ceiling: every expert on the device; with ``--record-routing``, its routing."""
    row = serve(model.hf, probe, prompts, args, dev, deadline=deadline)
    if args.record_routing:
        row["routing"] = probe.routing()
    return row


def accelerate_row(
    folder: Path, args: argparse.Namespace, dev: Device, prompts: dict[str, torch.Tensor],
    deadline: float | None,
) -> dict[str, Any]:  # fmt: skip
    """transformers + accelerate with the experts offloaded to the CPU (module docstring)."""
    try:
        import accelerate
        from accelerate.utils import check_device_map
    except ImportError:
        return skipped("accelerate is not importable: carry its wheel (docs/kernels.md)")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        shape_only = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    target = (dev.device.index or 0) if dev.cuda else "cpu"
    device_map = expert_offload_map(shape_only, target)
    check_device_map(shape_only, device_map)  # every tensor placed (raises otherwise)
    offloaded_modules = sum(v == "cpu" for v in device_map.values())
    del shape_only
    if not dev.cuda:
        return skipped(
            f"needs a CUDA device: on the CPU nothing is offloaded (device map checked: "
            f"{offloaded_modules} experts modules on cpu, {len(device_map)} entries)"
        )
    model, loaded_with = load_offloaded(folder, device_map)
    experts = [model.get_submodule(n) for n, v in device_map.items() if v == "cpu"]
    where = sorted({p.device.type for m in experts for p in m.parameters(recurse=False)})
    if not where or "cuda" in where:  # offloaded, they wait on "meta" for each forward
        raise RuntimeError(f"accelerate put the experts on {where}: they are not offloaded")
    module_bytes = args.experts * expert_bytes(args)
    probe = AccelerateProbe(experts, module_bytes)
    # nothing to warm but the kernels
    row = serve(model, probe, prompts, args, dev, warmup=1, deadline=deadline)
    row.update(
        accelerate=accelerate.__version__, offloaded_modules=offloaded_modules,
        loaded_with=loaded_with, experts_between_forwards=where,
        device_experts=dict(at_once=args.experts, bytes=module_bytes,
                            what="one layer's experts, moved at its forward and dropped after"),
    )  # fmt: skip
    del model, experts, probe
    return row


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
        print(f"accelerate: from_pretrained(device_map) failed ({first}); dispatch_model instead")
    from accelerate import dispatch_model

    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return dispatch_model(model, device_map=device_map), f"dispatch_model ({first})"


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": True, "reason": reason}


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


def cache_row(
    model: HFMoEModel, source: HostTier | ExpertStore, policy: str, capacity: int,
    prefetch: bool, pins: list[list[int]] | None, prompts: dict[str, torch.Tensor],
    args: argparse.Namespace, dev: Device, deadline: float | None,
) -> dict[str, Any]:  # fmt: skip
    """One cache row: over the host tier, or over the store on disk with its pages dropped
    before each timed repeat; the device slots it holds."""
    host = source if isinstance(source, HostTier) else None
    files = [] if host else source.files()
    with cache_over(model, source, policy, capacity, prefetch, pins, dev) as cache:
        slots = device_slots(cache)
        row = serve(
            model.hf, CacheProbe(cache, host), prompts, args, dev, partial(drop_pages, files),
            deadline=deadline,
        )  # fmt: skip
    row["device_slots"] = {**slots, "bytes": slots["total"] * expert_bytes(args)}
    return row


def expert_bytes(args: argparse.Namespace) -> int:
    """One expert's bytes in bf16: w1 [D, 2F] and w2 [F, D]."""
    return 3 * args.hidden * args.expert_width * 2


# ---------------------------------------------------------------------------- the run
class Bench:
    """The rows so far, written to ``--json`` after each one, and the time budget."""

    def __init__(
        self, args: argparse.Namespace, config: dict[str, Any], start: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.args = args
        self.clock = clock
        # start: the clock's reading when main began: --budget-s counts from there
        self.budget = Budget(args.budget_s, start, clock)
        self.out: dict[str, Any] = {
            "config": config, "setup_s": {}, "link": {}, "rows": [], "skipped": [],
        }  # fmt: skip
        self.errors = 0

    def wanted(self, name: str) -> bool:
        only = [p for p in self.args.only.split(",") if p]
        return not only or any(name.startswith(p) for p in only)

    def timed(self, what: str) -> contextlib.AbstractContextManager:
        bench = self

        @contextlib.contextmanager
        def clock() -> Iterator[None]:
            t0 = bench.clock()
            yield
            bench.out["setup_s"][what] = round(bench.clock() - t0, 2)
            print(f"setup: {what} {bench.clock() - t0:.1f} s", flush=True)

        return clock()

    def row(
        self, spec: RowSpec, fields: dict[str, Any],
        run: Callable[[float | None], dict[str, Any]], *, always: bool = False,
    ) -> None:  # fmt: skip
        """Measure one row, ``run(deadline)``, unless filtered out by ``--only`` or judged
        past the budget (``Budget.skip_reason``; ``always``: the ceiling every ratio needs),
        and save; a skipped row is kept with its reason."""
        row: dict[str, Any] = {"name": spec.name, **fields}
        reason = None if self.wanted(spec.name) else "not selected by --only"
        reason = reason or self.budget.skip_reason(spec.kind, always)
        if reason:
            row.update(skipped(reason))
        else:
            t0 = self.clock()
            try:
                row.update(run(self.budget.deadline()))
            except Exception as err:  # one failed row must not lose the others
                traceback.print_exc()
                row.update(error=f"{type(err).__name__}: {err}".splitlines()[0])
                self.errors += 1
            seconds = self.clock() - t0
            self.budget.record(spec.kind, seconds)
            row["row_s"] = round(seconds, 2)
        if row.get("skipped"):
            self.out["skipped"].append({"name": spec.name, "reason": row["reason"]})
        self.out["rows"].append(row)
        print(f"row {spec.name}: {brief(row)}", flush=True)
        self.save()

    def save(self) -> None:
        finish(self.out)
        if self.args.json:
            write_text(Path(self.args.json), json.dumps(self.out, indent=1))


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
        dev.sync()
        start = time.perf_counter()
        slot.copy_(flat, non_blocking=True)
        dev.sync()
        times.append(time.perf_counter() - start)
    del slot
    host.loads = 0
    median = sorted(times[2:])[samples // 2]
    pageable = torch.ones(8 * host.expert_bytes, dtype=torch.uint8)  # touched: no page faults
    target = torch.empty_like(pageable, device=dev.device)
    copies = []
    for _ in range(5):
        dev.sync()
        start = time.perf_counter()
        target.copy_(pageable)
        dev.sync()
        copies.append(time.perf_counter() - start)
    del pageable, target
    return {
        "expert_load_s": median,
        "h2d_gbps": host.expert_bytes / median / 1e9,
        "pageable_gbps": 8 * host.expert_bytes / statistics.median(copies[1:]) / 1e9,
    }


def set_estimates(budget: Budget, setup_s: dict[str, float], link: dict[str, Any],
                  args: argparse.Namespace) -> None:  # fmt: skip
    """The estimates of the first accelerate and disk rows (module docstring)."""
    all_bytes = args.layers * args.experts * expert_bytes(args)
    window_s = args.row_seconds / args.repeats
    gbps = link.get("pageable_gbps")
    if gbps:
        fwd = all_bytes / (gbps * 1e9)
        window = min(args.decode_tokens * fwd, max(MIN_DECODE * fwd, window_s))
        load = 2 * setup_s.get("save_folder", 0.0)
        budget.prior_s["accelerate"] = (
            load + 2 * fwd + args.repeats * (window + fwd),
            f"its load ~ twice the folder's save, {load:.1f} s, and {fwd:.2f} s a forward moving "
            f"{all_bytes / 1e9:.1f} GB at the pageable {gbps:.1f} GB/s measured",
        )
    read = all_bytes / (DISK_GBPS * 1e9)
    budget.extra_s["disk"] = (
        args.repeats * (window_s + read),
        f"{args.repeats} x ({window_s:.2f} s window + {read:.2f} s reading "
        f"{all_bytes / 1e9:.2f} GB at an assumed {DISK_GBPS:g} GB/s)",
    )


def run(bench: Bench, args: argparse.Namespace, dev: Device, root: Path) -> None:
    """Build, then measure every row (module docstring) into ``bench``."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = {
        k: torch.randint(0, args.vocab, (1, args.prompt_tokens), generator=gen).to(dev.device)
        for k in ("a", "b", "calibration")
    }
    with bench.timed("build_model"):
        built = build_model(args, dev.device)
    with bench.timed("save_folder"):
        folder = save_folder(built, root)
    with bench.timed("load_resident"):
        model = resident_model(folder, built, args, dev)
    del built
    dev.free()
    with bench.timed("write_store"):
        store = ExpertStore.write(model, root / "store")
    try:
        measure_rows(bench, args, dev, model, folder, store, prompts)
    finally:
        store.close()


def measure_rows(
    bench: Bench, args: argparse.Namespace, dev: Device, model: HFMoEModel, folder: Path,
    store: ExpertStore, prompts: dict[str, torch.Tensor],
) -> None:  # fmt: skip
    """The ceiling's row, then the model's experts released and every other row of ROWS
    in order: the cache rows serve the same model."""
    sizes = capacities(args.experts, args.top_k)
    pins = calibration_pins(model, prompts["calibration"], sorted(set(sizes.values())))
    probe = ResidentProbe(model, record=args.record_routing)
    serve_resident = partial(resident_row, model, probe, prompts, args, dev)
    bench.row(ROWS[0], {"tier": "device"}, serve_resident, always=True)
    probe.close()
    release_experts(model)  # from here on the cache serves them
    dev.free()
    with bench.timed("host_tier"):
        host = HostTier.read(store, pin=dev.cuda)
    bench.out["link"] = link_figures(host, dev)
    set_estimates(bench.budget, bench.out["setup_s"], bench.out["link"], args)
    gc.collect()
    gc.freeze()  # the rows' collections (Device.free) then scan only what the rows made
    try:
        for spec in ROWS[1:]:
            if spec.kind == "accelerate":
                measure = partial(accelerate_row, folder, args, dev, prompts)
                bench.row(spec, {"tier": spec.tier}, measure)
            else:
                assert spec.policy is not None and spec.label is not None
                capacity = sizes[spec.label]
                fields = dict(tier=spec.tier, policy=spec.policy, capacity=capacity,
                              capacity_label=spec.label, prefetch=spec.prefetch)  # fmt: skip
                measure = partial(
                    cache_row, model, host if spec.kind == "cache" else store, spec.policy,
                    capacity, spec.prefetch, pins.get(capacity), prompts, args, dev,
                )  # fmt: skip
                bench.row(spec, fields, measure)
            dev.free()
    finally:
        gc.unfreeze()


def run_config(args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    """What the JSON records of the run: sizes, knobs, device and versions."""
    import transformers

    keys = (*FULL, "router_skew", "residual_update", "seed", "impl", "row_seconds", "budget_s")
    return {
        **{k: getattr(args, k) for k in keys},
        "device": str(dev.device), "dtype": "bfloat16", "expert_bytes": expert_bytes(args),
        "noise_factor": NOISE_FACTOR, "miss_share": MISS_SHARE, "disk_gbps_assumed": DISK_GBPS,
        "row_order": [spec.name for spec in ROWS],
        "gpu": torch.cuda.get_device_name(dev.device) if dev.cuda else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda when there is one (the CPU needs --tiny)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU tests)")
    for key, value in FULL.items():
        flag = "--" + key.replace("_", "-")
        parser.add_argument(
            flag, type=int, default=None, help=f"default {value} (--tiny: {TINY[key]})"
        )
    parser.add_argument(
        "--router-skew",
        type=float,
        default=0.0,
        help="router rows x exp(skew x N(0, 1)): 0 = experts equally popular",
    )
    parser.add_argument(
        "--residual-update",
        type=float,
        default=0.1,
        help="output projections' scale: each block's share of the residual",
    )
    parser.add_argument("--row-seconds", type=float, default=2.5,
                        help="timed decode per row, split over its repeats (each window at "
                             "least 4 tokens)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="skip the rows that would end past this many seconds from the "
                             "start, each judged by the slowest row of its kind so far (the "
                             "ceiling and the first cache row always run; 0: no limit)")  # fmt: skip
    parser.add_argument(
        "--impl",
        default="torch",
        help="moestack's experts (torch: grouped GEMMs, nothing to compile; "
        "triton compiles per shape, bench_moe times it)",
    )
    parser.add_argument("--only", default="", help="comma-separated row-name prefixes")
    parser.add_argument(
        "--record-routing",
        action="store_true",
        help="keep the ceiling's routing in its row (routing[forward][layer]: expert ids in "
        "request order; forwards: prefill A, the warm-up and timed decode steps, then each "
        "timed prefill of B)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default="", help="scratch folder (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the model folder and store")
    parser.add_argument("--json", default="", help="write the results here (after every row)")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if torch.device(args.device).type == "cpu" and not args.tiny:
        parser.error("on the CPU use --tiny (the full sizes need a GPU)")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: use 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    dev = Device(torch.device(args.device))
    bench = Bench(args, run_config(args, dev), start)
    root = Path(tempfile.mkdtemp(prefix="bench_serve.", dir=args.dir or None))
    try:
        run(bench, args, dev, root)
    except KeyboardInterrupt:  # gpu_check's cap (SIGINT): keep what was measured
        bench.out["interrupted"] = (
            f"interrupted after {time.monotonic() - start:.1f} s: the table holds the rows "
            "measured before"
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    bench.save()
    print_table(bench.out)
    print_targets(bench.out)
    return 1 if bench.errors or bench.out.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
