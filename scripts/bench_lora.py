"""LoRA fine-tuning of a transformers MoE model against full and router-only fine-tuning.

A random Qwen3-MoE-architecture folder is built offline (``--d-model``, ``--layers``,
``--experts``, ``--top-k``, ``--d-ff``; fp32 safetensors from a transformers Qwen3MoeConfig,
and a byte-level BPE tokenizer of ``--vocab`` tokens trained on the default corpus, Python's
stdlib). moestack then fine-tunes it (``moestack.trainer.train``, ``model.path=DIR``, the
stdlib corpus capped at ``--max-bytes``, torch AdamW, the same lr, batches and seed) for the
same ``--steps`` in three contenders, one after another in this process, and all of it
``--repeats`` times over (the contenders interleaved: all, routers, lora, all, ...):

- ``all``: every weight trains (full fine-tune);
- ``routers``: the MoE routers only (``trainable=routers``);
- ``lora``: low-rank adapters of rank ``--rank`` on the experts and the attention
  projections (``trainable=lora``, ``lora.targets=both``), the base model frozen.

Per contender: the parameters that train and the AdamW state bytes, both counted from the
optimizer state the run checkpointed at its last step (torch AdamW: two fp32 moments per
trained element and a 4-byte step per trained tensor); the step time, from the run's
metrics.jsonl (``log_every=1``: each record's ``perf/tokens_per_s`` is one step's tokens over
the seconds ``train_step`` took, evaluation and checkpoints apart), median and range over the
steps after ``--warmup``; the train loss of the last step and the final validation loss.
Ratios are to the full fine-tune (parameters, state, step time) and to router-only (step
time), each repeat's from its own figures. Over the repeats the table and the JSON give the
median and the range (min-max) of each repeat's figure: its median step, its ratios (the
JSON row of a contender: ``X`` the median, ``X_range`` the range, ``repeats`` each repeat's
row). The counts are also worked from the shapes (``full_params``, ``router_params``,
``lora_params``: the projection's formulas) and checked against the counted ones.

The runs follow one another, so a neighbour that changes pace on shared cores moves one
contender's step times and not another's. So the step is also timed interleaved
(``--rounds``): the three runs are built as the trainer builds them (``build_run``) and
``train_step`` is called on each in turn, round after round; the first round is left out.
Besides the medians, the ratios of each contender's fastest step ("best": the step least
slowed by other jobs, as bench_optim.py keeps each variant's best round) are given.

Last, a projection for Qwen3-30B-A3B worked from its shapes (no model is built): trainable
parameters and AdamW state of a full fine-tune and of LoRA rank ``--rank`` on experts +
attention, and the bf16 weights' bytes. Step times are not projected.

    python scripts/bench_lora.py [--steps 30 --rank 16 --threads 2 --repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moestack import bench

CONTENDERS = ("all", "routers", "lora")
# --moestack-model's contenders: (name, trainable, lora.base_dtype); lora_bf16base holds the
# frozen weights in bf16 (issue 34: "may be held in bf16"), the adapters in fp32
DEVICE_CONTENDERS = (
    ("all", "all", "float32"),
    ("routers", "routers", "float32"),
    ("lora", "lora", "float32"),
    ("lora_bf16base", "lora", "bfloat16"),
)
EOS, PAD = "<|endoftext|>", "<pad>"
ADAMW_STEP_BYTES = 4  # torch AdamW's per-tensor step counter: a float32 scalar
MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32, per trained element


@dataclass(frozen=True)
class Shapes:
    """The sizes of a Qwen3-MoE-architecture model that set its parameter counts."""

    d_model: int
    layers: int
    experts: int
    top_k: int
    d_ff: int  # each routed expert's width (moe_intermediate_size)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def attention_linears(self) -> list[tuple[int, int]]:
        """(in, out) of q, k, v and o projections (no biases in Qwen3-MoE)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.d_model, q), (self.d_model, kv), (self.d_model, kv), (q, self.d_model)]


