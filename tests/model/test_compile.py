"""torch.compile of the model (``compile=true``): the Triton experts as custom ops, every
checkpointing mode, dynamo's settings left as they were, and a compiled training run.

Compiling is slow on two cores (inductor's first compile of a graph, C++ included, takes
15-25 s there; a graph it has compiled before comes from its cache in 1-3 s), so the models
are tiny, each compiled model serves several asserts, and inductor compiles one model: the
triton one, whose graphs the compiled training run (the same model and batch) finds in the
cache. The checkpointing modes compile with ``aot_eager_decomp_partition``: dynamo, AOT
autograd with inductor's decompositions and its min-cut partitioner (where the checkpointing
policies act), all but inductor's code generation; tests/memory_plan/test_memory.py compiles
the torch impl with inductor. ``torch._dynamo.reset()`` before each compile: the blocks of
every model share one code object, and its recompile limit must not be reached across tests.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch._dynamo
from helpers.runs import losses, small_config, small_model
from torch._dynamo.utils import counters

from moestack.config import ModelConfig, RouterConfig, TrainConfig
from moestack.model import MoETransformer
from moestack.trainer import train

MODES = ("none", "moe", "block", "selective")
KERNELS = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
# Locality losses too: they size their pieces on the host, so nothing breaks the graph.
LOCALITY = RouterConfig(temporal=0.1, window=0.05, window_size=8)


def model_config(impl: str, checkpointing: str = "none", router: RouterConfig | None = None):
    """small_config's model (the compiled training run's) with these settings."""
    model = small_model(checkpointing=checkpointing, moe={"impl": impl})
    return TrainConfig(model=model, router=router or RouterConfig(), data={"seq_len": 32}).model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the compiled training run's shape (2 x 32)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)


def run(cfg: ModelConfig, backend: str | None = None, infer: bool = False) -> dict:
    """Loss, aux loss, every gradient and the graph breaks of one forward and backward,
    eager or (with a backend) with compiled blocks; with ``infer`` also the logits of an
    evaluation-mode forward without gradients (the training run's final evaluation)."""
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    model.train()
    if backend:
        torch._dynamo.reset()
        model.compile_blocks(backend=backend)
    counters.clear()
    tokens, targets = batch()
    out = model(tokens, targets=targets)
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "aux_loss": out.aux_loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "breaks": dict(counters["graph_break"]),
        "graphs": counters["stats"]["unique_graphs"],
        "logits": infer_logits(model, tokens) if infer else None,
    }


def infer_logits(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def assert_same(compiled: dict, eager: dict) -> None:
    torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled["aux_loss"], eager["aux_loss"], rtol=1e-5, atol=1e-6)
    assert compiled["grads"].keys() == eager["grads"].keys()
    for name, grad in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def triton_runs() -> tuple[dict, dict]:
    """The triton impl (the interpreter on the CPU, fp32), eager and compiled."""
    if not KERNELS:
        pytest.skip("the triton impl needs CUDA or TRITON_INTERPRET=1 (set by conftest.py)")
    cfg = model_config("triton")
    return run(cfg, infer=True), run(cfg, backend="inductor", infer=True)


def test_compiled_triton_impl_matches_eager(triton_runs):
    eager, compiled = triton_runs
    assert_same(compiled, eager)
    torch.testing.assert_close(compiled["logits"], eager["logits"], rtol=1e-5, atol=1e-5)


def test_compiled_triton_impl_has_no_graph_break(triton_runs):
    """The experts are custom ops (moestack::triton_moe_experts and its backward): dynamo
    keeps them in the block's graph."""
    _, compiled = triton_runs
    assert compiled["breaks"] == {}, compiled["breaks"]
    assert compiled["graphs"] >= 1


def test_compiled_triton_impl_with_selective_checkpointing(triton_runs):
    """Selective checkpointing sees the experts as one op (recomputed in backward, as in
    eager, where its kernels were invisible to the policy): mode none's gradients."""
    eager, _ = triton_runs
    cfg = model_config("triton", "selective")
    compiled = run(cfg, backend="aot_eager_decomp_partition")
    assert_same(compiled, eager)
    assert compiled["breaks"] == {}, compiled["breaks"]


def test_locality_losses_trace_whole_with_dynamo_defaults():
    """Every router loss and bias update in a compiled block, with dynamo's default settings
    (no value read from a tensor, no shape from data): no graph break, eager's loss."""
    config = torch._dynamo.config
    assert not config.capture_scalar_outputs and not config.capture_dynamic_output_shape_ops
    router = RouterConfig(temporal=0.1, consistency=0.1, window=0.05, window_size=8, pin=0.1,
                          anchor=0.1, score="sigmoid", bias_update_rate=0.01)  # fmt: skip
    compiled = run(model_config("torch", "none", router), backend="eager")
    assert compiled["breaks"] == {}, compiled["breaks"]
    assert compiled["loss"] == run(model_config("torch", "none", router))["loss"]


@pytest.fixture(scope="module")
def eager_none() -> dict:
    return run(model_config("torch", "none", LOCALITY))


@pytest.mark.parametrize("mode", MODES)
def test_compiled_checkpointing_gives_eager_mode_none_gradients(mode, eager_none):
    compiled = run(model_config("torch", mode, LOCALITY), backend="aot_eager_decomp_partition")
    assert_same(compiled, eager_none)
    assert compiled["breaks"] == {}, compiled["breaks"]


def test_compiled_training_run_matches_eager(tmp_path, triton_runs):
    """compile=true through the trainer (the triton impl: triton_runs compiled its graphs):
    the same losses, step by step, as the eager run."""
    cfg = dict(model=model_config("triton"), batch_size=2, steps=2, eval_batches=1,
               ckpt_every=0, log_every=1, threads=0)  # fmt: skip
    train(small_config(**cfg), tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    train(small_config(compile=True, **cfg), tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] >= 2  # the training step and the evaluation
    assert not counters["graph_break"], dict(counters["graph_break"])
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(eager) == sorted(compiled) == [1, 2]
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-5), step
