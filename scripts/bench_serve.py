"""Serving a transformers MoE model from moestack's expert cache, against every expert on the
device (the ceiling) and against accelerate's CPU offload (the baseline users run): decode
and prefill tokens/s, peak device memory, bytes moved per token and hit rate (issue 31).

The model is built offline: a Qwen3-MoE folder (``save_pretrained``: config.json and
safetensors) of random weights with Qwen3-30B-A3B's layers (128 experts, top-8, hidden
2048, expert width 768, 32 query and 4 key-value heads of 128; bf16), ``--layers`` of them,
and a smaller vocabulary (``--vocab``: the embedding is not what is measured). Its experts
are then written to an expert store on the local disk (``ExpertStore.write``) and read once
into pinned host memory. Weights: std 1/sqrt(fan_in), the embedding std 1, the output
projections (attention ``o_proj``, the experts' ``down_proj``) scaled by
``--residual-update``, so that each block changes the residual stream by about that
fraction, as in a trained model (it is what lets a layer's input predict the next layer's
experts); each router row scaled by exp(``--router-skew`` x N(0, 1)) (0: every expert about
equally popular, as load balancing trains for; larger: a few popular experts).

Contenders, one after another in this process, each with only its own weights on the
device (``torch.cuda.max_memory_allocated`` is that contender's):

- ``resident``: ``load_hf_moe(folder)`` on the device, every expert resident (the ceiling);
- ``accelerate``: transformers' ``from_pretrained`` with accelerate's ``device_map`` putting
  every sparse block's ``experts`` module on "cpu" (moved to the device at each forward,
  all of a layer's experts, and dropped after); skipped, with the reason, where accelerate
  is not importable or there is no CUDA device (on the CPU nothing is offloaded);
- ``cache``: ``load_hf_moe(folder, experts=False)`` on the device, its experts served by an
  ``ExpertCache`` (``moestack.cache.offloaded``) over the experts in pinned host memory, at
  k, 2k, 25% and 50% of a layer's experts, policies lru and static (pins: each layer's most
  requested experts on a calibration prompt through the resident model), prefetch off and
  on (the next layer's router applied to this layer's input: ``CachedExperts``);
- ``disk``: the cache at 2k over the store on the local disk (no host tier), its files'
  pages dropped from the page cache (``posix_fadvise`` DONTNEED) before each timed phase.

Each row: a warm-up (prefill of prompt A, ``--warmup`` decode steps), then a timed greedy
decode (transformers' KV cache: one token per forward, batch 1) of up to ``--decode-tokens``
tokens or ``--row-seconds`` (at least 4 tokens), then a timed prefill of a fresh prompt B
(batch 1, ``--prompt-tokens``). Per phase: tokens/s, the peak device memory since the
phase began, bytes moved host to device per token (cache: the bytes it copied into its
device tier, prefetches included, ``ExpertCacheStats.bytes_to_device``; accelerate: every
offloaded experts module's bytes at each of its forwards), the hit rate (the policy's: a
request per token and slot; the ceiling's is 1) and the seconds the serving thread waited on
expert loads (``ExpertCacheStats.stall_s``: reads and waits on the host; the copies
themselves run on the device's copy stream, so on a GPU this is not the miss time). The
decoded tokens are compared with the ceiling's (same weights, same prompt): the cache must
give the same tokens. ``--record-routing`` keeps the ceiling's routing in its row, so that
the cache rows' hits and misses can be replayed independently.

How much of the miss time prefetch hides, per policy and capacity, from the decode rows
with prefetch off and on: ``hidden_wall = (s_off - s_on) / miss_off`` (s: seconds per
decode token; miss_off: the load time of the misses per token without prefetch: on a GPU
over the host tier, misses per token x one expert's measured copy time (``link``), else
the seconds per token the serving thread waited on loads; prefetch's own cost, the
prediction and the wasted loads, counts against it) and ``hidden_stall = 1 - stall_on /
stall_off`` (the load time the serving thread still waits for on the host). The targets of
issue 31 are judged on ``hidden_wall``.

    python scripts/bench_serve.py [--layers 4] [--json out.json]          # on a GPU
    python scripts/bench_serve.py --tiny --device cpu --json out.json     # toy sizes, CPU

The JSON is written after every row; ``--budget-s`` skips the rows that would end past it,
judged by the row before (the ceiling always runs), so a capped run keeps what it measured;
``--only`` runs the rows whose names start with one of its comma-separated prefixes. The
rows are measured with the ones issue 31's targets judge first (lru at 25% and 2k), then
the disk tier, then the rest. A failed row is recorded with its error and the exit status
is 1.

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
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_cache import drop_pages  # scripts/ is on sys.path when this file runs
from torch import nn

from moestack.atomic import write_text
from moestack.cache import ExpertCache, ExpertStore, offloaded
from moestack.cache.device_tier import flat_view
from moestack.cache.host_tier import HostTier
from moestack.interop.hf_model import HFMoEModel, load_hf_moe
from moestack.runs import move_resident

# Qwen3-30B-A3B's layers (config.json of the published model), and toy sizes for the CPU.
FULL = dict(
    layers=4, experts=128, top_k=8, hidden=2048, expert_width=768, heads=32, kv_heads=4,
    head_dim=128, vocab=32768, prompt_tokens=512, decode_tokens=32, warmup=4,
)  # fmt: skip
TINY = dict(
    layers=2, experts=32, top_k=2, hidden=64, expert_width=32, heads=4, kv_heads=2,
    head_dim=16, vocab=512, prompt_tokens=32, decode_tokens=6, warmup=2,
)  # fmt: skip
MIN_DECODE = 4  # timed decode steps of a row, whatever --row-seconds says
DISK_CAPACITY = "2k"


# ---------------------------------------------------------------------------- the model
def qwen3_config(args: argparse.Namespace) -> Any:
    """A transformers Qwen3-MoE config of the benchmark's sizes (every layer sparse)."""
    from transformers import AutoConfig

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
        max_position_embeddings=args.prompt_tokens + args.warmup + args.decode_tokens + 8,
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


