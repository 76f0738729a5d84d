"""Activation memory an MoE layer keeps for backward, counted byte by byte on the CPU.

Every tensor autograd saves during the forward pass is seen through
``torch.autograd.graph.saved_tensors_hooks``; bytes are summed over distinct storages, leaving
out the parameters (weights are not activations). Contenders: moestack's torch and triton
impls (triton runs in the interpreter here, so keep shapes small) and transformers' Qwen3-MoE
block with its grouped_mm and eager experts. Ratios are against moestack-torch.

    python scripts/bench_moe_memory.py [--tokens 512] [--json out.json]
"""

from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():  # before any kernel is decorated
        os.environ["TRITON_INTERPRET"] = "1"

import torch

from moestack import bench
from moestack.interop.hf import moe_from_hf
from moestack.memory_plan import saved_tensor_bytes

SHAPES = [  # name, experts, top_k, d_model, d_ff
    ("E8-k2", 8, 2, 256, 512),
    ("E64-k8", 64, 8, 256, 128),
]


def main() -> None:
    parser = bench.parser(__doc__, json="")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    rows = []
    for name, experts, top_k, d_model, d_ff in SHAPES:
        torch.manual_seed(0)
        hf_cfg = Qwen3MoeConfig(
            hidden_size=d_model,
            moe_intermediate_size=d_ff,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
        )
        block = Qwen3MoeSparseMoeBlock(hf_cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
        contenders: dict[str, torch.nn.Module] = {
            "moestack-torch": moe_from_hf(block, impl="torch")
        }
        contenders["moestack-triton"] = moe_from_hf(block, impl="triton")
        for impl in ("grouped_mm", "eager"):
            hf = Qwen3MoeSparseMoeBlock(hf_cfg)
            hf.load_state_dict(block.state_dict())
            hf.experts.config._experts_implementation = impl
            contenders[f"transformers-{impl}"] = hf
        x = torch.randn(1, args.tokens, d_model, requires_grad=True)
        base = None
        for contender, module in contenders.items():
            nbytes = saved_tensor_bytes(module, x)
            base = base or nbytes
            rows.append({"shape": name, "contender": contender, "saved_mib": nbytes / 2**20,
                         "ratio": nbytes / base})  # fmt: skip
    cells = [
        (r["shape"], r["contender"], f"{r['saved_mib']:.2f}", f"{r['ratio']:.2f}") for r in rows
    ]
    print(bench.table(("shape", "contender", "saved MiB", "x torch"), cells, "<8 <24 >10 >8"))
    if args.json:
        bench.write_json(args.json, {"tokens": args.tokens, "dtype": "float32", "results": rows})


if __name__ == "__main__":
    main()
