"""Where the time of the Triton MoE layer's forward+backward goes, launch by launch.

bench_moe.py says how fast each path is; this says why. Every kernel launch of the Triton
experts is timed on its own (CUDA events around it; on the CPU, the wall clock around the
interpreter) and labelled by its role: the forward's gate/up GEMM (gather + SwiGLU epilogue)
and down GEMM (router weight + scatter), the backward's row gathers (dy's and x's rows copied
into expert order for G and the weight gradients), G = dy @ W2^T, the elementwise SwiGLU
backward (or, where the tuned table fuses it into G's GEMM, the one launch
"bwd G=dy@W2^T +SwiGLU'"), dW2, dx and dW1; a weight gradient that the tuned table gives to torch._grouped_mm
is its own row, "[torch._grouped_mm]" after the role, and a GEMM that it gives to the
persistent kernel (h@W2, G, dx; its tile table built inside the row) "[persistent]".
--persistent forces the persistent kernel's default candidate on those GEMMs, to set its
launches beside the classic ones of a run without it; --fused-dswiglu forces the fused
G + SwiGLU backward's default tile the same way, and --torch-wgrad torch._grouped_mm's weight
gradients (where it runs: bf16 on sm90+). The first lines say which configs the run used
(forced, or the tuned table named and whether autotuning is on). Each GEMM row gives its
useful TFLOP/s
and the fraction of the dense bf16 matmul rate measured in the same run; "other" is the rest
of the step (router, sort, the forward's index gathers, the sum over the k slots,
allocations), from an untimed pass of the same step. A launch's time runs from its start event, recorded before the Python launcher, to its
end event: while the GPU waits for the host (small shapes), launcher overhead lands in the
launch's row rather than in "other". The torch path's whole step is timed beside it, for the
ratio bench_moe reports. Prints a table per shape; --json writes them.

    python scripts/profile_moe.py                          # GPU: every bench_moe shape
    python scripts/profile_moe.py --shapes mixtral-8k --json profile.json
    python scripts/profile_moe.py --shapes mixtral-8k --persistent   # the persistent GEMMs
    python scripts/profile_moe.py --shapes mixtral-8k --fused-dswiglu  # G + SwiGLU' fused
    python scripts/profile_moe.py --persistent --fused-dswiglu --torch-wgrad  # every new path
    TRITON_INTERPRET=1 python scripts/profile_moe.py --tiny   # CPU smoke run
    TRITON_INTERPRET=1 python scripts/profile_moe.py --tiny --steps 1 --no-warmup  # the tests'
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from moestack import MoE, MoEConfig, RouterConfig, bench
from moestack.kernels import _launch, tuned_table, tuning

TINY_SHAPE = ("tiny", 4, 2, 32, 48, 64)  # name, experts, top_k, d_model, d_ff, tokens


TORCH_TAG = " [torch._grouped_mm]"  # after the role of a weight gradient torch computed
PERSISTENT_TAG = " [persistent]"  # after the role of a GEMM the persistent kernel computed
GATHER_ROLE = "bwd gather dy,x rows"
DSWIGLU_ROLE = "bwd G=dy@W2^T +SwiGLU'"  # G's GEMM with the SwiGLU backward in its epilogue


def grouped_mm_role(args: tuple, kw: dict, dims: tuple[int, int]) -> str:
    """The role of a ``grouped_mm`` launch in the fused experts (kernels/moe.py)."""
    if kw.get("swiglu"):
        return "fwd x@W1 +SwiGLU"
    if kw.get("c_rows") is not None:
        return "fwd h@W2 +combine" if kw.get("scale") is not None else "bwd dx=dz@W1^T"
    w = args[1]
    transposed = w.stride(2) != 1 and w.stride(1) == 1  # W2^T: a view with unit K stride
    return "bwd G=dy@W2^T" if transposed or kw.get("a_rows") is not None else "grouped_mm"


def wgrad_role(args: tuple, kw: dict, dims: tuple[int, int]) -> str:
    """dW1 is [D, 2F] per expert, dW2 [F, D]: told apart by the operands' widths."""
    D, F = dims
    widths = (args[0].shape[1], args[1].shape[1])
    if widths == (D, 2 * F):
        return "bwd dW1=x^T dz"
    return "bwd dW2=(wh)^T dy" if widths == (F, D) else "grouped_wgrad"


