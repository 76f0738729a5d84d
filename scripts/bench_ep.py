"""Expert parallelism on gloo (CPU): step time and bytes moved per step at ep = 1, 2, 4, and
what the measured exchange would move for a Qwen3-30B-like layer.

The ranks are processes on this machine (mp.spawn, gloo, one thread each), the same world
for every ep (``--ranks``, 4): ep=1 is pure data parallelism (DDP, as moestack-train runs it),
ep=2 two data-parallel groups of 2 EP ranks, ep=4 one group of 4. In the same processes one
moestack run per ep is built (``moestack.trainer.build_run``: model, sharded experts, torch
AdamW, data loader, from the composed config, as ``moestack-train parallel.ep=P`` builds it)
and their steps interleave: each round runs one ``trainer.train_step`` of every ep, in an
order rotated each round, between barriers. Ratios against ep=1 are medians of the per-round
ratios (a shared machine's load moves neighbouring steps alike). The same seed and data give
every ep the same model and tokens.

Bytes per step and rank: the all-to-alls' rows and bytes are moestack's own counters
(``ExchangeStats``: rows and bytes sent to other ranks, forward and backward; what
``ep/bytes_per_step`` logs); the gradient all-reduce is counted from the parameter sizes
(a ring all-reduce sends 2 (n - 1) / n of the buffer per rank; gloo's algorithm may differ).

Then ``exchange_bytes`` projects the measured fraction of (token, slot) rows that leave
their rank, and the load imbalance, onto a Qwen3-30B-like layer at ep=8, printing every
factor. ``--merge A.json B.json ...`` prints the median (range) of several runs' rows.

    python scripts/bench_ep.py [--models tiny,small] [--ranks 4] [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moestack import bench, distributed, trainer
from moestack.config import TrainConfig

MiB, GiB = 2**20, 2**30
# The projection's layer: Qwen3-30B-A3B's MoE shapes, bf16 activations, 8192 tokens per rank.
QWEN3_30B = {"tokens": 8192, "top_k": 8, "d_model": 2048, "elem_bytes": 2, "layers": 48, "ep": 8}
LINK_GBPS = 450.0  # NVLink 4 per GPU and direction (H100/H200), for scale only: not measured
COMMON = [
    "telemetry=off", "wandb_mode=disabled", "progress=false", "threads=1", "eval_every=0",
    "eval_batches=1", "ckpt_every=0", "log_every=1000", "model.moe.impl=torch",
]  # fmt: skip


# --------------------------------------------------------------------------- arithmetic
def exchange_bytes(
    tokens: int,
    top_k: int,
    d_model: int,
    elem_bytes: int,
    remote: float,
    imbalance: float = 1.0,
    layers: int = 1,
) -> dict[str, float]:
    """Bytes one rank sends to other ranks per training step in the expert-parallel
    all-to-alls of ``layers`` MoE layers (dropless top-k routing)::

        per layer = 4 x tokens x top_k x remote x d_model x elem_bytes

    ``tokens`` per rank and step, each in ``top_k`` (token, slot) rows of ``d_model``
    elements of ``elem_bytes``; ``remote``: the fraction of rows whose expert sits on another
    rank ((P - 1) / P for uniform routing over P ranks); 4 = two exchanges (dispatch to the
    experts, combine back) x two passes (the backward sends each exchange's gradient back the
    reversed way, the same rows). That is the mean over ranks; the busiest rank (``imbalance``
    = max / mean rows per rank) receives and returns about ``imbalance`` times it.

    Example: tokens 4, top_k 2, d_model 3, 2 bytes, remote 0.5: 4 rows leave, 4 x 4 x 3 x 2 =
    96 bytes per layer; with imbalance 1.5 the busiest rank's 144."""
    rows = tokens * top_k * remote
    per_layer = 4 * rows * d_model * elem_bytes
    return {
        "remote_rows_per_layer": rows,
        "per_layer": per_layer,
        "per_step": per_layer * layers,
        "busiest_per_layer": per_layer * imbalance,
        "busiest_per_step": per_layer * imbalance * layers,
    }


