"""TieredAdamW (optim=tiered) against the equations of docs/optim.md ("Tiered state"),
written out here in float64, and against torch.optim.AdamW where the policy makes it AdamW."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _tiered_testlib import (
    SAVE_AFTER,
    STEPS,
    ep_rank_worker,
    grad_for,
    rank_worker,
    run_steps,
    small_model,
    tiered,
    weights,
)
from helpers.multiprocess import file_rendezvous, spawn_ranks

from moestack.config import ModelConfig, MoEConfig, OptimConfig
from moestack.kernels import host_tiered
from moestack.lora import LoRAConfig, add_adapters
from moestack.optim import expert_state
from moestack.optim.tiered import TieredAdamW
from moestack.optim.tiered_bytes import planned_state_bytes
from moestack.populations import PopulationConfig, classify

LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8

# -- the float64 reference of the documented equations -----------------------------------


def reference_update(w, g, st, momentum, factored, t, wd, clip, stacked):  # noqa: ANN001, ANN201
    """One step of the documented update in float64 (w, g: float64; st: this tensor's
    state, filled on the first call)."""
    b1, b2 = BETAS
    if factored and w.ndim >= 2:
        r = b2 * st.get("r", 0.0) + (1 - b2) * (g * g).mean(-1)
        c = b2 * st.get("c", 0.0) + (1 - b2) * (g * g).mean(-2)
        st["r"], st["c"] = r, c
        v = r[..., :, None] * c[..., None, :] / r.mean(-1)[..., None, None].clamp_min(1e-30)
    else:
        v = st["v"] = b2 * st.get("v", 0.0) + (1 - b2) * g * g
    v_hat = v / (1 - b2**t)
    if momentum:
        m = st["m"] = b1 * st.get("m", 0.0) + (1 - b1) * g
        d = m / (1 - b1**t)
    else:
        d = g
    u = d / (v_hat.sqrt() + EPS)
    if clip > 0:
        dims = tuple(range(1, u.ndim)) if stacked else tuple(range(u.ndim))
        rms = u.square().mean(dim=dims, keepdim=True).sqrt()
        u = u / (rms / clip).clamp_min(1.0)
    if w.ndim >= 2:
        w = w * (1 - LR * wd)
    return w - LR * u


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _grad(shape: tuple[int, ...], step: int, zero_expert: bool) -> torch.Tensor:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    if zero_expert:
        g[1] = 0  # expert 1 got no tokens this step
    return g * 3


CASES = [
    # shape, stacked, momentum, factored, clip, weight decay
    ((3, 5, 7), True, False, True, 1.0, 0.1),  # experts: odd shapes, per-expert factors
    ((3, 5, 7), True, False, True, 0.0, 0.0),  # clipping and decay off
    ((3, 5, 7), True, True, False, 0.3, 0.1),  # experts with momentum and a full moment
    ((5, 3), False, True, True, 0.5, 0.1),  # backbone matrix
    ((4, 9), False, False, False, 1.0, 0.1),  # router
    ((7,), False, True, True, 1.0, 0.1),  # a 1-D tensor: always full, never decayed
]


@pytest.mark.parametrize("shape,stacked,momentum,factored,clip,wd", CASES)
def test_update_matches_float64_reference(shape, stacked, momentum, factored, clip, wd) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    w0 = torch.randn(shape, dtype=torch.float64)
    p = torch.nn.Parameter(w0.float())
    group = {
        "params": [("w", p)], "population": "experts" if stacked else "backbone",
        "momentum": "float32" if momentum else "none",
        "second_moment": "factored" if factored else "full",
        "weight_decay": wd, "stacked": {"w"} if stacked else set(),
    }  # fmt: skip
    opt = TieredAdamW([group], lr=LR, betas=BETAS, eps=EPS, clip_update=clip, master="float32")
    w, st = w0.clone(), {}
    for t in range(1, 7):
        g = _grad(shape, t, zero_expert=stacked and t % 2 == 0)
        p.grad = g.float()
        opt.step()
        w = reference_update(w, g, st, momentum, factored, t, wd, clip, stacked)
        assert _relerr(p.data, w) < 2e-6, f"step {t}"
    expected = {"v"} if not factored or len(shape) < 2 else {"row", "col"}
    expected |= {"m"} if momentum else set()
    assert set(opt.state[p]) - {"step"} == expected


def test_an_expert_without_tokens_moves_by_weight_decay_alone() -> None:
    """Zero gradient: the factored estimate is finite, the update of that expert is 0, only
    decay moves it (by exactly lr x wd of itself)."""
    p = torch.nn.Parameter(torch.randn(3, 4, 6))
    group = {"params": [("w", p)], "population": "experts", "momentum": "none",
             "second_moment": "factored", "weight_decay": 0.1, "stacked": {"w"}}  # fmt: skip
    opt = TieredAdamW([group], lr=LR, clip_update=1.0, master="float32")
    g = torch.randn(3, 4, 6)
    g[2] = 0
    before = p.detach().clone()
    p.grad = g
    opt.step()
    assert torch.equal(p.data[2], before[2] * (1 - LR * 0.1))
    assert torch.isfinite(p.data).all()


def test_all_full_fp32_policy_is_torch_adamw() -> None:
    """momentum=float32, second_moment=full everywhere, clipping off: torch AdamW's update."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(a.detach().clone())
    group = {"params": [("w", a)], "population": "backbone", "momentum": "float32",
             "second_moment": "full", "weight_decay": 0.1, "stacked": set()}  # fmt: skip
    ours = TieredAdamW([group], lr=LR, betas=BETAS, eps=EPS, clip_update=0.0, master="float32")
    ref = torch.optim.AdamW([b], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1)
    for t in range(10):
        g = torch.randn(6, 5, generator=torch.Generator().manual_seed(t))
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert _relerr(a.data, b.data) < 1e-6