def gemm_flops(role: str, R: int, D: int, F: int) -> float:
    """Useful FLOPs of one launch (R = tokens x top_k rows), whichever backend ran it."""
    for tag in (TORCH_TAG, PERSISTENT_TAG):
        role = role.removesuffix(tag)
    two_f = {"fwd x@W1 +SwiGLU", "bwd dx=dz@W1^T", "bwd dW1=x^T dz"}
    one_f = {"fwd h@W2 +combine", "bwd G=dy@W2^T", DSWIGLU_ROLE, "bwd dW2=(wh)^T dy"}
    if role in two_f:
        return 2.0 * R * D * 2 * F
    return 2.0 * R * D * F if role in one_f else 0.0


class LaunchTimer:
    """Wraps the launchers of moestack.kernels._launch; sums each role's time per step.

    Only the outermost wrapped call is timed: a launcher called by another one (torch's
    weight gradient inside ``grouped_wgrad``, a gather for it) adds its tag, if it has one,
    to the caller's role instead of a row of its own, so no time is counted twice."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, object, object]] = []
        self.active = False
        self.dims = (0, 0)  # (d_model, d_ff) of the shape being profiled
        self.tags: list[list[str]] = []  # one list per wrapped call in progress

    def wrap(self, fn: Callable, role_of: Callable[[tuple, dict, tuple], str]) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kw):
            if not self.active or self.tags:
                return fn(*args, **kw)
            self.tags.append([])
            try:
                if self.device.type == "cuda":
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    out = fn(*args, **kw)
                    end.record()
                else:
                    t0 = time.perf_counter()
                    out = fn(*args, **kw)
                    elapsed = (time.perf_counter() - t0) * 1e3
            finally:
                tags = self.tags.pop()
            role = role_of(args, kw, self.dims) + "".join(tags)
            if self.device.type == "cuda":
                self.pending.append((role, start, end))
            else:
                self.ms[role] += elapsed
            return out

        return timed

    def tag(self, fn: Callable, tag: str) -> Callable:
        """``fn``, adding ``tag`` to the role of the timed call it runs inside."""

        @functools.wraps(fn)
        def tagged(*args, **kw):
            if self.active and self.tags and tag not in self.tags[-1]:
                self.tags[-1].append(tag)
            return fn(*args, **kw)

        return tagged

    def collect(self) -> None:
        """Fold the CUDA events in (after a synchronise)."""
        for role, start, end in self.pending:
            self.ms[role] += start.elapsed_time(end)
        self.pending.clear()


def install(timer: LaunchTimer) -> None:
    _launch.grouped_mm = timer.wrap(_launch.grouped_mm, grouped_mm_role)
    _launch.grouped_wgrad = timer.wrap(_launch.grouped_wgrad, wgrad_role)
    _launch.grouped_wgrad_torch = timer.tag(_launch.grouped_wgrad_torch, TORCH_TAG)
    _launch.persistent_mm = timer.tag(_launch.persistent_mm, PERSISTENT_TAG)
    _launch.gather_rows = timer.wrap(_launch.gather_rows, lambda *_: GATHER_ROLE)
    _launch.swiglu_bwd = timer.wrap(_launch.swiglu_bwd, lambda *_: "bwd SwiGLU' (elementwise)")
    _launch.mm_dswiglu_fused = timer.wrap(_launch.mm_dswiglu_fused, lambda *_: DSWIGLU_ROLE)


def step_ms(step: Callable[[], None], device: torch.device, steps: int) -> float:
    """Milliseconds per step of ``steps`` steps run back to back (synchronised around)."""
    return 1e3 * bench.seconds(lambda: [step() for _ in range(steps)], device) / steps


def profile_shape(
    shape: tuple,
    device: torch.device,
    dtype: torch.dtype,
    timer: LaunchTimer,
    dense_tflops: float,
    steps: int,
    warmup: bool = True,
) -> dict:
    """One shape: the Triton step's launches by role, the rest, and the torch step (after
    warm-up passes unless ``warmup`` is false)."""
    name, E, k, D, F, T = shape
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, top_k=k, d_ff=F, impl="torch")
    with torch.device(device):
        torch_moe = MoE(D, cfg, RouterConfig(load_balance=0.0, z_loss=0.0)).to(dtype)
    triton_moe = bench.sharing_weights(torch_moe, "triton")
    x = torch.randn(1, T, D, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, T, D, device=device, dtype=dtype)
    triton_step = bench.fwd_bwd(triton_moe, x, grad)
    torch_step = bench.fwd_bwd(torch_moe, x, grad)
    if warmup:
        for step in (triton_step, torch_step, triton_step):  # compile, tune, warm the allocator
            step()
    torch_ms = step_ms(torch_step, device, steps)
    triton_total = step_ms(triton_step, device, steps)  # untimed launches: no event overhead
    timer.ms.clear()
    timer.dims = (D, F)
    timer.active = True
    try:
        step_ms(triton_step, device, steps)
    finally:
        timer.active = False
    timer.collect()
    return {
        "shape": name,
        "triton_ms": triton_total,
        "torch_ms": torch_ms,
        "speedup_over_torch": torch_ms / triton_total,
        "rows": launch_rows(timer, steps, T * k, D, F, dense_tflops, triton_total),
    }


def launch_rows(
    timer: LaunchTimer, steps: int, R: int, D: int, F: int, dense_tflops: float, total: float
) -> list[dict]:
    """One row per launch role, slowest first (ms per step, useful TFLOP/s, its fraction of
    the dense rate), then "other": the rest of the step's ``total`` ms."""
    rows = []
    for role, summed in sorted(timer.ms.items(), key=lambda kv: -kv[1]):
        ms = summed / steps
        flops = gemm_flops(role, R, D, F)
        tflops = flops / ms / 1e9 if flops and ms > 0 else 0.0
        dense = tflops / dense_tflops if dense_tflops else 0.0
        rows.append({"role": role, "ms": ms, "tflops": tflops, "dense_fraction": dense})
    launched = sum(r["ms"] for r in rows)
    other = max(total - launched, 0.0)
    return [*rows, {"role": "other", "ms": other, "tflops": 0.0, "dense_fraction": 0.0}]