def ring_allreduce_bytes(numel: int, ranks: int, elem_bytes: int = 4) -> float:
    """Bytes each rank sends in a ring all-reduce of ``numel`` elements over ``ranks``:
    2 (n - 1) / n of the buffer (reduce-scatter, then all-gather); 0 for one rank."""
    return 2 * (ranks - 1) / ranks * numel * elem_bytes if ranks > 1 else 0.0


def scaled_remote(remote: float, measured_ep: int, target_ep: int) -> float:
    """A measured remote fraction carried to another EP degree, as a multiple of uniform
    routing's: ``remote x ((T - 1) / T) / ((M - 1) / M)``, at most 1."""
    uniform = (measured_ep - 1) / measured_ep
    return min(1.0, remote * ((target_ep - 1) / target_ep) / uniform)


# --------------------------------------------------------------------------- measurement
def _grad_sync_bytes(run: trainer.Trainer, world: int) -> float:
    """Ring all-reduce bytes per rank and step for the gradients: replicated parameters over
    the world, the rank's experts over their expert data-parallel group (all at ep=1)."""
    experts = {id(getattr(m, n)) for m in run.model.moe_layers for n in ("w1", "w2")}
    params = [p for p in run.model.parameters() if p.requires_grad]
    shared = sum(p.numel() for p in params if id(p) not in experts)
    own = sum(p.numel() for p in params if id(p) in experts)
    expert_ranks = run.mesh.dp if run.mesh is not None else world
    return ring_allreduce_bytes(shared, world) + ring_allreduce_bytes(own, expert_ranks)


def _timed_step(run: trainer.Trainer) -> dict[str, float]:
    """One training step between barriers: its wall time and this rank's exchange counts."""
    dist.barrier()
    start = time.perf_counter()
    run.train_step()
    dist.barrier()
    seconds = time.perf_counter() - start
    stats = run.exchange
    if stats is None:
        return {"step_s": seconds, "a2a_s": 0.0, "rows_sent": 0, "bytes": 0, "imbalance": 1.0}
    record = {
        "step_s": seconds,
        "a2a_s": stats.seconds,
        "rows_sent": stats.rows_sent,
        "bytes": stats.bytes_moved,
        "imbalance": stats.load_imbalance_sum / max(stats.layers, 1),
    }
    stats.reset()
    return record


def _measure(
    name: str, by_ep: dict[int, TrainConfig], info: distributed.DistInfo, args: Any, tmp: Path
) -> dict[str, Any]:
    """Build one run per ep, interleave their steps; every rank's records (collective)."""
    runs = {ep: trainer.build_run(cfg, tmp / f"{name}_ep{ep}", info) for ep, cfg in by_ep.items()}
    eps = sorted(runs)
    records: dict[str, list[dict[str, float]]] = {str(ep): [] for ep in eps}
    for rnd in range(args.warmup + args.rounds):
        shift = rnd % len(eps)
        for ep in eps[shift:] + eps[:shift]:
            record = _timed_step(runs[ep])
            if rnd >= args.warmup:
                records[str(ep)].append(record)
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, records)
    cfg, model = by_ep[eps[0]], runs[eps[0]].model
    out = {
        "records": every,  # [rank][str(ep)][round]
        "grad_sync_bytes": {str(ep): _grad_sync_bytes(runs[ep], info.world_size) for ep in eps},
        "params": model.num_params()["total"],
        "tokens_per_rank": cfg.batch_size // info.world_size * cfg.data.seq_len,
        "shape": {k: getattr(cfg.model, k) for k in ("n_layers", "d_model")}
        | {"num_experts": cfg.model.moe.num_experts, "top_k": cfg.model.moe.top_k},
    }
    del runs
    return out


# How long one collective (and the set-up, which waits for every rank to start) may wait for
# the other ranks: a deadlock fails instead of hanging the benchmark.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def _worker(rank: int, world: int, init: str, cfgs: dict, args: Any, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip
    info = distributed.DistInfo(rank=rank, world_size=world, local_rank=rank)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = {
                name: _measure(name, by_ep, info, args, Path(tmp)) for name, by_ep in cfgs.items()
            }
            dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        distributed.close_process_groups()