def build_folder(root: Path, args: argparse.Namespace, device: torch.device) -> Path:
    """The random Qwen3-MoE folder (config.json, safetensors), built on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_config(args), dtype=torch.bfloat16)
    randomize(model, args)
    out = root / "model"
    model.to("cpu").save_pretrained(out)
    del model
    return out


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


# ---------------------------------------------------------------------------- host tier
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


def phase_figures(
    counts: dict[str, float | None], tokens: int, seconds: float, peak: int | None
) -> dict[str, float | None]:
    """One timed phase's row fields from its counters."""
    requests = counts.get("requests")
    hits = counts.get("hits")
    hit_rate = counts.get("hit_rate", hits / requests if requests else None)
    moved = counts.get("moved_bytes")
    stall = counts.get("stall_s")
    out = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "peak_device_bytes": peak,
        "hit_rate": hit_rate,
        "bytes_per_token": moved / tokens if moved is not None and tokens else None,
        "misses_per_token": counts["misses"] / tokens if counts.get("misses") is not None else None,
        "stall_s_per_token": stall / tokens if stall is not None else None,
    }
    for key in ("requests", "hits", "misses", "loads", "prefetch_issued", "prefetch_hits",
                "prefetch_wasted", "host_loads"):  # fmt: skip
        if key in counts:
            out[key] = counts[key]
    return out


