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
import shutil
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

from moestack import bench as harness
from moestack.cache import ExpertStore
from moestack.cache.host_tier import HostTier
from moestack.cache.offload import release_experts
from moestack.cache.serve_bench import (
    MIN_DECODE,
    AccelerateProbe,
    Budget,
    CacheProbe,
    Device,
    ResidentProbe,
    build_model,
    cache_over,
    calibration_pins,
    capacities,
    device_slots,
    expert_offload_map,
    link_figures,
    load_offloaded,
    resident_model,
    save_folder,
    serve,
)
from moestack.cache.serve_report import (
    MISS_SHARE,
    NOISE_FACTOR,
    brief,
    finish,
    print_table,
    print_targets,
)
from moestack.interop.hf_model import HFMoEModel

# Qwen3-30B-A3B's layers (config.json of the published model), and toy sizes for the CPU.
FULL = dict(
    layers=3, experts=128, top_k=8, hidden=2048, expert_width=768, heads=32, kv_heads=4,
    head_dim=128, vocab=32768, prompt_tokens=512, decode_tokens=32, warmup=4, repeats=3,
)  # fmt: skip
TINY = dict(
    layers=2, experts=32, top_k=2, hidden=64, expert_width=32, heads=4, kv_heads=2,
    head_dim=16, vocab=512, prompt_tokens=32, decode_tokens=6, warmup=2, repeats=3,
)  # fmt: skip
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


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": True, "reason": reason}


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
            model.hf, CacheProbe(cache, host), prompts, args, dev,
            partial(harness.drop_pages, files),
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
            harness.write_json(
                self.args.json, self.out, indent=1, device=self.out["config"].get("device")
            )


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
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU needs --tiny
    parser = harness.parser(__doc__, device=device, json="")
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
