"""Layout-free initialisation (moestack/seeding.py, MoETransformer.init_weights): every rank of
every (ranks, ep) layout starts from the weights of the model built whole, and a rank that
builds its experts on meta allocates none of another rank's."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moestack import ModelConfig, MoEConfig, lora, seeding
from moestack.parallel import ExpertParallelMesh, shard_experts

CFG = ModelConfig(d_model=24, n_heads=2, n_layers=2, moe=MoEConfig(8, 2, 20))
LAYOUTS = [(1, 1), (2, 2), (4, 2), (4, 4)]  # (ranks, ep)


def _mesh(world: int, ep: int, rank: int) -> ExpertParallelMesh:
    """Rank ``rank``'s place in a (world, ep) mesh; no process groups (sharding alone)."""
    return ExpertParallelMesh(world, ep, rank % ep, rank // ep, None, None)


def _rank_model(world: int, ep: int, rank: int, seed: int):
    """What the trainer builds on rank ``rank`` (moestack.trainer._build_model): experts on
    meta, cut to the rank's rows (memory for those alone), drawn."""
    model = CFG.build(seed=seed, experts_on_meta=ep > 1)
    if ep > 1:
        shard_experts(model, _mesh(world, ep, rank))
        model.init_experts(seed)
    return model


def test_weights_depend_on_the_seed_alone() -> None:
    torch.manual_seed(1)
    a = CFG.build(seed=7)
    torch.manual_seed(2)
    torch.randn(100)  # the global stream elsewhere
    b = CFG.build(seed=7)
    c = CFG.build(seed=8)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert p.ndim == 1 or not torch.equal(p, r), name  # norms start at one either way
    torch.manual_seed(3)  # no seed: one drawn from the global stream, so it still decides
    d = CFG.build()
    torch.manual_seed(3)
    e = CFG.build()
    assert all(torch.equal(p, q) for p, q in zip(d.parameters(), e.parameters(), strict=True))


def test_the_draws_follow_the_config() -> None:
    """Normal(0, init_std) weights, residual outputs at init_std / sqrt(2 n_layers), expert
    down projections at init_std / sqrt(2), norms at one (an MoE layer's statistics)."""
    cfg = ModelConfig(d_model=64, n_heads=2, n_layers=2, moe=MoEConfig(8, 2, 96), init_std=0.03)
    model = cfg.build(seed=0)
    layer = model.layers[1]
    want = {
        "qkv": (layer.attn.qkv.weight, 0.03),
        "out": (layer.attn.out.weight, 0.03 / 2),
        "w1": (layer.moe.w1, 0.03),
        "w2": (layer.moe.w2, 0.03 / 2**0.5),
        "router": (layer.moe.router.weight, 0.03),
    }
    for name, (p, std) in want.items():
        assert abs(float(p.detach().std()) / std - 1) < 0.08, name
        assert abs(float(p.detach().mean())) < 0.2 * std, name
    assert torch.equal(layer.moe_norm.weight, torch.ones(64))
    # each expert its own stream: two experts' weights are not one another's
    assert not torch.equal(layer.moe.w1[0], layer.moe.w1[1])


@pytest.mark.parametrize(("world", "ep"), LAYOUTS, ids=[f"{w}x{e}" for w, e in LAYOUTS])
def test_every_layout_starts_from_the_whole_models_weights(world: int, ep: int) -> None:
    whole = dict(CFG.build(seed=3).named_parameters())
    for rank in range(world):
        model = _rank_model(world, ep, rank, seed=3)
        lo, hi = _mesh(world, ep, rank).expert_range(CFG.moe.num_experts) if ep > 1 else (0, 8)
        for name, p in model.named_parameters():
            assert not p.is_meta, name
            want = whole[name][lo:hi] if name.endswith((".w1", ".w2")) else whole[name]
            assert torch.equal(p, want), (world, ep, rank, name)


class _Allocations(TorchDispatchMode):
    """The shapes of every tensor a factory op creates off the meta device."""

    FACTORIES = ("empty", "zeros", "ones", "full", "randn", "rand", "randint", "arange")

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name.startswith(self.FACTORIES) and isinstance(out, torch.Tensor) and not out.is_meta:
            self.shapes.append(tuple(out.shape))
        return out


def test_a_rank_allocates_none_of_another_ranks_experts() -> None:
    """ep=4 on 4 ranks: rank 2 builds, cuts and materialises; no allocation holds more than
    its 2 experts' rows, and its expert bytes are a quarter of the whole model's."""
    world, ep, rank = 4, 4, 2
    with _Allocations() as seen:
        model = _rank_model(world, ep, rank, seed=0)
    local = CFG.moe.num_experts // ep
    expert_shapes = {(CFG.moe.num_experts, 24, 40), (CFG.moe.num_experts, 20, 24)}
    assert not expert_shapes & set(seen.shapes), "a whole expert tensor was allocated"
    stacked = [s for s in seen.shapes if len(s) == 3]
    assert stacked and all(s[0] == local for s in stacked), stacked
    held = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".w1", ".w2")))
    whole = sum(p.numel() for n, p in CFG.build(seed=0).named_parameters() if n.endswith("w1"))
    whole += sum(p.numel() for n, p in CFG.build(seed=0).named_parameters() if n.endswith("w2"))
    assert held * ep == whole


def test_generator_streams_are_named() -> None:
    a = torch.randn(5, generator=seeding.generator(0, "x"))
    assert torch.equal(a, torch.randn(5, generator=seeding.generator(0, "x")))
    assert not torch.equal(a, torch.randn(5, generator=seeding.generator(0, "y")))
    assert not torch.equal(a, torch.randn(5, generator=seeding.generator(1, "x")))


@pytest.mark.parametrize(("world", "ep"), LAYOUTS[1:], ids=[f"{w}x{e}" for w, e in LAYOUTS[1:]])
def test_lora_adapters_on_the_experts_are_the_whole_builds_rows(world: int, ep: int) -> None:
    """Adapters on the experts, built on meta with them and drawn after the cut
    (``lora.init_expert_adapters``), are the whole build's rows; A is not all alike."""
    cfg = lora.LoRAConfig(rank=3, targets="both")
    whole = CFG.build(seed=3)
    lora.add_adapters(whole, cfg, seed=5)
    want = dict(whole.named_parameters())
    assert not torch.equal(want["layers.0.moe.lora_w1_A"][0], want["layers.0.moe.lora_w1_A"][1])
    for rank in range(world):
        model = CFG.build(seed=3, experts_on_meta=True)
        lora.add_adapters(model, cfg, seed=5)
        assert model.layers[0].moe.lora_w1_A.is_meta
        shard_experts(model, _mesh(world, ep, rank))
        model.init_experts(3)
        lora.init_expert_adapters(model, seed=5)
        lo, hi = _mesh(world, ep, rank).expert_range(CFG.moe.num_experts)
        for name, p in model.named_parameters():
            stacked = ".moe.w" in name or ".moe.lora_" in name
            assert torch.equal(p, want[name][lo:hi] if stacked else want[name]), (rank, name)