@torch.no_grad()
def serve(
    lm: LM, probe: Probe, prompts: dict[str, torch.Tensor], args: argparse.Namespace, dev: Device,
    before_phase: Callable[[], None] = lambda: None, warmup: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Warm-up, timed decode, timed prefill (module docstring); the row's figures.
    ``before_phase`` runs before each timed phase; ``warmup`` replaces ``args.warmup``."""
    warmup = args.warmup if warmup is None else warmup
    tok, past = step(lm, prompts["a"], None)
    tokens = [tok]
    for _ in range(warmup):
        tok, past = step(lm, tok, past)
        tokens.append(tok)
    before_phase()
    dev.sync()
    dev.reset_peak()
    probe.reset()
    start = time.perf_counter()
    steps = 0
    while steps < args.decode_tokens and (
        steps < MIN_DECODE or time.perf_counter() - start < args.row_seconds
    ):
        tok, past = step(lm, tok, past)
        tokens.append(tok)
        steps += 1
    dev.sync()
    decode = phase_figures(probe.read(), steps, time.perf_counter() - start, dev.peak())
    kv_tokens = past.get_seq_length()
    if kv_tokens != prompts["a"].shape[1] + warmup + steps:
        raise RuntimeError(f"the KV cache holds {kv_tokens} tokens: it was not used")
    del past, tok
    before_phase()
    dev.sync()
    dev.reset_peak()
    probe.reset()
    start = time.perf_counter()
    step(lm, prompts["b"], None)
    dev.sync()
    prefill_tokens = prompts["b"].shape[1]
    prefill = phase_figures(probe.read(), prefill_tokens, time.perf_counter() - start, dev.peak())
    return {"decode": decode, "prefill": prefill, "decoded": torch.cat(tokens, 1)[0].tolist()}


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
    experts = {
        f"{name}.experts" if name else "experts"
        for name, m in model.named_modules()
        if isinstance(getattr(m, "gate", None), nn.Module)
        and isinstance(getattr(m, "experts", None), nn.Module)
    }
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
    args: argparse.Namespace, dev: Device,
) -> dict[str, Any]:  # fmt: skip
    """The ceiling: every expert on the device; with ``--record-routing``, its routing."""
    row = serve(model.hf, probe, prompts, args, dev)
    if args.record_routing:
        row["routing"] = probe.routing()
    return row


def accelerate_row(
    folder: Path, args: argparse.Namespace, dev: Device, prompts: dict[str, torch.Tensor]
) -> dict[str, Any]:
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
    module_bytes = args.experts * 3 * args.hidden * args.expert_width * 2  # bf16
    probe = AccelerateProbe(experts, module_bytes)
    row = serve(model, probe, prompts, args, dev, warmup=1)  # nothing to warm but the kernels
    row.update(
        accelerate=accelerate.__version__, offloaded_modules=offloaded_modules,
        loaded_with=loaded_with, experts_between_forwards=where,
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


# ---------------------------------------------------------------------------- the run
class Bench:
    """The rows so far, written to ``--json`` after each one, and the time budget."""

    def __init__(self, args: argparse.Namespace, config: dict[str, Any], start: float) -> None:
        self.args = args
        self.start = start  # time.monotonic() when main began: --budget-s counts from there
        self.out: dict[str, Any] = {"config": config, "setup_s": {}, "link": {}, "rows": []}
        self.last_row_s = 0.0
        self.errors = 0

    def wanted(self, name: str) -> bool:
        only = [p for p in self.args.only.split(",") if p]
        return not only or any(name.startswith(p) for p in only)

    def timed(self, what: str) -> contextlib.AbstractContextManager:
        bench = self

        @contextlib.contextmanager
        def clock() -> Iterator[None]:
            t0 = time.monotonic()
            yield
            bench.out["setup_s"][what] = round(time.monotonic() - t0, 2)
            print(f"setup: {what} {time.monotonic() - t0:.1f} s", flush=True)

        return clock()

    def row(
        self, name: str, fields: dict[str, Any], run: Callable[[], dict[str, Any]],
        *, always: bool = False,
    ) -> None:  # fmt: skip
        """Measure one row (unless filtered out, or past the budget and not ``always``: the
        ceiling every ratio needs) and save."""
        if not self.wanted(name):
            return
        row: dict[str, Any] = {"name": name, **fields}
        budget = self.args.budget_s
        late = budget and time.monotonic() - self.start + self.last_row_s > budget
        if late and not always:
            row.update(skipped("time budget spent (--budget-s)"))
        else:
            t0 = time.monotonic()
            try:
                row.update(run())
            except Exception as err:  # one failed row must not lose the others
                traceback.print_exc()
                row.update(error=f"{type(err).__name__}: {err}".splitlines()[0])
                self.errors += 1
            self.last_row_s = time.monotonic() - t0
            row["row_s"] = round(self.last_row_s, 2)
        self.out["rows"].append(row)
        print(f"row {name}: {brief(row)}", flush=True)
        self.save()

    def save(self) -> None:
        finish(self.out)
        if self.args.json:
            write_text(Path(self.args.json), json.dumps(self.out, indent=1))


def brief(row: dict[str, Any]) -> str:
    if row.get("skipped") or row.get("error"):
        return row.get("reason") or row.get("error", "")
    d, p = row["decode"], row["prefill"]
    return f"decode {fmt(d['tokens_per_s'], 1)} tok/s, prefill {fmt(p['tokens_per_s'], 1)} tok/s"


def finish(out: dict[str, Any]) -> None:
    """Ratios to the ceiling and to accelerate, token checks, and the prefetch figures."""
    rows = {r["name"]: r for r in out["rows"] if "decode" in r}
    resident, accel = rows.get("resident"), rows.get("accelerate")
    for row in rows.values():
        for ph in ("decode", "prefill"):
            tps = row[ph]["tokens_per_s"]
            for key, ref in (("vs_resident", resident), ("vs_accelerate", accel)):
                base = ref[ph]["tokens_per_s"] if ref else None
                row[ph][key] = tps / base if tps and base else None
            mem, base_mem = row[ph]["peak_device_bytes"], accel and accel[ph]["peak_device_bytes"]
            row[ph]["memory_vs_accelerate"] = mem / base_mem if mem and base_mem else None
        if resident is not None and row is not resident:
            ref, got = resident["decoded"], row["decoded"]
            n = min(len(ref), len(got))  # every token the row decoded is the ceiling's
            row["same_tokens_as_resident"] = ref[:n] == got[:n]
    out["prefetch"] = prefetch_figures(rows, out.get("link", {}).get("expert_load_s"))


def prefetch_figures(
    rows: dict[str, dict[str, Any]], expert_load_s: float | None
) -> list[dict[str, Any]]:
    """How much of the miss time prefetch hides, per tier, policy and capacity (module
    docstring: hidden_wall and hidden_stall, from the decode phases). ``link_miss_s_per_token``
    is the misses per token without prefetch x one expert's measured copy time (``link``):
    what stall_off should be over the host tier."""
    out = []
    for name, on in rows.items():
        if not on.get("prefetch") or name.replace("+prefetch", "") not in rows:
            continue
        off = rows[name.replace("+prefetch", "")]
        d_on, d_off = on["decode"], off["decode"]
        stall_off, stall_on = d_off["stall_s_per_token"], d_on["stall_s_per_token"]
        s_on = 1 / d_on["tokens_per_s"] if d_on["tokens_per_s"] else None
        s_off = 1 / d_off["tokens_per_s"] if d_off["tokens_per_s"] else None
        link = (
            d_off["misses_per_token"] * expert_load_s
            if expert_load_s and d_off["misses_per_token"] is not None and on["tier"] == "host"
            else None
        )
        miss = link or stall_off  # the copies run on the device: the host waits on none
        ok = miss and s_on is not None and s_off is not None
        misses = d_on.get("misses") or 0
        out.append({
            "tier": on["tier"], "policy": on["policy"], "capacity": on["capacity"],
            "capacity_label": on["capacity_label"],
            "miss_s_per_token": stall_off,
            "link_miss_s_per_token": link,
            "hidden_wall": (s_off - s_on) / miss if ok else None,
            "hidden_stall": 1 - stall_on / stall_off if ok and stall_off else None,
            "predicted": d_on.get("prefetch_hits", 0) / misses if misses else None,
        })  # fmt: skip
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


LABELS = ("k", "2k", "25%", "50%")


def table_order(row: dict[str, Any]) -> tuple:
    """resident, accelerate, the cache over host memory by policy and size, the disk tier."""
    tiers = ("device", "cpu", "host", "disk")
    label = row.get("capacity_label")
    return (
        tiers.index(row.get("tier", "host")),
        row.get("policy", ""),
        LABELS.index(label) if label in LABELS else -1,
        bool(row.get("prefetch")),
    )


def print_table(out: dict[str, Any]) -> None:
    """The rows side by side; ratios to the ceiling (resident) and to accelerate."""
    cfg = out["config"]
    print(
        f"\nbench_serve: {cfg['layers']} layers x {cfg['experts']} experts (top-{cfg['top_k']}, "
        f"hidden {cfg['hidden']}, width {cfg['expert_width']}, {cfg['dtype']}; "
        f"{cfg['expert_bytes'] / 2**20:.2f} MiB an expert) on {cfg['device']}; prompt "
        f"{cfg['prompt_tokens']} tokens, batch 1"
    )
    head = (
        f"| {'row':<26}| {'decode tok/s':>12} | {'x res':>6} | {'x acc':>6} | {'prefill tok/s':>13} "
        f"| {'x res':>6} | {'x acc':>6} | {'peak MiB':>9} | {'x acc':>6} | {'MB/token':>9} "
        f"| {'hit':>5} | {'stall ms/t':>10} | same |"
    )
    print(head)
    for row in sorted(out["rows"], key=table_order):
        if "decode" not in row:
            why = row.get("reason") or row.get("error")
            print(f"| {row['name']:<26}| {'skipped' if row.get('skipped') else 'ERROR'}: {why}")
            continue
        d, p = row["decode"], row["prefill"]
        peaks = [x for x in (d["peak_device_bytes"], p["peak_device_bytes"]) if x is not None]
        mib = max(peaks) / 2**20 if peaks else None
        mem_x = d["memory_vs_accelerate"]
        mb = d["bytes_per_token"] / 1e6 if d["bytes_per_token"] is not None else None
        stall = d["stall_s_per_token"] * 1e3 if d["stall_s_per_token"] is not None else None
        same = row.get("same_tokens_as_resident")
        print(
            f"| {row['name']:<26}| {fmt(d['tokens_per_s'], 1):>12} | {fmt(d['vs_resident']):>6} "
            f"| {fmt(d['vs_accelerate']):>6} | {fmt(p['tokens_per_s'], 1):>13} "
            f"| {fmt(p['vs_resident']):>6} | {fmt(p['vs_accelerate']):>6} | {fmt(mib, 0):>9} "
            f"| {fmt(mem_x):>6} | {fmt(mb, 1):>9} | {fmt(d['hit_rate']):>5} | {fmt(stall):>10} "
            f"| {'-' if same is None else ('yes' if same else 'NO')}  |"
        )
    print(
        "decode: one token per forward after a warm-up; x res / x acc: tokens/s over the "
        "resident ceiling's / accelerate's; peak: device memory, the larger of the two phases; "
        "x acc (memory): decode peak over accelerate's; MB/token, hit, stall: decode phase; "
        "same: the tokens equal the ceiling's"
    )
    if out["prefetch"]:
        print("prefetch: miss time hidden (wall = (s_off - s_on) / miss_off per decode token; "
              "stall = 1 - stall_on / stall_off; predicted = prefetch hits / misses)")  # fmt: skip
        for f in sorted(out["prefetch"], key=table_order):
            print(
                f"|   {f['tier']:<5}{f['policy']:<7}{f['capacity_label']:>4} ({f['capacity']:>3}) "
                f"| miss {fmt(f['miss_s_per_token'] and f['miss_s_per_token'] * 1e3)} ms/token "
                f"| hidden wall {fmt(f['hidden_wall'])} | stall {fmt(f['hidden_stall'])} "
                f"| predicted {fmt(f['predicted'])} |"
            )


def print_targets(out: dict[str, Any]) -> None:
    """Issue 31's GPU targets, met or missed (judged on this run alone, on a GPU only)."""
    rows = [r for r in out["rows"] if "decode" in r]
    # accelerate is left out: it computes with transformers' own experts (rounding may differ)
    bad = [
        r["name"]
        for r in rows
        if r.get("tier") in ("host", "disk") and r.get("same_tokens_as_resident") is False
    ]
    if bad:
        print(f"serve check: tokens differ from the ceiling's in {', '.join(bad)}")
    if not out["config"]["device"].startswith("cuda"):
        print("serve target: not judged off a GPU")
        return
    quarter = [
        r for r in rows
        if r.get("capacity_label") == "25%" and r.get("tier") == "host"
        and r["decode"]["vs_accelerate"] is not None
    ]  # fmt: skip
    if quarter:
        best = max(quarter, key=lambda r: r["decode"]["vs_accelerate"])
        d = best["decode"]
        ok = d["vs_accelerate"] >= 2 and (d["memory_vs_accelerate"] or 0) <= 1
        print(
            f"serve target: {'met' if ok else 'MISSED'}: cache at 25% ({best['name']}) decodes "
            f"{d['vs_accelerate']:.2f}x accelerate's tokens/s at {fmt(d['memory_vs_accelerate'])}x "
            "its peak device memory (target >= 2x at <= 1x)"
        )
    else:
        print("serve target: not judged: no accelerate row or no 25% cache row")
    hidden = [f for f in out["prefetch"] if f["tier"] == "host" and f["capacity_label"] == "2k"]
    for f in hidden:
        ok = f["hidden_wall"] is not None and f["hidden_wall"] >= 0.5
        print(
            f"serve target: {'met' if ok else 'MISSED'}: prefetch hides {fmt(f['hidden_wall'])} "
            f"of the miss time at 2k ({f['policy']}; stall-based {fmt(f['hidden_stall'])}) "
            "(target >= 0.5)"
        )


# The cache rows in the order they are measured (the rows that judge issue 31's targets
# first, then the disk tier, then the rest); the table prints them by tier, policy, size.
CACHE_PLAN = (
    ("host", "lru", "25%"), ("host", "lru", "2k"), ("disk", "lru", DISK_CAPACITY),
    ("host", "lru", "k"), ("host", "lru", "50%"),
    *(("host", "static", label) for label in ("k", "2k", "25%", "50%")),
)  # fmt: skip


def link_figures(host: HostTier, dev: Device, samples: int = 16) -> dict[str, float | None]:
    """One expert's copy from the host tier to the device, as the cache makes it (its one
    flat buffer, one copy), timed to its end: the median seconds and the GB/s it implies
    (None on the CPU)."""
    if not dev.cuda:
        return {"expert_load_s": None, "h2d_gbps": None}
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
    return {"expert_load_s": median, "h2d_gbps": host.expert_bytes / median / 1e9}


def run(args: argparse.Namespace, root: Path, start: float) -> Bench:
    """Build, then measure every row (module docstring); the rows as they came."""
    dev = Device(torch.device(args.device))
    bench = Bench(args, run_config(args, dev), start)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = {
        k: torch.randint(0, args.vocab, (1, args.prompt_tokens), generator=gen).to(dev.device)
        for k in ("a", "b", "calibration")
    }
    with bench.timed("build_folder"):
        folder = build_folder(root, args, dev.device)
    sizes = capacities(args.experts, args.top_k)
    with bench.timed("load_resident"):
        resident = load_hf_moe(folder, impl=args.impl, dtype=torch.bfloat16)
    with bench.timed("write_store"):
        store = ExpertStore.write(resident, root / "store")
    resident.to(dev.device)
    pins = calibration_pins(resident, prompts["calibration"], sorted(set(sizes.values())))
    probe = ResidentProbe(resident, record=args.record_routing)
    serve_resident = partial(resident_row, resident, probe, prompts, args, dev)
    bench.row("resident", {"tier": "device"}, serve_resident, always=True)
    probe.close()
    del resident, probe, serve_resident
    dev.free()
    bench.row("accelerate", {"tier": "cpu"}, partial(accelerate_row, folder, args, dev, prompts))
    dev.free()
    with bench.timed("host_tier"):
        host = HostTier.read(store, pin=dev.cuda)
    bench.out["link"] = link_figures(host, dev)
    with bench.timed("load_cache_model"):
        model = load_hf_moe(folder, impl=args.impl, dtype=torch.bfloat16, experts=False)
        move_resident(model, dev.device)
    gc.collect()
    gc.freeze()  # the rows' collections (Device.free) then scan only what the rows made
    try:
        for tier, policy, label in CACHE_PLAN:
            for prefetch in (False, True):
                name = f"{'cache' if tier == 'host' else 'disk'} {policy} {label}"
                name += "+prefetch" if prefetch else ""
                fields = dict(tier=tier, policy=policy, capacity=sizes[label],
                              capacity_label=label, prefetch=prefetch)  # fmt: skip
                source = host if tier == "host" else store
                measure = partial(
                    cache_row, model, source, policy, sizes[label], prefetch,
                    pins.get(sizes[label]), prompts, args, dev,
                )  # fmt: skip
                bench.row(name, fields, measure)
                dev.free()
    finally:
        gc.unfreeze()
    store.close()
    return bench


def run_config(args: argparse.Namespace, dev: Device) -> dict[str, Any]:
    """What the JSON records of the run: sizes, knobs, device and versions."""
    import transformers

    keys = (*FULL, "router_skew", "residual_update", "seed", "impl", "row_seconds")
    return {
        **{k: getattr(args, k) for k in keys},
        "device": str(dev.device), "dtype": "bfloat16",
        "expert_bytes": 3 * args.hidden * args.expert_width * 2,
        "gpu": torch.cuda.get_device_name(dev.device) if dev.cuda else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
    }  # fmt: skip


def cache_row(
    model: HFMoEModel, source: HostTier | ExpertStore, policy: str, capacity: int,
    prefetch: bool, pins: list[list[int]] | None, prompts: dict[str, torch.Tensor],
    args: argparse.Namespace, dev: Device,
) -> dict[str, Any]:  # fmt: skip
    """One cache row: over the host tier, or over the store on disk with its pages dropped
    before each timed phase."""
    host = source if isinstance(source, HostTier) else None
    files = [] if host else source.files()
    with cache_over(model, source, policy, capacity, prefetch, pins, dev) as cache:
        return serve(
            model.hf, CacheProbe(cache, host), prompts, args, dev, partial(drop_pages, files)
        )


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
    parser.add_argument("--row-seconds", type=float, default=2.5, help="timed decode per row")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="skip the rows that would end past this many seconds from the "
                             "start, judged by the row before (0: no limit)")  # fmt: skip
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
        "request order; forwards: prefill A, the warm-up and timed decode steps, prefill B)",
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
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    root = Path(tempfile.mkdtemp(prefix="bench_serve.", dir=args.dir or None))
    try:
        bench = run(args, root, start)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    bench.save()
    print_table(bench.out)
    print_targets(bench.out)
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
