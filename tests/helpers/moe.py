"""The MoE layer's reference (a float64 loop over tokens) and a layer whose routing is
decisive, for the tests of the layer and of its experts back-ends."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moestack import MoE, MoEConfig, RouterConfig


def reference_moe(x, router_w, w1, w2, top_k, score="softmax", renormalize=True):
    """Token by token, slot by slot: the definition of a top-k SwiGLU MoE, in float64."""
    d_ff = w2.shape[1]
    out = []
    for t in range(x.shape[0]):
        logits = router_w @ x[t]
        scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
        top_vals, top_ids = torch.topk(scores, top_k)
        if renormalize:
            top_vals = top_vals / top_vals.sum()
        y = torch.zeros_like(x[t])
        for j in range(top_k):
            e = int(top_ids[j])
            h = x[t] @ w1[e]
            y = y + top_vals[j] * ((F.silu(h[:d_ff]) * h[d_ff:]) @ w2[e])
        out.append(y)
    return torch.stack(out) if out else x.new_zeros(x.shape)


def moe_layer(d_model: int, num_experts: int, top_k: int, d_ff: int, seed: int, **router_kw: Any):
    """An MoE layer (torch impl, no router losses) with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=num_experts, top_k=top_k, d_ff=d_ff, impl="torch")
    moe = MoE(d_model, cfg, RouterConfig(load_balance=0.0, z_loss=0.0, **router_kw))
    with torch.no_grad():  # larger router weights so the routing is decisive, not uniform
        moe.router.weight.normal_(0, 1.0)
        moe.w1.normal_(0, 0.3)
        moe.w2.normal_(0, 0.3)
    return moe
