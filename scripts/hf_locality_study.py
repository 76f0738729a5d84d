"""Router-only locality fine-tuning of a transformers MoE model, end to end (issue 14's table).

1. ``make_model``: a small Qwen3-MoE-architecture model folder, built offline: a byte-level BPE
   tokenizer trained on the training split of the default corpus (Python's stdlib) and a
   random Qwen3MoeConfig model, saved with ``save_pretrained``.
2. ``pretrain``: ``moestack-train model=hf model.path=<that folder>`` (all weights), then
   ``moestack export`` to a transformers folder: the "pretrained" model.
3. ``finetune``: routers only (``trainable=routers``) with the temporal loss at three
   weights beside the anchor loss (KL to the pretrained routing).
4. ``evaluate``: every model's validation perplexity and the hit rates of a real expert
   cache (LRU and static-pin at 2 x top_k slots per layer, experts served from a store),
   and cache-aware routing at inference (a bias toward resident experts, no training) on the
   un-tuned and on the tuned models.
5. ``step_speed``: tokens/s of one training step with the patched model against
   transformers' own model (grouped_mm experts) on the same batch, in one process.

Prints markdown tables and writes ``<out>/results.json``. Everything runs offline:

    .venv/bin/python scripts/hf_locality_study.py --out runs/hf_study

``--base-only`` stops after step 2 and prints the sha256 of ``<out>/pretrained/
model.safetensors``: the pretrained model of experiments/prereg_hf_finetune.yaml, built with
``--out runs/hf_base --threads 1`` (one thread: the sums, and so the weights, are then
reproducible on the same machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from moestack.cache import evaluate_offloaded, open_or_write_store
from moestack.config import (
    CacheConfig,
    DataConfig,
    HFModelConfig,
    OptimConfig,
    RouterConfig,
    TelemetryConfig,
    TrainConfig,
)
from moestack.data import eval_batches, load_corpus
from moestack.interop.hf_export import export_hf
from moestack.runs import load_run, run_corpus
from moestack.trainer import train

log = logging.getLogger("hf_locality_study")
EOS = "<|endoftext|>"


def make_model(folder: Path, args: argparse.Namespace) -> Path:
    """A random Qwen3-MoE model folder with a BPE tokenizer trained on the stdlib corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    corpus = load_corpus(DataConfig(max_bytes=args.tokenizer_bytes))
    text = bytes(corpus.train).decode("utf-8", "replace").split("\0")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    cfg = Qwen3MoeConfig(
        vocab_size=len(fast), hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, head_dim=args.d_model // 4,
        moe_intermediate_size=args.d_ff, intermediate_size=4 * args.d_model,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=512, eos_token_id=fast.eos_token_id,
        tie_word_embeddings=True, output_router_logits=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # transformers leaves the routers at zero: every token would tie
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def run_config(
    path: Path, out_dir: Path, args: argparse.Namespace, **overrides: Any
) -> TrainConfig:
    base: dict[str, Any] = dict(
        model=HFModelConfig(path=str(path)),
        data=DataConfig(seq_len=args.seq_len, max_bytes=args.max_bytes),
        telemetry=TelemetryConfig(enabled=False),
        batch_size=args.batch_size, eval_every=0, eval_batches=args.eval_batches,
        log_every=10, ckpt_every=0, progress=False, wandb_mode="disabled",
        out_dir=str(out_dir),
    )  # fmt: skip
    base.update(overrides)
    return TrainConfig(**base).resolve()  # the folder's architecture, for run_corpus and top_k


def train_and_export(cfg: TrainConfig, export_dir: Path, source: Path) -> Path:
    """Train ``cfg`` (reusing a finished run) and export it as a transformers folder."""
    out_dir = Path(cfg.out_dir)
    if not (out_dir / "summary.json").exists():
        shutil.rmtree(out_dir, ignore_errors=True)
        train(cfg, out_dir)
    if not (export_dir / "config.json").exists():
        export_hf(load_run(out_dir).model, export_dir, source_dir=source, overwrite=True)
    return export_dir


def cache_metrics(folder: Path, batches: list, capacity: int, bias: float = 0.0) -> dict:
    """Validation perplexity and LRU / static-pin hit rates with the experts of ``folder``
    served from an expert store (written once per folder)."""
    out: dict[str, float] = {}
    for policy in ("lru", "static"):
        run = load_run(folder)
        store = open_or_write_store(run.model, folder.parent / f"{folder.name}.store",
                                    run.cfg.model, source=str(folder))  # fmt: skip
        result = evaluate_offloaded(
            run.model, store, batches, "cpu", CacheConfig(policy=policy, capacity=capacity,
                                                          warmup=256), cache_aware_bias=bias,
        )  # fmt: skip
        out[f"{policy}_hit_rate"] = result["cache/hit_rate"]
        out["perplexity"] = result["eval/perplexity"]
    return out


def step_speed(folder: Path, args: argparse.Namespace, reps: int = 5) -> dict[str, float]:
    """Tokens/s of forward+backward, patched model vs transformers' own (grouped_mm)."""
    from transformers import AutoModelForCausalLM

    ours = load_run(folder).model.train()
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).train()
    theirs.config._experts_implementation = "grouped_mm"
    for module in theirs.modules():
        if hasattr(module, "config") and hasattr(module.config, "_experts_implementation"):
            module.config._experts_implementation = "grouped_mm"
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ours.cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)

    def ours_step() -> None:
        ours(tokens, tokens).loss.backward()

    def theirs_step() -> None:
        theirs(input_ids=tokens, labels=tokens).loss.backward()

    steps = {"moestack": ours_step, "transformers": theirs_step}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(reps):  # interleaved, so a noisy neighbour slows both alike
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    seconds = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    n = tokens.numel()
    return {
        "moestack_tokens_per_s": n / seconds["moestack"],
        "transformers_tokens_per_s": n / seconds["transformers"],
        "ratio": seconds["transformers"] / seconds["moestack"],
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base_dir = out / "base_model"
    if not (base_dir / "config.json").exists():
        make_model(base_dir, args)
    pre = run_config(base_dir, out / "pretrain", args, steps=args.pretrain_steps,
                     optim=OptimConfig(lr=3e-3, warmup_steps=30))  # fmt: skip
    pretrained = train_and_export(pre, out / "pretrained", base_dir)
    if args.base_only:
        digest = hashlib.sha256((pretrained / "model.safetensors").read_bytes()).hexdigest()
        print(f"{pretrained}/model.safetensors sha256 {digest}")
        return
    if args.speed_only:
        speed = step_speed(pretrained, args)
        print(json.dumps(speed))
        return

    tuned: dict[str, Path] = {}
    for weight in args.temporal:
        cfg = run_config(
            pretrained, out / f"tune_t{weight}", args, steps=args.finetune_steps,
            trainable="routers", optim=OptimConfig(lr=1e-3, warmup_steps=10, weight_decay=0.0),
            router=RouterConfig(temporal=weight, anchor=args.anchor),
        )  # fmt: skip
        tuned[f"temporal {weight} + anchor {args.anchor}"] = train_and_export(
            cfg, out / f"tuned_t{weight}", pretrained
        )
    eval_cfg = run_config(pretrained, out / "eval", args)
    batches = eval_batches(run_corpus(eval_cfg).val, args.batch_size, args.seq_len,
                           args.eval_batches)  # fmt: skip
    capacity = 2 * eval_cfg.model.moe.top_k
    rows = [{"model": "pretrained (un-tuned)", "bias": 0.0,
             **cache_metrics(pretrained, batches, capacity)}]  # fmt: skip
    for name, folder in tuned.items():
        rows.append({"model": name, "bias": 0.0, **cache_metrics(folder, batches, capacity)})
    best = list(tuned.values())[-1]
    for bias in args.biases:
        for name, folder in (("pretrained", pretrained), (list(tuned)[-1], best)):
            rows.append({"model": f"{name}, cache-aware routing", "bias": bias,
                         **cache_metrics(folder, batches, capacity, bias)})  # fmt: skip
    speed = step_speed(pretrained, args)
    report(rows, speed, capacity, args, out)


def report(
    rows: list[dict], speed: dict, capacity: int, args: argparse.Namespace, out: Path
) -> None:
    base = rows[0]
    print(f"\nCapacity {capacity} experts per layer (2 x top_k); {args.eval_batches} x "
          f"{args.batch_size} x {args.seq_len} validation tokens\n")  # fmt: skip
    print("| model | bias | perplexity | change | LRU hit rate | static hit rate |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        change = r["perplexity"] / base["perplexity"] - 1
        print(f"| {r['model']} | {r['bias']} | {r['perplexity']:.3f} | {change:+.2%} | "
              f"{r['lru_hit_rate']:.3f} | {r['static_hit_rate']:.3f} |")  # fmt: skip
    print(
        f"\ntraining step, {args.batch_size} x {args.seq_len} tokens: moestack "
        f"{speed['moestack_tokens_per_s']:.0f} tokens/s, transformers (grouped_mm) "
        f"{speed['transformers_tokens_per_s']:.0f} tokens/s, ratio {speed['ratio']:.2f}x"
    )
    (out / "results.json").write_text(json.dumps({"rows": rows, "speed": speed,
                                                  "args": vars(args)}, indent=2))  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/hf_study", help="working folder (reused on rerun)")
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size")
    p.add_argument("--tokenizer-bytes", type=int, default=4_000_000, help="text to train it on")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-bytes", type=int, default=20_000_000, help="corpus cap (bytes)")
    p.add_argument("--pretrain-steps", type=int, default=400)
    p.add_argument("--finetune-steps", type=int, default=100)
    p.add_argument("--temporal", type=float, nargs="+", default=[0.03, 0.1, 0.3])
    p.add_argument("--anchor", type=float, default=0.1)
    p.add_argument("--biases", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--speed-only", action="store_true", help="only time the training step (needs a run)"
    )
    p.add_argument(
        "--base-only",
        action="store_true",
        help="stop after the pretrained export (<out>/pretrained) and print its sha256",
    )
    return p.parse_args()


if __name__ == "__main__":
    main()
