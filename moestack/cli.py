"""The ``moestack`` command: verbs around training runs (training itself is moestack-train).

    moestack eval RUN_DIR [--checkpoint PATH] [--batches N]   validation loss and perplexity
    moestack eval RUN_DIR --offload [--capacity N --policy P --prefetch --generate N]
                                                              the same with experts served from
                                                              safetensors through an expert cache
    moestack export RUN_DIR OUT_DIR                           a transformers model's run back
                                                              to a transformers folder
    moestack telemetry MODEL TEXT OUT                         route a text through an MoE model,
                                                              write its trace and a report
    moestack simulate TRACE [--policies ..] [--capacities ..] replay a trace through caches
             [--expert-bytes N --link-gbps G --compute-ms C]  (after a warm-up it announces),
                                                              with the tokens/s they allow
    moestack trace import SRC OUT [--num-experts N]           a routing trace recorded by
                                                              another tool, as a trace folder
    moestack report RUN_DIR [--out DIR]                       charts and an HTML page of a run
    moestack prereg lock|run|status|evaluate|keep|restore|analyze|power FILE
                                                                      pre-registered experiments
    moestack plan [OVERRIDES] [--ranks N] [--device D]        the memory plan of a run (also
             [--gpu-gb N]                                     model=hf model.path=DIR), and
                                                              whether it fits a GPU of N GiB
    moestack --version

The eval and export verbs are in ``moestack.cli_eval``, prereg in ``moestack.cli_prereg``, plan
in ``moestack.cli_plan``.

Each verb prints its result, with progress bars on the slow ones (log lines do not break
them); bad input, a missing file or a missing extra end with one line on stderr and exit
status 2. ``moestack VERB --help`` lists every option with its default.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from moestack.cli_eval import eval_parser, export_parser
from moestack.cli_plan import plan_parser
from moestack.cli_prereg import prereg_parser
from moestack.errors import MoestackError

log = logging.getLogger("moestack")
POLICIES = "lru,lfu,static,lru+static,belady"  # the default of --policies


def _csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _print_hit_rates(rates: dict[tuple[str, int], float], heading: str) -> None:
    """A policy x capacity table of hit rates."""
    if not rates:
        return
    capacities = sorted({cap for _, cap in rates})
    print(heading)
    print(f"{'policy':<12}" + "".join(f"{f'{cap} experts':>12}" for cap in capacities))
    for policy in dict.fromkeys(policy for policy, _ in rates):
        cells = [rates.get((policy, cap)) for cap in capacities]
        print(
            f"{policy:<12}"
            + "".join(f"{c:>12.3f}" if c is not None else f"{'-':>12}" for c in cells)
        )


def cmd_telemetry(args: argparse.Namespace) -> None:
    from moestack.telemetry import run_telemetry
    from moestack.telemetry.standalone import hit_rates

    if not Path(args.text).is_file():
        raise MoestackError(f"text file {args.text!r} not found; give a text file to route")
    out = run_telemetry(
        args.model,
        args.text,
        args.out,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        policies=_csv(args.policies),
        capacities=[int(c) for c in _csv(args.capacities)] or None,
        device=args.device,
        record_probs=args.record_probs,
        progress=True,
    )
    summary = json.loads((out / "summary.json").read_text())
    print(
        f"loss {summary['loss']:.4f}, perplexity {summary['perplexity']:.2f} over {summary['tokens']} tokens"
    )
    _print_hit_rates(hit_rates(summary), "hit rate per policy and cache size (after warm-up):")
    print(f"trace, metrics and summary in {out}; report: {out / 'report' / 'index.html'}")


def _warmup(text: str) -> int | float:
    """--warmup: a fraction of each layer's requests (0.1) or a count of requests (500)."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a fraction (0.1) or a count (500)"
        ) from None


