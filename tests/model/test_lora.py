"""LoRA on the experts and the attention projections (moestack.lora, trainable=lora): the
adapted model equals the base model at step 0, the adapters' gradients equal a per-expert
float64 reference on both expert paths, training moves only the adapters, merging gives the
adapted model's function, and bad values are refused in one line."""

from __future__ import annotations

import math
import os

import pytest
import safetensors.torch
import torch
from helpers.lora import CASES, check_against_reference, check_half_precision_base, random_case
from helpers.runs import killed_at, losses, small_config, small_model

import moestack.kernels.grouped_mm as grouped_mm_module
from moestack import checkpoint
from moestack.config import LoRAConfig, OptimConfig, TelemetryConfig, TrainConfig
from moestack.lora import adapter_parameters, add_adapters, add_adapters_for, merge_adapters
from moestack.memory_plan import plan_memory
from moestack.metrics import read_metrics
from moestack.moe import ExpertAdapters, run_experts
from moestack.trainer import train

IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the triton path needs CUDA or TRITON_INTERPRET=1"))]  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_adapter_output_and_gradients_match_a_per_expert_float64_reference(impl, case):
    dtype = torch.float64 if impl == "torch" else torch.float32  # triton: fp32 kernels
    check_against_reference(impl, dtype, case)


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_adapters_of_any_rank_run_on_grouped_mm_not_a_loop(monkeypatch, case):
    """fp32 on the torch path: every product (rank 1 and odd widths included, padded to
    16-byte rows) is a torch._grouped_mm, forward and backward; no per-expert loop runs."""
    calls = []
    real = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def no_loop(*args):
        raise AssertionError("a per-expert loop ran")

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    monkeypatch.setattr(grouped_mm_module, "_grouped_mm_loop", no_loop)
    check_against_reference("torch", torch.float32, case)
    assert len(calls) == 6  # forward: w1, A1, B1, w2, A2, B2 (their backward is autograd's)


def test_dropout_on_the_expert_adapter_inputs_changes_their_term_only():
    x, w1, w2, experts, weights, adapters = random_case(3, **CASES["ragged groups"])
    torch.manual_seed(0)
    args = (x, w1, w2, experts, weights, "torch")
    no_drop = run_experts(*args, ExpertAdapters(*adapters, 1.0, 0.0))
    dropped = run_experts(*args, ExpertAdapters(*adapters, 1.0, 0.5))
    base = run_experts(*args)
    assert not torch.allclose(dropped, no_drop)  # some adapter inputs were dropped
    # with B = 0 the adapter adds nothing, dropped or not
    zero_b = [
        adapters[0],
        torch.zeros_like(adapters[1]),
        adapters[2],
        torch.zeros_like(adapters[3]),
    ]
    torch.testing.assert_close(run_experts(*args, ExpertAdapters(*zero_b, 1.0, 0.5)), base)


