"""The ``moestack eval`` and ``moestack export`` verbs: a run (or a transformers model folder)
evaluated in memory or with its experts served from disk by the expert cache, and a
transformers model's run written back to a transformers folder. ``moestack.cli`` registers
them.

Both refuse a run of a transformers model whose source folder's config or tokenizer files
changed since it trained (``runs.load_run``), and weights holding NaN/inf, naming the tensors
(``--allow-nonfinite`` warns and goes on); ``eval`` refuses a non-finite validation loss.
Counts and the cache-aware bias are checked by the argument parser (``count_arg``,
``warmup_arg``, ``bias_arg``), naming the option. ``eval`` prints its metrics as JSON, then
(``--generate``) the generated text as text; ``--help`` says which text a model folder is
evaluated on (``model_folder_text``).

A run trained with its experts streamed (``offload_experts``; its checkpoints hold none)
is read from the expert store it trained with: ``export`` and ``eval`` read its experts
back (``runs.load_run``), ``eval --offload`` serves them from that store as it is (LoRA
adapters on them applied as training applied them, ``cache.streaming.evaluate_streamed``);
a store gone, or failing its checksums, is refused naming it.

``eval`` checks first and loads only what it uses: what the command line and the run's config
decide (``check_offload_config``) before the model is read, the model and its weights' checks
before any text, and of the corpus only the validation split
(``moestack.eval_corpus.validation_tokens``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moestack.config import CacheConfig, HFModelConfig, TrainConfig
from moestack.errors import MoestackError

log = logging.getLogger(__name__)

# export --dtype; the same as moestack.interop.hf_export.EXPORT_DTYPES (not imported here:
# it needs torch, and building the parser should not)
EXPORT_DTYPES = ("source", "float32", "bfloat16", "float16")


def cmd_eval(args: argparse.Namespace) -> dict:
    """Check first, then load only what is used: a refusal the run's config decides comes
    before its model is read, the model (and its weights' checks) before any text, and of
    the corpus only the validation split is read and tokenised."""
    from moestack.data import eval_batches
    from moestack.device import resolve_device
    from moestack.eval_corpus import validation_tokens
    from moestack.evaluation import (
        check_finite_loss,
        check_finite_weights,
        evaluate,
        greedy_generate,
        model_tensors,
    )
    from moestack.runs import load_run

    if args.offload:
        check_offload_config(args)
    # offloaded, the experts are never read into memory: the store serves them, written
    # from the checkpoint's (or the folder's) safetensors one layer at a time
    run = load_run(args.run_dir, args.checkpoint, experts=not args.offload)
    # NaN/inf weights are refused, naming them (the experts of an offloaded model as the
    # expert store is written); --allow-nonfinite warns and goes on
    check_finite_weights(model_tensors(run.model), _weights_name(run), allow=args.allow_nonfinite)
    cfg = run.cfg
    if args.max_bytes is not None:
        cfg.data.max_bytes = args.max_bytes
    device = resolve_device(args.device or cfg.device)
    codec = _text_codec(cfg.model) if args.generate else None  # the prompt refused early
    prompt = codec[0](args.prompt) if codec else []
    batches = eval_batches(
        validation_tokens(cfg), cfg.batch_size, cfg.data.seq_len, args.batches or cfg.eval_batches
    )
    if args.offload:
        metrics, new = _eval_offloaded(args, run, batches, device, prompt)
    else:
        run.model.to(device)
        metrics = evaluate(run.model, batches, device, progress=True)
        new = greedy_generate(run.model, prompt, args.generate, device) if codec else []
    check_finite_loss(metrics, _weights_name(run))
    result = {"checkpoint": str(run.checkpoint), **metrics}
    print(json.dumps(result, indent=2))
    if args.offload:
        from moestack.cache.offload import COUNTER_LEGEND

        log.info("%s", COUNTER_LEGEND)
    if codec:
        result["generation"] = _print_generation(codec[1], prompt, new)
    return result


def check_offload_config(args: argparse.Namespace) -> None:
    """Refuse what ``eval --offload`` cannot do from the command line and the run's config
    alone, before any weight or text is read: ``--policy belady`` (it needs the future), a
    cache smaller than one token's experts, and a run with LoRA adapters on its experts (an
    expert store holds the experts, not the adapters; ``cache.offload.check_servable`` says
    the same of a model already built). A folder whose config cannot be read is left to
    ``load_run``, which says why."""
    from moestack.lora import LORA_TRAINABLE
    from moestack.runs import is_transformers_dir, load_run_config

    try:
        if is_transformers_dir(args.run_dir):  # the default run's settings, no adapters
            cfg, top_k = TrainConfig(), HFModelConfig(path=str(args.run_dir)).resolve().moe.top_k
        else:
            cfg = load_run_config(args.run_dir)
            top_k = cfg.model.moe.top_k
    except MoestackError:  # not a run, or its source folder changed: load_run says which
        return
    cache_cfg = _cache_config(args, cfg.cache)
    if cache_cfg.policy == "belady":
        raise MoestackError("--policy belady needs the future: use `moestack simulate` on a trace")
    _check_capacity(cache_cfg, top_k)
    expert_adapters = cfg.trainable in LORA_TRAINABLE and cfg.lora.on_experts
    if cfg.offload_experts != "off":
        _check_streamed(args, cfg, expert_adapters)
    elif expert_adapters:
        raise MoestackError(
            f"{args.run_dir} trained LoRA adapters on its experts (trainable={cfg.trainable}, "
            f"lora.targets={cfg.lora.targets}), which an expert store does not hold: evaluate "
            "it without --offload, or merge them (moestack export RUN OUT, for a transformers "
            "model's run) and serve the merged model"
        )


def _check_streamed(args: argparse.Namespace, cfg: TrainConfig, expert_adapters: bool) -> None:
    """A run that streamed its experts is served from its own store (its checkpoints hold
    none): refuse ``--store-dir`` naming another, and the routing steering where the layers
    carry LoRA adapters on their experts (served as training served them, unsteered)."""
    from moestack.cache.streaming import store_path

    own = store_path(cfg, args.run_dir)
    if args.store_dir and Path(args.store_dir).resolve() != own.resolve():
        raise MoestackError(
            f"{args.run_dir} streamed its experts (offload_experts={cfg.offload_experts}) from "
            f"its own expert store {own}, which --offload serves: drop --store-dir {args.store_dir}"
        )
    if expert_adapters and (args.cache_aware_bias or args.reroute_tau):
        raise MoestackError(
            f"{args.run_dir} trained LoRA adapters on its streamed experts (lora.targets="
            f"{cfg.lora.targets}): --cache-aware-bias and --reroute-tau do not steer such "
            "layers; evaluate it without them, or export it merged (moestack export RUN OUT) "
            "and evaluate the export with them"
        )


def _print_generation(decode: Callable[[list[int]], str], prompt: list[int], new: list[int]) -> str:
    """Print the prompt and its continuation as text, on the lines after the metrics
    (decoded together, so a character split between them is whole); returns the text."""
    text = decode(prompt + new)
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(f"generated ({len(new)} tokens after --prompt):")
    print(text.encode(encoding, "replace").decode(encoding))  # what the terminal can show
    return text


def _weights_name(run: Any) -> str:
    """What the evaluated weights are, for messages: the checkpoint or the model folder."""
    kind = "model folder" if run.checkpoint == run.run_dir else "checkpoint"
    return f"{kind} {run.checkpoint}"


def _cache_config(args: argparse.Namespace, cfg: CacheConfig) -> CacheConfig:
    """The run's cache settings with the command line's on top."""
    changes: dict[str, Any] = {"prefetch": args.prefetch or cfg.prefetch}
    if args.policy:
        changes["policy"] = args.policy
    if args.capacity:
        changes.update(capacity=args.capacity, capacity_bytes=0)
    if args.capacity_bytes:
        changes.update(capacity=0, capacity_bytes=args.capacity_bytes)
    if args.warmup is not None:
        changes["warmup"] = args.warmup
    return dataclasses.replace(cfg, **changes)


def _eval_offloaded(
    args: argparse.Namespace, run: Any, batches: list, device: Any, prompt: list[int]
) -> tuple[dict, list[int]]:
    """The metrics, and the ids ``--generate`` appends to ``prompt`` (none without it);
    every expert weight lives only in the safetensors store and the cache: one written
    from the checkpoint (or folder), or the store a streamed run trained with (read as it
    is, each load checked against its checksum: its checkpoints hold no experts)."""
    from moestack.cache import evaluate_offloaded, generate_offloaded
    from moestack.cache.streaming import evaluate_streamed
    from moestack.device import move_resident
    from moestack.meta_load import resident_bytes
    from moestack.runs import open_run_store, run_store_checked

    cache_cfg = _cache_config(args, run.cfg.cache)  # checked by check_offload_config
    streamed = run.cfg.offload_experts != "off"
    store = open_run_store(run.cfg, run.run_dir) if streamed else _written_store(args, run)
    move_resident(run.model, device)  # released (or never read) experts stay meta
    steer = {"cache_aware_bias": args.cache_aware_bias, "reroute_tau": args.reroute_tau}
    new: list[int] = []
    checked = run_store_checked(run.cfg, run.run_dir) if streamed else contextlib.nullcontext()
    with store, checked:
        if any(moe.expert_adapters() is not None for moe in run.model.moe_layers):  # streamed
            result, new = evaluate_streamed(
                run.model, store, batches, device, cache_cfg, prompt, args.generate
            )
        else:
            result = evaluate_offloaded(run.model, store, batches, device, cache_cfg, **steer)
            if args.generate:
                new = generate_offloaded(
                    run.model, store, prompt, args.generate, device, cache_cfg, **steer
                )["tokens"]
    result["memory/model_bytes"] = resident_bytes(run.model)  # held by the model: no expert
    result["memory/experts_bytes"] = store.expert_bytes * store.num_experts * store.num_layers
    return _counts_as_int(result), new


def _written_store(args: argparse.Namespace, run: Any) -> Any:
    """The expert store ``eval --offload`` serves a run (or a model folder) from: at
    ``--store-dir``, the run's ``cache.store_dir`` or its default place, reused when it was
    written from these weights (``_weights_identity``), else written from the checkpoint's
    (or the folder's) safetensors one layer at a time."""
    from moestack.cache import open_or_write_store
    from moestack.cache.offload import check_servable
    from moestack.evaluation import finite_expert_layers

    for layer, moe in enumerate(run.model.moe_layers):
        check_servable(moe, layer)
    bare = run.checkpoint == run.run_dir  # a transformers model folder itself, not a run
    default_dir = run.run_dir.with_name(f"{run.run_dir.name}.experts") if bare else (
        run.run_dir / "experts")  # fmt: skip
    store_dir = args.store_dir or run.cfg.cache.store_dir or default_dir
    dtype = run.model.moe_layers[0].w1.dtype  # the store holds the experts as the model would
    if bare:  # the experts were not loaded: the store is read from the safetensors
        from moestack.interop.hf_experts import iter_hf_expert_layers

        layers = iter_hf_expert_layers(run.run_dir, dtype)
    else:
        from moestack.checkpoint import iter_expert_layers

        layers = iter_expert_layers(run.checkpoint, dtype, verify=False)  # load_run verified
    layers = finite_expert_layers(layers, _weights_name(run), allow=args.allow_nonfinite)
    source = _weights_identity(run, args.allow_nonfinite)
    return open_or_write_store(run.model, store_dir, run.cfg.model, source=source, layers=layers)


def _weights_identity(run: Any, allow_nonfinite: bool = False) -> str:
    """What the expert store was written from: the checkpoint (or folder) path and the
    identity of its weights (the checkpoint's sha256; a folder's weight files' names, sizes
    and modification times), so a store of older weights at the same path is rewritten;
    and whether its experts were checked finite as it was written (a store written under
    --allow-nonfinite, or before the check, is rewritten rather than served unchecked)."""
    where = str(Path(run.checkpoint).resolve())
    checked = "experts:nonfinite-allowed" if allow_nonfinite else "experts:finite"
    if run.checkpoint != run.run_dir:
        from moestack.checkpoint import model_sha256

        return f"{where} sha256:{model_sha256(run.checkpoint)} {checked}"
    files = sorted(Path(run.run_dir).glob("*.safetensors*")) + [Path(run.run_dir) / "config.json"]
    stamp = ",".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return f"{where} files:{stamp} {checked}"


def _prompt_bytes(text: str) -> bytes:
    """``text`` (``--prompt``) as UTF-8; bytes of the command line that were not UTF-8 (held
    as lone surrogates by Python) are given back as they were."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # surrogates that stand for no byte
        return text.encode("utf-8", "replace")


def _decode_bytes(ids: list[int]) -> str:
    """Byte tokens as text: UTF-8, a byte sequence that is not UTF-8 shown as U+FFFD (the
    separator and ids past a byte are skipped)."""
    return bytes(t for t in ids if 0 < t < 256).decode("utf-8", "replace")


Codec = tuple[Callable[[str], list[int]], Callable[[list[int]], str]]


def _text_codec(model_cfg: Any) -> Codec:
    """(encode, decode) between text and the model's tokens: bytes for moestack's own
    models, the folder's tokenizer for transformers models. The decoded text is valid
    Unicode (no lone surrogates), so it prints as text; a prompt that encodes to no token
    is refused."""
    if model_cfg.pretrained_path:
        from moestack.interop.hf_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_cfg.pretrained_path)

        def tokens(text: str) -> list[int]:
            valid = _prompt_bytes(text).decode("utf-8", "replace")
            return list(tokenizer(valid, add_special_tokens=False)["input_ids"])

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)
    else:

        def tokens(text: str) -> list[int]:
            return list(_prompt_bytes(text))

        decode = _decode_bytes

    def encode(text: str) -> list[int]:
        ids = tokens(text)
        if not ids:
            raise MoestackError(f"--prompt {text!r} encodes to no tokens; give a prompt with text")
        return ids

    return encode, decode


def cmd_export(args: argparse.Namespace) -> dict:
    from moestack.checkpoint import model_sha256
    from moestack.evaluation import check_finite_weights, model_tensors
    from moestack.interop.hf_export import export_hf
    from moestack.lora import merge_adapters
    from moestack.runs import load_run

    run = load_run(args.run_dir, args.checkpoint)
    if not run.cfg.model.is_transformers:
        raise MoestackError(
            f"{args.run_dir} trained moestack's own model; export writes runs of transformers "
            "models (model=hf model.path=DIR) back to the transformers format"
        )
    bare = run.checkpoint == run.run_dir  # a transformers model folder, not a run
    if args.adapter:
        from moestack.interop.hf_adapter import export_adapter

        check_finite_weights(model_tensors(run.model), _weights_name(run),
                             allow=args.allow_nonfinite)  # fmt: skip
        report = export_adapter(
            run.model, args.out_dir, source_dir=run.cfg.model.path, rank=run.cfg.lora.rank,
            alpha=run.cfg.lora.alpha_value, routers=run.cfg.trainable == "routers+lora",
            overwrite=args.overwrite, run_dir=run.run_dir,
            checkpoint=None if bare else run.checkpoint, dtype=args.dtype,
        )  # fmt: skip
        print(json.dumps(report, indent=2, default=str))
        return report
    merged = merge_adapters(run.model)  # the whole model: W + alpha / r * A @ B
    if merged:
        log.info("merged the LoRA adapters of %d weights into them", merged)
    report = export_hf(
        run.model, args.out_dir, source_dir=run.cfg.model.path, overwrite=args.overwrite,
        run_dir=run.run_dir, checkpoint=None if bare else run.checkpoint,
        checkpoint_sha256=None if bare else model_sha256(run.checkpoint),
        allow_nonfinite=args.allow_nonfinite, dtype=args.dtype,
    )  # fmt: skip
    print(json.dumps(report, indent=2, default=str))
    return report


_COUNTS = ("hits", "misses", "loads", "host_hits", "bytes_read", "requests", "capacity")
_COUNTS += ("prefetch_issued", "prefetch_hits", "prefetch_wasted")


def _check_capacity(cache_cfg: CacheConfig, top_k: int) -> None:
    """Refuse a cache smaller than one token's experts before any work is done."""
    if cache_cfg.capacity and cache_cfg.capacity < top_k:
        raise MoestackError(
            f"--capacity {cache_cfg.capacity} is below moe.top_k={top_k}: one token's experts "
            f"would not fit; use --capacity {top_k} or more"
        )


def _counts_as_int(result: dict[str, Any]) -> dict[str, Any]:
    """The cache's counters as integers (they arrive as floats)."""
    return {
        k: int(v) if k.removeprefix("cache/") in _COUNTS and isinstance(v, float) else v
        for k, v in result.items()
    }


def count_arg(text: str) -> int:
    """An argparse type: a whole number >= 0 (a count of batches, bytes, tokens, requests)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; give a number >= 0")
    return value


def _number_arg(text: str, ok: Callable[[float], bool], fix: str) -> float:
    """``text`` as a number that passes ``ok``, else an argparse error saying ``fix``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r}: {fix}")
    return value


