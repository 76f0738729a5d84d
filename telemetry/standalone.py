"""Telemetry on its own: run a transformers MoE model over a text file, write trace + report.

``run_telemetry(model, text_path, out_dir)`` takes a local model directory (loaded with
``from_pretrained(local_files_only=True)``; a directory with only config.json gives a random
model), a config JSON file (random model), a transformers model type with tiny sizes
(``"mixtral"``, ``"qwen2_moe"``, ``"qwen3_moe"``, ``"olmoe"``, ``"deepseek_v3"``, ``"gpt_oss"``),
or an ``nn.Module`` (a moestack ``MoETransformer`` included). Text becomes tokens with the
model directory's tokenizer when there is one, else bytes modulo the vocabulary size.

It writes into ``out_dir``: ``trace/`` (the RoutingTrace), ``metrics.jsonl`` (one row per
batch: loss, perplexity and the telemetry interval metrics), ``summary.json`` and the
``report/`` of ``render_report``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moestack.telemetry.hooks import attach
from moestack.telemetry.report import render_report

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
TINY_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def tiny_config_kwargs(model_type: str, **overrides: Any) -> dict[str, Any]:
    """Config keyword arguments of a tiny, CPU-sized model of a transformers MoE family."""
    kw: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    family: dict[str, dict[str, Any]] = {
        "mixtral": dict(num_local_experts=8),
        "qwen2_moe": dict(
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            norm_topk_prob=False,
        ),
        "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True),
        "olmoe": dict(num_experts=8),
        "deepseek_v3": dict(
            n_routed_experts=8,
            moe_intermediate_size=32,
            n_shared_experts=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            v_head_dim=8,
            qk_nope_head_dim=8,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            num_key_value_heads=4,
            rope_scaling=None,
        ),
        "gpt_oss": dict(
            num_local_experts=8,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=16,
        ),
    }
    if model_type not in family:
        raise ValueError(
            f"no tiny config for model type {model_type!r}; use one of {TINY_FAMILIES}"
        )
    kw.update(family[model_type])
    kw.update(overrides)
    return kw


def _transformers() -> Any:
    """The transformers package, or an ImportError naming the extra that installs it."""
    try:
        import transformers
    except ModuleNotFoundError as err:
        if err.name != "transformers":
            raise
        raise ModuleNotFoundError(
            "transformers is not installed; install moestack's hf extra: "
            "pip install 'moestack[hf]'",
            name="transformers",
        ) from None
    return transformers


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random tiny transformers MoE causal LM (offline, CPU-sized)."""
    transformers = _transformers()
    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, **overrides))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def load_model(
    model: str | os.PathLike[str] | nn.Module, seed: int = 0
) -> tuple[nn.Module, Any | None]:
    """(model, tokenizer or None) from a model dir, config JSON, tiny model type or module."""
    if isinstance(model, nn.Module):
        return model, None
    path = Path(model)
    if not path.exists() and str(model) not in TINY_FAMILIES:
        raise ValueError(
            f"model={str(model)!r} is not a model directory, a config .json file or one of "
            f"{TINY_FAMILIES}"
        )
    transformers = _transformers()
    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM
    AutoTokenizer = transformers.AutoTokenizer

    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json; not a transformers model directory")
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        if has_weights:
            loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        else:
            log.warning("%s has no weights: building a random model from its config.json", path)
            torch.manual_seed(seed)
            loaded = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path, local_files_only=True)
            )
        tokenizer = None
        if any((path / name).is_file() for name in _TOKENIZER_FILES):
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as err:  # unreadable tokenizer files: fall back to bytes
                log.warning("tokenizer in %s unusable (%s); using bytes", path, err)
        else:
            log.info("no tokenizer files in %s; using bytes modulo the vocabulary", path)
        return loaded, tokenizer
    if path.suffix == ".json" and path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a JSON config ({err})") from err
        if "model_type" not in data:
            raise ValueError(f"{path}: the config has no 'model_type' (e.g. \"mixtral\")")
        torch.manual_seed(seed)
        config = AutoConfig.for_model(**data)
        return AutoModelForCausalLM.from_config(config), None
    if str(model) in TINY_FAMILIES:
        return tiny_model(str(model), seed), None
    raise ValueError(
        f"model={str(model)!r} is not a model directory, a config .json file or one of "
        f"{TINY_FAMILIES}"
    )


def _vocab_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        return int(cfg.vocab_size)
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        return int(cfg.vocab_size)
    raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}")


def _read_tokens(
    text_path: str | os.PathLike[str], tokenizer: Any | None, vocab: int
) -> np.ndarray:
    """Token ids int64 of a text file: the tokenizer's, else bytes modulo ``vocab``."""
    text = Path(text_path).read_bytes()
    if tokenizer is not None:
        ids = np.asarray(tokenizer(text.decode("utf-8", errors="replace"))["input_ids"], np.int64)
    else:
        ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64) % vocab
    if ids.size == 0 and text:
        log.warning("the tokenizer gave no tokens for %s; using bytes instead", text_path)
        ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64) % vocab
    return ids


def _next_token_loss(
    net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, is_moestack: bool
) -> float:
    """Mean next-token cross-entropy of one batch (no gradients)."""
    with torch.no_grad():
        if is_moestack:
            loss = net(inputs, targets=targets).ce_loss
        else:
            logits = net(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )
    return float(loss)