def trained_looking_model(targets: str, dropout: float, **model_changes):
    """small_model with adapters on ``targets`` whose B moved away from zero (as after
    training), the same weights whatever ``dropout``."""
    torch.manual_seed(0)
    model = small_model(moe={"impl": "torch"}, **model_changes).build()
    add_adapters(model, LoRAConfig(rank=4, targets=targets, dropout=dropout), seed=0)
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            if name.endswith("_B"):
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("targets", ["experts", "attention"])
def test_adapter_dropout_acts_in_training_and_not_in_eval(targets):
    """Dropout 0.5 on the adapters' inputs: two training forwards draw different masks;
    in eval the model computes exactly what the same model with dropout 0 computes."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(6))
    dropped, plain = trained_looking_model(targets, 0.5), trained_looking_model(targets, 0.0)
    dropped.train()
    first, second = dropped(tokens).logits, dropped(tokens).logits
    assert not torch.allclose(first, second, atol=1e-4)  # a fresh mask each forward
    plain.train()
    assert not torch.allclose(first, plain(tokens).logits, atol=1e-4)  # the mask acts
    dropped.eval()
    plain.eval()
    assert torch.equal(dropped(tokens).logits, plain(tokens).logits)


@pytest.mark.parametrize("targets", ["experts", "attention", "both"])
def test_adapters_start_at_the_base_model_and_merge_into_its_function(targets):
    torch.manual_seed(0)
    model = small_model(moe={"impl": "torch"}).build()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    base = model(tokens).logits
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    added = add_adapters(model, LoRAConfig(rank=4, targets=targets), seed=0)
    assert torch.equal(model(tokens).logits, base)  # B = 0: the base model exactly
    names = [name for name, _ in adapter_parameters(model)]
    assert names and all("lora" in name for name in names)
    # worked by hand for small_model (D = F = 32, 4 experts, 2 layers) at rank 4: per layer
    # the experts' 4 x (32x4 + 4x64 + 32x4 + 4x32) = 2560, attention's qkv 4x32 + 96x4 and
    # out 4x32 + 32x4 = 768
    want = 2 * {"experts": 2560, "attention": 768, "both": 2560 + 768}[targets]
    assert added == want == sum(p.numel() for _, p in adapter_parameters(model))
    with torch.no_grad():  # trained adapters: B moved away from zero
        for name, p in adapter_parameters(model):
            if name.endswith("_B"):
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    adapted = model(tokens).logits
    assert not torch.allclose(adapted, base, atol=1e-4)
    assert merge_adapters(model) > 0
    assert not any("lora" in k for k in model.state_dict())
    assert set(model.state_dict()) == set(base_state)  # the base model's tensors only
    torch.testing.assert_close(model(tokens).logits, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS[1:])
def test_triton_adapters_at_step_0_equal_the_base_model_within_rounding(impl):
    """With adapters the triton path runs the base product on its unfused grouped GEMM (the
    fused expert kernel has no low-rank term), so step 0 equals the fused base model up to
    the order of fp32 sums, not bitwise (the torch path: bitwise, test above)."""
    torch.manual_seed(0)
    model = small_model(moe={"impl": impl}).build()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = model(tokens).logits
        add_adapters(model, LoRAConfig(rank=4, targets="both"), seed=0)
        adapted = model(tokens).logits
    torch.testing.assert_close(adapted, base, rtol=1e-6, atol=1e-6)


def test_adapters_do_not_depend_on_the_global_random_state():
    def adapters_after(draws: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = small_model().build()
        torch.rand(draws)  # whatever else drew from the global generator
        add_adapters(model, LoRAConfig(rank=2, targets="both"), seed=3)
        return {name: p.detach().clone() for name, p in adapter_parameters(model)}

    first, second = adapters_after(1), adapters_after(1000)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def _tensors(ckpt_dir):
    return safetensors.torch.load_file(ckpt_dir / checkpoint.MODEL_FILE)


@pytest.mark.parametrize("trainable", ["lora", "routers+lora"])
def test_training_moves_only_the_adapters_and_the_routers_asked_for(tmp_path, trainable):
    cfg = small_config(trainable=trainable, lora=LoRAConfig(rank=4, targets="both"), steps=10,
                       ckpt_every=0, optim=OptimConfig(lr=1e-2, warmup_steps=1))  # fmt: skip
    initial = cfg.model.build(seed=cfg.seed).state_dict()  # the run's base (its seed)
    train(cfg, tmp_path / "run")
    final = _tensors(checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    moved = sorted(k for k in final if k not in initial or not torch.equal(final[k], initial[k]))
    adapters = sorted(k for k in final if "lora" in k)
    routers = sorted(k for k in initial if k.endswith("router.weight"))
    assert adapters and all(k not in initial for k in adapters)
    assert moved == sorted(adapters + (routers if trainable == "routers+lora" else []))
    for k in adapters:  # every adapter trained: B left zero, A its draw
        assert final[k].abs().sum() > 0


def test_a_killed_lora_run_with_telemetry_resumes_exactly(tmp_path):
    def cfg(**changes):
        return small_config(trainable="lora", lora=LoRAConfig(rank=2, dropout=0.1), steps=20,
                            telemetry=TelemetryConfig(), log_every=5, **changes)  # fmt: skip

    train(cfg(), tmp_path / "reference")
    with killed_at(13):
        train(cfg(), tmp_path / "crashed")
    train(cfg(resume=True), tmp_path / "crashed")
    assert losses(tmp_path / "crashed") == losses(tmp_path / "reference")
    records = read_metrics(tmp_path / "crashed" / "metrics.jsonl")
    rates = [r["telemetry/hit_rate"] for r in records if "telemetry/hit_rate" in r]
    assert len(rates) == 4 and all(0 < rate <= 1 for rate in rates)  # every log record's replay


@pytest.mark.parametrize("checkpointing", ["moe", "block", "selective"])
def test_adapter_gradients_are_the_same_under_activation_checkpointing(checkpointing):
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))

    def grads(mode: str) -> dict[str, torch.Tensor]:
        model = trained_looking_model("both", 0.2, checkpointing=mode)
        model.set_trainable("lora")
        torch.manual_seed(1)  # the same dropout masks in both runs
        model(tokens, tokens).loss.backward()
        return {n: p.grad for n, p in adapter_parameters(model)}

    want, got = grads("none"), grads(checkpointing)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


MIXED = [("torch", torch.bfloat16), ("torch", torch.float16),
         pytest.param("triton", torch.float16, marks=IMPLS[1].marks)]  # fmt: skip


@pytest.mark.parametrize(("impl", "base_dtype"), MIXED)
def test_experts_with_half_precision_weights_and_fp32_adapters(impl, base_dtype):
    """lora.base_dtype's layout at the experts: w1/w2 in half precision, the input and the
    adapters in fp32. The experts compute in the weights' dtype (the interpreter runs Triton
    in fp16, not bf16) and give the float64 reference of the same values within that
    dtype's rounding; the adapters' gradients come back in fp32."""
    check_half_precision_base(impl, base_dtype)


@pytest.mark.parametrize("trainable", ["lora", "routers+lora"])
def test_a_bf16_base_starts_at_the_bf16_base_model_with_fp32_adapters(trainable):
    """lora.base_dtype=bfloat16: every frozen weight bf16, the adapters (and trained routers)
    fp32, and at step 0 the logits of the base model held in bf16 (its routers in fp32
    where they train), bitwise (the torch path)."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    base = small_model(moe={"impl": "torch"}).build()
    routers = {id(moe.router.weight) for moe in base.moe_layers}
    for p in base.parameters():
        if not (trainable == "routers+lora" and id(p) in routers):
            p.data = p.data.bfloat16()
    torch.manual_seed(0)
    model = small_model(moe={"impl": "torch"}).build()
    lora = LoRAConfig(rank=4, targets="both", base_dtype="bfloat16")
    add_adapters_for(model, trainable, lora, seed=0)
    model.set_trainable(trainable)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(dtypes[n] == torch.float32 for n in trained)
    assert {dtypes[n] for n in dtypes if n not in trained} == {torch.bfloat16}
    assert any("router" in n for n in trained) == (trainable == "routers+lora")
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, base(tokens).logits)