def tau_arg(text: str) -> float:
    """An argparse type: a number in [0, 1] (the rerouting rule's tolerance)."""
    return _number_arg(text, lambda v: 0 <= v <= 1, "give a number in [0, 1], e.g. 0.25")


def bias_arg(text: str) -> float:
    """An argparse type: a finite number >= 0 (NaN or inf would poison every router score)."""
    return _number_arg(text, lambda v: math.isfinite(v) and v >= 0, "give a finite number >= 0")


def warmup_arg(text: str) -> int:
    """An argparse type: eval's cache warm-up, a count of requests per layer >= 0 (as the
    cache counts it; `moestack simulate --warmup` also takes a fraction of a trace)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a count of requests (500); fractions of a trace are for "
            "`moestack simulate`"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; give a count of requests >= 0")
    return value


def _allow_nonfinite(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="go on (with a warning) when weights hold NaN/inf (default: refuse, naming them)",
    )


def model_folder_text() -> str:
    """Which text ``moestack eval`` evaluates a transformers model folder on (the default
    run config that ``runs.load_run`` gives a folder), for ``eval --help``."""
    cfg = TrainConfig()
    data = cfg.data
    return (
        f"A run is evaluated on its own data config's validation split. A transformers model "
        f"folder DIR is evaluated on the default corpus, data.source={data.source}: the "
        f"validation split of the running Python's standard library (its .py files; a module "
        f"is held out when a hash of its path falls below data.val_fraction={data.val_fraction}"
        f"), tokenised by DIR's own tokenizer with its EOS between modules, in "
        f"{cfg.eval_batches} batches of {cfg.batch_size} windows of min({data.seq_len}, "
        f"max_position_embeddings) tokens evenly spaced over the split. Tokenised corpora are "
        f'cached on disk (docs/hf.md, "Token cache").'
    )


def eval_parser(verbs: Any) -> None:
    p = verbs.add_parser(
        "eval",
        help="validation loss and perplexity of a run's checkpoint or a model folder",
        description="Validation loss and perplexity, printed as JSON. " + model_folder_text(),
    )
    p.add_argument(
        "run_dir", help="a moestack-train run folder (its out_dir), or a transformers model folder"
    )
    p.add_argument("--checkpoint", help="a checkpoint folder (default: the run's newest)")
    p.add_argument(
        "--batches",
        type=count_arg,
        default=0,
        help="validation batches (default: the run's eval_batches; "
        f"{TrainConfig().eval_batches} for a model folder)",
    )
    p.add_argument(
        "--max-bytes",
        type=count_arg,
        default=None,
        help="read corpus text in whole documents until each split holds its share of this "
        "many bytes (validation: data.val_fraction of it; a split's last document is kept "
        "whole, so it may pass its share by one document); 0 = all (default: the run's "
        "data.max_bytes; all for a model folder)",
    )
    p.add_argument("--device", default="", help="cpu or cuda (default: the run's device)")
    _cache_options(p)
    _generation_options(p)
    _allow_nonfinite(p)
    p.set_defaults(func=cmd_eval)


def _cache_options(p: argparse.ArgumentParser) -> None:
    """eval's options of the expert cache (--offload and how it serves)."""
    p.add_argument(
        "--offload", action="store_true", help="serve experts from the store + cache (default: off)"
    )
    p.add_argument(
        "--policy",
        default="",
        help="lru, lfu, static, lru+static (default: the run's cache.policy)",
    )
    p.add_argument(
        "--capacity",
        type=count_arg,
        default=0,
        help="experts per layer, >= top_k (default: 2 x top_k)",
    )
    p.add_argument(
        "--capacity-bytes",
        type=count_arg,
        default=0,
        help="or a byte budget per layer (default: unset)",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="load predicted next-layer experts early (default: off)",
    )
    p.add_argument(
        "--warmup",
        type=warmup_arg,
        default=None,
        help="static policies: requests counted before pinning (default: the run's cache.warmup)",
    )
    p.add_argument(
        "--store-dir",
        default="",
        help="where --offload writes and reads the expert store (default: the run's "
        "cache.store_dir if set, else RUN_DIR/experts for a run; DIR.experts beside a model "
        "folder DIR); a run that streamed its experts (offload_experts) is served from the "
        "store it trained with, never another",
    )
    p.add_argument(
        "--cache-aware-bias",
        type=bias_arg,
        default=0.0,
        help="router bias toward resident experts (default: %(default)s, none)",
    )
    p.add_argument(
        "--reroute-tau",
        type=tau_arg,
        default=0.0,
        help="send a pick that is not resident to the best resident expert scoring at least "
        "(1 - tau) x the token's best (default: %(default)s, never)",
    )


