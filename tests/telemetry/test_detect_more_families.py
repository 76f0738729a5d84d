"""attach() on Llama4, AFMoE, JetMoe and Doge: recorded ids are the ids the experts received.

Each tiny model is built offline from its config class. The test captures what the experts
got with its own hooks (never the router's output) and compares with the trace; Mixtral
and moestack's model are checked against their routing rule rewritten here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moestack import ModelConfig, MoEConfig, MoETransformer
from moestack.telemetry import attach, tiny_model

transformers = pytest.importorskip("transformers")

VOCAB, B, S = 64, 2, 9


def build(family: str) -> nn.Module:
    """A tiny random model of ``family``: 2 layers, hidden 32, top-2."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
    )
    table = {
        "llama4": (
            "Llama4TextConfig",
            "Llama4ForCausalLM",
            dict(
                num_local_experts=4,
                intermediate_size=32,
                intermediate_size_mlp=64,
                interleave_moe_layer_step=1,
                head_dim=8,
            ),
        ),
        "afmoe": (
            "AfmoeConfig",
            "AfmoeForCausalLM",
            dict(
                num_experts=8,
                moe_intermediate_size=16,
                num_shared_experts=1,
                num_dense_layers=0,
                intermediate_size=64,
            ),
        ),
        "jetmoe": (
            "JetMoeConfig",
            "JetMoeForCausalLM",
            dict(num_local_experts=6, intermediate_size=32, kv_channels=8),
        ),
        "doge": (
            "DogeConfig",
            "DogeForCausalLM",
            dict(is_moe=True, num_experts=16, intermediate_size=32),
        ),
    }
    config_name, model_name, extra = table[family]
    config = getattr(transformers, config_name)(**common, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # spread router scores so every top-k is unambiguous
        for name, p in model.named_parameters():
            if any(key in name for key in ("router", "expert_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def run(model: nn.Module, **kw) -> tuple:
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    with attach(model, **kw) as tel, torch.no_grad():
        hooked = model(input_ids=ids).logits
    assert torch.equal(plain, hooked)
    return tel


def hook_inputs(modules: list[nn.Module]) -> tuple[list[tuple], list]:
    seen: list[tuple] = [() for _ in modules]

    def grab(i: int):
        def pre(mod, args):
            seen[i] = tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args)

        return pre

    handles = [m.register_forward_pre_hook(grab(i)) for i, m in enumerate(modules)]
    return seen, handles


def test_llama4_experts_receive_recorded_ids_and_sigmoid_probs() -> None:
    model = build("llama4")
    blocks = [layer.feed_forward for layer in model.model.layers]
    seen, handles = hook_inputs([b.experts for b in blocks] + [b.router for b in blocks])
    tel = run(model, record_probs=True)
    for h in handles:
        h.remove()
    assert [s.kind for s in tel.routers] == ["family_router"] * 2
    for layer, block in enumerate(blocks):
        routed_ETH = seen[layer][0].view(4, B * S, -1)  # rows scaled by 0 were not routed
        received_TE = (routed_ETH != 0).any(-1).T
        got = tel.trace.experts(layer)
        assert got.shape == (B * S, 2)
        want_TE = np.zeros((B * S, 4), dtype=bool)
        np.put_along_axis(want_TE, got.astype(np.int64), True, axis=1)
        np.testing.assert_array_equal(want_TE, received_TE.numpy())
        x = seen[2 + layer][0]
        gate = torch.sigmoid(F.linear(x.double(), block.router.weight.detach().double()))
        np.testing.assert_allclose(
            tel.trace.probs(layer), (gate / gate.sum(-1, keepdim=True)).numpy(), atol=2e-3
        )


def test_afmoe_experts_receive_recorded_ids() -> None:
    model = build("afmoe")
    blocks = [layer.mlp for layer in model.model.layers]
    assert all(b.expert_bias.abs().sum() > 0 for b in blocks)  # the bias changes the choice
    seen, handles = hook_inputs([b.experts for b in blocks])
    tel = run(model)
    for h in handles:
        h.remove()
    for layer in range(2):
        np.testing.assert_array_equal(tel.trace.experts(layer), seen[layer][1].numpy())


def test_jetmoe_experts_receive_recorded_ids() -> None:
    model = build("jetmoe")
    blocks = [layer.mlp for layer in model.model.layers]
    seen, handles = hook_inputs(blocks + [b.input_linear for b in blocks])
    tel = run(model, record_probs=True)
    for h in handles:
        h.remove()
    assert [s.name for s in tel.routers] == [f"model.layers.{i}.mlp.router" for i in range(2)]
    for layer, block in enumerate(blocks):
        x_TH = seen[layer][0].reshape(B * S, -1)
        rows, sizes = seen[2 + layer]
        got = tel.trace.experts(layer)
        start = 0
        for e, n in enumerate(sizes):
            dist = torch.cdist(rows[start : start + n], x_TH)
            assert torch.all(dist.min(-1).values < 1e-5)
            tokens = sorted(dist.argmin(-1).tolist())
            assert tokens == np.flatnonzero((got == e).any(1)).tolist(), (layer, e)
            start += n
        logits = F.linear(x_TH.double(), block.router.layer.weight.detach().double())
        np.testing.assert_allclose(
            tel.trace.probs(layer), torch.softmax(logits, -1).numpy(), atol=2e-3
        )


def test_doge_experts_receive_recorded_ids() -> None:
    model = build("doge")
    blocks = [layer.mlp for layer in model.model.layers]
    seen, handles = hook_inputs([b.down_embed for b in blocks])
    tel = run(model)
    for h in handles:
        h.remove()
    assert [s.kind for s in tel.routers] == ["product_key"] * 2
    for layer in range(2):
        np.testing.assert_array_equal(tel.trace.experts(layer), seen[layer][0].numpy())


def test_mixtral_and_moestack_unchanged() -> None:
    model = tiny_model("mixtral").eval()
    routers = [layer.mlp.gate for layer in model.model.layers]
    seen, handles = hook_inputs(routers)
    tel = run(model, record_probs=True)
    for h in handles:
        h.remove()
    assert [s.kind for s in tel.routers] == ["topk_router"] * len(routers)
    for layer, router in enumerate(routers):
        probs = torch.softmax(
            F.linear(seen[layer][0].double(), router.weight.detach().double()), -1
        )
        np.testing.assert_array_equal(tel.trace.experts(layer), probs.topk(2, -1).indices.numpy())
        np.testing.assert_allclose(tel.trace.probs(layer), probs.numpy(), atol=2e-3)

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, moe=MoEConfig(8, 2, 32))
    own = MoETransformer(cfg).eval()
    with attach(own) as tel:
        assert [s.kind for s in tel.routers] == ["moestack", "moestack"]
        assert [s.module for s in tel.routers] == [m.router for m in own.moe_layers]