def print_profile(p: dict) -> None:
    print(
        f"\n{p['shape']}: triton {p['triton_ms']:.3f} ms fwd+bwd, torch {p['torch_ms']:.3f} "
        f"ms (x{p['speedup_over_torch']:.2f})"
    )
    print(f"  {'launch':<40} {'ms':>9} {'% step':>7} {'TFLOP/s':>8} {'of dense':>8}")
    for r in p["rows"]:
        share = 100 * r["ms"] / p["triton_ms"] if p["triton_ms"] else 0.0
        dense = f"{100 * r['dense_fraction']:7.1f}%" if r["tflops"] else f"{'':>8}"
        tf = f"{r['tflops']:8.1f}" if r["tflops"] else f"{'':>8}"
        print(f"  {r['role']:<40} {r['ms']:9.3f} {share:6.1f}% {tf} {dense}")


def build_parser() -> argparse.ArgumentParser:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = bench.parser(__doc__, device=device, steps=5, json="")
    parser.add_argument("--shapes", default="", help="comma-separated bench_moe shape names")
    parser.add_argument("--tiny", action="store_true", help="one tiny fp32 shape (CPU tests)")
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up passes (compile, tune, warm the allocator): the interpreter has "
        "none of those to do, and each of its passes takes seconds",
    )
    parser.add_argument(
        "--persistent",
        action="store_true",
        help="force the persistent kernel's default candidate on the GEMMs without SwiGLU "
        "(h@W2, G, dx) instead of the tuned or default configs",
    )
    parser.add_argument(
        "--fused-dswiglu",
        action="store_true",
        help="force the fused G=dy@W2^T + SwiGLU backward's first tile (kind mm_dswiglu) "
        "instead of the tuned or default (unfused) choice",
    )
    parser.add_argument(
        "--torch-wgrad",
        action="store_true",
        help="force torch._grouped_mm's weight gradients (kind wgrad) where they run (bf16 on "
        "sm90+; elsewhere moestack's default tile) instead of the tuned or default choice",
    )
    return parser


