"""Low-rank adapters (LoRA) on the routed experts and the attention projections.

``trainable=lora`` (or ``routers+lora``) freezes the model and adds, per target weight W, two
small trained tensors whose product is added to W's output, scaled by ``alpha / rank``
(``lora.alpha`` defaults to 2 x ``lora.rank``: a scale of 2 whatever the rank):

- experts: each MoE layer's ``w1 [E, D, 2F]`` gets ``lora_w1_A [E, D, r]`` and
  ``lora_w1_B [E, r, 2F]``; ``w2 [E, F, D]`` gets ``lora_w2_A [E, F, r]`` and
  ``lora_w2_B [E, r, D]``. They run through the experts' own dispatch as grouped GEMMs of
  rank r (``moe.run_experts``), so they shard, checkpoint and recompute with the experts.
- attention: each attention projection (an ``nn.Linear``, weight ``[out, in]``) gets
  ``lora_A [r, in]`` and ``lora_B [out, r]``, added by a forward hook, so the projection
  keeps its name and its weight's state_dict key.

``B`` starts at zero, so the adapted model equals the base model until it trains (bitwise on
the torch path; within rounding on triton's, whose adapted experts leave the fused kernel); ``A`` is
drawn from a generator seeded by the run's seed and the tensor's name (an expert's rows: and
its global expert id), so it does not depend on how many processes build the model; a rank
whose experts were built on meta draws its own rows only (``init_expert_adapters``). ``merge_adapters`` folds them into the base weights
(``W + alpha / r * A @ B``) for export.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moestack.checks import check
from moestack.moe import EXPERT_ADAPTERS, MoE

LORA_TARGETS = ("experts", "attention", "both")  # lora.targets
LORA_TRAINABLE = ("lora", "routers+lora")  # the trainable= values that add adapters
LINEAR_ADAPTERS = ("lora_A", "lora_B")  # on an attention projection
LORA_BASE_DTYPES = ("float32", "bfloat16")  # lora.base_dtype


@dataclass
class LoRAConfig:
    """The adapters of ``trainable=lora`` / ``routers+lora`` (ignored otherwise)."""

    rank: int = 16  # r: inner width of every adapter; 1 <= r <= min(in, out) of its weight
    # the adapters' output is scaled by alpha / rank; unset (null): 2 x rank, so the scale
    # is 2 at any rank
    alpha: float | None = None
    dropout: float = 0.0  # dropout on each adapter's input while training (0 = none)
    targets: str = "experts"  # "experts", "attention" (its projections) or "both"
    # the frozen base weights' dtype: "bfloat16" holds them in half the memory (the adapters,
    # and the routers of routers+lora, stay float32; the layers then compute in bfloat16)
    base_dtype: str = "float32"

    def __post_init__(self) -> None:
        check(self.rank >= 1, f"lora.rank={self.rank} must be >= 1 (16 is usual)")
        check(
            self.alpha is None or (math.isfinite(self.alpha) and self.alpha > 0),
            f"lora.alpha={self.alpha} must be a positive number (2 x lora.rank is usual)",
        )
        check(0 <= self.dropout < 1, f"lora.dropout={self.dropout} must be in [0, 1)")
        check(
            self.targets in LORA_TARGETS,
            f"lora.targets={self.targets!r} is unknown; use one of {LORA_TARGETS}",
        )
        check(
            self.base_dtype in LORA_BASE_DTYPES,
            f"lora.base_dtype={self.base_dtype!r} is unknown; use one of {LORA_BASE_DTYPES}",
        )

    def check_fits(self, d_model: int, d_ff: int) -> None:
        """Refuse a rank above the smaller side of a target weight of a model of width
        ``d_model`` and expert width ``d_ff`` (checked again, per tensor, when the adapters
        are added): such a rank adds no capacity, only memory."""
        if self.on_experts:
            _check_rank(self, "the experts' w1/w2", d_model, d_ff)
        if self.on_attention:
            _check_rank(self, "the attention projections", d_model, d_model)

    @property
    def alpha_value(self) -> float:
        """``alpha``, or 2 x ``rank`` where it is unset. The field itself stays None then: the
        config schema is built from a default instance, and a resolved 32 there would be kept
        by ``lora.rank=4`` (a scale of 8 nobody asked for)."""
        return 2.0 * self.rank if self.alpha is None else float(self.alpha)

    @property
    def scale(self) -> float:
        """The factor on every adapter's output: ``alpha / rank`` (2 where alpha is unset)."""
        return self.alpha_value / self.rank

    def describe(self) -> str:
        """The run's line about its adapters: rank, alpha and the scale they make, so that the
        scale shows among the run's first lines."""
        given = "" if self.alpha is not None else " (2 x rank: lora.alpha unset)"
        return (
            f"lora: rank {self.rank}, alpha {self.alpha_value:g}{given}, scale alpha/rank = "
            f"{self.scale:g}; targets {self.targets}, dropout {self.dropout:g}"
        )

    @property
    def on_experts(self) -> bool:
        return self.targets in ("experts", "both")

    @property
    def on_attention(self) -> bool:
        return self.targets in ("attention", "both")


