"""Micro-benchmark: moestack's Triton grouped GEMM vs torch._grouped_mm and a loop (CUDA).

    python scripts/bench_grouped_gemm.py [--tokens 16384] [--json out.json]

Times forward and forward+backward of one grouped GEMM ``[T*k, K] x [E, K, M]`` at the
expert shapes of the bench models, in bf16, with a random top-k routing. Prints a table of
ms and TFLOP/s (useful FLOPs only). The whole MoE layer is benchmarked by
scripts/bench_moe.py; this isolates the GEMM kernel.
"""

from __future__ import annotations

import sys

import torch

from moestack import bench

# name: (E, k, K, M) -- the first expert GEMM (D -> 2F) of each bench model
SHAPES = {
    "mixtral-w1": (8, 2, 4096, 2 * 14336),
    "qwen3-30b-w1": (128, 8, 2048, 2 * 768),
    "qwen3-30b-w2": (128, 8, 768, 2048),
    "olmoe-w1": (64, 8, 2048, 2 * 1024),
}


def _loop(x, w, offsets):
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        outs.append(x[start:end] @ w[e])
        start = end
    return torch.cat(outs)


def _impls():
    from moestack.kernels import grouped_gemm

    impls = {"triton": grouped_gemm, "loop": _loop}
    if hasattr(torch, "_grouped_mm"):
        impls["torch._grouped_mm"] = lambda x, w, offs: torch._grouped_mm(x, w, offs=offs)
    return impls


def time_impl(fn, x, w, offsets, backward: bool) -> float:
    """Mean milliseconds of one call (and its backward): triton's timer, gradients dropped."""
    from triton.testing import do_bench

    def step():
        y = fn(x, w, offsets)
        if backward:
            y.backward(dy_cache.setdefault(y.shape, torch.randn_like(y)))

    dy_cache: dict = {}
    return do_bench(step, warmup=25, rep=100, grad_to_none=[x, w])


def main(argv: list[str] | None = None) -> int:
    parser = bench.parser(__doc__, json=None)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_grouped_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (E, k, K, M) in SHAPES.items():
        experts = torch.rand(args.tokens, E, device="cuda", generator=gen).topk(k).indices
        offsets = torch.bincount(experts.flatten(), minlength=E).cumsum(0).to(torch.int32)
        N = args.tokens * k
        x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(E, K, M, device="cuda", dtype=torch.bfloat16) / K**0.5
        w.requires_grad_()
        flops = 2 * N * K * M
        for impl, fn in _impls().items():
            try:
                fwd = time_impl(fn, x, w, offsets, backward=False)
                fb = time_impl(fn, x, w, offsets, backward=True)
            except Exception as exc:  # e.g. torch._grouped_mm unsupported on this GPU
                print(f"{name:14s} {impl:18s} failed: {exc}", file=sys.stderr)
                continue
            rows.append(
                {
                    "shape": name,
                    "impl": impl,
                    "fwd_ms": fwd,
                    "fwd_bwd_ms": fb,
                    "fwd_tflops": flops / fwd / 1e9,
                    "fwd_bwd_tflops": 3 * flops / fb / 1e9,
                }
            )
    print(f"GPU: {torch.cuda.get_device_name()}  tokens={args.tokens}  bf16")
    cells = [
        (r["shape"], r["impl"], f"{r['fwd_ms']:.3f}", f"{r['fwd_tflops']:.1f}",
         f"{r['fwd_bwd_ms']:.3f}", f"{r['fwd_bwd_tflops']:.1f}")
        for r in rows
    ]  # fmt: skip
    head = ("shape", "impl", "fwd ms", "TF/s", "f+b ms", "TF/s")
    print(bench.table(head, cells, "<14 <18 >8 >7 >8 >7"))
    if args.json:
        bench.write_json(
            args.json, {"gpu": torch.cuda.get_device_name(), "rows": rows}, device="cuda"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