def test_a_bf16_base_lora_run_trains_only_its_fp32_adapters(tmp_path):
    """A whole run with lora.base_dtype=bfloat16: the checkpoint holds the frozen weights in
    bf16, unchanged from the base model's draw, and the adapters in fp32, trained."""
    lora = LoRAConfig(rank=4, targets="both", base_dtype="bfloat16")
    cfg = small_config(trainable="lora", lora=lora, steps=6, ckpt_every=0,
                       optim=OptimConfig(lr=1e-2, warmup_steps=1))  # fmt: skip
    initial = dict(cfg.model.build(seed=cfg.seed).named_parameters())  # the run's base
    train(cfg, tmp_path / "run")
    final = _tensors(checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    adapters = [k for k in final if "lora" in k]
    assert adapters and all(final[k].dtype == torch.float32 for k in adapters)
    assert all(final[k].abs().sum() > 0 for k in adapters)  # B moved from zero, A its draw
    frozen = [k for k in initial if k in final]
    assert len(frozen) >= len(initial) - 1  # a tied head is stored once
    for k in frozen:
        assert final[k].dtype == torch.bfloat16, k
        assert torch.equal(final[k], initial[k].detach().bfloat16()), k
    steps = losses(tmp_path / "run")
    assert len(steps) == 6 and all(math.isfinite(v) for v in steps.values())


def test_the_memory_plan_counts_the_adapters_alone_as_trained():
    full = plan_memory(small_config(), 1, "cpu")
    plan = plan_memory(small_config(trainable="lora", lora=LoRAConfig(rank=4)), 1, "cpu")
    trained = 2 * 2560  # the experts' adapters of small_model at rank 4 (worked above)
    assert plan.line("gradients").bytes == 4 * trained  # fp32 gradients of the adapters only
    # torch AdamW: two fp32 moments, and a 4-byte step for each of the 8 adapter tensors
    assert plan.line("optimizer state").bytes == 2 * 4 * trained + 4 * 8
    weights = full.line("weights").bytes + 4 * trained  # the base model and its adapters
    assert plan.line("weights").bytes == weights
    assert plan.line("gradients").bytes < full.line("gradients").bytes / 4


def test_the_memory_plan_counts_a_bf16_base_at_two_bytes():
    """lora.base_dtype=bfloat16: the frozen weights 2 bytes each, the adapters 4."""
    full = plan_memory(small_config(), 1, "cpu")
    lora = LoRAConfig(rank=4, base_dtype="bfloat16")
    plan = plan_memory(small_config(trainable="lora", lora=lora), 1, "cpu")
    base = full.line("gradients").bytes // 4  # a full fine-tune trains every base weight
    buffers = full.line("weights").bytes - 4 * base
    trained = 2 * 2560  # the experts' adapters of small_model at rank 4 (worked above)
    assert plan.line("weights").bytes == 2 * base + 4 * trained + buffers
    assert plan.line("gradients").bytes == 4 * trained
    assert "frozen params in their own dtype" in plan.line("weights").formula


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(lora={"rank": 0}), r"lora.rank=0 must be >= 1"),
        (dict(lora={"rank": 33}), r"lora.rank=33 exceeds min\(in, out\)=32 of the experts"),
        (dict(lora={"rank": 33, "targets": "attention"}), r"of the attention projections"),
        (dict(lora={"targets": "mlp"}), r"lora.targets='mlp' is unknown"),
        (dict(lora={"alpha": math.nan}), r"lora.alpha=nan must be a positive number"),
        (dict(lora={"dropout": 1.0}), r"lora.dropout=1.0 must be in \[0, 1\)"),
        (dict(model=small_model(moe={"impl": "megablocks"})), r"megablocks has no low-rank"),
    ],
)
def test_bad_lora_values_are_refused_in_one_line(overrides, message):
    fields = dict(small_config().__dict__, trainable="lora", **{"lora": {"rank": 4}})
    fields.update(overrides)
    with pytest.raises(ValueError, match=message) as err:
        TrainConfig(**fields)
    assert "\n" not in str(err.value)