def _batch_sizes(text: str) -> list[int]:
    """--batch-sizes: whole numbers >= 1, comma-separated (1,8,32)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 1, as in 1,8,32")
    return sizes


def _warmup_note(warmup: int | float) -> str:
    if warmup == 0:
        return "warm-up: none, every request is counted"
    if isinstance(warmup, float):
        what = f"the first {warmup:.0%} of each layer's requests"
    else:
        what = f"the first {warmup} requests of each layer"
    return f"warm-up: {what} fill the caches and are not counted (--warmup 0 counts every request)"


def cmd_simulate(args: argparse.Namespace) -> None:
    from tqdm.auto import tqdm

    from moestack.cache.policies import default_capacities
    from moestack.telemetry import load_run_trace, sweep

    if not Path(args.trace).is_dir():
        raise MoestackError(
            f"trace folder {args.trace!r} not found; give a run's trace/ folder (its parts "
            "joined) or one trace/<part> folder"
        )
    estimate = _serving_estimate(args)
    run = load_run_trace(args.trace)
    trace = run.trace
    if len(run.parts) > 1:
        print(
            f"{len(run.parts)} trace parts joined in training order: "
            + ", ".join(f"{p.name} ({p.kept} tokens, {p.cut} cut)" for p in run.parts)
        )
    top_k = max(trace.top_k) if isinstance(trace.top_k, list | tuple) else int(trace.top_k)
    capacities = [int(c) for c in _csv(args.capacities)] or list(default_capacities(top_k))
    batches = args.batch_sizes
    jobs = [(p, c, b) for b in batches for p in _csv(args.policies) for c in capacities]
    rows = []
    # --expert-bytes sizes every load: bytes_loaded = misses x N in the rows
    sizes = {} if estimate is None else {"expert_bytes": round(estimate.expert_bytes)}
    for policy, capacity, batch in tqdm(jobs, desc="simulate", unit="cache"):
        found = sweep(trace, [policy], [capacity], warmup=args.warmup, batch_size=batch, **sizes)
        rows += [{**row, "batch_size": batch} for row in _simulate_rows(found, estimate)]
    _print_simulated(rows, trace.num_layers, batches, args.warmup, estimate)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def _print_simulated(
    rows: list[dict[str, Any]],
    layers: int,
    batches: list[int],
    warmup: int | float,
    estimate: Any,
) -> None:
    """`simulate`'s notes and table: one line per (batch, policy, capacity) row of ``rows``
    for a trace of ``layers`` MoE layers, with the tokens/s ``estimate`` allows if given."""
    print(_warmup_note(warmup))
    print(
        f"misses/token: the misses of all {layers} MoE layers per token (loads a token costs); "
        "per layer: their mean over the layers"
    )
    if estimate is not None:
        print(_estimate_note(estimate))
    if batches != [1]:
        print(
            "batch: sequences served together, a step at a time; a step's requests are the "
            "union of its sequences' experts (misses/token: per token of the batch)"
        )
    batch_head = f"{'batch':>6} " if batches != [1] else ""
    rate = f" {'est tok/s':>10}" if estimate is not None else ""
    print(
        f"{batch_head}{'policy':<12} {'capacity':>8} {'hit rate':>9} {'misses':>10} "
        f"{'misses/token':>13} {'per layer':>10}{rate}"
    )
    for row in rows:
        batch = f"{row['batch_size']:>6} " if batches != [1] else ""
        est = row.get("est_tokens_per_s")  # None: no bound (inf in the table)
        rate = f" {math.inf if est is None else est:>10.2f}" if estimate is not None else ""
        print(
            f"{batch}{row['policy']:<12} {row['capacity']:>8} {row['hit_rate']:>9.4f} "
            f"{row['misses']:>10} {row['misses_per_token']:>13.3f} "
            f"{row['misses_per_token'] / max(layers, 1):>10.3f}{rate}"
        )


ESTIMATE_OPTIONS = ("--expert-bytes", "--link-gbps", "--compute-ms")


def _serving_estimate(args: argparse.Namespace) -> Any:
    """The ServingEstimate of --expert-bytes, --link-gbps and --compute-ms (all three or
    none: None), checked before any replay."""
    from moestack.telemetry import ServingEstimate

    values = (args.expert_bytes, args.link_gbps, args.compute_ms)
    given = [opt for opt, v in zip(ESTIMATE_OPTIONS, values, strict=True) if v is not None]
    if not given:
        return None
    if len(given) < len(ESTIMATE_OPTIONS):
        missing = [opt for opt in ESTIMATE_OPTIONS if opt not in given]
        raise MoestackError(
            f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} "
            f"{' and '.join(missing)} too: the estimate of tokens/s takes all three of "
            f"{', '.join(ESTIMATE_OPTIONS)}"
        )
    return ServingEstimate(*values)


def _simulate_rows(results: list[Any], estimate: Any) -> list[dict[str, Any]]:
    """The JSON rows of simulate (and its table): each CacheStats as a dict, with
    ``est_tokens_per_s`` when an estimate is asked for."""
    rows = []
    for stats in results:
        row = stats.to_dict()
        if estimate is not None:  # null: no bound (--compute-ms 0 and no misses)
            rate = estimate.est_tokens_per_s(stats.misses_per_token)
            row["est_tokens_per_s"] = rate if math.isfinite(rate) else None
        rows.append(row)
    return rows


def _estimate_note(estimate: Any) -> str:
    return (
        f"est tok/s = 1000 / token_ms, token_ms = {estimate.compute_ms:g} ms compute + "
        f"misses/token x {estimate.expert_bytes:.0f} B / ({estimate.link_gbps:g} GB/s x 1e6): "
        "every load in series, none hidden behind compute"
    )


def cmd_trace(args: argparse.Namespace) -> None:
    from moestack.telemetry import import_trace

    trace = import_trace(args.src, args.out, num_experts=args.num_experts, progress=True)
    k = "/".join(str(k) for k in sorted(set(trace.top_k)))
    print(
        f"imported {trace.num_tokens} tokens x {trace.num_layers} MoE layers "
        f"(top-{k} of {max(trace.num_experts)} experts, {trace.meta['import_format']}) "
        f"from {args.src} into {args.out}; replay it with: moestack simulate {args.out}"
    )


def cmd_report(args: argparse.Namespace) -> None:
    from moestack.telemetry import render_report

    if not Path(args.run_dir).is_dir():
        raise MoestackError(f"run folder {args.run_dir!r} not found; give a moestack-train out_dir")
    index = render_report(
        args.run_dir, out_dir=args.out or None, trace_dir=args.trace or None, progress=True
    )
    print(f"report: {index}")


def _telemetry_parser(verbs: Any) -> None:
    p = verbs.add_parser("telemetry", help="run a transformers MoE model over a text file")
    p.add_argument(
        "model",
        help="a local model folder, a config .json, or a tiny random model: mixtral, qwen2_moe, "
        "qwen3_moe, olmoe, deepseek_v3, gpt_oss",
    )
    p.add_argument("text", help="a text file")
    p.add_argument("out", help="output folder for the trace, metrics and report")
    p.add_argument(
        "--seq-len", type=int, default=256, help="tokens per sequence (default: %(default)s)"
    )
    p.add_argument(
        "--batch-size", type=int, default=4, help="sequences per batch (default: %(default)s)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=65536,
        help="tokens read from the text (default: %(default)s)",
    )
    p.add_argument("--policies", default=POLICIES, help="cache policies (default: %(default)s)")
    p.add_argument("--capacities", default="", help="experts per layer (default: k and 2k)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument(
        "--record-probs",
        action="store_true",
        help="also record the routers' probabilities in the trace (default: off)",
    )
    p.set_defaults(func=cmd_telemetry)


def _simulate_parser(verbs: Any) -> None:
    p = verbs.add_parser(
        "simulate",
        help="replay a routing trace through cache policies",
        description="Replay a routing trace through cache policies and capacities: hit rate "
        "and misses per token of each. With --expert-bytes N, --link-gbps G and --compute-ms "
        "C, each row also gets the tokens/s those misses allow on such a machine: "
        "est_tokens_per_s = 1000 / token_ms, token_ms = C + misses_per_token * N / (G * 1e6) "
        "(N bytes per expert load, G GB/s, C ms of compute per token with every expert "
        "resident; loads in series, none hidden behind compute), and bytes_loaded = misses "
        "x N.",
    )
    p.add_argument(
        "trace",
        help="a trace folder: a run's trace/ (its parts joined) or one part, or RoutingTrace.save's",
    )
    p.add_argument("--policies", default=POLICIES, help="cache policies (default: %(default)s)")
    p.add_argument("--capacities", default="", help="experts per layer (default: k and 2k)")
    p.add_argument(
        "--warmup",
        type=_warmup,
        default=0.1,
        help="requests per layer that fill the caches uncounted: a fraction or a count "
        "(default: %(default)s, the first 10%%)",
    )
    p.add_argument(
        "--batch-sizes",
        type=_batch_sizes,
        default=[1],
        metavar="B,...",
        help="sequences served together, a decode step at a time: a step's requests are the "
        "union of its sequences' experts (default: 1, the trace as recorded)",
    )
    _estimate_options(p)
    p.add_argument("--json", default="", help="also write the results to this file (default: none)")
    p.set_defaults(func=cmd_simulate)


def _estimate_options(p: argparse.ArgumentParser) -> None:
    """`simulate`'s --expert-bytes, --link-gbps and --compute-ms: the machine whose
    tokens/s each row's misses allow (all three, or no estimate)."""
    estimate = (
        "; with all three of --expert-bytes N, --link-gbps G and --compute-ms C each row gains "
        "est_tokens_per_s = 1000 / token_ms, token_ms = C + misses_per_token * N / (G * 1e6) "
        "(loads in series, none hidden behind compute)"
    )
    p.add_argument(
        "--expert-bytes",
        type=float,
        default=None,
        metavar="N",
        help=f"bytes one expert load moves{estimate} (default: none, no estimate)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        metavar="G",
        help="GB/s (1e9 bytes/s) of the link experts load over, e.g. 25 for PCIe 4 x16, 3.5 "
        "for an NVMe disk (default: none, no estimate)",
    )
    p.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        metavar="C",
        help="milliseconds of compute per token with every expert resident, >= 0 (0: loads "
        "only; default: none, no estimate)",
    )


