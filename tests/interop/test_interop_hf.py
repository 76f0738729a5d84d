"""moe_from_hf against transformers' own sparse-MoE blocks, built tiny and offline."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moestack.interop.hf import moe_from_hf  # noqa: E402


def _qwen3():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=24,
        moe_intermediate_size=12,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return Qwen3MoeSparseMoeBlock(cfg)


def _qwen3_no_renorm():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=16,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=4,
        norm_topk_prob=False,
    )
    return Qwen3MoeSparseMoeBlock(cfg)


def _mixtral():
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=20, intermediate_size=10, num_local_experts=4, num_experts_per_tok=2
    )
    return MixtralSparseMoeBlock(cfg)


def _olmoe():
    from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    cfg = OlmoeConfig(
        hidden_size=16,
        intermediate_size=8,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
    )
    return OlmoeSparseMoeBlock(cfg)


@pytest.mark.parametrize("make_block", [_qwen3, _qwen3_no_renorm, _mixtral, _olmoe])
def test_moe_from_hf_matches_transformers(make_block):
    torch.manual_seed(0)
    block = make_block().float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    moe = moe_from_hf(block)
    hidden = block.gate.weight.shape[1]
    x = torch.randn(3, 7, hidden)

    x_ref = x.clone().requires_grad_(True)
    y_ref = block(x_ref)
    grad = torch.randn_like(y_ref)
    (y_ref * grad).sum().backward()

    x_ours = x.clone().requires_grad_(True)
    y_ours = moe(x_ours)
    (y_ours * grad).sum().backward()

    torch.testing.assert_close(y_ours, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-5, rtol=1e-5)


def test_moe_from_hf_rejects_non_moe_block():
    with pytest.raises(ValueError, match="not a sparse-MoE block"):
        moe_from_hf(torch.nn.Linear(4, 4))
