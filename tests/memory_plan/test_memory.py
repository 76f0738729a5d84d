"""Activation checkpointing, the memory plan and torch.compile (issue 17)."""

import pytest
import torch
from helpers.memory import batch, tiny

from moestack.cli import main as cli_main
from moestack.config import ModelConfig, RouterConfig
from moestack.memory_plan import measure_activations, plan_memory, saved_tensor_bytes
from moestack.model import MoETransformer
from moestack.optim import apply_param_dtype, build_optimizer
from moestack.telemetry import attach

MODES = ("none", "moe", "block", "selective")


def forward_backward(cfg, tokens, targets, telemetry=False):
    torch.manual_seed(0)
    model = cfg.model.build()
    model.train()
    tel = attach(model, max_memory_tokens=1 << 16) if telemetry else None
    out = model(tokens, targets=targets)
    out.loss.backward()
    trace = None
    if tel is not None:
        tel.close()
        trace = [tel.trace.experts(layer) for layer in range(tel.trace.num_layers)]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads, trace, model


@pytest.mark.parametrize("mode", MODES[1:])
def test_checkpointing_gives_mode_none_gradients_with_a_locality_loss_and_telemetry(mode):
    router = RouterConfig(temporal=0.1, window=0.05, window_size=8)
    tokens, targets = batch()
    ref, ref_grads, ref_trace, ref_model = forward_backward(tiny("none", router), tokens, targets,
                                                            telemetry=True)  # fmt: skip
    out, grads, trace, model = forward_backward(tiny(mode, router), tokens, targets, True)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=0, atol=1e-7)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert len(trace) == len(ref_trace) == 2  # each token recorded once, the same experts
    for mine, theirs in zip(trace, ref_trace, strict=True):
        assert mine.shape[0] == tokens.numel() and (mine == theirs).all()
    for moe, ref_moe in zip(model.moe_layers, ref_model.moe_layers, strict=True):
        assert set(moe.metrics) == set(ref_moe.metrics)


def test_router_counts_see_each_token_once_under_checkpointing():
    router = RouterConfig(bias_update_rate=0.01)
    tokens, targets = batch()
    _, _, _, ref = forward_backward(tiny("none", router), tokens, targets)
    _, _, _, model = forward_backward(tiny("block", router), tokens, targets)
    for moe, ref_moe in zip(model.moe_layers, ref.moe_layers, strict=True):
        assert torch.equal(moe.router.pending_counts, ref_moe.router.pending_counts)
        assert moe.router.pending_counts.sum() == tokens.numel() * 2  # top_k = 2


def test_a_bad_checkpointing_value_is_one_line_naming_the_field():
    with pytest.raises(ValueError) as err:
        ModelConfig(checkpointing="everything")
    assert "model.checkpointing='everything'" in str(err.value)
    assert "\n" not in str(err.value)


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    "optim", [{"name": "adamw"}, {"name": "offload_adamw"},
              {"name": "offload_adamw", "param_dtype": "bfloat16"}],  # a split master
    ids=["adamw", "offload_adamw", "offload_adamw-bf16"],
)  # fmt: skip
def test_plan_matches_the_tensors_a_real_run_allocates(optim):
    cfg = tiny(optim=optim)
    plan = plan_memory(cfg, ranks=1, device="cpu")
    torch.manual_seed(0)
    model = cfg.model.build()
    apply_param_dtype(model, cfg.optim, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    tokens, targets = batch()
    model(tokens, targets=targets).loss.backward()
    optimizer.step()
    weights = _bytes(model.parameters()) + _bytes(model.buffers())
    grads = _bytes(p.grad for p in model.parameters())
    if optim["name"] == "adamw":
        state = _bytes(t for s in optimizer.state.values() for t in s.values())
        planned = plan.line("optimizer state").bytes
    else:
        state = _bytes(optimizer.host_buffers().values())
        planned = plan.total("host")
    # Byte counts are exact: a plan that forgets the buffers, a bias or the master's dtype
    # is wrong by a few bytes, which a relative tolerance would hide.
    assert (plan.line("weights").bytes, plan.line("gradients").bytes, planned) == (
        weights,
        grads,
        state,
    )


@pytest.mark.parametrize("mode", MODES)
def test_plan_activations_match_what_a_forward_keeps(mode):
    """Mode none against saved_tensors_hooks; every mode against the storages a forward
    leaves alive (the hooks do not see what a checkpoint holds: its inputs, SAC's cache)."""
    cfg = tiny(mode)
    planned = plan_memory(cfg, device="cpu").line("activations").bytes
    torch.manual_seed(0)
    model = cfg.model.build()
    tokens, targets = batch()
    assert planned == pytest.approx(measure_activations(model, tokens, targets), rel=0.1)
    if mode == "none":
        assert planned == pytest.approx(saved_tensor_bytes(model, tokens, targets), rel=0.1)


def test_checkpointing_keeps_less():
    tokens, targets = batch()
    kept = {}
    for mode in MODES:
        torch.manual_seed(0)
        kept[mode] = measure_activations(tiny(mode).model.build(), tokens, targets)
    assert kept["block"] < kept["moe"] < kept["selective"] < kept["none"]


def test_moestack_plan_prints_every_line(capsys):
    cli_main(["plan", "model=m137", "optim=offload_adamw", "--ranks", "8", "--device", "cuda"])
    out = capsys.readouterr().out
    for what in ("weights", "gradients", "optimizer moments", "master weights",
                 "activations (checkpointing=none)"):  # fmt: skip
        assert what in out
    cli_main(["plan", "model=m137", "optim=offload_adamw", "parallel.ep=2", "--ranks", "8"])
    out = capsys.readouterr().out
    for what in ("optimizer moments (experts)", "optimizer moments (replicated)", "parallel.ep=2"):
        assert what in out
    assert "sharded over 8 ranks" in out


def test_compiled_model_matches_eager_with_no_graph_breaks():
    """The torch impl on the CPU in fp32: loss and every gradient within float tolerance;
    dynamo compiles each block in one graph (the grouped matmul is a custom op)."""
    import torch._dynamo

    cfg = tiny()
    tokens, targets = batch()
    ref, ref_grads, _, _ = forward_backward(cfg, tokens, targets)
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    model.compile_blocks()
    torch._dynamo.reset()
    counters.clear()
    out = model(tokens, targets=targets)
    out.loss.backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "override, expected",
    [("+optim.lrr=1", "did you mean optim.lr?"), ("seed=abc", "seed is an integer")],
)
def test_moestack_plan_checks_overrides_as_training_does(capsys, override, expected):
    with pytest.raises(SystemExit) as done:
        cli_main(["plan", "model=m137", override])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and "\n" not in err and expected in err, err