def add_adapters_for(model: nn.Module, trainable: str, cfg: LoRAConfig, seed: int) -> int:
    """``add_adapters`` where ``trainable`` asks for adapters (``LORA_TRAINABLE``), then the
    frozen weights cast to ``cfg.base_dtype``; else nothing (0): the one rule every builder
    of a run's model follows (the trainer, the run loader, the memory plan)."""
    if trainable not in LORA_TRAINABLE:
        return 0
    added = add_adapters(model, cfg, seed)
    cast_frozen(model, trainable, getattr(torch, cfg.base_dtype))
    return added


def frozen_parameters(model: nn.Module, trainable: str) -> list[nn.Parameter]:
    """The parameters a ``trainable`` run of ``model`` (``LORA_TRAINABLE``) does not train:
    all but the adapters and, for ``routers+lora``, the routers (as ``set_trainable`` keeps
    them)."""
    trained = {id(p) for _, p in adapter_parameters(model)}
    if trainable == "routers+lora":
        trained |= {id(moe.router.weight) for moe in model.moe_layers}
    return [p for p in model.parameters() if id(p) not in trained]


def cast_frozen(model: nn.Module, trainable: str, dtype: torch.dtype) -> int:
    """Hold the frozen weights of a ``trainable`` run in ``dtype`` (``lora.base_dtype``: the
    adapters stay float32); returns how many parameters were cast. Meta tensors take the
    dtype too, so what a meta-built rank later materialises, and the memory plan, follow.
    The layers compute in their weights' dtype: the experts cast their input and the
    adapters at the grouped GEMMs (``moe.run_experts``), an attention adapter its factors
    to the projection's output dtype."""
    cast = 0
    for p in frozen_parameters(model, trainable):
        if p.dtype != dtype and p.is_floating_point():
            p.data = p.data.to(dtype)
            cast += p.numel()
    return cast


def add_adapters(model: nn.Module, cfg: LoRAConfig, seed: int = 0) -> int:
    """Give ``model`` (a ``RoutedLM``: its ``moe_layers`` and ``attention_projections()``)
    the adapters ``cfg`` names, B at zero; returns how many adapter parameters it added.
    A rank above a target weight's smaller side is refused (it would add no capacity)."""
    added = 0
    if cfg.on_experts:
        for moe in model.moe_layers:
            added += _add_expert_adapters(moe, cfg, seed, _name_of(model, moe))
    if cfg.on_attention:
        for name, linear in model.attention_projections():
            added += _add_linear_adapter(linear, cfg, seed, name)
    return added


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _draw_A(
    shape: tuple[int, ...], fan_in: int, seed: int, name: str, like: torch.Tensor
) -> torch.Tensor:
    """A's initial values: uniform in +-1/sqrt(fan_in) (nn.Linear's default), from a
    generator seeded by (seed, name), so every layout of the run draws the same ones."""
    if like.is_meta:  # a model built on meta (the memory plan, a model without experts)
        return torch.empty(shape, dtype=like.dtype, device="meta")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    values = torch.rand(shape, generator=gen, dtype=torch.float32, device="cpu")
    return (values * (2 * bound) - bound).to(device=like.device, dtype=like.dtype)


def _expert_A(
    shape: tuple[int, ...], fan_in: int, seed: int, name: str, like: torch.Tensor, first: int
) -> torch.Tensor:
    """Rows of an expert adapter's A (``[held, *per_expert]``), each drawn as ``_draw_A``
    draws a tensor, from the generator of (seed, ``name/expert<global id>``): the ids start
    at ``first``, so a rank's rows are the whole build's. Meta ``like``: meta rows, drawn
    once a rank holds them (``init_expert_adapters``)."""
    if like.is_meta:
        return torch.empty(shape, dtype=like.dtype, device="meta")
    rows = [_draw_A(shape[1:], fan_in, seed, f"{name}/expert{first + e}", like)
            for e in range(shape[0])]  # fmt: skip
    return torch.stack(rows) if rows else torch.empty(shape, dtype=like.dtype, device=like.device)


def init_expert_adapters(model: nn.Module, seed: int) -> None:
    """Draw the expert adapters of a rank whose experts (and so their adapters) were built on
    meta and then given memory for its own rows (``parallel.shard_experts``): A's rows by
    their global expert ids, as the whole build draws them, B at zero."""
    for moe in model.moe_layers:
        if moe.expert_adapters() is None:
            continue
        name = _name_of(model, moe)
        with torch.no_grad():
            for a, fan_in in (("lora_w1_A", moe.w1.shape[1]), ("lora_w2_A", moe.w2.shape[1])):
                param = getattr(moe, a)
                param.copy_(_expert_A(tuple(param.shape), fan_in, seed, f"{name}.{a}", param,
                                      moe.expert_offset))  # fmt: skip
            moe.lora_w1_B.zero_()
            moe.lora_w2_B.zero_()


