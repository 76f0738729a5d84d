"""A decoder-only transformer whose feed-forward blocks are MoE layers.

tokens [B, S] -> embed -> n x Block(x + Attn(norm x); x + MoE(norm x)) -> norm -> logits.
RMSNorm, rotary attention through scaled_dot_product_attention (causal over the packed
sequence), SwiGLU experts. ``forward(tokens, cache=kv)`` decodes with a ``KVCache``
(``MoETransformer.new_kv_cache``): the new tokens attend to the cached keys and themselves, and
only they are routed. The model sums the MoE layers' aux losses into its loss and
collects their router metrics under flat ``router/layer{i}/{name}`` keys. ``ModelConfig``
sits here beside the model it configures, and builds it (``ModelConfig.build``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from moestack import seeding
from moestack.checks import check, coerce
from moestack.errors import MoestackError
from moestack.meta_load import parameters_on_meta
from moestack.moe import MoE, MoEConfig, checkpoint_kwargs
from moestack.router import RouterConfig

CHECKPOINTING = ("none", "moe", "block", "selective")  # model.checkpointing


def check_checkpointing(mode: str) -> None:
    """``model.checkpointing`` must name one of ``CHECKPOINTING``."""
    check(
        mode in CHECKPOINTING,
        f"model.checkpointing={mode!r} is unknown; use one of {CHECKPOINTING}",
    )


@dataclass
class ModelConfig:
    """A decoder-only transformer whose every feed-forward block is an MoE layer."""

    vocab_size: int = 256  # byte-level tokens by default; byte 0 separates documents
    d_model: int = 128  # residual stream width (D)
    n_layers: int = 4  # transformer blocks, each with attention and an MoE layer
    n_heads: int = 4  # attention heads; must divide d_model
    max_seq_len: int = 256  # longest sequence the rotary tables are built for
    moe: MoEConfig = field(default_factory=MoEConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-6  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init of every weight matrix
    tie_embeddings: bool = True  # share the token embedding with the output projection
    doc_separator: int = 0  # token that ends a document in packed sequences (-1 = none)
    # activation checkpointing: what backward recomputes instead of keeping: "none", "moe"
    # (the experts), "block" (the whole block but its router) or "selective" (norms, rotary,
    # SwiGLU, gathers; matmul and attention outputs kept). Routing is never recomputed.
    checkpointing: str = "none"

    def __post_init__(self) -> None:
        self.moe = coerce(self.moe, MoEConfig)
        self.router = coerce(self.router, RouterConfig)
        check_checkpointing(self.checkpointing)
        check(self.vocab_size >= 2, f"model.vocab_size={self.vocab_size} must be >= 2")
        check(self.d_model >= 1, f"model.d_model={self.d_model} must be >= 1")
        check(self.n_layers >= 1, f"model.n_layers={self.n_layers} must be >= 1")
        check(self.n_heads >= 1, f"model.n_heads={self.n_heads} must be >= 1")
        check(
            self.d_model % self.n_heads == 0,
            f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}",
        )
        check(
            (self.d_model // self.n_heads) % 2 == 0,
            f"model.d_model/n_heads={self.d_model // self.n_heads} must be even for rotary "
            "embeddings",
        )
        check(self.max_seq_len >= 1, f"model.max_seq_len={self.max_seq_len} must be >= 1")
        check(
            self.rope_theta > 1, f"model.rope_theta={self.rope_theta} must be > 1 (10000 is usual)"
        )
        check(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be > 0")
        check(self.init_std > 0, f"model.init_std={self.init_std} must be > 0 (0.02 is usual)")
        check(
            -1 <= self.doc_separator < self.vocab_size,
            f"model.doc_separator={self.doc_separator} is outside the vocabulary "
            f"[0, {self.vocab_size}); use a token id, or -1 for none",
        )

    @property
    def resolved(self) -> bool:
        """True: every field is known when the config is built (nothing to read from disk)."""
        return True

    def resolve(self) -> ModelConfig:
        """This config: moestack's model reads nothing to learn its architecture."""
        return self

    def build(
        self, *, experts: bool = True, seed: int | None = None, experts_on_meta: bool = False
    ) -> MoETransformer:
        """The ``MoETransformer`` this config describes, freshly initialised from ``seed``
        (None: one drawn from torch's global generator; :meth:`MoETransformer.init_weights`);
        routers with an anchor loss take the built weights as their reference.
        ``experts_on_meta``: the routed experts take no memory yet (expert parallelism: each
        rank keeps and draws its own, :meth:`MoETransformer.init_experts`).

        ``experts=False`` is for a transformers model folder (``HFModelConfig.build``);
        moestack's own model without its experts is loaded from a checkpoint instead."""
        if not experts:
            raise ValueError(
                "experts=False reads a transformers model folder without its experts; "
                "moestack's own model without experts is loaded from a checkpoint: "
                "moestack.runs.load_run(RUN, experts=False)"
            )
        return MoETransformer(self, seed=seed, experts_on_meta=experts_on_meta)

    # What a caller asks instead of the config's type (HFModelConfig answers the same).
    is_transformers = False  # a transformers model folder (HFModelConfig), not this model
    pretrained_path = ""  # the folder its weights and tokenizer come from: none, bytes
    plan_notes = ()  # what the memory plan says of its figures: nothing more

    def describe(self) -> str:
        """The model in a few words, for a report's header: ``LAYERSxWIDTH``."""
        return f"{self.n_layers}x{self.d_model}"

    def tokenizer(self) -> None:
        """None: moestack's model reads bytes as tokens (its vocabulary must hold them)."""
        if self.vocab_size < 256:
            raise MoestackError(f"model.vocab_size={self.vocab_size} is below 256 byte tokens")

    @property
    def store_shape(self) -> ModelConfig:
        """The config an expert store of its experts is checked against (``ExpertStore``)."""
        return self

    def build_for_run(
        self, *, seed: int, experts_on_meta: bool, from_checkpoint: bool
    ) -> MoETransformer:
        """The training run's model: drawn from ``seed`` (``experts_on_meta``: the routed
        experts left for ``fill_experts``), also when a checkpoint then fills it."""
        return self.build(seed=seed, experts_on_meta=experts_on_meta)

    def fill_experts(self, model: MoETransformer, seed: int, *, resumed: bool) -> None:
        """This rank's experts of a model built with ``experts_on_meta``, drawn as the whole
        model's would be (a resumed run's checkpoint then overwrites them)."""
        model.init_experts(seed)

    def build_for_checkpoint(self) -> MoETransformer:
        """The model with every parameter on the meta device (buffers real), for a
        checkpoint to fill (``moestack.runs.load_run``)."""
        with parameters_on_meta():
            return self.build()

    def build_for_plan(self) -> MoETransformer:
        """The model on the meta device, nothing allocated: its shapes for the memory plan."""
        with torch.device("meta"):
            return self.build()


