"""Validation, greedy generation and the finite-weights check: what training, ``moestack
eval``, the pre-registered analysis and offloaded evaluation share (the device and its
autocast: ``moestack.device``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from moestack.device import autocast_context
from moestack.errors import MoestackError

if TYPE_CHECKING:
    from moestack.model import KVCache

log = logging.getLogger(__name__)

NONFINITE_LISTED = 5  # tensors named in a non-finite refusal; the rest are counted
FINITE_CHUNK = 1 << 24  # elements checked for NaN/inf at a time
ALLOW_NONFINITE = "--allow-nonfinite"  # the option of `eval` and `export` that skips the check


def perplexity(loss: float) -> float:
    """exp(loss), capped so that a diverged run reports a large number, not inf."""
    return math.exp(min(loss, 50.0))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    *,
    progress: bool = False,
) -> dict[str, float]:
    """Mean validation cross-entropy over fixed batches, and its perplexity (with a
    progress bar over the batches when ``progress``)."""
    was_training = model.training
    model.eval()
    total = 0.0
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="eval", unit="batch", leave=False)
    for inputs, targets in batches:
        with autocast_context(device):
            out = model(inputs.to(device), targets.to(device))
        total += out.ce_loss.item()
    model.train(was_training)
    loss = total / max(1, len(batches))
    return {"loss/val": loss, "eval/perplexity": perplexity(loss)}


def prompt_tokens(
    prompt: torch.Tensor | Sequence[int], max_new_tokens: int, device: torch.device
) -> torch.Tensor:
    """``prompt`` as a ``[1, P]`` long tensor on ``device``; ValueError for an empty prompt
    or a negative ``max_new_tokens`` (checked before any generation work is set up)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    tokens = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1).to(device)
    if tokens.numel() == 0:
        raise ValueError("prompt is empty; give at least one token id")
    return tokens


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompt: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    device: torch.device,
) -> list[int]:
    """The ``max_new_tokens`` ids that greedy decoding appends to ``prompt`` (token ids);
    in-memory and offloaded ``eval --generate`` share it.

    A model with a KV cache (``new_kv_cache``: moestack's own) runs the prompt once, then
    one token per forward, while the sequence fits its ``cfg.max_seq_len``; past that, and
    for a model without a KV cache, each step re-runs the last ``max_seq_len`` tokens (all
    of them for a model without one). Both give the tokens that re-running the window at
    every step gives: the positions of a window past ``max_seq_len`` restart at 0, which a
    cache cannot follow."""
    tokens = prompt_tokens(prompt, max_new_tokens, device)
    max_len = getattr(getattr(model, "cfg", None), "max_seq_len", None)
    cache = model.new_kv_cache(1, device) if max_len and hasattr(model, "new_kv_cache") else None
    was_training = model.training
    model.eval()
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            nxt = next_logits(model, tokens, cache, max_len).argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            new.append(int(nxt))
    finally:
        model.train(was_training)
    return new


def next_logits(
    model: nn.Module, tokens_BS: torch.Tensor, cache: KVCache | None, max_len: int | None
) -> torch.Tensor:
    """Logits ``[B, V]`` for the token after ``tokens``: through ``cache`` (only the tokens
    it has not seen) while the sequence fits ``max_len``, else by re-running the last
    ``max_len`` tokens."""
    if cache is not None and tokens_BS.shape[1] <= max_len:
        return model(tokens_BS[:, cache.length :], cache=cache).logits[:, -1]
    window = tokens_BS[:, -max_len:] if max_len else tokens_BS
    return model(window).logits[:, -1]


def is_finite(t: torch.Tensor) -> bool:
    """Every value of ``t`` is finite, checked ``FINITE_CHUNK`` elements at a time (the mask
    of a whole expert stack would be as large as the stack)."""
    if not t.is_contiguous():
        return all(is_finite(row) for row in t)
    return all(bool(torch.isfinite(part).all()) for part in t.reshape(-1).split(FINITE_CHUNK))


def non_finite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors holding NaN or inf, in order (meta tensors,
    which hold no values, are skipped); a stack of experts (an MoE layer's ``w1``/``w2``,
    ``[E, ...]``) also names the experts affected."""
    found = []
    for name, t in named:
        if not t.is_floating_point() or t.is_meta or is_finite(t):
            continue
        if name.rpartition(".")[2] in ("w1", "w2") and t.ndim == 3:
            name = f"{name} (experts {[e for e in range(t.shape[0]) if not is_finite(t[e])]})"
        found.append(name)
    return found


def model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` by name (a tied tensor once)."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def _listing(names: list[str]) -> str:
    """The first ``NONFINITE_LISTED`` names, then how many more."""
    shown = ", ".join(names[:NONFINITE_LISTED])
    rest = len(names) - NONFINITE_LISTED
    return f"{shown} and {rest} more" if rest > 0 else shown


def check_finite_weights(
    named: Iterable[tuple[str, torch.Tensor]], where: str, *, allow: bool = False
) -> None:
    """Refuse weights holding NaN/inf, naming the tensors (the first few, then a count):
    a model with them evaluates to NaN, or exports a folder that does. ``allow`` (the
    ``--allow-nonfinite`` option) logs the same as a warning and goes on."""
    bad = non_finite_tensors(named)
    if not bad:
        return
    what = f"{where} holds NaN/inf values in {len(bad)} tensor(s): {_listing(bad)}"
    if allow:
        log.warning("%s; going on as %s asks", what, ALLOW_NONFINITE)
        return
    raise MoestackError(
        f"{what}; use an earlier checkpoint or repaired weights, or pass {ALLOW_NONFINITE} "
        "to go on anyway"
    )


def finite_expert_layers(
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]], where: str, *, allow: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``layers`` (``(w1 [E, D, 2F], w2 [E, F, D])`` per MoE layer, as an expert store is
    written from) passed through ``check_finite_weights`` one layer at a time, named
    ``moe_layers.<i>.w1`` / ``.w2`` (the model's MoE layer i)."""
    for i, (w1, w2) in enumerate(layers):
        named = [(f"moe_layers.{i}.w1", w1), (f"moe_layers.{i}.w2", w2)]
        check_finite_weights(named, where, allow=allow)
        yield w1, w2


def check_finite_loss(metrics: dict[str, float], where: str) -> None:
    """Refuse a validation loss that is NaN or inf: the weights or the data are broken, and
    the number must not pass for a result."""
    loss = metrics.get("loss/val")
    if loss is not None and not math.isfinite(loss):
        raise MoestackError(
            f"{where}: the validation loss is {loss} (not finite); the weights hold NaN/inf or "
            "overflow in this dtype: check the checkpoint or evaluate an earlier one"
        )
