"""optim.update_in_backward: TieredAdamW stepping each tensor as its gradient lands in
backward steps the bits of its step after backward (itself checked against a float64
reference in test_tiered.py), holds one module's gradients at a time (measured with hooks,
against a count worked by hand), steps nothing on a non-finite loss, and refuses the settings
it cannot honour in one line naming the field."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _tiered_testlib import small_model, weights
from torch.utils.checkpoint import checkpoint

from moestack.config import ModelConfig, OptimConfig, TrainConfig
from moestack.optim import build_optimizer, build_training_optimizer
from moestack.optim.tiered import TieredAdamW
from moestack.optim.tiered_backward import held_gradient_numel

STEPS = 3


def _tokens(step: int, vocab: int = 40) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (2, 9), generator=gen)  # 18 tokens: an odd count


def _train(in_backward: bool, dtype: torch.dtype, **kw: object) -> tuple:
    model = small_model(dtype)
    torch.manual_seed(1)
    cfg = OptimConfig(name="tiered", lr=1e-2, grad_clip=0.0, update_in_backward=in_backward)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, TieredAdamW)
    for key, value in kw.items():
        setattr(opt, key, value)
    losses, metrics = [], []
    for step in range(STEPS):
        tokens = _tokens(step)
        out = model(tokens, tokens)
        opt.backward(out.loss)
        if in_backward:  # every gradient was used and freed in backward
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        metrics.append(opt.metrics())
    return model, opt, losses, metrics


@pytest.mark.parametrize(
    "dtype, kw",
    [
        (torch.bfloat16, {}),  # master=none: stochastic rounding, the C++ kernel
        (torch.bfloat16, {"host_kernel": False}),  # the torch ops
        (torch.float32, {"master": "float32"}),  # fp32 weights, their own master
    ],
    ids=["bf16-kernel", "bf16-torch", "fp32-master"],
)
def test_steps_the_bits_of_the_step_after_backward(dtype: torch.dtype, kw: dict) -> None:
    plain, plain_opt, plain_losses, plain_metrics = _train(False, dtype, **kw)
    hooked, hooked_opt, hooked_losses, hooked_metrics = _train(True, dtype, **kw)
    assert hooked_losses == plain_losses
    a, b = weights(plain), weights(hooked)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert a["layers.0.moe.w1"].dtype == dtype
    assert not torch.equal(a["layers.0.moe.w1"], weights(small_model(dtype))["layers.0.moe.w1"])
    sa, sb = plain_opt.state_dict()["entries"], hooked_opt.state_dict()["entries"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for key in sa:
        for field, value in sa[key].items():
            other = sb[key][field]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    assert hooked_metrics == plain_metrics  # the statistics added in the step's order


def test_one_module_gradients_held_at_a_time() -> None:
    """Every hook sees only its own tensor's gradient held (the others freed at their hooks),
    so the most held at once is under the count: the largest module's, plus the tied
    embedding's."""
    model = small_model()
    held: list[int] = []

    def observe(p: torch.Tensor) -> None:  # registered first: runs before the update
        held.append(sum(q.grad.numel() for q in model.parameters() if q.grad is not None))
        assert all(q.grad is None for q in model.parameters() if q is not p)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(observe)
    opt = build_optimizer(model, OptimConfig(name="tiered", grad_clip=0.0, update_in_backward=True))
    out = model(_tokens(0), _tokens(0))
    opt.backward(out.loss)
    assert len(held) == len(list(model.parameters()))
    assert max(held) <= held_gradient_numel(model)
    assert max(held) == max(p.numel() for p in model.parameters())