QWEN3_30B_A3B = Shapes(
    d_model=2048, layers=48, experts=128, top_k=8, d_ff=768,
    heads=32, kv_heads=4, head_dim=128, vocab=151936,
)  # fmt: skip


def full_params(s: Shapes) -> tuple[int, int]:
    """(parameters, tensors) of the whole model as moestack trains it (untied embeddings;
    the experts stacked per layer as w1 [E, D, 2F] and w2 [E, F, D])."""
    attention = sum(i * o for i, o in s.attention_linears()) + 2 * s.head_dim  # + q/k norms
    experts = s.experts * (s.d_model * 2 * s.d_ff + s.d_ff * s.d_model)
    router = s.experts * s.d_model
    norms = 2 * s.d_model
    per_layer = attention + experts + router + norms
    params = s.layers * per_layer + 2 * s.vocab * s.d_model + s.d_model  # + final norm
    tensors = s.layers * (4 + 2 + 2 + 1 + 2) + 3  # q,k,v,o, q/k norm, w1/w2, router, 2 norms
    return params, tensors


def lora_params(s: Shapes, rank: int) -> tuple[int, int]:
    """(parameters, tensors) of LoRA rank ``rank`` on the experts and the attention: per
    layer A [E, D, r] + B [E, r, 2F] on w1, A [E, F, r] + B [E, r, D] on w2, and
    A [r, in] + B [out, r] on each of q/k/v/o."""
    experts = s.experts * rank * (s.d_model + 2 * s.d_ff + s.d_ff + s.d_model)
    attention = sum(rank * (i + o) for i, o in s.attention_linears())
    return s.layers * (experts + attention), s.layers * (4 + 2 * len(s.attention_linears()))


def router_params(s: Shapes) -> tuple[int, int]:
    return s.layers * s.experts * s.d_model, s.layers


def adamw_state_bytes(params: int, tensors: int) -> int:
    return MOMENT_BYTES * params + ADAMW_STEP_BYTES * tensors


def projection(s: Shapes, rank: int) -> dict[str, Any]:
    """Trainable parameters and AdamW state of full / router-only / LoRA fine-tuning of
    ``s``, and its weights in bf16: worked from the shapes."""
    out: dict[str, Any] = {"shapes": vars(s), "rank": rank}
    total, _ = full_params(s)
    out["weights_bf16_bytes"] = 2 * total
    worked = {"all": full_params(s), "routers": router_params(s), "lora": lora_params(s, rank)}
    for name, (params, tensors) in worked.items():
        out[name] = {
            "trainable_params": params,
            "trained_tensors": tensors,
            "adamw_state_bytes": adamw_state_bytes(params, tensors),
            "params_vs_all": params / total,
        }
    out["lora"]["adapter_fp32_bytes"] = 4 * out["lora"]["trainable_params"]
    out["note"] = "worked from the shapes; step times are not projected"
    return out


# --------------------------------------------------------------------------- the model folder
def shapes_of(args: argparse.Namespace, vocab: int) -> Shapes:
    return Shapes(
        d_model=args.d_model, layers=args.layers, experts=args.experts, top_k=args.top_k,
        d_ff=args.d_ff, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.d_model // args.heads, vocab=vocab,
    )  # fmt: skip


