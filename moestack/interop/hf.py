"""Build a moestack ``MoE`` from a transformers sparse-MoE block, copying its weights.

Supported: the v5 layout (``block.gate`` a ``*TopKRouter`` with ``weight [E, D]``,
``block.experts.gate_up_proj [E, 2F, D]`` and ``down_proj [E, D, F]``) of Qwen3-MoE,
Qwen2-MoE (routed experts only), Mixtral and OLMoE, and the v4 layout (``block.gate`` an
``nn.Linear``, ``block.experts`` a ModuleList of per-expert MLPs with gate/up/down or
Mixtral's w1/w3/w2). The converted layer computes the same function, so parity with
transformers can be tested; its router losses are off (weights 0) unless a ``router``
config gives their weights (its score and renormalisation are always the block's own).

``moe_from_hf`` builds the layer on the meta device and then takes the block's weights, so
a large model is not first filled with a random init it would throw away.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moestack.moe import MoE, MoEConfig
from moestack.router import Router, RouterConfig


def _routing_settings(block: nn.Module) -> tuple[int, int, bool]:
    """(num_experts, top_k, renormalize) from the block, its router or its config."""
    gate = block.gate
    num_experts = getattr(gate, "num_experts", None) or gate.weight.shape[0]
    top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
    if top_k is None:
        raise ValueError(f"{type(block).__name__}: cannot find top_k on the block or its gate")
    renormalize = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", None))
    if renormalize is None:  # Mixtral always renormalises its top-k weights
        renormalize = "Mixtral" in type(block).__name__
    return int(num_experts), int(top_k), bool(renormalize)


def _stacked_expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E, D, 2F], w2 [E, F, D]) in moestack layout from either transformers layout."""
    if hasattr(experts, "gate_up_proj"):
        return experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    gates, ups, downs = [], [], []
    for expert in experts:
        if hasattr(expert, "gate_proj"):
            gate, up, down = expert.gate_proj, expert.up_proj, expert.down_proj
        elif hasattr(expert, "w1"):
            gate, up, down = expert.w1, expert.w3, expert.w2
        else:
            raise ValueError(
                f"unknown expert layout {type(expert).__name__}: expected gate/up/down projections"
            )
        gates.append(gate.weight.t())
        ups.append(up.weight.t())
        downs.append(down.weight.t())
    w1 = torch.cat([torch.stack(gates), torch.stack(ups)], dim=-1)
    return w1, torch.stack(downs)


def _check_activation(experts: nn.Module) -> None:
    act = getattr(experts, "act_fn", None)
    if act is None and isinstance(experts, nn.ModuleList) and len(experts) > 0:
        act = getattr(experts[0], "act_fn", None)
    if act is not None and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        raise ValueError(
            f"expert activation {type(act).__name__} is not SiLU; moestack experts are SwiGLU"
        )


def family_router_config(renormalize: bool, router: RouterConfig | None = None) -> RouterConfig:
    """``router``'s loss weights with a transformers family's own routing (softmax scores,
    ``renormalize`` as the block does); losses off when ``router`` is None."""
    base = router if router is not None else RouterConfig(load_balance=0.0, z_loss=0.0)
    return dataclasses.replace(base, score="softmax", renormalize=renormalize)


def _empty_moe(d_model: int, moe_cfg: MoEConfig, router_cfg: RouterConfig) -> MoE:
    """An MoE whose expert weights are still to be assigned: built on the meta device (no
    random init of the experts), with a real router (small, and its buffers initialised)."""
    with torch.device("meta"):
        moe = MoE(d_model, moe_cfg, router_cfg)
    moe.router = Router(d_model, moe_cfg.num_experts, moe_cfg.top_k, router_cfg)
    moe.aux_loss = torch.zeros(())
    return moe


def moe_from_hf(
    block: nn.Module,
    impl: str = "torch",
    allow_shared_expert: bool = False,
    router: RouterConfig | None = None,
) -> MoE:
    """An equivalent ``MoE`` with ``block``'s routed weights copied (same dtype and device).

    ``router`` sets the router losses' weights (and aux-loss-free balancing); the score and
    renormalisation are forced to the block's, so the layer computes the block's function.
    A shared expert is refused unless ``allow_shared_expert`` (the caller keeps it beside).
    """
    if not hasattr(block, "gate") or not hasattr(block, "experts"):
        raise ValueError(f"{type(block).__name__} has no gate/experts: not a sparse-MoE block")
    if hasattr(block, "shared_expert") and not allow_shared_expert:
        raise ValueError(
            f"{type(block).__name__} has a shared expert, which moestack's MoE does not model; "
            "pass allow_shared_expert=True to convert only the routed experts"
        )
    _check_activation(block.experts)
    num_experts, top_k, renormalize = _routing_settings(block)
    w1, w2 = _stacked_expert_weights(block.experts)
    d_model, d_ff = w1.shape[1], w2.shape[1]
    moe = _empty_moe(
        d_model,
        MoEConfig(num_experts=num_experts, top_k=top_k, d_ff=d_ff, impl=impl),
        family_router_config(renormalize, router),
    )
    moe.w1 = nn.Parameter(w1.detach().clone(memory_format=torch.contiguous_format))
    moe.w2 = nn.Parameter(w2.detach().clone(memory_format=torch.contiguous_format))
    gate = block.gate.weight
    if gate.is_meta:  # a model read without weights (filled from a checkpoint later)
        moe.router.to(dtype=w1.dtype)  # buffers real (the non-persistent ones stay so)
        moe.router.weight = nn.Parameter(torch.empty_like(moe.router.weight, device="meta"))
    else:
        moe.router.to(device=gate.device, dtype=w1.dtype)  # w1 may be meta
        with torch.no_grad():
            moe.router.weight.copy_(gate)
        moe.router.reset_anchor()  # the anchor loss's reference: the pretrained router
    tensors = (*moe.named_parameters(), *moe.named_buffers())
    # experts read without their weights (load_hf_moe(experts=False)) stay meta on purpose,
    # and the router's weight of a model read without any
    on_purpose = (
        *(("w1", "w2") if w1.is_meta else ()),
        *(("router.weight",) if gate.is_meta else ()),
    )
    leftover = [n for n, t in tensors if t.is_meta and n not in on_purpose]
    if leftover:  # a tensor MoE gained that this function does not fill yet
        raise RuntimeError(f"moe_from_hf left {leftover} uninitialised; fill them here")
    return moe