def _check_rank(cfg: LoRAConfig, name: str, rows: int, cols: int) -> None:
    """The one rule on the rank: at most the smaller side of the weight it adapts."""
    check(
        cfg.rank <= min(rows, cols),
        f"lora.rank={cfg.rank} exceeds min(in, out)={min(rows, cols)} of {name} "
        f"[{rows} x {cols}]; use lora.rank <= {min(rows, cols)}",
    )


def _add_expert_adapters(moe: MoE, cfg: LoRAConfig, seed: int, name: str) -> int:
    like = moe.w1.detach()  # meta where the experts are (built without them): so are these
    num_experts, d_model, two_f = moe.w1.shape
    d_ff = moe.w2.shape[1]
    _check_rank(cfg, f"{name}.w1", d_model, two_f)
    _check_rank(cfg, f"{name}.w2", d_ff, d_model)
    r, first = cfg.rank, moe.expert_offset
    moe.lora_w1_A = nn.Parameter(_expert_A((num_experts, d_model, r), d_model, seed,
                                           f"{name}.lora_w1_A", like, first))  # fmt: skip
    moe.lora_w2_A = nn.Parameter(_expert_A((num_experts, d_ff, r), d_ff, seed,
                                           f"{name}.lora_w2_A", like, first))  # fmt: skip
    moe.lora_w1_B = nn.Parameter(torch.zeros(num_experts, r, two_f, dtype=like.dtype,
                                             device=like.device))  # fmt: skip
    moe.lora_w2_B = nn.Parameter(torch.zeros(num_experts, r, d_model, dtype=like.dtype,
                                             device=like.device))  # fmt: skip
    moe.lora_scale, moe.lora_dropout = cfg.scale, cfg.dropout
    return sum(getattr(moe, n).numel() for n in EXPERT_ADAPTERS)


def _add_linear_adapter(linear: nn.Linear, cfg: LoRAConfig, seed: int, name: str) -> int:
    out_features, in_features = linear.weight.shape
    _check_rank(cfg, f"{name}.weight", in_features, out_features)
    like = linear.weight.detach()
    linear.lora_A = nn.Parameter(
        _draw_A((cfg.rank, in_features), in_features, seed, f"{name}.lora_A", like)
    )
    linear.lora_B = nn.Parameter(torch.zeros(out_features, cfg.rank, dtype=like.dtype,
                                             device=like.device))  # fmt: skip
    linear.lora_scale, linear.lora_dropout = cfg.scale, cfg.dropout
    linear._lora_hook = linear.register_forward_hook(_linear_adapter_output)
    return linear.lora_A.numel() + linear.lora_B.numel()


def _linear_adapter_output(linear: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The projection's output plus its adapter's: ``out + s * dropout(x) @ A^T @ B^T``."""
    x = F.dropout(args[0], linear.lora_dropout, linear.training)
    low = F.linear(F.linear(x, linear.lora_A.to(out.dtype)), linear.lora_B.to(out.dtype))
    return out.add(low, alpha=linear.lora_scale)  # one pass over the output, scale included


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every adapter tensor of ``model``, by name (each name holds ``lora``)."""
    for name, p in model.named_parameters():
        if name.rpartition(".")[2] in (*EXPERT_ADAPTERS, *LINEAR_ADAPTERS):
            yield name, p


def has_adapters(model: nn.Module) -> bool:
    return next(adapter_parameters(model), None) is not None


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter into its base weight (``W += alpha / r * A @ B``, computed in
    float32) and remove it: the model then computes what it computed with the adapters
    (up to rounding) and has the base model's tensors only; returns how many it merged."""
    merged = 0
    for moe in model.moe_layers:
        if getattr(moe, "lora_w1_A", None) is None:
            continue
        for w, a, b in (("w1", "lora_w1_A", "lora_w1_B"), ("w2", "lora_w2_A", "lora_w2_B")):
            weight = getattr(moe, w)
            delta = torch.bmm(getattr(moe, a).float(), getattr(moe, b).float())
            weight.copy_((weight.float() + moe.lora_scale * delta).to(weight.dtype))
            delattr(moe, a)
            delattr(moe, b)
        del moe.lora_scale, moe.lora_dropout
        merged += 1
    for _, linear in model.attention_projections():
        if getattr(linear, "lora_A", None) is None:
            continue
        delta = linear.lora_B.float() @ linear.lora_A.float()
        linear.weight.copy_(
            (linear.weight.float() + linear.lora_scale * delta).to(linear.weight.dtype)
        )
        linear._lora_hook.remove()
        del linear.lora_A, linear.lora_B, linear.lora_scale, linear.lora_dropout, linear._lora_hook
        merged += 1
    return merged