def _generation_options(p: argparse.ArgumentParser) -> None:
    """eval's options of greedy generation after the metrics."""
    p.add_argument(
        "--generate",
        type=count_arg,
        metavar="N",
        default=0,
        help="also greedily generate N tokens (bytes for moestack's byte-level models) after "
        "--prompt, printed as text after the metrics (default: 0, none)",
    )
    p.add_argument(
        "--prompt", default="def ", help="the text --generate continues (default: %(default)r)"
    )


def export_parser(verbs: Any) -> None:
    p = verbs.add_parser("export", help="a run of a transformers model back to a model folder")
    p.add_argument("run_dir", help="a moestack-train run of model=hf model.path=DIR")
    p.add_argument("out_dir", help="the transformers model folder to write (must not exist)")
    p.add_argument(
        "--checkpoint", default=None, help="a checkpoint folder (default: the run's newest)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR if it is an earlier export, holding moestack_export.json "
        "(default: refuse an existing OUT_DIR)",
    )
    p.add_argument(
        "--adapter",
        action="store_true",
        help="write a trainable=lora run's adapters alone, as a peft adapter folder where the "
        "installed peft can hold them (default: the whole model, adapters merged in)",
    )
    p.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        default="source",
        help="the dtype of the written weights (and --adapter tensors); 'source': the one the "
        "source model folder's config.json declares, float32 if none (default: %(default)s)",
    )
    _allow_nonfinite(p)
    p.set_defaults(func=cmd_export)