@dataclass
class ModelOutput:
    """What a forward pass returns; ``loss`` is None without targets."""

    logits: torch.Tensor  # [B, S, V]
    loss: torch.Tensor | None = None  # ce_loss + aux_loss (the training objective)
    ce_loss: torch.Tensor | None = None  # mean next-token cross-entropy (for perplexity)
    aux_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # router losses
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached, flat keys


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` run in its input's dtype, outside autocast.

    Why: CUDA autocast (torch 2.11) runs ``rms_norm`` under its fp32 policy, which casts the
    input but not the (optional) weight. With bf16 weights (``optim=offload_adamw``) the
    fused kernel then sees an fp32 input and a bf16 weight, warns "Mismatch dtype between
    input and weight", and falls back to a composite of several kernels over an fp32 copy of
    the activations (seen on an H200, 2026-11-30). The fused kernel accumulates in fp32
    itself: with the weight cast to the input's dtype it stays fused. Without autocast and
    with matching dtypes this is ``nn.RMSNorm`` exactly.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        if not torch.is_autocast_enabled(x.device.type):
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [S, head_dim/2] for rotary position embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles_SH = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles_SH.cos(), angles_SH.sin()


def apply_rotary(x_BHSd: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's channels by position."""
    x1, x2 = x_BHSd.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos_SH - x2 * sin_SH, x1 * sin_SH + x2 * cos_SH), dim=-1)
    return out.to(x_BHSd.dtype)


@dataclass
class KVCache:
    """The keys and values of the tokens a model has seen, per layer, for decoding.

    ``keys[i]`` and ``values[i]`` are layer i's ``[B, H, S, Dh]`` (rotary already applied to
    the keys); ``length`` is S, the position the next token takes. A forward pass given the
    cache appends its tokens' keys and values and advances ``length``; the model keeps no
    state of its own. Built by ``MoETransformer.new_kv_cache``.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @property
    def batch(self) -> int:
        """Sequences the cache holds (B)."""
        return self.keys[0].shape[0]

    def append(
        self, layer: int, k_BHSd: torch.Tensor, v_BHSd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cached keys and values followed by ``k``/``v`` (kept for the next
        call). An empty layer takes them as they come (their dtype: bf16 under autocast)."""
        if self.keys[layer].shape[2] == 0:  # own copies: q, k and v are views of one qkv
            self.keys[layer], self.values[layer] = k_BHSd.contiguous(), v_BHSd.contiguous()
        else:
            if k_BHSd.dtype != self.keys[layer].dtype:
                raise ValueError(
                    f"the KV cache holds {self.keys[layer].dtype} keys but this forward made "
                    f"{k_BHSd.dtype} ones; decode with the autocast setting of the prefill"
                )
            self.keys[layer] = torch.cat([self.keys[layer], k_BHSd], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v_BHSd], dim=2)
        return self.keys[layer], self.values[layer]


def offset_causal_mask(new: int, offset: int, device: torch.device) -> torch.Tensor | None:
    """Which keys each of ``new`` queries at positions ``offset..offset+new-1`` sees (True:
    attend) among ``offset + new`` keys; None where every key is visible (one new token)."""
    if new == 1:
        return None
    q_pos_S1 = torch.arange(offset, offset + new, device=device)[:, None]
    k_pos_1K = torch.arange(offset + new, device=device)[None, :]
    return k_pos_1K <= q_pos_S1


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary embeddings (and, given a ``KVCache``,
    over the cached keys too)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_SH: torch.Tensor,
        sin_SH: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """``cos``/``sin``: the rows of the tokens' positions; with ``cache``, the tokens
        follow its ``length`` cached ones and their keys and values join layer ``layer``'s."""
        qkv = self.qkv(x_BSD)
        q_BHSd, k_BHSd, v_BHSd = rearrange(qkv, "b s (n h d) -> n b h s d", n=3, h=self.n_heads)
        q_BHSd = apply_rotary(q_BHSd, cos_SH, sin_SH)
        k_BHSd = apply_rotary(k_BHSd, cos_SH, sin_SH)
        if cache is None or cache.length == 0:
            if cache is not None:
                cache.append(layer, k_BHSd, v_BHSd)
            y_BHSd = F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSd, is_causal=True)
        else:
            mask = offset_causal_mask(x_BSD.shape[1], cache.length, x_BSD.device)
            k_BHKd, v_BHKd = cache.append(layer, k_BHSd, v_BHSd)
            y_BHSd = F.scaled_dot_product_attention(q_BHSd, k_BHKd, v_BHKd, attn_mask=mask)
        return self.out(rearrange(y_BHSd, "b h s d -> b s (h d)"))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MoE, each with a residual."""

    def __init__(self, cfg: ModelConfig, expert_device: torch.device | str | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.moe = MoE(cfg.d_model, cfg.moe, cfg.router, expert_device)
        self.checkpointing = cfg.checkpointing
        self.moe.recompute = cfg.checkpointing

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_SH: torch.Tensor,
        sin_SH: torch.Tensor,
        segment_ids_BS: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        if cache is not None:  # decoding: nothing to recompute
            x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SH, sin_SH, cache, layer)
            return x_BSD + self.moe(self.moe_norm(x_BSD), segment_ids_BS)
        if self.checkpointing in ("block", "selective") and torch.is_grad_enabled():
            # The attention half is recomputed in backward; the router stays outside every
            # recomputed region (it runs once: one routing, telemetry and router counts see
            # each token once) and the experts recompute inside MoE.experts.
            h_BSD, u_BSD = checkpoint(
                self._attention_half, x_BSD, cos_SH, sin_SH,
                **checkpoint_kwargs(self.checkpointing),
            )  # fmt: skip
            return h_BSD + self.moe(u_BSD, segment_ids_BS)
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SH, sin_SH)
        return x_BSD + self.moe(self.moe_norm(x_BSD), segment_ids_BS)

    def _attention_half(
        self, x_BSD: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + Attn(norm x), norm of that)``: the block up to the MoE layer's input."""
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_SH, sin_SH)
        return h_BSD, self.moe_norm(h_BSD)


# what set_trainable may keep training ("lora", "routers+lora": the adapters moestack.lora
# added, and the routers too)
TRAINABLE = ("all", "routers", "routers+experts", "lora", "routers+lora")


class RoutedLM(nn.Module):
    """What the training loop needs of any MoE language model (moestack's own, or a
    transformers model with moestack MoE layers): ``moe_layers``, the router bias update,
    and one way to turn logits and router state into a ``ModelOutput``."""

    @property
    def moe_layers(self) -> list[MoE]:
        raise NotImplementedError

    def attention_projections(self) -> list[tuple[str, nn.Linear]]:
        """The attention's projections (``nn.Linear``), by name: where attention adapters
        go (``lora.targets``)."""
        raise NotImplementedError

    def lm_output(self, logits_BSV: torch.Tensor, targets: torch.Tensor | None) -> ModelOutput:
        """Logits plus the MoE layers' router losses and metrics from this forward pass;
        with targets, the cross-entropy and the total loss."""
        aux_loss = torch.zeros((), device=logits_BSV.device)
        metrics: dict[str, torch.Tensor] = {}
        for i, moe in enumerate(self.moe_layers):
            aux_loss = aux_loss + moe.aux_loss.to(aux_loss.device)
            metrics.update({f"router/layer{i}/{k}": v for k, v in moe.metrics.items()})
        out = ModelOutput(logits=logits_BSV, aux_loss=aux_loss, metrics=metrics)
        if targets is not None:
            out.ce_loss = F.cross_entropy(
                logits_BSV.float().reshape(-1, logits_BSV.shape[-1]), targets.reshape(-1)
            )
            out.loss = out.ce_loss + aux_loss
        return out

    @torch.no_grad()
    def update_router_biases(self) -> None:
        """Apply the aux-loss-free balancing update of every router (after an optimizer step).

        Under torch.distributed the token counts are summed over ranks first, so every
        replica moves its biases identically (as a single process over the global batch would).
        """
        routers = [moe.router for moe in self.moe_layers if moe.router.cfg.bias_update_rate > 0]
        if not routers:
            return
        if dist.is_available() and dist.is_initialized():
            counts_LE = torch.stack([r.pending_counts for r in routers])
            dist.all_reduce(counts_LE)
            for router, counts_E in zip(routers, counts_LE, strict=True):
                router.pending_counts.copy_(counts_E)
        for router in routers:
            router.update_bias()

    def set_trainable(self, which: str) -> int:
        """Freeze all weights but ``which`` ("all"; "routers": the MoE routers;
        "routers+experts": also the routed experts' w1/w2; "lora": the LoRA adapters
        ``moestack.lora.add_adapters`` added; "routers+lora": the adapters and the routers);
        returns how many parameters train. Frozen weights get no gradient, hence no gradient
        buffer and no optimizer state."""
        if which not in TRAINABLE:
            raise ValueError(f"trainable={which!r} is unknown; use one of {TRAINABLE}")
        named = dict(self.named_parameters())
        adapters = {id(p) for name, p in named.items() if "lora_" in name.rpartition(".")[2]}
        if which.endswith("lora") and not adapters:
            raise ValueError(f"trainable={which} but the model has no adapters: add them first "
                             "(moestack.lora.add_adapters)")  # fmt: skip
        keep = {id(p) for p in named.values()} if which == "all" else set(adapters)
        for moe in self.moe_layers:
            if which.startswith("routers"):
                keep.add(id(moe.router.weight))
            if which == "routers+experts":
                keep.update((id(moe.w1), id(moe.w2)))
        for p in self.parameters():
            p.requires_grad_(id(p) in keep)
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @torch.no_grad()
    def num_params(self) -> dict[str, int]:
        """The whole model's parameters and those active per token (top_k of num_experts
        routed experts; attention, embeddings and any shared expert are always active),
        however many of the experts this process holds (under expert parallelism a rank
        keeps num_experts / ep of them)."""
        held = sum(p.numel() for p in self.parameters())
        routed_held = routed = routed_active = 0
        for moe in self.moe_layers:
            stacked = [getattr(moe, name) for name in moe.expert_tensor_names()]
            per_expert = sum(t[0].numel() for t in stacked)
            routed_held += sum(t.numel() for t in stacked)
            routed += per_expert * moe.cfg.num_experts
            routed_active += per_expert * moe.cfg.top_k
        total = held - routed_held + routed
        return {"total": total, "active": total - routed + routed_active}

    @torch.no_grad()
    def reset_anchors(self) -> None:
        """Take the current router weights as the anchor loss's reference, in every layer
        (after the model is built or loaded)."""
        for moe in self.moe_layers:
            moe.router.reset_anchor()

    def discard_router_counts(self) -> None:
        """Forget the token counts of a step that was skipped (a NaN/inf loss)."""
        for moe in self.moe_layers:
            moe.router.pending_counts.zero_()


class MoETransformer(RoutedLM):
    """The language model: ``forward(tokens, targets=None) -> ModelOutput``."""

    def __init__(
        self, cfg: ModelConfig, seed: int | None = None, experts_on_meta: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        expert_device = "meta" if experts_on_meta else None
        self.layers = nn.ModuleList(Block(cfg, expert_device) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos_SH, sin_SH = rotary_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos_SH, persistent=False)
        self.register_buffer("rope_sin", sin_SH, persistent=False)
        self.init_weights(seeding.draw_seed() if seed is None else seed)

    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) weights, residual outputs scaled by 1/sqrt(2 n_layers), each
        tensor drawn from a generator of its own (seed, name) and each expert from one of
        (seed, layer, expert id) (:mod:`moestack.seeding`): any layout of the experts over
        ranks, built whole or on meta and materialised, starts from the same weights. Meta
        tensors are skipped (drawn once a rank holds its rows: :meth:`init_experts`). Routers
        with an anchor loss take the weights drawn here as their reference."""
        std = self.cfg.init_std

        def draw(name: str, tensor: torch.Tensor, scale: float = std) -> None:
            seeding.normal_(tensor, scale, seeding.generator(seed, name))

        draw("embed.weight", self.embed.weight)
        if not self.cfg.tie_embeddings:
            draw("lm_head.weight", self.lm_head.weight)
        for i, block in enumerate(self.layers):
            draw(f"layers.{i}.attn.qkv.weight", block.attn.qkv.weight)
            out_std = std / math.sqrt(2 * self.cfg.n_layers)
            draw(f"layers.{i}.attn.out.weight", block.attn.out.weight, out_std)
            draw(f"layers.{i}.moe.router.weight", block.moe.router.weight)
            block.moe.init_experts(seed, f"layers.{i}.moe", std)
        self.reset_anchors()  # the anchor loss's reference is the router drawn here

    def init_experts(self, seed: int) -> None:
        """Draw every layer's expert rows as :meth:`init_weights` does (by their global
        expert ids): for experts built on meta whose rows a rank was then given memory for
        (``parallel.shard_experts``)."""
        for i, block in enumerate(self.layers):
            block.moe.init_experts(seed, f"layers.{i}.moe", self.cfg.init_std)

    @property
    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.layers]

    def attention_projections(self) -> list[tuple[str, nn.Linear]]:
        return [
            (f"layers.{i}.attn.{name}", getattr(block.attn, name))
            for i, block in enumerate(self.layers)
            for name in ("qkv", "out")
        ]

    def new_kv_cache(self, batch: int, device: torch.device | str | None = None) -> KVCache:
        """An empty ``KVCache`` for ``batch`` sequences on ``device`` (the embedding's by
        default), for ``forward(tokens, cache=...)``; its layers take the dtype of the first
        keys and values they get (bf16 under autocast)."""
        weight = self.embed.weight
        shape = (batch, self.cfg.n_heads, 0, self.cfg.d_model // self.cfg.n_heads)
        device = weight.device if device is None else device
        dtype = weight.dtype

        def empty() -> list[torch.Tensor]:
            return [torch.empty(shape, device=device, dtype=dtype) for _ in self.layers]

        return KVCache(keys=empty(), values=empty())

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> ModelOutput:
        """Logits (and with ``targets`` the loss) of ``tokens [B, S]``. With ``cache`` the
        tokens continue the cached sequences: their positions start at ``cache.length``,
        they attend to the cached keys and themselves, and the cache is extended by them
        (router losses then see only these tokens)."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if cache is not None:
            return self._forward_cached(tokens, targets, cache)
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        cos_SH, sin_SH = self.rope_cos[:seq], self.rope_sin[:seq]
        segment_ids_BS = self.segment_ids(tokens)
        x_BSD = self.embed(tokens)
        for block in self.layers:
            x_BSD = block(x_BSD, cos_SH, sin_SH, segment_ids_BS)
        return self.lm_output(self.lm_head(self.norm(x_BSD)), targets)

    def _forward_cached(
        self, tokens: torch.Tensor, targets: torch.Tensor | None, cache: KVCache
    ) -> ModelOutput:
        """``forward`` after the ``cache.length`` tokens the cache holds."""
        start, seq = cache.length, tokens.shape[1]
        if len(cache.keys) != len(self.layers) or tokens.shape[0] != cache.batch:
            raise ValueError(
                f"the KV cache holds {len(cache.keys)} layers x {cache.batch} sequences; "
                f"this model has {len(self.layers)} layers and the tokens are "
                f"{tuple(tokens.shape)}: build it with model.new_kv_cache({tokens.shape[0]})"
            )
        if start + seq > self.cfg.max_seq_len:
            raise ValueError(
                f"KV cache length {start} + {seq} new tokens exceeds "
                f"model.max_seq_len={self.cfg.max_seq_len}; start a new cache over the last "
                f"{self.cfg.max_seq_len} tokens (positions restart at 0)"
            )
        cos_SH, sin_SH = self.rope_cos[start : start + seq], self.rope_sin[start : start + seq]
        segment_ids_BS = self.segment_ids(tokens)
        x_BSD = self.embed(tokens)
        for i, block in enumerate(self.layers):
            x_BSD = block(x_BSD, cos_SH, sin_SH, segment_ids_BS, cache, i)
        cache.length = start + seq
        return self.lm_output(self.lm_head(self.norm(x_BSD)), targets)

    def compile_blocks(self, **options: object) -> None:
        """Compile each block with torch.compile (in place; ``compile=true``).

        Per block, so a compile covers one repeated unit and recompiles stay rare. Nothing in
        a block reads a tensor's value or sizes a tensor from data (the router losses size
        on the host), so dynamo's default settings trace it whole. The grouped matmul (torch
        impl) and the Triton experts (triton impl) are custom ops, opaque to dynamo. Graph
        breaks: docs/memory.md."""
        for block in self.layers:
            block.compile(**options)

    def segment_ids(self, tokens_BS: torch.Tensor) -> torch.Tensor | None:
        """Document index of each token: a separator token ends its document."""
        if self.cfg.doc_separator < 0:
            return None
        is_sep_BS = (tokens_BS == self.cfg.doc_separator).long()
        return torch.cumsum(is_sep_BS, dim=1) - is_sep_BS