def forced_configs(args: argparse.Namespace) -> dict[str, tuning.KernelConfig]:
    """The configs the flags force, per kernel kind."""
    forced = {}
    if args.persistent:
        forced["mm"] = tuning.PERSISTENT_CANDIDATES[0]
    if args.fused_dswiglu:
        forced["mm_dswiglu"] = tuning.CANDIDATES["mm_dswiglu"][0]
    if args.torch_wgrad:
        forced["wgrad"] = tuning.TORCH_WGRAD
    return forced


def describe(cfg: tuning.KernelConfig) -> str:
    """A config in a few words: its backend or tile, and the path it names."""
    if cfg.backend == "torch":
        return "torch._grouped_mm"
    tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    return tile + (" persistent" if cfg.persistent else "") + (" fused" if cfg.fused else "")


def configs_line(forced: dict[str, tuning.KernelConfig]) -> str:
    """Which configs the run's launches use: the label of its tables."""
    if _launch.interpreted():
        source = "the interpreter's fixed tile"
    elif tuning.autotune_enabled():
        source = f"the tuned table {tuned_table.table_path()}, autotuned where it has no entry"
    else:
        source = f"the tuned table {tuned_table.table_path()}, the default where it has no entry"
    if not forced:
        return f"configs: every kind from {source}"
    named = "; ".join(f"{kind} forced to {describe(cfg)}" for kind, cfg in forced.items())
    unforced = ", ".join(sorted(set(tuning.CANDIDATES) - set(forced)))
    return f"configs: {named}; {unforced} from {source}"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not (args.tiny and _launch.interpreted()):
        sys.exit("profile_moe.py: without a GPU only --tiny runs, under TRITON_INTERPRET=1")
    dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32
    shapes = [TINY_SHAPE] if args.tiny else bench.MOE_GPU_SHAPES
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - {s[0] for s in shapes})
        if unknown:
            parser.error(f"--shapes: unknown {unknown}; choose from {[s[0] for s in shapes]}")
        shapes = [s for s in shapes if s[0] in wanted]
    dense = bench.dense_matmul_tflops(device, dtype)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {machine}, {dtype}, dense matmul {dense:.2f} TFLOP/s")
    timer = LaunchTimer(device)
    install(timer)
    forced = forced_configs(args)
    print(configs_line(forced))
    header = {
        "device": machine,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "dense_tflops": dense,
        "configs": configs_line(forced),
        "forced_mm_config": str(forced["mm"]) if "mm" in forced else None,
        "forced_dswiglu_config": str(forced["mm_dswiglu"]) if "mm_dswiglu" in forced else None,
        "forced_wgrad_config": str(forced["wgrad"]) if "wgrad" in forced else None,
    }
    profiles: list[dict] = []
    with contextlib.ExitStack() as stack:
        for kind, cfg in forced.items():
            stack.enter_context(tuning.forced_config(kind, cfg))
        for shape in shapes:
            profiles.append(
                profile_shape(shape, device, dtype, timer, dense, args.steps, not args.no_warmup)
            )
            print_profile(profiles[-1])
            if args.json:
                bench.write_json(args.json, {**header, "profiles": profiles}, device=device)


if __name__ == "__main__":
    main()