def _trace_parser(verbs: Any) -> None:
    p = verbs.add_parser("trace", help="routing traces recorded by other tools")
    actions = p.add_subparsers(
        dest="trace_action", required=True, help="import: write a foreign trace as a trace folder"
    )
    imp = actions.add_parser(
        "import",
        help="write a routing trace recorded by another tool as a moestack trace folder",
        description="Read SRC, a moe-routing-lab .npz (experts int16 [layers, tokens, k] and "
        "a JSON meta with num_experts and top_k) or the llama.cpp eval-callback tracer's binary "
        "records (int32 layer, n_tokens, k, then n_tokens*k ids; the layout is told from the "
        "file's first bytes), check it whole and write OUT, a trace folder for moestack "
        "simulate. The tokens are one sequence, in file order. Bad input: one line, nothing "
        "written.",
    )
    imp.add_argument("src", help="the trace file: a .npz archive or a binary record stream")
    imp.add_argument("out", help="the trace folder to write (must not exist, or be empty)")
    imp.add_argument(
        "--num-experts",
        type=int,
        default=None,
        metavar="N",
        help="experts per MoE layer: required for a binary record stream (it does not say); "
        "an .npz's meta says it (default: none)",
    )
    imp.set_defaults(func=cmd_trace)


def _report_parser(verbs: Any) -> None:
    p = verbs.add_parser("report", help="charts and an HTML page of a run folder")
    p.add_argument("run_dir", help="a moestack-train run folder, or a moestack telemetry output")
    p.add_argument("--out", default="", help="where to write (default: RUN_DIR/report)")
    p.add_argument("--trace", default="", help="trace folder (default: found in RUN_DIR)")
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    from moestack import __version__

    description = __doc__.split("\n")[0].replace("``", "")  # plain text, not reST
    parser = argparse.ArgumentParser(prog="moestack", description=description)
    parser.add_argument("--version", action="version", version=f"moestack {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    for add in (
        eval_parser, export_parser, _telemetry_parser, _simulate_parser, _trace_parser,
        _report_parser, prereg_parser, plan_parser,
    ):  # fmt: skip
        add(verbs)
    return parser


def _error(verb: str, err: BaseException) -> None:
    print(f"moestack {verb}: error: {err}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``moestack``: log lines go through tqdm, so they never break a
    progress bar; bad input, a missing file or a missing extra end with one line."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        with logging_redirect_tqdm():
            args.func(args)
    except (MoestackError, ValueError, OSError, ImportError) as err:
        _error(" ".join(filter(None, (args.verb, getattr(args, "trace_action", None)))), err)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (runs resume where they stopped)
        print(f"moestack {args.verb}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
