"""Benchmark the expert store and cache: loading GB/s and offloaded-evaluation tokens/s.

1. Expert loading. A store of random experts (``--io-layers`` x ``--io-experts`` experts of
   ``w1 [D, 2F]`` + ``w2 [F, D]`` fp32) is written in both layouts. For each layout, cold
   (every file's pages dropped with ``posix_fadvise(DONTNEED)`` first) and warm (read once
   before): ``ExpertStore.load`` of every expert in a random order, against a plain
   sequential read of the same files in the same run (large ``readinto`` calls). Best of
   ``--reps``. GB/s = 1e9 bytes/s.
2. Offloaded evaluation. ``MoETransformer(ModelConfig())`` (random weights, or a trained run
   with ``--run-dir``) on ``--batches`` batches of ``--batch`` x ``--seq`` tokens: in memory,
   then offloaded at each of ``--capacities`` with and without prefetch (the store's pages
   dropped before each run, so first reads come from disk): tokens/s, hit rate, seconds
   stalled on I/O. Then cache-aware routing: hit rate and perplexity against the bias.

    python scripts/bench_cache.py [--json out.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from moestack import CacheConfig, ModelConfig, MoETransformer, bench
from moestack.cache import ExpertStore, evaluate_offloaded
from moestack.evaluation import evaluate

CPU = torch.device("cpu")


def sequential_read(files: list[Path], chunk: int = 16 << 20) -> float:
    """Seconds to read every file front to back with large reads."""
    view = memoryview(bytearray(chunk))

    def read() -> None:
        for file in files:
            with open(file, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass

    return bench.seconds(read)


def expert_read(store: ExpertStore, order: list[tuple[int, int]]) -> float:
    """Seconds to load every expert once, in ``order``."""
    return bench.seconds(lambda: [store.load(layer, expert) for layer, expert in order])


def bench_io(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    d, f = args.d_model, args.d_ff
    gen = torch.Generator().manual_seed(0)
    state = {}
    for i in range(args.io_layers):
        state[f"layers.{i}.moe.w1"] = torch.randn(args.io_experts, d, 2 * f, generator=gen)
        state[f"layers.{i}.moe.w2"] = torch.randn(args.io_experts, f, d, generator=gen)
    rows = []
    for layout in ("per_layer", "per_expert"):
        store = ExpertStore.write(state, root / f"io_{layout}", layout=layout)
        files = store.files()
        total = sum(p.stat().st_size for p in files)
        payload = store.expert_bytes * store.num_layers * store.num_experts
        order = [(i, e) for i in range(store.num_layers) for e in range(store.num_experts)]
        random.Random(0).shuffle(order)
        for mode in ("cold", "warm"):
            seq_s, exp_s = [], []
            for _ in range(args.reps):
                for name in ("seq", "expert"):
                    if mode == "cold":
                        bench.drop_pages(files)
                    else:
                        sequential_read(files)
                    if name == "seq":
                        seq_s.append(sequential_read(files))
                    else:
                        exp_s.append(expert_read(store, order))
            seq_gbs = total / min(seq_s) / 1e9
            exp_gbs = payload / min(exp_s) / 1e9
            rows.append(
                {
                    "layout": layout,
                    "mode": mode,
                    "bytes": payload,
                    "expert_bytes": store.expert_bytes,
                    "sequential_GBps": seq_gbs,
                    "expert_GBps": exp_gbs,
                    "ratio": exp_gbs / seq_gbs,
                }
            )
        store.close()
    return rows


def load_model(args: argparse.Namespace) -> tuple[MoETransformer, list]:
    if args.run_dir:
        from moestack.data import eval_batches, load_corpus
        from moestack.runs import load_run

        run = load_run(args.run_dir)
        cfg, model = run.cfg, run.model
        corpus = load_corpus(cfg.data)
        data = eval_batches(corpus.val, args.batch, min(args.seq, cfg.data.seq_len), args.batches)
        return model.eval(), data
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig()).eval()
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(args.batches):
        window = torch.randint(1, 256, (args.batch, args.seq + 1), generator=gen)
        data.append((window[:, :-1], window[:, 1:]))
    return model, data


def bench_eval(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """In memory (best of ``--eval-reps``), offloaded at each capacity without and with
    prefetch, and cache-aware routing at each bias."""
    model, data = load_model(args)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = sum(x.numel() for x, _ in data)
    evaluate(model, data[:1], CPU)  # warm-up (first-call kernel set-up)
    ref: dict[str, Any] = {}
    times = bench.times(lambda: ref.update(evaluate(model, data, CPU)), repeats=args.eval_reps)
    store = ExpertStore.write(model, root / "eval_store")

    def fresh() -> MoETransformer:
        m = MoETransformer(model.cfg)
        m.load_state_dict(state)
        return m.eval()

    rows = [
        offloaded_row(fresh, store, data, capacity, prefetch, ref, args.eval_reps)
        for capacity in args.capacities
        if capacity >= model.cfg.moe.top_k
        for prefetch in (False, True)
    ]
    bias_rows = []
    for capacity in args.bias_capacities:
        for bias in args.biases:
            r = evaluate_offloaded(
                fresh(), store, data, CPU, CacheConfig(capacity=capacity), cache_aware_bias=bias
            )
            ppl = r["eval/perplexity"]
            bias_rows.append(dict(capacity=capacity, bias=bias, hit_rate=r["cache/hit_rate"],
                                  perplexity=ppl, ppl_change=ppl / ref["eval/perplexity"] - 1))  # fmt: skip
    random_model = "random MoETransformer(ModelConfig())"
    return {
        "model": "trained:" + args.run_dir if args.run_dir else random_model,
        "tokens": tokens,
        "in_memory_tokens_per_s": tokens / min(times),
        "perplexity": ref["eval/perplexity"],
        "expert_bytes": store.expert_bytes,
        "offloaded": rows,
        "cache_aware": bias_rows,
    }


def offloaded_row(
    fresh: Any, store: ExpertStore, data: list, capacity: int, prefetch: bool, ref: dict, reps: int
) -> dict[str, Any]:
    """One capacity and prefetch setting: the best of ``reps`` runs, each from a cold store."""
    runs = []
    for _ in range(reps):
        bench.drop_pages(store.files())
        cfg = CacheConfig(capacity=capacity, prefetch=prefetch)
        runs.append(evaluate_offloaded(fresh(), store, data, CPU, cfg))
    best = max(runs, key=lambda r: r["eval/tokens_per_s"])
    assert best["loss/val"] == ref["loss/val"], "offloaded loss differs from in-memory"
    return {
        "capacity": capacity,
        "prefetch": prefetch,
        "tokens_per_s": best["eval/tokens_per_s"],
        "hit_rate": best["cache/hit_rate"],
        "loads": int(best["cache/loads"]),
        "stall_s": statistics.median(r["cache/stall_s"] for r in runs),
        "seconds": best["eval/seconds"],
        "prefetch_hits": int(best["cache/prefetch_hits"]),
        "prefetch_wasted": int(best["cache/prefetch_wasted"]),
    }


def print_tables(io_rows: list[dict], ev: dict) -> None:
    print("\nexpert loading (GB/s, best of reps)")
    print(f"{'layout':<11}{'mode':<6}{'sequential':>11}{'expert':>9}{'ratio':>7}")
    for r in io_rows:
        print(
            f"{r['layout']:<11}{r['mode']:<6}{r['sequential_GBps']:>11.2f}"
            f"{r['expert_GBps']:>9.2f}{r['ratio']:>7.0%}"
        )
    print(
        f"\noffloaded eval, {ev['model']}, {ev['tokens']} tokens; in memory "
        f"{ev['in_memory_tokens_per_s']:.0f} tok/s, ppl {ev['perplexity']:.3f}"
    )
    print(
        f"{'cap':>4}{'prefetch':>9}{'tok/s':>9}{'hit':>7}{'loads':>7}{'stall s':>9}{'pf hit':>8}{'pf waste':>9}"
    )
    for r in ev["offloaded"]:
        print(
            f"{r['capacity']:>4}{str(r['prefetch']):>9}{r['tokens_per_s']:>9.0f}{r['hit_rate']:>7.3f}"
            f"{r['loads']:>7}{r['stall_s']:>9.4f}{r['prefetch_hits']:>8}{r['prefetch_wasted']:>9}"
        )
    print("\ncache-aware routing (bias on resident experts' scores)")
    print(f"{'cap':>4}{'bias':>6}{'hit':>7}{'ppl':>9}{'ppl chg':>9}")
    for r in ev["cache_aware"]:
        print(
            f"{r['capacity']:>4}{r['bias']:>6.2f}{r['hit_rate']:>7.3f}{r['perplexity']:>9.3f}"
            f"{r['ppl_change']:>9.2%}"
        )


def main() -> None:
    parser = bench.parser(__doc__, reps=3, threads=0, json="")
    parser.add_argument("--io-layers", type=int, default=4)
    parser.add_argument("--io-experts", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512, help="I/O store: D")
    parser.add_argument("--d-ff", type=int, default=1024, help="I/O store: F")
    parser.add_argument("--run-dir", default="", help="a trained run (default: random model)")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--capacities", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--eval-reps", type=int, default=2)
    parser.add_argument("--bias-capacities", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--biases", type=float, nargs="+", default=[0.0, 0.02, 0.05, 0.1, 0.3])
    parser.add_argument("--dir", default="", help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench_cache.", dir=args.dir or None))
    try:
        io_rows = bench_io(args, root)
        ev = bench_eval(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_tables(io_rows, ev)
    if args.json:
        out = {"io": io_rows, "eval": ev, "torch_threads": torch.get_num_threads()}
        bench.write_json(args.json, out)


if __name__ == "__main__":
    main()