def write_tokenizer(folder: Path, vocab: int, max_bytes: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab`` tokens (EOS, pad) trained on the training
    split of the default corpus, saved into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moestack.config import DataConfig
    from moestack.data import load_corpus

    corpus = load_corpus(DataConfig(max_bytes=max_bytes))
    text = bytes(corpus.train).decode("utf-8", "replace").split("\0")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    fast.save_pretrained(folder)
    return fast


def write_folder(root: Path, args: argparse.Namespace) -> tuple[Path, Shapes]:
    """A random Qwen3-MoE folder (config.json, model.safetensors, tokenizer): weights
    N(0, 0.02) from a seeded generator (the routers too: transformers may leave them at
    zero, where every token would tie), norms at one."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    folder = root / "model"
    tok = write_tokenizer(folder, args.vocab, args.max_bytes)
    shapes = shapes_of(args, len(tok))
    config = Qwen3MoeConfig(
        vocab_size=shapes.vocab, hidden_size=shapes.d_model, num_hidden_layers=shapes.layers,
        num_attention_heads=shapes.heads, num_key_value_heads=shapes.kv_heads,
        head_dim=shapes.head_dim, intermediate_size=4 * shapes.d_model,
        moe_intermediate_size=shapes.d_ff, num_experts=shapes.experts,
        num_experts_per_tok=shapes.top_k, norm_topk_prob=True, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False, output_router_logits=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(folder)
    return folder, shapes


# --------------------------------------------------------------------------- one contender
def run_config(folder: Path, out_dir: Path, trainable: str, args: argparse.Namespace) -> Any:
    from moestack.config import (
        DataConfig,
        HFModelConfig,
        LoRAConfig,
        OptimConfig,
        TelemetryConfig,
        TrainConfig,
    )

    return TrainConfig(
        model=HFModelConfig(path=str(folder), moe={"impl": args.impl}),
        trainable=trainable,
        lora=LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets="both"),
        optim=OptimConfig(name="adamw", lr=args.lr, warmup_steps=min(3, args.steps),
                          weight_decay=0.0),  # fmt: skip
        data=DataConfig(seq_len=args.seq_len, max_bytes=args.max_bytes),
        telemetry=TelemetryConfig(enabled=False),
        steps=args.steps, batch_size=args.batch_size, eval_every=0,
        eval_batches=args.eval_batches, log_every=1, ckpt_every=0, keep_last=1,
        progress=False, wandb_mode="disabled", threads=args.threads, seed=0,
        out_dir=str(out_dir),
    )  # fmt: skip


def optimizer_state(run_dir: Path) -> dict[str, int]:
    """Trained parameters, tensors and AdamW state bytes, counted from the optimizer state
    the run checkpointed at its last step (every tensor of every trained parameter's entry:
    exp_avg, exp_avg_sq, step)."""
    from moestack import checkpoint

    last = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    state = checkpoint.load_train_state(last)["optimizer"]["state"]
    params = tensors = nbytes = 0
    for entry in state.values():
        params += entry["exp_avg"].numel()
        tensors += 1
        nbytes += sum(t.numel() * t.element_size() for t in entry.values() if torch.is_tensor(t))
    return {"trainable_params": params, "trained_tensors": tensors, "adamw_state_bytes": nbytes}


def step_times(run_dir: Path, tokens_per_step: int, warmup: int) -> list[float]:
    """Seconds of each step after ``warmup`` (metrics.jsonl at log_every=1:
    tokens_per_step / perf/tokens_per_s is the time ``train_step`` took)."""
    from moestack.metrics import read_metrics

    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "perf/tokens_per_s" in r]
    return [tokens_per_step / r["perf/tokens_per_s"] for r in records if r["step"] > warmup]


def run_contender(trainable: str, folder: Path, root: Path, args: argparse.Namespace) -> dict:
    from moestack.metrics import read_metrics
    from moestack.trainer import train

    out_dir = root / f"run_{trainable}"
    cfg = run_config(folder, out_dir, trainable, args)
    started = time.perf_counter()
    summary = train(cfg, out_dir)
    wall = time.perf_counter() - started
    times = step_times(out_dir, args.batch_size * args.seq_len, args.warmup)
    train_losses = [r["loss/train"] for r in read_metrics(out_dir / "metrics.jsonl")
                    if "loss/train" in r]  # fmt: skip
    row = {
        "contender": trainable,
        **optimizer_state(out_dir),
        "model_params": summary["params/total"],
        **{f"step_s_{k}": v for k, v in bench.spread(times).items()},
        "timed_steps": len(times),
        "step_s": times,
        "loss_train_first": train_losses[0],
        "loss_train_final": train_losses[-1],
        "loss_val_final": summary["loss/val"],
        "run_wall_s": wall,
    }
    shutil.rmtree(out_dir, ignore_errors=True)
    return row


def interleaved_step_times(folder: Path, root: Path, args: argparse.Namespace) -> dict:
    """Seconds of ``Trainer.train_step`` of each contender's run, called on the three in
    turn for ``args.rounds`` rounds after one warm-up round (a load that drifts slows all
    three alike)."""
    from moestack import distributed
    from moestack.trainer import build_run

    runs = {}
    for trainable in CONTENDERS:
        cfg = run_config(folder, root / f"steps_{trainable}", trainable, args).resolve()
        runs[trainable] = build_run(cfg, Path(cfg.out_dir), distributed.DistInfo())
    steps = {trainable: run.train_step for trainable, run in runs.items()}
    times = bench.interleave(steps, args.rounds, warmup=1, rotate=False)
    for trainable, run in runs.items():
        run.writer.close()
        shutil.rmtree(root / f"steps_{trainable}", ignore_errors=True)
    return times


def add_ratios(rows: list[dict]) -> None:
    full = next(r for r in rows if r["contender"] == "all")
    routers = next(r for r in rows if r["contender"] == "routers")
    for r in rows:
        r["params_vs_all"] = r["trainable_params"] / full["trainable_params"]
        r["state_vs_all"] = r["adamw_state_bytes"] / full["adamw_state_bytes"]
        for step in ("step", "interleaved_step"):
            if f"{step}_s_median" in r:
                r[f"{step}_vs_all"] = r[f"{step}_s_median"] / full[f"{step}_s_median"]
                r[f"{step}_vs_routers"] = r[f"{step}_s_median"] / routers[f"{step}_s_median"]
                r[f"{step}_best_vs_all"] = r[f"{step}_s_min"] / full[f"{step}_s_min"]
                r[f"{step}_best_vs_routers"] = r[f"{step}_s_min"] / routers[f"{step}_s_min"]


# --------------------------------------------------------------------------- the repeats
# Each repeat's figures that the repeats give a median and a range of.
TIMED = tuple(
    f"{step}{what}"
    for step in ("step", "interleaved_step")
    for what in ("_s_median", "_vs_all", "_vs_routers", "_best_vs_all", "_best_vs_routers")
)
SAME_EVERY_REPEAT = ("trainable_params", "trained_tensors", "adamw_state_bytes", "model_params",
                     "params_vs_all", "state_vs_all")  # fmt: skip


def run_repeats(folder: Path, root: Path, args: argparse.Namespace) -> list[list[dict]]:
    """``args.repeats`` rounds of the three contenders' runs (and their interleaved step
    timing), each round's rows with its own ratios: one list of rows per repeat."""
    repeats = []
    for _ in range(args.repeats):
        rows = [run_contender(c, folder, root, args) for c in CONTENDERS]
        if args.rounds:
            times = interleaved_step_times(folder, root, args)
            for r in rows:
                steps = r["interleaved_step_s"] = times[r["contender"]]
                r.update({f"interleaved_step_s_{k}": v for k, v in bench.spread(steps).items()})
        add_ratios(rows)
        repeats.append(rows)
    return repeats


