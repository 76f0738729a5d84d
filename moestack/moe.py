"""The dropless Mixture-of-Experts layer: router, SwiGLU experts, weighted combine.

Every token reaches all of its top-k experts (no capacity factor, no padding, no drops).
The expert computation has interchangeable implementations that compute the same function:
``torch`` (``torch._grouped_mm`` where the device and dtype allow, odd widths padded with
zeros to its 16-byte rows; else a loop over the sorted groups), ``triton``
(moestack.kernels, fused gather/scatter) and ``megablocks`` (an optional baseline).
``auto`` picks triton on CUDA and torch elsewhere.

Where the experts run is the layer's one experts back-end slot, set with ``MoE.set_experts``:
``LocalExperts`` (the default: the stacked ``w1``/``w2`` in memory, with ``impl``),
``moestack.parallel.ExpertParallelExperts`` (this rank's shard of the experts, tokens moved by
all-to-all) or ``moestack.cache.CachedExperts`` (experts served by an expert cache). The
parameters stay the layer's in every case (same names, same state_dict keys): a back-end reads
them, it does not own them. ``MoEConfig`` sits here beside the layer it configures.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from moestack import router_losses, seeding
from moestack.checks import check
from moestack.kernels import grouped_mm_torch
from moestack.router import Router, RouterConfig, Routing, tokens_per_expert

MOE_IMPLS = ("auto", "triton", "torch", "megablocks")
# The low-rank adapters an MoE layer may carry (moestack.lora adds them): stacked per expert
# like w1/w2, so they shard, checkpoint and recompute with the experts.
EXPERT_ADAPTERS = ("lora_w1_A", "lora_w1_B", "lora_w2_A", "lora_w2_B")


@dataclass
class MoEConfig:
    """The expert layer: how many experts, how many per token, their width, the kernel."""

    num_experts: int = 8  # experts per MoE layer (E)
    top_k: int = 2  # experts each token is routed to (k)
    d_ff: int = 256  # hidden width of each SwiGLU expert (F)
    impl: str = "auto"  # "auto" (triton on CUDA, torch elsewhere), "triton", "torch", "megablocks"

    def __post_init__(self) -> None:
        check(self.num_experts >= 1, f"moe.num_experts={self.num_experts} must be >= 1")
        check(self.top_k >= 1, f"moe.top_k={self.top_k} must be >= 1")
        check(
            self.top_k <= self.num_experts,
            f"moe.top_k={self.top_k} is larger than moe.num_experts={self.num_experts}; "
            "lower top_k or add experts",
        )
        check(self.d_ff >= 1, f"moe.d_ff={self.d_ff} must be >= 1")
        check(self.impl in MOE_IMPLS, f"moe.impl={self.impl!r} is unknown; use one of {MOE_IMPLS}")


def sort_by_expert(
    experts_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order the (token, slot) pairs by expert.

    Returns ``order_N`` (flat pair index, sorted stably by expert), ``token_N`` (the token of
    each sorted pair) and ``offsets_E`` (int32 cumulative row ends per expert).
    """
    flat_N = experts_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    token_N = order_N // experts_TK.shape[-1]
    tokens_per_expert_E = tokens_per_expert(flat_N, num_experts)
    offsets_E = torch.cumsum(tokens_per_expert_E, 0).to(torch.int32)
    return order_N, token_N, offsets_E


class ExpertAdapters(NamedTuple):
    """Low-rank adapters on every expert's w1 and w2: ``x @ w1[e]`` becomes
    ``x @ w1[e] + scale * dropout(x) @ w1_A[e] @ w1_B[e]``, likewise for w2."""

    w1_A_EDR: torch.Tensor
    w1_B_ERF2: torch.Tensor
    w2_A_EFR: torch.Tensor
    w2_B_ERD: torch.Tensor
    scale: float  # lora.alpha / lora.rank
    dropout: float  # on the adapters' inputs, 0 outside training

    def to(self, dtype: torch.dtype) -> ExpertAdapters:
        return self._replace(**{f: getattr(self, f).to(dtype) for f in self._fields[:4]})


GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _adapted_mm(
    x_NK: torch.Tensor,
    w_EKM: torch.Tensor,
    low: tuple[torch.Tensor, torch.Tensor] | None,
    offsets_E: torch.Tensor,
    adapters: ExpertAdapters | None,
    gemm: GroupedMM,
) -> torch.Tensor:
    """``x @ w[e]`` per group, plus the adapter's ``scale * dropout(x) @ a[e] @ b[e]`` (two
    grouped GEMMs of rank r) when ``low = (a_EKR, b_ERM)`` is given."""
    y_NM = gemm(x_NK, w_EKM, offsets_E)
    if low is None or adapters is None:
        return y_NM
    x_NK = F.dropout(x_NK, adapters.dropout) if adapters.dropout else x_NK
    low_NM = gemm(gemm(x_NK, low[0], offsets_E), low[1], offsets_E)
    return y_NM.add(low_NM, alpha=adapters.scale)  # one pass over [N, M], scale included


def moe_experts_torch(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    adapters: ExpertAdapters | None = None,
    gemm: GroupedMM | None = None,
) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * SwiGLU expert experts[t, j] applied to x[t]; with
    ``adapters``, each expert's w1/w2 product takes its low-rank term. ``gemm`` is the
    grouped GEMM the products run on (default ``grouped_mm_torch``; Triton's for
    ``impl=triton`` with adapters)."""
    gemm = gemm or grouped_mm_torch
    w1_low = (adapters.w1_A_EDR, adapters.w1_B_ERF2) if adapters is not None else None
    w2_low = (adapters.w2_A_EFR, adapters.w2_B_ERD) if adapters is not None else None
    num_tokens, top_k = experts_TK.shape
    d_ff = w2_EFD.shape[1]
    order_N, token_N, offsets_E = sort_by_expert(experts_TK, w1_EDF2.shape[0])
    h_NF2 = _adapted_mm(x_TD[token_N], w1_EDF2, w1_low, offsets_E, adapters, gemm)
    gate_NF, up_NF = h_NF2.split(d_ff, dim=-1)  # split: its backward is one cat, not two fills
    h_NF = F.silu(gate_NF) * up_NF
    y_ND = _adapted_mm(h_NF, w2_EFD, w2_low, offsets_E, adapters, gemm)
    # Back to (token, slot) order with a permutation (deterministic, unlike index_add).
    y_TKD = (
        y_ND.new_empty(y_ND.shape)
        .index_copy_(0, order_N, y_ND)
        .view(num_tokens, top_k, y_ND.shape[-1])
    )
    return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)


def resolve_impl(impl: str, device: torch.device) -> str:
    """The expert implementation ``impl`` means on ``device``: "auto" is triton on CUDA and
    torch elsewhere."""
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return impl


def check_impl(impl: str, device: torch.device) -> None:
    """Refuse an expert implementation that cannot run on ``device``, saying why and which
    one to use (instead of a long traceback from inside the first forward pass)."""
    impl = resolve_impl(impl, device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "triton" and device.type != "cuda" and not interpreted:
        raise ValueError(
            f"moe.impl=triton needs a CUDA device (or TRITON_INTERPRET=1, the slow CPU "
            f"interpreter); this run is on {device}: use moe.impl=auto or torch"
        )
    if impl == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("moe.impl=triton needs the triton package; use moe.impl=torch")
    if impl == "megablocks" and (
        device.type != "cuda" or importlib.util.find_spec("megablocks") is None
    ):
        raise ValueError(
            f"moe.impl=megablocks needs a CUDA device and the optional megablocks package "
            f"(this run: {device}); use moe.impl=auto"
        )


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's when it is on (the custom kernels do not
    autocast themselves), else the weights'."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return w.dtype


def run_experts(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    impl: str = "auto",
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """Apply the chosen SwiGLU experts to flat tokens and combine them with the weights.

    The one way into the expert computation, for the MoE layer and for anything that holds
    expert weights elsewhere (the expert cache): under autocast everything runs in the
    autocast dtype (the custom kernels don't autocast), otherwise ``x`` takes the weights'
    dtype; ``impl`` is one of ``MOE_IMPLS``. ``adapters`` (LoRA on the experts) run through
    the same sorted dispatch as grouped GEMMs: the torch path's, or Triton's grouped GEMM
    for ``impl=triton`` (the fused expert kernel has no low-rank term).
    """
    dtype = compute_dtype(x_TD, w1_EDF2)
    x_TD, w1_EDF2, w2_EFD = x_TD.to(dtype), w1_EDF2.to(dtype), w2_EFD.to(dtype)
    args = (x_TD, w1_EDF2, w2_EFD, experts_TK, weights_TK)
    impl = resolve_impl(impl, x_TD.device)
    if adapters is not None:
        return _run_adapted_experts(*args, adapters.to(dtype), impl)
    if impl == "torch":
        return moe_experts_torch(*args)
    if impl == "triton":
        from moestack.kernels import moe_experts

        return moe_experts(*args)  # custom ops (moestack::triton_moe_experts): no graph break
    from moestack.kernels.megablocks_adapter import moe_experts_megablocks

    return moe_experts_megablocks(*args)


def _run_adapted_experts(
    x_TD: torch.Tensor,
    w1_EDF2: torch.Tensor,
    w2_EFD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    adapters: ExpertAdapters,
    impl: str,
) -> torch.Tensor:
    """The experts with their adapters, on the torch path's or Triton's grouped GEMM."""
    if impl == "megablocks":
        raise ValueError("LoRA on the experts runs with moe.impl=torch or triton, not megablocks")
    gemm = None
    if impl == "triton":
        from moestack.kernels import grouped_gemm as gemm
    return moe_experts_torch(x_TD, w1_EDF2, w2_EFD, experts_TK, weights_TK, adapters, gemm)


# model.checkpointing=selective keeps the outputs of these ops (the matmuls and attention:
# expensive to recompute) and recomputes everything else in its regions (norms, rotary,
# SwiGLU, gathers and permutations: cheap elementwise or copy work). docs/memory.md.
_SELECTIVE_SAVE = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention",
    )  # fmt: skip
    if hasattr(torch.ops.aten, name)
) | {torch.ops.moestack.grouped_mm.default}


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    if func in _SELECTIVE_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(mode: str) -> dict:
    """Keyword arguments of ``torch.utils.checkpoint.checkpoint`` for a checkpointing mode:
    non-reentrant; ``selective`` adds the policy above (``_SELECTIVE_SAVE``)."""
    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _selective_policy
        )
    return kwargs


class ExpertsBackend(Protocol):
    """How an MoE layer runs its experts: ``backend(moe, x [T, D], routing) -> y [T, D]``,
    ``y[t] = sum_j routing.weights[t, j] * expert_{routing.experts[t, j]}(x[t])``. It reads the
    layer's weights, config and ``recompute`` from ``moe``; set one with ``MoE.set_experts``."""

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor: ...


def check_resident(moe: MoE, x_TD: torch.Tensor) -> None:
    """Refuse to compute with expert weights that are not in memory (meta tensors: released,
    or a model loaded with experts=False): torch would return garbage, not raise."""
    if moe.w1.is_meta and not x_TD.is_meta:
        raise RuntimeError(
            "this MoE layer's expert weights are not in memory (released, or a model loaded "
            "with experts=False): run it with its experts served from a store "
            "(moestack.cache.offloaded / evaluate_offloaded), or load it with its experts"
        )


class LocalExperts:
    """The default experts back-end: the layer's stacked ``w1``/``w2``, in memory, computed
    by ``moe.cfg.impl`` (``run_experts``).

    With ``moe.recompute`` set (``model.checkpointing``: moe, block or selective) the expert
    computation keeps only its inputs and is run again in backward; the routing is one of
    those inputs, so the recomputation uses this forward's expert choices, never new ones.
    """

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        check_resident(moe, x_TD)
        return self.run(moe, x_TD, routing.experts, routing.weights)

    @staticmethod
    def run(
        moe: MoE, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> torch.Tensor:
        """``run_experts`` on ``moe``'s weights for ``experts_TK`` (ids into its ``w1``/``w2``),
        recomputed in backward when ``moe.recompute`` is set (expert parallelism runs its
        local experts through here)."""
        args = (x_TD, moe.w1, moe.w2, experts_TK, weights_TK, moe.cfg.impl, moe.expert_adapters())
        if moe.recompute == "none" or not torch.is_grad_enabled():
            return run_experts(*args)
        return checkpoint(run_experts, *args, **checkpoint_kwargs(moe.recompute))


LOCAL_EXPERTS = LocalExperts()  # stateless: every layer's default back-end


class MoE(nn.Module):
    """Dropless top-k MoE with SwiGLU experts stored as stacked weights.

    ``w1 [E, D, 2F]`` holds gate (first F columns) and up projections; ``w2 [E, F, D]`` the
    down projection. After a forward pass in training mode ``aux_loss`` holds the weighted
    router losses and ``metrics`` the detached per-layer statistics. Where the experts run is
    the back-end set with ``set_experts`` (local stacked weights unless told otherwise).
    """

    def __init__(
        self,
        d_model: int,
        moe: MoEConfig,
        router: RouterConfig,
        expert_device: torch.device | str | None = None,
    ) -> None:
        """``expert_device="meta"``: the experts take no memory until a rank is given memory
        for its own rows (``parallel.shard_experts``) and draws them
        (``MoETransformer.init_experts``)."""
        super().__init__()
        self.d_model = d_model
        self.cfg = moe
        self.router_cfg = router
        self.router = Router(d_model, moe.num_experts, moe.top_k, router)
        self.w1 = nn.Parameter(
            torch.empty(moe.num_experts, d_model, 2 * moe.d_ff, device=expert_device)
        )
        self.w2 = nn.Parameter(
            torch.empty(moe.num_experts, moe.d_ff, d_model, device=expert_device)
        )
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.metrics: dict[str, torch.Tensor] = {}
        self.recompute = "none"  # model.checkpointing (model.CHECKPOINTING); set by the model
        self._experts_backend: ExpertsBackend = LOCAL_EXPERTS
        self.expert_offset = 0  # the global id of this layer's first expert row (EP: lo)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w2, std=std / math.sqrt(2))

    def init_experts(self, seed: int, name: str, std: float = 0.02) -> None:
        """Draw each expert row's ``w1`` then ``w2`` from a generator seeded by (``seed``,
        ``name``, its global expert id): the same weights whichever rank holds the expert
        (:mod:`moestack.seeding`). Meta rows are left for their materialisation."""
        for row in range(self.w1.shape[0]):
            gen = seeding.generator(seed, f"{name}.expert{self.expert_offset + row}")
            seeding.normal_(self.w1[row], std, gen)
            seeding.normal_(self.w2[row], std / math.sqrt(2), gen)

    def set_experts(self, backend: ExpertsBackend | None = None) -> None:
        """Run this layer's experts with ``backend`` from now on (None: ``LocalExperts``, the
        stacked weights in memory). The one way to change where the experts run: expert
        parallelism (``moestack.parallel.shard_experts``) and offloaded evaluation
        (``moestack.cache.offloaded``) come in through here."""
        self._experts_backend = LOCAL_EXPERTS if backend is None else backend

    def expert_adapters(self) -> ExpertAdapters | None:
        """This layer's LoRA adapters on its experts (``moestack.lora``), None without."""
        if getattr(self, "lora_w1_A", None) is None:
            return None
        tensors = (getattr(self, name) for name in EXPERT_ADAPTERS)
        return ExpertAdapters(
            *tensors, self.lora_scale, self.lora_dropout if self.training else 0.0
        )

    def expert_tensor_names(self) -> tuple[str, ...]:
        """The names of this layer's tensors stacked per expert ([E, ...]): w1, w2 and any
        adapters on them. Expert parallelism keeps this rank's rows of each."""
        return ("w1", "w2") + (EXPERT_ADAPTERS if self.expert_adapters() is not None else ())

    @property
    def experts_backend(self) -> ExpertsBackend:
        """The back-end this layer runs its experts with (``set_experts``)."""
        return self._experts_backend

    def experts(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Apply the chosen experts to flat tokens and combine them with the router weights,
        through this layer's experts back-end."""
        return self._experts_backend(self, x_TD, routing)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., D] -> [..., D]``; ``segment_ids [...]`` (document of each token, optional)
        lets locality losses ignore pairs of tokens from different documents."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoE expects last dim d_model={self.d_model}, got {tuple(x.shape)}")
        lead_shape = x.shape[:-1]
        x_TD = x.reshape(-1, self.d_model)
        routing = self.router(x_TD)
        y_TD = self.experts(x_TD, routing)
        losses = {}
        if self.training:
            reference = self.router.anchor_scores(x_TD) if self.router_cfg.anchor > 0 else None
            losses = router_losses.aux_loss(
                routing, lead_shape, self.router_cfg, segment_ids, reference
            )
        self.aux_loss = sum(losses.values(), x.new_zeros((), dtype=torch.float32))
        metrics = Router.metrics(routing, self.cfg.num_experts)
        metrics.update({k: v.detach() for k, v in losses.items()})
        self.metrics = metrics
        return y_TD.reshape(x.shape)
