"""A transformers MoE bigger than memory, fine-tuned with its experts streamed from disk: the
process's peak RSS against the bytes of the experts it trains around.

Writes a synthetic Qwen3-MoE folder (``--layers`` x ``--experts`` experts of width
``--moe-inter`` at ``--hidden``, random bf16 weights, one safetensors file per layer written
one at a time, so this script never holds the model either; a byte-level BPE tokenizer
trained in memory), then runs ``moestack-train model=hf model.path=FOLDER trainable=lora
offload_experts=disk`` for ``--steps`` steps in a child process and reads its peak resident
set (``ru_maxrss`` of the child: the most memory it held at once, mapped file pages
included). Reports the experts' bf16 bytes in the folder, the store the run writes (fp32 on a
CPU: the run's parameter dtype), the peak RSS and the ratio experts / peak RSS.

    python scripts/bench_stream_hf.py --out /tmp/stream_hf [--layers 48 --experts 64
        --hidden 768 --moe-inter 512 --steps 3 --capacity 8] [--json out.json] [OVERRIDE ...]

The folder is reused when its config matches (writing it takes about a minute per 5 GB).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from moestack import bench

EOS, PAD, VOCAB = "<|endoftext|>", "<pad>", 320


def qwen3_config(a: object) -> dict:
    """config.json of the synthetic folder (Qwen3-MoE, top-2, bf16)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": VOCAB, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": a.hidden // 8,
        "intermediate_size": 4 * a.hidden, "moe_intermediate_size": a.moe_inter,
        "num_experts": a.experts, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "eos_token_id": 0, "pad_token_id": 1,
    }  # fmt: skip


def layer_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors (names as a Qwen3-MoE checkpoint stores them)."""
    d, hd, f = c["hidden_size"], c["head_dim"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate.weight": (c["num_experts"], d),
    }  # fmt: skip
    for e in range(c["num_experts"]):
        for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            shapes[f"mlp.experts.{e}.{name}.weight"] = shape
    return shapes


def random_tensors(shapes: dict[str, tuple[int, ...]], gen: torch.Generator) -> dict:
    """bf16 weights: norms at one, the rest N(0, 0.02^2) (routers N(0, 0.2^2), so tokens
    route apart)."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            std = 0.2 if name.endswith("gate.weight") and "proj" not in name else 0.02
            out[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
    return out


def write_folder(folder: Path, config: dict) -> int:
    """The folder (config, tokenizer, one safetensors file per layer); returns the experts'
    bytes. Reused as it is when its config.json matches."""
    shapes = layer_shapes(config)
    expert_bytes = config["num_hidden_layers"] * sum(
        2 * torch.Size(s).numel() for n, s in shapes.items() if ".experts." in n
    )
    if (folder / "config.json").is_file() and json.loads(
        (folder / "config.json").read_text()
    ) == config:
        return expert_bytes
    folder.mkdir(parents=True, exist_ok=True)
    gen, index = torch.Generator().manual_seed(0), {}
    d = config["hidden_size"]
    top = {
        "model.embed_tokens.weight": (VOCAB, d),
        "lm_head.weight": (VOCAB, d),
        "model.norm.weight": (d,),
    }
    files = {"top.safetensors": random_tensors(top, gen)}
    for name, tensors in files.items():
        save_file(tensors, folder / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    for layer in range(config["num_hidden_layers"]):
        tensors = {f"model.layers.{layer}.{k}": v for k, v in random_tensors(shapes, gen).items()}
        name = f"layer-{layer:03d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(config, indent=1))  # last: the folder is whole
    return expert_bytes


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer trained in memory (offline), EOS id 0 and pad id 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(
        ["def f(x):\n    return x * x\n", "import os, sys\n"] * 8, trainer=trainer
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD).save_pretrained(
        folder
    )


def train(folder: Path, run: Path, a: object) -> tuple[float, float]:
    """``moestack-train`` on the folder, experts streamed from disk: (peak RSS in bytes of
    the child, seconds)."""
    cmd = [sys.executable, "-m", "moestack.train", "model=hf", f"model.path={folder}",
           "trainable=lora", "offload_experts=disk", f"cache.capacity={a.capacity}",
           f"steps={a.steps}", "batch_size=1", "data.seq_len=32", "data.max_bytes=200000",
           "eval_every=0", "eval_batches=1", "ckpt_every=0", "log_every=1", "telemetry=off",
           "wandb_mode=disabled", "progress=false", f"threads={a.threads}", f"out_dir={run}",
           *a.overrides]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return resource.getrusage(
        resource.RUSAGE_CHILDREN
    ).ru_maxrss * 1024.0, time.perf_counter() - start


def main() -> None:
    ap = bench.parser(__doc__, json=None)
    ap.add_argument("--out", type=Path, required=True, help="where the folder and the run go")
    for name, default in (("layers", 48), ("experts", 64), ("hidden", 768), ("moe-inter", 512),
                          ("steps", 3), ("capacity", 8), ("threads", 2)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("overrides", nargs="*", help="more moestack-train overrides (lora.rank=4)")
    a = ap.parse_args()
    config = qwen3_config(a)
    experts = write_folder(a.out / "model", config)
    run = a.out / f"run-{int(time.time())}"
    peak, seconds = train(a.out / "model", run, a)
    store = sum(p.stat().st_size for p in (run / "experts").rglob("*") if p.is_file())
    row = {"experts_bf16_bytes": experts, "store_bytes": store, "peak_rss_bytes": peak,
           "experts_over_peak_rss": experts / peak, "seconds": seconds, "config": config,
           "steps": a.steps, "capacity": a.capacity, "overrides": a.overrides}  # fmt: skip
    print(bench.table(["experts (bf16)", "store on disk", "peak RSS", "experts / peak RSS"],
                      [[f"{experts / 2**30:.2f} GiB", f"{store / 2**30:.2f} GiB",
                        f"{peak / 2**30:.2f} GiB", f"{experts / peak:.2f}x"]], "<16 <14 <10 <18"))  # fmt: skip
    if a.json:
        bench.write_json(a.json, row)


if __name__ == "__main__":
    main()
