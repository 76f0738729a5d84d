"""load_hf_moe against transformers' own model: same logits, and a model that trains."""

from __future__ import annotations

import inspect
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from helpers.hf import FAMILIES, VOCAB, reference_model, sample_tokens  # noqa: E402

from moestack import router_losses  # noqa: E402
from moestack.config import RouterConfig  # noqa: E402
from moestack.errors import MoestackError  # noqa: E402
from moestack.interop.hf_model import HFMoEBlock, document_ids, load_hf_moe  # noqa: E402

RENORMALIZE = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True, "olmoe": False}


def _eos(model) -> int:
    return model.cfg.doc_separator


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(hf_dir, family):
    path = hf_dir(family)
    ref = reference_model(path)
    model = load_hf_moe(path, impl="torch")
    tokens = sample_tokens(_eos(model), batch=3, seq=20)
    with torch.no_grad():
        want = ref(input_ids=tokens).logits
        got = model(tokens).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_structure_and_router_config(hf_dir, family):
    router = RouterConfig(score="sigmoid", renormalize=False, load_balance=0.02, temporal=0.1)
    model = load_hf_moe(hf_dir(family), impl="torch", router=router)
    assert len(model.moe_layers) == 2 and len(model.blocks) == 2
    assert not any(type(m).__name__.endswith("SparseMoeBlock") for m in model.hf.modules())
    for moe in model.moe_layers:
        cfg = moe.router.cfg
        assert (cfg.score, cfg.renormalize) == ("softmax", RENORMALIZE[family])
        assert (cfg.load_balance, cfg.temporal, cfg.z_loss) == (0.02, 0.1, router.z_loss)
        assert (moe.cfg.num_experts, moe.cfg.top_k, moe.cfg.d_ff) == (6, 2, 16)
    assert (model.cfg.vocab_size, model.cfg.d_model, model.cfg.n_layers) == (VOCAB, 32, 2)
    assert model.cfg.moe.impl == "torch"
    assert model.cfg.router == model.moe_layers[0].router.cfg
    assert model.cfg.doc_separator >= 0
    shared = [b.shared_expert is not None for b in model.blocks]
    assert shared == [family == "qwen2_moe"] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_num_params(hf_dir, family):
    path = hf_dir(family)
    model = load_hf_moe(path, impl="torch")
    total = sum(p.numel() for p in reference_model(path).parameters())
    routed = 2 * 6 * (32 * 2 * 16 + 16 * 32)
    assert model.num_params() == {"total": total, "active": total - routed + routed * 2 // 6}


def _transformers_grad(ref, name: str) -> torch.Tensor:
    """The gradient transformers' model holds for the moestack parameter ``name``: the same
    name under ``hf.``, but the router is the block's ``gate`` and the stacked experts are
    stored transposed (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``)."""
    params = dict(ref.named_parameters())
    name = name.removeprefix("hf.")
    for ours, theirs in (("mlp.moe.router.weight", "mlp.gate.weight"),
                         ("mlp.moe.w1", "mlp.experts.gate_up_proj"),
                         ("mlp.moe.w2", "mlp.experts.down_proj")):  # fmt: skip
        if name.endswith(ours):
            grad = params[name.replace(ours, theirs)].grad
            return grad if ours.endswith("router.weight") else grad.transpose(1, 2)
    return params[name].grad


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_equals_transformers_gradients(hf_dir, family):
    """Without router losses the training loss is transformers' cross-entropy: the loss and
    every parameter's gradient (routers, experts, attention, embeddings, a shared expert)
    equal those of transformers' own model on the same tokens."""
    path = hf_dir(family)
    router = RouterConfig(load_balance=0.0, z_loss=0.0)
    model, ref = load_hf_moe(path, impl="torch", router=router), reference_model(path)
    model.train()
    tokens = sample_tokens(_eos(model))
    targets = torch.roll(tokens, -1, dims=1)
    out = model(tokens, targets=targets)
    want = torch.nn.functional.cross_entropy(
        ref(input_ids=tokens).logits.flatten(0, 1), targets.flatten()
    )
    torch.testing.assert_close(out.loss, want, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    want.backward()
    named = dict(model.named_parameters())
    assert any(n.endswith("mlp.moe.w1") for n in named) and len(named) == len(
        list(ref.parameters())
    )
    for name, p in named.items():
        torch.testing.assert_close(p.grad, _transformers_grad(ref, name), atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_router_losses_join_the_loss_and_reach_the_routers(hf_dir):
    """With a locality loss the loss is transformers' cross-entropy plus the per-layer
    router loss terms (the metrics hold them weighted); the loss reaches the routers and
    leaves the output head (after every router) alone."""
    path = hf_dir("qwen3_moe")
    ref = reference_model(path)
    grads = {}
    for temporal in (0.0, 0.1):
        model = load_hf_moe(path, impl="torch", router=RouterConfig(temporal=temporal))
        model.train()
        tokens = sample_tokens(_eos(model))
        targets = torch.roll(tokens, -1, dims=1)
        out = model(tokens, targets=targets)
        terms = [out.metrics[f"router/layer{i}/{k}"] for i in range(2)
                 for k in ("load_balance", "z_loss", "temporal") if k != "temporal" or temporal]  # fmt: skip
        assert all(t > 0 for t in terms)
        torch.testing.assert_close(out.aux_loss, sum(terms))
        with torch.no_grad():
            ce = torch.nn.functional.cross_entropy(
                ref(input_ids=tokens).logits.flatten(0, 1), targets.flatten()
            )
        torch.testing.assert_close(out.loss, ce + out.aux_loss, atol=1e-5, rtol=1e-5)
        out.loss.backward()
        grads[temporal] = {n: p.grad.clone() for n, p in model.named_parameters()}
    routers = [n for n in grads[0.1] if n.endswith("router.weight")]
    assert len(routers) == 2
    for name in routers:
        assert not torch.allclose(grads[0.1][name], grads[0.0][name], atol=1e-7, rtol=1e-5)
    head = "hf.lm_head.weight"  # after every router: the losses of the routing leave it alone
    torch.testing.assert_close(grads[0.1][head], grads[0.0][head], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_steps_lower_the_loss(hf_dir, family):
    model = load_hf_moe(hf_dir(family), impl="torch")
    model.train()
    tokens = sample_tokens(_eos(model), seed=1)
    targets = torch.roll(tokens, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(tokens, targets=targets).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_router_biases()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_router_losses_see_document_boundaries(hf_dir, monkeypatch):
    model = load_hf_moe(hf_dir("qwen3_moe"), impl="torch", router=RouterConfig(temporal=0.1))
    model.train()
    seen = []
    real = router_losses.aux_loss
    signature = inspect.signature(real)

    def spy(*args, **kwargs):
        seen.append(signature.bind(*args, **kwargs).arguments.get("segment_ids"))
        return real(*args, **kwargs)

    monkeypatch.setattr(router_losses, "aux_loss", spy)
    tokens = sample_tokens(_eos(model), seq=12)
    model(tokens)
    want = document_ids(tokens, _eos(model))
    assert want[0].tolist() == [0] * 5 + [1] * 7  # the EOS (position 4) ends document 0
    assert len(seen) == 2 and all(torch.equal(s, want) for s in seen)
    # The transformers model called directly, with another shape: stale ids are ignored.
    seen.clear()
    model.hf(input_ids=tokens[:1, :5], use_cache=False)
    assert seen == [None, None]


def test_router_only_steps_change_only_routers_and_cut_the_locality_loss(hf_dir):
    """trainable=routers with temporal + anchor: 20 steps move the routers alone and lower
    the temporal loss."""
    router = RouterConfig(temporal=1.0, anchor=0.1, load_balance=0.0, z_loss=0.0)
    model = load_hf_moe(hf_dir("qwen3_moe"), impl="torch", router=router)
    model.set_trainable("routers")
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = sample_tokens(_eos(model), batch=4, seq=32, seed=2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    temporal = []
    for _ in range(20):
        out = model(tokens, targets=torch.roll(tokens, -1, dims=1))
        temporal.append(sum(out.metrics[f"router/layer{i}/temporal"] for i in range(2)).item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert temporal[-1] < temporal[0]
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == name.endswith("router.weight"), name


def test_anchor_reference_is_the_pretrained_router(hf_dir):
    model = load_hf_moe(hf_dir("mixtral"), impl="torch", router=RouterConfig(anchor=1.0))
    model.train()
    for moe in model.moe_layers:
        assert torch.equal(moe.router.anchor_weight, moe.router.weight)
    out = model(sample_tokens(_eos(model)))
    assert all(out.metrics[f"router/layer{i}/anchor"].abs() < 1e-6 for i in range(2))


def test_aux_loss_free_bias_updates(hf_dir):
    """One update moves each layer's bias by rate * sign(mean load - load), the loads counted
    from the experts transformers' own routers pick for the same tokens (top-2 of their
    logits; the bias starts at 0, so it does not change the first choice)."""
    path = hf_dir("olmoe")
    model = load_hf_moe(path, impl="torch", router=RouterConfig(bias_update_rate=0.01))
    model.train()
    tokens = sample_tokens(_eos(model))
    model(tokens)
    model.update_router_biases()
    with torch.no_grad():
        logits = reference_model(path)(input_ids=tokens, output_router_logits=True).router_logits
    assert len(logits) == len(model.moe_layers) == 2
    for moe, layer_logits in zip(model.moe_layers, logits, strict=True):
        picked = layer_logits.topk(2, dim=-1).indices.flatten()
        load = torch.zeros(6).index_add_(0, picked, torch.ones(picked.numel()))
        want = 0.01 * torch.sign(load.mean() - load)
        assert want.abs().sum() > 0  # the loads are uneven: the update is visible
        torch.testing.assert_close(moe.router.expert_bias, want, atol=0, rtol=0)
        assert (moe.router.pending_counts == 0).all()  # counted once, then cleared
    model.discard_router_counts()


def test_greedy_generation_equals_transformers(hf_dir):
    """model.hf.generate (KV cache, one token per step) runs through the moestack blocks."""
    path = hf_dir("qwen2_moe")
    model, ref = load_hf_moe(path, impl="torch"), reference_model(path)
    prompt = sample_tokens(_eos(model), seq=8)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=_eos(model))
    assert torch.equal(model.hf.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_blocks_return_what_transformers_blocks_return(hf_dir, family):
    """Each patched block against the transformers sparse-MoE block it replaced (a shared
    expert included): the same type of result, the same values."""
    path = hf_dir(family)
    model, ref = load_hf_moe(path, impl="torch"), reference_model(path)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    for i, block in enumerate(model.blocks):
        assert isinstance(block, HFMoEBlock)
        with torch.no_grad():
            out, want = block(x), ref.model.layers[i].mlp(x)
        assert type(out) is type(want) and isinstance(out, torch.Tensor)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_load_is_as_close_to_float32_as_transformers_own(hf_dir):
    """bf16 logits off transformers' fp32 logits (normwise) by no more than 1.5 times what
    transformers' own bf16 model is off them (measured: 0.033 against 0.036)."""
    from transformers import AutoModelForCausalLM

    path = hf_dir("mixtral")
    model = load_hf_moe(path, impl="torch", dtype=torch.bfloat16)
    assert model.moe_layers[0].w1.dtype == torch.bfloat16
    theirs = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.bfloat16)
    tokens = sample_tokens(_eos(model))
    with torch.no_grad():
        logits = model(tokens).logits
        want = reference_model(path)(input_ids=tokens).logits.double()
        their_err = (theirs(input_ids=tokens).logits.double() - want).norm() / want.norm()
    assert logits.dtype == torch.bfloat16
    err = (logits.double() - want).norm() / want.norm()
    assert 0 < their_err < 0.1 and err <= 1.5 * their_err, (float(err), float(their_err))


def test_mixtral_jitter_noise_warns(tmp_path, caplog):
    from helpers.hf import tiny_hf_model_dir

    path = tiny_hf_model_dir(tmp_path, "mixtral", router_jitter_noise=0.1)
    load_hf_moe(path, impl="torch")
    assert "router_jitter_noise=0.1 is not applied" in caplog.text


def test_missing_folder_and_weights_are_one_line(hf_dir, tmp_path):
    with pytest.raises(MoestackError, match="does not exist") as err:
        load_hf_moe(tmp_path / "absent")
    assert "\n" not in str(err.value)
    folder = tmp_path / "m"
    shutil.copytree(hf_dir("olmoe"), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(MoestackError, match="holds no model weights") as err:
        load_hf_moe(folder)
    assert str(folder) in str(err.value) and "\n" not in str(err.value)


def test_unsupported_family_is_one_line(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(MoestackError, match="'llama' is not a supported MoE family"):
        load_hf_moe(tmp_path / "llama")