def combine_repeats(repeats: list[list[dict]]) -> list[dict]:
    """One row per contender: the counts (which every repeat must give alike), the median
    of each ``TIMED`` figure and of the losses over the repeats with its range
    (``X_range``: [min, max]), every timed step of every repeat (``step_s``, its fastest and
    slowest step ``step_s_min``/``step_s_max``) and the repeats' own rows (``repeats``)."""
    rows = []
    for i, contender in enumerate(CONTENDERS):
        runs = [rows_of[i] for rows_of in repeats]
        row: dict[str, Any] = {"contender": contender, "n_repeats": len(runs)}
        for key in SAME_EVERY_REPEAT:
            values = {r[key] for r in runs}
            if len(values) != 1:
                raise RuntimeError(f"{contender}: {key} differs between repeats: {values}")
            row[key] = values.pop()
        for key in (*TIMED, "loss_train_first", "loss_train_final", "loss_val_final"):
            if key in runs[0]:
                values = [r[key] for r in runs]
                row[key] = statistics.median(values)
                row[f"{key}_range"] = [min(values), max(values)]
        row["step_s"] = [t for r in runs for t in r["step_s"]]
        row["timed_steps"] = len(row["step_s"])
        row["step_s_min"], row["step_s_max"] = min(row["step_s"]), max(row["step_s"])
        if "interleaved_step_s" in runs[0]:
            row["interleaved_step_s"] = [t for r in runs for t in r["interleaved_step_s"]]
        row["repeats"] = runs
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- output
def median_range(row: dict, key: str, scale: float = 1.0, fmt: str = ".2f") -> str:
    """``row[key]`` (a median over the repeats) and its range, as "m (lo-hi)"."""
    lo, hi = row[f"{key}_range"]
    return bench.median_range(scale * row[key], scale * lo, scale * hi, fmt)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, {args.threads} "
        f"thread(s), {args.repeats} repeat(s); step times from metrics.jsonl after "
        f"{args.warmup} warm-up steps: median (range) over the repeats of each repeat's "
        "median step, and of its ratios"
    )
    head = ("contender", "params", "x all", "AdamW MiB", "x all", "step ms (range)",
            "x all (range)", "x routers (range)", "loss train", "loss val")  # fmt: skip
    cells = [
        (r["contender"], f"{r['trainable_params']:,}", f"{r['params_vs_all']:.4f}",
         f"{r['adamw_state_bytes'] / 2**20:.2f}", f"{r['state_vs_all']:.4f}",
         median_range(r, "step_s_median", 1e3, ".0f"), median_range(r, "step_vs_all"),
         median_range(r, "step_vs_routers"), f"{r['loss_train_final']:.3f}",
         f"{r['loss_val_final']:.3f}")
        for r in rows
    ]  # fmt: skip
    print(bench.table(head, cells, "<9 >11 >8 >10 >8 >17 >17 >17 >10 >9"))
    if "interleaved_step_s_median" not in rows[0]:
        return
    print(f"\ntrain_step timed interleaved, {args.rounds} rounds after 1 warm-up round, "
          f"median (range) over the {args.repeats} repeat(s):")  # fmt: skip
    head = ("contender", "step ms (range)", "x all", "x routers", "best x all", "best x routers")
    ratios = ("vs_all", "vs_routers", "best_vs_all", "best_vs_routers")
    cells = [
        (r["contender"], median_range(r, "interleaved_step_s_median", 1e3, ".0f"),
         *(median_range(r, f"interleaved_step_{k}") for k in ratios))
        for r in rows
    ]  # fmt: skip
    print(bench.table(head, cells, "<9" + " >17" * 5))
    print("best = each contender's fastest step of a repeat (the one least slowed by other jobs)")