def _route(
    net: nn.Module,
    tel: Any,
    blocks: torch.Tensor,
    metrics_path: Path,
    batch_size: int,
    device: str,
    progress: bool,
) -> dict[str, float]:
    """Run every batch of ``blocks`` through ``net``, one metrics.jsonl row per batch (its
    loss, perplexity, tokens routed so far, the telemetry interval); returns the loss and
    perplexity over the whole text."""
    from tqdm.auto import tqdm

    is_moestack = hasattr(net, "moe_layers")
    seen, loss_sum = 0, 0.0
    starts = range(0, blocks.shape[0], batch_size)
    with metrics_path.open("w", encoding="utf-8") as metrics_file:
        for step, start in enumerate(
            tqdm(starts, desc="telemetry", unit="batch", disable=not progress)
        ):
            batch = blocks[start : start + batch_size].to(device)
            inputs = batch[:, :-1]
            seen += int(inputs.numel())
            row: dict[str, Any] = {"step": step, "tokens": int(inputs.numel()), "tokens_seen": seen}
            row["loss"] = _next_token_loss(net, inputs, batch[:, 1:], is_moestack)
            row["perplexity"] = math.exp(min(row["loss"], 50.0))
            loss_sum += row["loss"] * inputs.numel()
            row.update(tel.interval_metrics(step=step))
            metrics_file.write(json.dumps(row) + "\n")
    loss = loss_sum / max(seen, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def hit_rates(summary: dict[str, Any]) -> dict[tuple[str, int], float]:
    """{(policy, capacity): hit rate over the whole run} from a telemetry summary."""
    found = {}
    for key, value in (summary.get("metrics") or {}).items():
        parts = key.split("/")
        if len(parts) == 4 and parts[3] == "hit_rate" and parts[2].startswith("cap"):
            found[(parts[1], int(parts[2][3:]))] = float(value)
    return found


def _check_inputs(
    text_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    seq_len: int,
    batch_size: int,
    max_tokens: int,
) -> Path:
    """``out_dir`` as a Path, once the sizes make sense, the text exists and ``out_dir``
    holds no telemetry run yet (each refused in one line naming the value)."""
    if seq_len < 2 or batch_size < 1 or max_tokens < seq_len:
        raise ValueError(
            f"need seq_len >= 2, batch_size >= 1, max_tokens >= seq_len; got {seq_len}, "
            f"{batch_size}, {max_tokens}"
        )
    if not Path(text_path).is_file():
        raise FileNotFoundError(
            f"text file {str(text_path)!r} not found; give a text file to route"
        )
    out = Path(out_dir)
    if (out / "trace" / "header.json").exists():
        raise FileExistsError(f"{out} already holds a telemetry run; choose a new out_dir")
    return out


def _token_blocks(
    text_path: str | os.PathLike[str],
    tokenizer: Any,
    vocab_size: int,
    max_tokens: int,
    seq_len: int,
) -> torch.Tensor:
    """The first ``max_tokens`` tokens of the text as [sequences, seq_len + 1] blocks (the
    extra token: the next-token targets); the tokens past the last whole block are left."""
    ids = _read_tokens(text_path, tokenizer, vocab_size)[:max_tokens]
    width = seq_len + 1  # next-token targets
    n_seq = len(ids) // width
    if n_seq == 0:
        raise ValueError(f"{text_path}: {len(ids)} tokens, fewer than seq_len+1={width}")
    return torch.from_numpy(ids[: n_seq * width].reshape(n_seq, width).copy())


def run_telemetry(
    model: str | os.PathLike[str] | nn.Module,
    text_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    seq_len: int = 256,
    batch_size: int = 4,
    max_tokens: int = 1 << 16,
    policies: Sequence[str] = ("lru", "lfu", "static", "lru+static", "belady"),
    capacities: Sequence[int] | None = None,
    device: str = "cpu",
    record_probs: bool = False,
    seed: int = 0,
    report: bool = True,
    progress: bool = False,
) -> Path:
    """Run ``model`` over ``text_path``; writes trace, metrics.jsonl, summary.json, report/.

    Returns ``out_dir``. ``max_tokens`` caps the tokens read from the text. ``capacities``
    (expert slots per layer) default to ``default_capacities(top_k)`` of the model's routers
    (``attach``): (2, 4) for top_k = 2. ``progress`` shows progress bars (batches, report).
    """
    out = _check_inputs(text_path, out_dir, seq_len, batch_size, max_tokens)
    net, tokenizer = load_model(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    net.to(device).eval()
    blocks = _token_blocks(text_path, tokenizer, _vocab_size(net), max_tokens, seq_len)
    n_seq = blocks.shape[0]
    tel = attach(
        net,
        policies=policies,
        capacities=capacities,
        trace_dir=str(out / "trace"),
        record_probs=record_probs,
    )
    with tel:
        overall = _route(net, tel, blocks, out / "metrics.jsonl", batch_size, device, progress)
        summary = tel.summary()
    summary.update(
        {
            "model": str(model) if not isinstance(model, nn.Module) else type(model).__name__,
            "text": str(text_path),
            "sequences": int(n_seq),
            "seq_len": seq_len,
            "tokenizer": "bytes" if tokenizer is None else type(tokenizer).__name__,
            **overall,
        }
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if report:
        render_report(out, policies=policies, progress=progress)
    log.info("telemetry run written to %s", out)
    return out