# --------------------------------------------------------------------------- summary
def summarize(measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per ep from every rank's per-round records: the step (slowest rank), its ratio
    to ep=1 in the same round, tokens/s, all-to-all share, rows and bytes per rank and step."""
    every = measured["records"]  # [rank][str(ep)][round]
    eps = sorted(int(ep) for ep in every[0])
    tokens = measured["tokens_per_rank"]
    shape = measured["shape"]
    rows_total = tokens * shape["top_k"] * shape["n_layers"]  # (token, slot) rows per rank
    world = len(every)

    def per_round(ep: int, key: str, how: Any = max) -> list[float]:
        rounds = zip(*(rank[str(ep)] for rank in every), strict=True)
        return [how(rec[key] for rec in recs) for recs in rounds]

    base = per_round(eps[0], "step_s")
    rows = []
    for ep in eps:
        steps = per_round(ep, "step_s")
        sent = statistics.mean(per_round(ep, "rows_sent", statistics.mean))
        moved = statistics.mean(per_round(ep, "bytes", statistics.mean))
        share = [a / s for a, s in zip(per_round(ep, "a2a_s"), steps, strict=True)]
        rows.append({
            "ep": ep, "dp": world // ep, "step_s": bench.spread(steps),
            "vs_ep1": bench.spread([s / b for s, b in zip(steps, base, strict=True)]),
            "tokens_per_s": world * tokens / statistics.median(steps),
            "a2a_share": statistics.median(share),
            "rows_sent_per_rank": sent, "remote_fraction": sent / rows_total,
            "uniform_fraction": (ep - 1) / ep, "a2a_bytes_per_rank": moved,
            "grad_sync_bytes_per_rank": measured["grad_sync_bytes"][str(ep)],
            "load_imbalance": statistics.mean(per_round(ep, "imbalance", statistics.mean)),
        })  # fmt: skip
    return rows


def projection(models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The Qwen3-30B-like layer's bytes with uniform routing, then with each model's remote
    fraction (carried from its largest measured ep to ep=8) and load imbalance."""
    q = QWEN3_30B
    cases = [("uniform routing", (q["ep"] - 1) / q["ep"], 1.0, None)]
    for name, model in models.items():
        top = max(model["rows"], key=lambda r: r["ep"])
        if top["ep"] > 1:
            remote = scaled_remote(top["remote_fraction"], top["ep"], q["ep"])
            cases.append(
                (f"{name}, measured at ep={top['ep']}", remote, top["load_imbalance"], top)
            )
    out = []
    for label, remote, imbalance, source in cases:
        b = exchange_bytes(q["tokens"], q["top_k"], q["d_model"], q["elem_bytes"], remote,
                           imbalance, q["layers"])  # fmt: skip
        out.append({"case": label, "remote": remote, "imbalance": imbalance, **b,
                    "measured_remote": source and source["remote_fraction"],
                    "busiest_ms_at_link": b["busiest_per_step"] / (LINK_GBPS * 1e9) * 1e3})  # fmt: skip
    return out


# --------------------------------------------------------------------------- printing
def _fmt(spread: dict[str, float], scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
    """``median (min-max)``, each times ``scale``; ``unit`` after the median."""
    m, lo, hi = (spread[k] * scale for k in ("median", "min", "max"))
    return bench.median_range(m, lo, hi, f".{digits}f", unit)


def print_measured(name: str, model: dict[str, Any], args: Any) -> None:
    """The measured table of one model, then the formula checked against the counters."""
    s, world = model["shape"], model["rows"][0]["ep"] * model["rows"][0]["dp"]
    print(f"\n{name}: {s['n_layers']} layers, d_model {s['d_model']}, {s['num_experts']} experts "
          f"top-{s['top_k']}, {model['params'] / 1e6:.2f}M parameters; {world} ranks x "
          f"{args.threads} thread, {model['tokens_per_rank']} tokens per rank and step; "
          f"{args.rounds} rounds after {args.warmup} warm-up")  # fmt: skip
    print("| ep | dp x ep | step ms, median (range) | vs ep=1, median (range) | tokens/s | "
          "a2a share | rows out / rank / step | remote fraction (uniform) | a2a MiB / rank / step | "
          "grad all-reduce MiB / rank / step | load imbalance |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in model["rows"]:
        print(f"| {r['ep']} | {r['dp']} x {r['ep']} | {_fmt(r['step_s'], 1e3)} | "
              f"{_fmt(r['vs_ep1'], 1, 2, 'x')} | {r['tokens_per_s']:,.0f} | {r['a2a_share']:.2f} | "
              f"{r['rows_sent_per_rank']:,.0f} | {r['remote_fraction']:.3f} ({r['uniform_fraction']:.3f}) | "
              f"{r['a2a_bytes_per_rank'] / MiB:.2f} | {r['grad_sync_bytes_per_rank'] / MiB:.2f} | "
              f"{r['load_imbalance']:.3f} |")  # fmt: skip
    for r in model["rows"]:
        if r["ep"] == 1 or not r["rows_sent_per_rank"]:
            continue
        elem = r["a2a_bytes_per_rank"] / (4 * r["rows_sent_per_rank"] * s["d_model"])
        want = exchange_bytes(model["tokens_per_rank"], s["top_k"], s["d_model"], round(elem),
                              r["remote_fraction"], layers=s["n_layers"])["per_step"]  # fmt: skip
        print(f"  ep={r['ep']}: counters {r['a2a_bytes_per_rank']:,.0f} B = 4 x {model['tokens_per_rank']}"
              f" x {s['top_k']} x {r['remote_fraction']:.4f} x {s['d_model']} x {elem:.2f} B x "
              f"{s['n_layers']} layers (formula: {want:,.0f} B, ratio {r['a2a_bytes_per_rank'] / want:.4f})")  # fmt: skip


def print_projection(proj: list[dict[str, Any]]) -> None:
    """The projection table with its formula and every factor."""
    q = QWEN3_30B
    print(f"\nQwen3-30B-like MoE layer at ep={q['ep']}: T = {q['tokens']} tokens per rank, k = "
          f"{q['top_k']}, D = {q['d_model']}, b = {q['elem_bytes']} bytes (bf16), L = {q['layers']} "
          "MoE layers")  # fmt: skip
    print("bytes a rank sends per step and layer = 4 x T x k x f x D x b (4 = dispatch + combine, "
          "x forward + backward); f = rows leaving the rank; busiest rank = x imbalance")  # fmt: skip
    print(f"measured f carried to ep={q['ep']}: f x (7/8) / ((P-1)/P) of the measured ep P")
    print("| routing | f | imbalance | rows out / layer (T k f) | MiB / layer | GiB / step (x L) | "
          f"busiest rank GiB / step | busiest ms at {LINK_GBPS:.0f} GB/s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in proj:
        print(f"| {p['case']} | {p['remote']:.4f} | {p['imbalance']:.3f} | "
              f"{p['remote_rows_per_layer']:,.0f} | {p['per_layer'] / MiB:,.1f} | "
              f"{p['per_step'] / GiB:.2f} | {p['busiest_per_step'] / GiB:.2f} | "
              f"{p['busiest_ms_at_link']:.0f} |")  # fmt: skip


def merge(paths: list[str]) -> dict[str, Any]:
    """Median and range over several runs' JSON of every numeric row field (the vs-ep=1 and
    step columns: of each run's median)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out: dict[str, Any] = {"runs": len(runs), "wall_s": bench.spread([r["wall_s"] for r in runs])}
    for name in runs[0]["models"]:
        rows = []
        for i, first in enumerate(runs[0]["models"][name]["rows"]):
            per_run = [r["models"][name]["rows"][i] for r in runs]
            row: dict[str, Any] = {"ep": first["ep"], "dp": first["dp"]}
            for key, value in first.items():
                if key in ("ep", "dp"):
                    continue
                pick = (lambda r, k=key: r[k]["median"]) if isinstance(value, dict) else (lambda r, k=key: r[k])  # fmt: skip
                row[key] = bench.spread([pick(r) for r in per_run])
            rows.append(row)
        out[name] = rows
    out["projection"] = [
        {"case": p["case"]} | {k: bench.spread([r["projection"][i][k] for r in runs])
                               for k in p if isinstance(p[k], (int, float)) and k != "case"}
        for i, p in enumerate(runs[0]["projection"])
    ]  # fmt: skip
    return out


def print_merged(merged: dict[str, Any]) -> None:
    n = merged["runs"]
    print(
        f"{n} runs; wall time per run {_fmt(merged['wall_s'], 1, 0)} s; median (range) of the runs"
    )
    for name, rows in merged.items():
        if name in ("runs", "wall_s", "projection"):
            continue
        print(f"\n{name}\n| ep | dp x ep | step ms | vs ep=1 | tokens/s | a2a share | remote "
              "fraction | a2a MiB / rank / step | grad all-reduce MiB / rank / step | load imbalance |")  # fmt: skip
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['ep']} | {r['dp']} x {r['ep']} | {_fmt(r['step_s'], 1e3)} | "
                  f"{_fmt(r['vs_ep1'], 1, 2, 'x')} | {_fmt(r['tokens_per_s'])} | "
                  f"{_fmt(r['a2a_share'], 1, 2)} | {_fmt(r['remote_fraction'], 1, 3)} | "
                  f"{_fmt(r['a2a_bytes_per_rank'], 1 / MiB, 2)} | "
                  f"{_fmt(r['grad_sync_bytes_per_rank'], 1 / MiB, 2)} | "
                  f"{_fmt(r['load_imbalance'], 1, 3)} |")  # fmt: skip
    print("\nprojection (Qwen3-30B-like, ep=8): GiB per rank and step")
    for p in merged["projection"]:
        print(f"| {p['case']} | f {_fmt(p['remote'], 1, 4)} | imbalance {_fmt(p['imbalance'], 1, 3)} "
              f"| {_fmt(p['per_step'], 1 / GiB, 2)} | busiest {_fmt(p['busiest_per_step'], 1 / GiB, 2)} "
              f"| {_fmt(p['busiest_ms_at_link'], 1, 0)} ms |")  # fmt: skip


# --------------------------------------------------------------------------- main
def configs(args: Any) -> dict[str, dict[int, TrainConfig]]:
    """The composed TrainConfig of every (model, ep): ``moestack-train`` with these overrides."""
    from moestack.prereg.compose import compose_config  # hydra: only the parent needs it

    eps = [int(e) for e in args.eps.split(",")]
    steps = args.warmup + args.rounds
    return {
        name: {
            ep: compose_config([f"model={name}", *COMMON, f"batch_size={args.batch}",
                                f"steps={steps}", f"parallel.ep={ep}", *args.override])
            for ep in eps
        }
        for name in args.models.split(",")
    }  # fmt: skip


def main() -> None:
    parser = bench.parser(__doc__, threads=1, warmup=2, rounds=10, json="")
    parser.add_argument("--models", default="tiny,small", help="configs/model/ names")
    parser.add_argument("--eps", default="1,2,4", help="EP degrees (the first is the baseline)")
    parser.add_argument("--ranks", type=int, default=4, help="processes (the same for every ep)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    parser.add_argument("--override", nargs="*", default=[], help="more moestack-train overrides")
    parser.add_argument("--merge", nargs="+", help="print median (range) of these JSON files")
    args = parser.parse_args()
    if args.merge:
        print_merged(merge(args.merge))
        return
    start, load0 = time.perf_counter(), os.getloadavg()
    cfgs = configs(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        mp.spawn(_worker, args=(args.ranks, f"{tmp}/init", cfgs, args, str(out)), nprocs=args.ranks)
        measured = json.loads(out.read_text())
    models = {}
    for name, m in measured.items():
        models[name] = {k: m[k] for k in ("params", "tokens_per_rank", "shape")}
        models[name]["rows"] = summarize(m)
    proj = projection(models)
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "cpu": bench.machine(),
                    "torch": torch.__version__, "load_before": load0, "load_after": os.getloadavg()},
        "args": vars(args), "wall_s": time.perf_counter() - start, "models": models,
        "projection": proj, "qwen3_30b_like": QWEN3_30B, "link_gbps": LINK_GBPS,
    }  # fmt: skip
    print(f"expert parallelism on gloo: {args.ranks} ranks (processes) for every ep, so that ep=1 "
          "is pure data parallelism (DDP) over the same ranks and a ratio compares layouts, not "
          "world sizes; the eps' steps interleave round by round, ratios are per round")  # fmt: skip
    for name, model in models.items():
        print_measured(name, model, args)
    print_projection(proj)
    print(f"\nwall time {results['wall_s']:.0f} s; load {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    if args.json:
        bench.write_json(args.json, results, indent=1)


if __name__ == "__main__":
    main()