def print_projection(p: dict[str, Any]) -> None:
    gib = 2**30
    print(f"\nprojection, Qwen3-30B-A3B (worked from the shapes; {p['note'].split('; ')[1]}):")
    print(f"  weights in bf16: {p['weights_bf16_bytes']:,} B = {p['weights_bf16_bytes'] / gib:.1f}"
          " GiB")  # fmt: skip
    for name in ("all", "routers", "lora"):
        q = p[name]
        label = {"all": "full fine-tune", "routers": "router-only",
                 "lora": f"LoRA r={p['rank']} (experts+attention)"}[name]  # fmt: skip
        print(f"  {label:<34} {q['trainable_params']:>15,} params ({q['params_vs_all']:.4%}), "
              f"AdamW state {q['adamw_state_bytes']:>17,} B = "
              f"{q['adamw_state_bytes'] / gib:.2f} GiB")  # fmt: skip


def device_rows(root: Path, args: argparse.Namespace) -> list[dict]:
    """``--moestack-model NAME``: moestack's own model (configs/model/NAME.yaml, e.g. the 137M
    model on a GPU, issue 34's device targets) fine-tuned by each contender with torch AdamW
    on ``--device``: median step time (synchronised, after ``--warmup`` steps) and, on CUDA,
    peak device memory (``torch.cuda.max_memory_allocated`` from the run's build to its last
    step); on the CPU the bytes of weights, gradients and AdamW state, counted."""
    from moestack import distributed
    from moestack.trainer import build_run

    cuda = args.device == "cuda"
    rows = []
    for name, trainable, base_dtype in DEVICE_CONTENDERS:
        out = root / f"device_{name}"
        cfg = device_config(args, trainable, base_dtype, out)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        run = build_run(cfg, out, distributed.DistInfo())
        times = bench.times(run.train_step, args.device, args.warmup, args.steps - args.warmup)
        params = list(run.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        counted = sum(t.numel() * t.element_size() for t in [*params, *grads])
        trained = [p for p in params if p.requires_grad]
        counted += MOMENT_BYTES * sum(p.numel() for p in trained) + ADAMW_STEP_BYTES * len(trained)
        rows.append({
            "contender": name,
            "trainable_params": sum(p.numel() for p in trained),
            **{f"step_s_{k}": v for k, v in bench.spread(times).items()},
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "weights_grads_state_bytes": counted,
        })  # fmt: skip
        run.writer.close()
        del run
        shutil.rmtree(out, ignore_errors=True)
    by = {r["contender"]: r for r in rows}
    memory = "peak_device_bytes" if cuda else "weights_grads_state_bytes"
    for r in rows:
        r["memory_x_full"] = r[memory] / by["all"][memory]
        r["step_x_full"] = r["step_s_median"] / by["all"]["step_s_median"]
        r["step_x_routers"] = r["step_s_median"] / by["routers"]["step_s_median"]
    return rows


def device_config(args: argparse.Namespace, trainable: str, base_dtype: str, out: Path) -> Any:
    """The --moestack-model run of one contender, as moestack-train composes it."""
    from moestack.prereg.compose import compose_config

    return compose_config([
        f"model={args.moestack_model}", f"trainable={trainable}", f"lora.rank={args.rank}",
        f"lora.base_dtype={base_dtype}",
        f"lora.alpha={2.0 * args.rank}", "lora.targets=both", "optim=adamw",
        f"optim.lr={args.lr}", f"device={args.device}", f"batch_size={args.batch_size}",
        f"data.seq_len={args.seq_len}", f"data.max_bytes={args.max_bytes}", "telemetry=off",
        f"steps={args.steps}", "eval_every=0", "eval_batches=1", "ckpt_every=0",
        "progress=false", "wandb_mode=disabled", f"threads={args.threads}", f"out_dir={out}",
    ]).resolve()  # fmt: skip


def print_device_rows(rows: list[dict], args: argparse.Namespace) -> None:
    memory = "peak device" if args.device == "cuda" else "weights+grads+state"
    print(f"model={args.moestack_model} on {args.device}, {args.batch_size} x {args.seq_len} "
          f"tokens a step, torch AdamW; LoRA rank {args.rank} on experts + attention")  # fmt: skip
    print(f"{'contender':<13} {'trained':>12} {'step ms':>18} {memory + ' MiB':>22} "
          f"{'mem x full':>10} {'step x full':>11} {'step x routers':>14}")  # fmt: skip
    for r in rows:
        mem = r["peak_device_bytes"] or r["weights_grads_state_bytes"]
        step = f"{1e3 * r['step_s_median']:.1f} ({1e3 * r['step_s_min']:.1f}-{1e3 * r['step_s_max']:.1f})"
        print(f"{r['contender']:<13} {r['trainable_params']:>12,} {step:>18} {mem / 2**20:>22.1f} "
              f"{r['memory_x_full']:>10.3f} {r['step_x_full']:>11.3f} {r['step_x_routers']:>14.3f}")  # fmt: skip
    if args.device == "cuda":  # issue 34's targets on the H200
        for r in rows:
            if r["contender"].startswith("lora"):
                print(f"target ({r['contender']}): peak memory <= 0.5x full: "
                      f"{r['memory_x_full']:.3f}; step <= 1.3x router-only: "
                      f"{r['step_x_routers']:.3f}")  # fmt: skip


def parse_args() -> argparse.Namespace:
    """The command line, checked."""
    ap = bench.parser(__doc__, steps=30, warmup=3, rounds=8, repeats=3, threads=2, json="",
                      device="cpu")  # fmt: skip
    for flag, default in (("--d-model", 256), ("--layers", 4), ("--experts", 16), ("--top-k", 4),
                          ("--kv-heads", 2), ("--batch-size", 8), ("--seq-len", 128),
                          ("--eval-batches", 4)):  # fmt: skip
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--d-ff", type=int, default=128, help="each expert's width")
    ap.add_argument("--heads", type=int, default=4, help="query heads (head_dim = d_model/heads)")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE tokenizer size")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr of every contender")
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus cap (bytes)")
    ap.add_argument("--impl", default="torch", help="moe.impl of the fine-tunes")
    ap.add_argument("--dir", default="", help="scratch directory (default: a temp dir)")
    ap.add_argument("--verbose", action="store_true", help="show the trainer's log")
    ap.add_argument(
        "--moestack-model",
        default="",
        help="instead: moestack's own model of this "
        "config group (m137: issue 34's GPU targets), step time and memory only",
    )
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    if args.warmup >= args.steps:
        ap.error(f"--warmup={args.warmup} leaves no timed step of --steps={args.steps}")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="bench_lora.", dir=args.dir or None))
    os.environ.setdefault("MOESTACK_DATA_CACHE", str(root / "tokens"))  # no user cache writes
    torch.set_num_threads(args.threads)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    machine = f"{bench.cpu_model()}, {os.cpu_count()} cores, {gpu}"  # for the record
    results: dict[str, Any] = {"torch": torch.__version__, "machine": machine,
                               "date": time.strftime("%Y-%m-%d"), "args": vars(args)}  # fmt: skip
    if args.moestack_model:
        try:
            rows = device_rows(root, args)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results.update(rows=rows, mode="moestack-model")
        print_device_rows(rows, args)
        if args.json:
            bench.write_json(args.json, results, device=args.device)
        return
    try:
        folder, shapes = write_folder(root, args)
        rows = combine_repeats(run_repeats(folder, root, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    worked = {"all": full_params(shapes), "routers": router_params(shapes),
              "lora": lora_params(shapes, args.rank)}  # fmt: skip
    matches = {r["contender"]: (r["trainable_params"], r["trained_tensors"])
               == worked[r["contender"]] for r in rows}  # fmt: skip
    results.update(
        shapes=vars(shapes), rows=rows,
        worked_from_shapes={k: {"trainable_params": p, "trained_tensors": t}
                            for k, (p, t) in worked.items()},
        counts_match_shapes=matches,
        step_time_source="metrics.jsonl perf/tokens_per_s at log_every=1 (train_step only); "
        "interleaved: perf_counter around trainer.train_step, the three runs in turn; "
        f"median and range over {args.repeats} repeat(s) of the three runs",
        projection=projection(QWEN3_30B_A3B, args.rank),
    )  # fmt: skip
    print(f"torch {torch.__version__}; {results['machine']}")
    print(f"model: {vars(shapes)}, {rows[0]['model_params']:,} parameters")
    print_table(rows, args)
    for name, ok in matches.items():  # the projection's formulas, checked on this model
        print(f"{name}: parameters and tensors worked from the shapes "
              f"{'match' if ok else 'DIFFER FROM'} the counted ones {worked[name]}")  # fmt: skip
    print_projection(results["projection"])
    if args.json:
        bench.write_json(args.json, results)


if __name__ == "__main__":
    main()