def test_held_gradient_count_worked_by_hand() -> None:
    """The default model: d 128, 4 layers, 8 experts of d_ff 256 (w1 [8, 128, 512], w2 [8,
    256, 128]), vocabulary 256, the output tied to the embedding."""
    experts = 8 * 128 * 512 + 8 * 256 * 128
    with torch.device("meta"):
        tied = ModelConfig().build()
        untied = ModelConfig(tie_embeddings=False).build()
    assert held_gradient_numel(tied) == experts + 256 * 128  # a MoE layer's, and the embedding
    assert held_gradient_numel(untied) == experts
    names = {n for n, _ in tied.named_parameters() if n.endswith((".w1", ".w2"))}
    assert held_gradient_numel(tied, only=names) == experts
    tied.layers[0].moe.w1.requires_grad_(False)  # frozen: no gradient
    assert held_gradient_numel(tied, only=names) == experts
    block = 128 + 384 * 128 + 128 * 128 + 128 + experts + 8 * 128  # norms, attention, MoE
    assert held_gradient_numel(untied, compiled=True) == block  # one graph's gradients a block
    with torch.device("meta"):
        wide = ModelConfig(vocab_size=8192).build()  # the tied embedding larger than a layer
    assert held_gradient_numel(wide) == 2 * 8192 * 128  # its two uses' gradients, being added


def test_a_non_finite_loss_steps_nothing() -> None:
    model = small_model()
    before = weights(model)
    opt = build_optimizer(model, OptimConfig(name="tiered", grad_clip=0.0, update_in_backward=True))
    out = model(_tokens(0), _tokens(0))
    opt.backward(out.loss * float("nan"))
    after = weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not opt.state  # no step counted
    assert all(p.grad is not None for p in model.parameters())  # left for the caller to drop


def test_a_plain_backward_leaves_the_step_to_step() -> None:
    """The hooks are armed only inside ``backward``: ``loss.backward(); step()`` steps as
    without them."""
    plain, plain_opt, *_ = _train(False, torch.bfloat16)
    model = small_model()
    torch.manual_seed(1)
    opt = build_optimizer(
        model, OptimConfig(name="tiered", lr=1e-2, grad_clip=0.0, update_in_backward=True)
    )
    for step in range(STEPS):
        tokens = _tokens(step)
        model(tokens, tokens).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    a, b = weights(plain), weights(model)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"name": "adamw", "grad_clip": 0.0}, "optim.update_in_backward=true is optim=tiered"),
        ({"name": "tiered"}, "optim.grad_clip=1.0"),
    ],
)
def test_settings_it_cannot_honour_are_refused(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OptimConfig(update_in_backward=True, **fields)


def test_accumulation_and_ranks_are_refused() -> None:
    optim = OptimConfig(name="tiered", grad_clip=0.0, update_in_backward=True)
    with pytest.raises(ValueError, match="not grad_accum=2: set grad_accum=1"):
        TrainConfig(optim=optim, grad_accum=2)
    with pytest.raises(ValueError, match="this run has 2 ranks"):
        build_training_optimizer(small_model(), optim, world_size=2)


def test_a_dropped_optimizer_is_freed_and_its_hooks_taken_off() -> None:
    model = small_model()
    opt = build_optimizer(model, OptimConfig(name="tiered", grad_clip=0.0, update_in_backward=True))
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # taken off
    before = weights(model)
    model(_tokens(0), _tokens(0)).loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # nothing stepped, nothing freed
    assert all(torch.equal(before[n], w) for n, w in weights(model).items())


def test_a_gradient_in_two_parts_is_refused() -> None:
    """Reentrant checkpointing runs a nested backward, so a parameter used inside and outside
    the region has its gradient accumulated twice: stepping it on the first part would be
    wrong, so the second stops the run naming it."""
    lin = torch.nn.Linear(4, 4)
    model = torch.nn.Module()
    model.lin = lin
    opt = TieredAdamW([{"params": [("lin.weight", lin.weight), ("lin.bias", lin.bias)],
                        "population": "backbone", "momentum": "float32",
                        "second_moment": "full", "weight_decay": 0.0}],
                      update_in_backward=True)  # fmt: skip
    x = torch.randn(3, 4, requires_grad=True)
    loss = lin(checkpoint(lin, x, use_reentrant=True)).sum()
    with pytest.raises(RuntimeError, match=r"lin\.(weight|bias) received a gradient twice"):
        opt.backward(loss)