def test_bf16_momentum_is_rounded_each_step() -> None:
    """momentum=bfloat16: the first moment is kept rounded to bf16 each step, and the update
    uses it as kept (the float64 reference rounds M before using it)."""
    torch.manual_seed(0)
    w0 = torch.randn(4, 5, dtype=torch.float64)
    p = torch.nn.Parameter(w0.float())
    group = {"params": [("w", p)], "population": "backbone", "momentum": "bfloat16",
             "second_moment": "full", "weight_decay": 0.0, "stacked": set()}  # fmt: skip
    opt = TieredAdamW([group], lr=LR, betas=BETAS, eps=EPS, clip_update=0.0, master="float32")
    m = torch.zeros(4, 5, dtype=torch.float64)
    v = torch.zeros(4, 5, dtype=torch.float64)
    w = w0.clone()
    for t in range(1, 4):
        g = torch.randn(4, 5, generator=torch.Generator().manual_seed(t))
        p.grad = g
        opt.step()
        g = g.double()
        m = (BETAS[0] * m + (1 - BETAS[0]) * g).to(torch.bfloat16).double()
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        u = (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
        w = w - LR * u
    assert opt.state[p]["m"].dtype == torch.bfloat16
    assert torch.equal(opt.state[p]["m"].double(), m)
    assert _relerr(p.data, w) < 2e-6


# -- stochastic rounding -------------------------------------------------------------------


def stochastic_round_bf16(w: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``w`` to bf16 as master=none writes it: 16 random low bits added, then cut."""
    return host_tiered.round_onto_bf16_grid_(w.clone(), noise).to(torch.bfloat16)


def test_stochastic_rounding_is_unbiased() -> None:
    """Each rounding is one of the two bf16 neighbours (from the bits: the value cut to bf16
    and the next one away from zero); the mean of N roundings is within 5 standard errors
    (spacing / (2 sqrt N) at most) of the fp32 value; values next to powers of two too."""
    torch.manual_seed(0)
    w = torch.randn(64) * torch.logspace(-3, 3, 64)
    w[:8] = torch.tensor([0.99902, -0.99902, 1.99, 0.4999, 1.0001, -2.0001, 3.9999, 0.25])
    n = 4000
    noise = torch.randint(0, 1 << 16, (n, 64), dtype=torch.int32)
    rounded = stochastic_round_bf16(w.expand(n, 64).contiguous(), noise).double()
    bits = w.view(torch.int32)
    down = (bits & -65536).view(torch.float32).double()
    up = ((bits & -65536) + 65536).view(torch.float32).double()  # the next one in magnitude
    assert ((rounded == down) | (rounded == up)).all()
    bound = 5 * (up - down).abs() / (2 * math.sqrt(n))
    assert ((rounded.mean(0) - w.double()).abs() <= bound).all()


def test_stochastic_rounding_passes_non_finite() -> None:
    w = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    out = stochastic_round_bf16(w, torch.full((4,), 65535, dtype=torch.int32))
    assert out[0] == math.inf and out[1] == -math.inf and out[2].isnan() and out[3] == 1.0


def test_master_none_resumes_bitwise() -> None:
    """bf16 weights, no master: 4 steps straight equal 2 steps, a saved state loaded into a
    new optimizer (its own seed drawn otherwise), and 2 more, bit for bit."""
    straight = small_model()
    run_steps(straight, tiered(straight), range(STEPS))
    first = small_model()
    opt = tiered(first)
    run_steps(first, opt, range(SAVE_AFTER))
    saved = opt.state_dict()
    torch.manual_seed(99)  # a resumed process's generator is elsewhere
    again = TieredAdamW(_regroup(first), lr=1e-2, clip_update=1.0)
    again.load_state_dict(saved)
    run_steps(first, again, range(SAVE_AFTER, STEPS))
    for name, p in weights(straight).items():
        assert torch.equal(p, dict(first.named_parameters())[name].detach()), name


def _regroup(model: torch.nn.Module) -> list[dict]:
    from moestack.optim.tiered import tiered_groups

    named = list(model.named_parameters())
    return tiered_groups(named, classify(model), OptimConfig(name="tiered").policy, 0.1)


def test_master_none_in_fp32_storage_is_the_bf16_run_on_the_bf16_grid() -> None:
    """master=none with fp32 storage (param_dtype=float32, for a CPU): every weight stays on
    the bf16 grid and equals the bf16-stored run's, bit for bit, on the same gradients."""
    stored = small_model(torch.bfloat16)
    grid = small_model(torch.float32)
    for p in grid.parameters():
        p.data = p.data.bfloat16().float()
    a, b = tiered(stored), tiered(grid)
    for step in range(3):
        run_steps(stored, a, range(step, step + 1))
        for q, p in zip(grid.parameters(), stored.parameters(), strict=True):
            q.grad = p.grad.float()  # the bf16 run's gradients, exactly
        b.step()
    for (name, p), q in zip(stored.named_parameters(), grid.parameters(), strict=True):
        assert torch.equal(q.data, p.data.float()), name
        assert torch.equal(q.data, q.data.bfloat16().float()), name


def test_master_float32_keeps_an_fp32_copy() -> None:
    """With an fp32 master the bf16 weights are the master rounded to nearest."""
    model = small_model()
    opt = tiered(model, master="float32")
    run_steps(model, opt, range(3))
    for p in model.parameters():
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(p.data, master.to(torch.bfloat16))


# -- populations, bytes, settings ------------------------------------------------------------


def test_populations_of_a_moestack_model_with_adapters() -> None:
    cfg = ModelConfig(vocab_size=40, d_model=12, n_layers=1, n_heads=2,
                      moe=MoEConfig(num_experts=3, top_k=1, d_ff=10))  # fmt: skip
    model = cfg.build()
    add_adapters(model, LoRAConfig(rank=2, targets="both"), seed=0)
    info = classify(model)
    assert info["embed.weight"].population == "embeddings"
    assert info["layers.0.moe.w1"].population == "experts" and info["layers.0.moe.w1"].stacked
    assert info["layers.0.moe.router.weight"].population == "routers"
    assert info["layers.0.attn.qkv.weight"].population == "backbone"
    assert info["norm.weight"].population == "backbone"
    lora = [n for n in info if "lora" in n]
    assert lora and all(info[n].population == "adapters" for n in lora)
    assert info["layers.0.moe.lora_w1_A"].stacked


def test_state_bytes_counted_by_hand() -> None:
    """Default policy, master none, every population stepped once: bytes worked by hand."""
    model = small_model()
    opt = tiered(model)
    run_steps(model, opt, range(1))
    d, f, e, v, layers = 12, 10, 3, 40, 2
    experts = layers * 4 * (e * d + e * 2 * f + e * f + e * d)  # w1 [E,D,2F], w2 [E,F,D] factors
    routers = layers * 4 * e * d  # full fp32 second moment
    embeddings = 4 * v * d + 4 * (v + d)  # momentum + row/col factors
    attn = layers * (4 * 3 * d * d + 4 * (3 * d + d) + 4 * d * d + 4 * (d + d))
    norms = (2 * layers + 1) * 8 * d  # 1-D: momentum + full moment
    assert opt.state_bytes() == {
        "experts": experts, "routers": routers, "embeddings": embeddings,
        "backbone": attn + norms, "adapters": 0,
    }  # fmt: skip


@pytest.mark.parametrize("master", ["none", "float32"])
def test_planned_bytes_are_the_bytes_held(master: str) -> None:
    """The plan from shapes alone (meta tensors) is what the optimizer holds after a step."""
    model = small_model()
    opt = tiered(model, master=master)
    run_steps(model, opt, range(1))
    with torch.device("meta"):
        shapes = small_model()
    cfg = OptimConfig(name="tiered")
    named = list(shapes.named_parameters())
    planned = planned_state_bytes(named, classify(shapes), cfg.policy, master, torch.bfloat16)
    assert planned == opt.state_bytes()


def test_transformers_populations() -> None:
    """A transformers Qwen3-MoE model (v5: stacked experts, a TopKRouter), classified by
    its own module types."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    info = classify(model)
    by_pop: dict[str, list[str]] = {}
    for name, i in info.items():
        by_pop.setdefault(i.population, []).append(name)
    assert sorted(by_pop["experts"]) == [
        "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]  # fmt: skip
    assert all(info[n].stacked for n in by_pop["experts"])
    assert by_pop["routers"] == ["model.layers.0.mlp.gate.weight"]
    assert sorted(by_pop["embeddings"]) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert "model.layers.0.self_attn.q_proj.weight" in by_pop["backbone"]


@pytest.mark.parametrize(
    "override,field",
    [
        ({"master": "fp16"}, "optim.master"),
        ({"clip_update": -1.0}, "optim.clip_update"),
        ({"experts": {"momentum": "int8"}}, "optim.experts.momentum"),
        ({"routers": {"second_moment": "diag"}}, "optim.routers.second_moment"),
        ({"backbone": {"weight_decay": -0.1}}, "optim.backbone.weight_decay"),
    ],
)
def test_bad_settings_refused_naming_the_field(override: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        OptimConfig(name="tiered", **override)


def test_policy_fields_reach_the_groups() -> None:
    model = small_model(torch.float32)
    opt = tiered(model, experts=PopulationConfig(momentum="bfloat16", second_moment="full",
                                                 weight_decay=0.0))  # fmt: skip
    group = next(g for g in opt.param_groups if g["population"] == "experts")
    assert (group["momentum"], group["second_moment"], group["weight_decay"]) == (
        "bfloat16", "full", 0.0)  # fmt: skip


# -- several ranks ---------------------------------------------------------------------------


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_two_ranks_equal_one_process_and_reshard(tmp_path: Path) -> None:
    """2 gloo ranks, each holding the state of its own tensors only, update as one process
    bit for bit (bf16 weights, stochastic rounding); a state they saved resumes in one
    process as the uninterrupted run."""
    spawn_ranks(rank_worker, (2, file_rendezvous(tmp_path), str(tmp_path)), 2, "tiered ranks")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    one = small_model()
    opt = tiered(one)
    run_steps(one, opt, range(SAVE_AFTER))
    whole = sum(opt.state_bytes().values())
    run_steps(one, opt, range(SAVE_AFTER, STEPS))
    for name, p in weights(one).items():
        for r in ranks:
            assert torch.equal(r["weights"][name], p), name
    held = [r["held"] for r in ranks]
    assert sum(held) == whole and max(held) < 0.75 * whole, held
    assert ranks[0]["metrics"]["optim/experts/state_bytes"] == opt.metrics()[
        "optim/experts/state_bytes"]  # fmt: skip
    resumed = small_model()
    again = tiered(resumed)
    run_steps(resumed, again, range(SAVE_AFTER))
    again.load_state_dict(ranks[1]["saved"])
    run_steps(resumed, again, range(SAVE_AFTER, STEPS))
    for name, p in weights(one).items():
        assert torch.equal(dict(resumed.named_parameters())[name].detach(), p), name


def _one_process_ep_reference(steps: range, model=None, opt=None):  # noqa: ANN001, ANN202
    model = model if model is not None else small_model(experts=4)
    if opt is None:
        torch.manual_seed(1)
        opt = tiered(model)
    for step in steps:
        for n, p in model.named_parameters():
            p.grad = grad_for(n, p.shape, step).to(p.dtype)
        opt.step()
    return model, opt


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_expert_parallel_equals_one_process_and_reshards(tmp_path: Path) -> None:
    """parallel.ep=2 on 2 gloo ranks, 2 of 4 experts each: every rank's weights (its experts'
    rows, the replicated tensors) are one process's bit for bit (stochastic rounding keyed by
    the global expert id); the state they saved resumes in one process as the uninterrupted
    run."""
    spawn_ranks(ep_rank_worker, (2, file_rendezvous(tmp_path), str(tmp_path)), 2, "tiered ep")
    ranks = [torch.load(tmp_path / f"ep_rank{r}.pt", weights_only=True) for r in range(2)]
    one, _ = _one_process_ep_reference(range(STEPS))
    want = weights(one)
    for r in ranks:
        for name, got in r["weights"].items():
            lo = r["rows"].get(name)
            expected = want[name] if lo is None else want[name][lo : lo + got.shape[0]]
            assert torch.equal(got, expected), name
    assert ranks[0]["saved"].keys() == ranks[1]["saved"].keys()
    model, opt = _one_process_ep_reference(range(SAVE_AFTER))
    opt.load_state_dict(ranks[1]["saved"])
    _one_process_ep_reference(range(SAVE_AFTER, STEPS), model, opt)
    for name, p in weights(model).items():
        assert torch.equal(p, want[name]), name
    # A checkpoint's pieces: rank 0's common part holds no expert entry, each rank's part
    # its own experts' (2 of 4, global ids), and joined they are the gathered state.
    whole = ranks[0]["saved"]["entries"]
    expert_keys = {k for k in whole if "/expert" in k}
    assert expert_keys and not expert_keys & ranks[0]["common"]["entries"].keys()
    for r in ranks:
        (part,) = r["own"]
        ids = {int(k.rsplit("expert", 1)[1]) for k in part["entries"]}
        assert ids == {2 * r["rank"], 2 * r["rank"] + 1}, ids
    joined = expert_state.merge(ranks[0]["common"], [r["own"][0] for r in ranks])
    assert joined["entries"].keys() == whole.keys()
    for key, entry in whole.items():
        for k, v in entry.items():
            got = joined["entries"][key][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, (key, k)