def test_an_expert_store_refuses_a_layer_with_adapters():
    from moestack.cache.offload import check_servable
    from moestack.errors import MoestackError

    torch.manual_seed(0)
    model = small_model().build()
    check_servable(model.moe_layers[0], 0)  # no adapters: served as it is
    add_adapters(model, LoRAConfig(rank=2), seed=0)
    with pytest.raises(MoestackError, match="MoE layer 1 carries LoRA adapters"):
        check_servable(model.moe_layers[1], 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_blocks_with_adapters_match_eager_without_graph_breaks(impl):
    """A block with adapters on its experts and attention compiles whole (no graph break)
    and gives eager's loss and gradients. One block: compile_blocks compiles each block on
    its own, every block the same code (a second block would only compile it again)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    tokens = torch.randint(1, 256, (2, 32), generator=torch.Generator().manual_seed(4))

    def run(backend: str | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
        torch.manual_seed(0)
        model = small_model(n_layers=1, moe={"impl": impl}).build()
        add_adapters(model, LoRAConfig(rank=4, targets="both"), seed=0)
        model.set_trainable("routers+lora")
        with torch.no_grad():
            for name, p in adapter_parameters(model):
                if name.endswith("_B"):
                    p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
        if backend:
            torch._dynamo.reset()
            model.compile_blocks(backend=backend)
        counters.clear()
        loss = model(tokens, tokens).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return loss.detach(), grads, dict(counters["graph_break"])

    eager_loss, eager_grads, _ = run(None)
    loss, grads, breaks = run("aot_eager_decomp_partition")
    assert breaks == {}, breaks
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
