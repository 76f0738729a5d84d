"""Autotune the grouped-GEMM kernels on this GPU and write the tuned-config table.

Run on the GPU the table is for (it needs CUDA):

    python scripts/tune_kernels.py                       # the bench shapes, bf16
    python scripts/tune_kernels.py --shapes 8,2,4096,14336 --dtype bfloat16

Every kernel variant of the MoE forward and backward (and the plain grouped GEMM) is timed
over the candidate configs of ``moestack.kernels.tuning`` at each shape (for the weight
gradients torch._grouped_mm too, where it runs: each entry names its backend; for the GEMMs
without SwiGLU the persistent kernel's candidates too, each charged the tile table it builds:
an entry it wins says ``"persistent": true``; for the backward's G = dy @ W2^T with the
SwiGLU backward, G's GEMM and the elementwise pass against the fused tiles: an entry the
fused epilogue wins says ``"fused": true``); the winners are
merged into ``kernels/tuned_configs.json`` under ``torch.cuda.get_device_name()``, so the
first use of those shapes on that GPU needs no autotuning. Only configs measured by this
run are written, each ``"source": "measured"`` with its ``provenance`` (GPU, date, torch,
triton); the entries it did not measure keep theirs. Keys carry the
power-of-two bucket of the sorted rows (tokens x top_k); a lookup without its bucket takes
the nearest one, so tune at the token counts you train with (``--tokens 8192 16384``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from moestack import bench

# name: (num_experts, top_k, d_model, d_ff) -- the shapes of scripts/bench_moe.py
SHAPES = {
    "mixtral": (8, 2, 4096, 14336),
    "qwen3-30b": (128, 8, 2048, 768),
    "olmoe": (64, 8, 2048, 1024),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
log = logging.getLogger("tune_kernels")


def parse_shape(text: str) -> tuple[str, tuple[int, int, int, int]]:
    if text in SHAPES:
        return text, SHAPES[text]
    parts = tuple(int(v) for v in text.split(","))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: a name in {list(SHAPES)} or E,k,D,F")
    return text, parts  # type: ignore[return-value]


def tune_moe(E: int, k: int, D: int, F: int, tokens: int, dtype: torch.dtype) -> None:
    """Run the MoE layer's kernel variants once at this shape; autotuning fills the cache."""
    from moestack.kernels import moe_experts

    dev = "cuda"
    x = torch.randn(tokens, D, device=dev, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(E, D, 2 * F, device=dev) / D**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, F, D, device=dev) / F**0.5).to(dtype).requires_grad_()
    scores = torch.randn(tokens, E, device=dev)
    weights, experts = torch.softmax(scores, -1).topk(k, dim=-1)
    weights.requires_grad_()
    y = moe_experts(x, w1, w2, experts, weights)
    y.backward(torch.randn_like(y))
    with torch.no_grad():  # inference keeps no pre-activations: another kernel variant
        moe_experts(x, w1, w2, experts, weights)
    torch.cuda.synchronize()


def tune_grouped_gemm(E: int, k: int, D: int, F: int, tokens: int, dtype: torch.dtype) -> None:
    """The plain grouped GEMM (moestack's torch-free API) at the two expert matmul shapes."""
    from moestack.kernels import grouped_gemm

    dev = "cuda"
    scores = torch.randn(tokens, E, device=dev)
    experts = scores.topk(k, dim=-1).indices
    counts = torch.bincount(experts.flatten(), minlength=E)
    offsets = counts.cumsum(0).to(torch.int32)
    rows = tokens * k
    for K, M in ((D, 2 * F), (F, D)):
        a = torch.randn(rows, K, device=dev, dtype=dtype, requires_grad=True)
        w = (torch.randn(E, K, M, device=dev) / K**0.5).to(dtype).requires_grad_()
        out = grouped_gemm(a, w, offsets)
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=list(SHAPES.items()))
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parents[1] / "kernels" / "tuned_configs.json"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        log.error("tune_kernels.py needs a CUDA GPU: the table is per GPU model")
        return 2

    # Tune from scratch: ignore any existing table while measuring.
    os.environ["MOESTACK_AUTOTUNE"] = "1"
    os.environ["MOESTACK_TUNED_CONFIGS"] = os.devnull
    from moestack.kernels import tuning

    tuning.clear_cache()
    dtype = DTYPES[args.dtype]
    # The MoE layer's kernels at every shape first, then the plain grouped GEMM: the table
    # is saved after every step, so a run stopped part-way keeps what it measured.
    for tune in (tune_moe, tune_grouped_gemm):
        for name, (E, k, D, F) in args.shapes:
            for tokens in args.tokens:
                log.info(
                    "%s %s: E=%d k=%d D=%d F=%d tokens=%d %s",
                    tune.__name__,
                    name,
                    *(E, k, D, F, tokens, dtype),
                )
                tune(E, k, D, F, tokens, dtype)
                bench.save_tuned(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
