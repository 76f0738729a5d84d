"""Training with frozen experts streamed through the expert cache (offload_experts=host|disk):
the losses and trained weights of the resident run, bitwise on the CPU; the cache traffic of
the forward and the backward, against a hand-written LRU; refusals."""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from helpers.cache import batches, tiny_cfg
from helpers.streaming import STEPS, build, run_cfg, train, trained

from moestack.cache.streaming import StreamingState, attach_streaming
from moestack.config import ParallelConfig, TrainConfig
from moestack.errors import MoestackError
from moestack.evaluation import evaluate
from moestack.router import Routing


@pytest.mark.parametrize(
    ("trainable", "mode", "prefetch", "capacity"),
    [
        ("routers", "disk", False, 2),
        ("lora", "disk", True, 6),
        ("routers+lora", "host", False, 2),
    ],
)
def test_equal_to_the_resident_run(
    tmp_path: Path, trainable: str, mode: str, prefetch: bool, capacity: int
):
    """20 steps with capacity = top_k (2 of 8 experts per layer: every call's experts in a
    buffer of their own) or 6 (in slots that end up in no particular order): the same losses
    and the same router/adapter weights as the run with every expert in memory, bit for bit
    (the same arithmetic in the same order on the CPU); lora adapters with dropout 0.1, so
    the backward's recomputation must draw the forward's mask again, over the rows in the
    same order."""
    cfg = run_cfg(trainable, mode, prefetch=prefetch, capacity=capacity)
    steps = STEPS if trainable in ("routers", "lora") else 10  # the targets: 20
    resident = build(cfg)
    resident_losses = train(resident, cfg, steps)
    streamed = build(cfg)
    state = attach_streaming(streamed, cfg, tmp_path)
    assert isinstance(state, StreamingState)
    for moe in streamed.moe_layers:  # the experts really left memory
        assert moe.w1.is_meta and moe.w2.is_meta
    losses = train(streamed, cfg, steps)
    assert losses == resident_losses
    want, got = trained(resident), trained(streamed)
    assert want.keys() == got.keys() and want
    assert any("lora" in k for k in got) == trainable.endswith("lora")
    assert any("router" in k for k in got) == trainable.startswith("routers")
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    tokens_slots = 2 * 16 * 2  # batch x seq x top_k, per layer and pass
    metrics = state.metrics(steps)
    assert metrics["cache/requests"] == 2 * 2 * tokens_slots  # 2 layers, forward + backward
    assert metrics["cache/loads"] > 0 and 0 < metrics["cache/hit_rate"] < 1
    moved = pytest.approx(metrics["cache/loads"] * state.store.expert_bytes)
    assert metrics["cache/bytes_moved"] == moved
    assert metrics["cache/bytes_read"] == (0 if mode == "host" else moved)
    if prefetch:  # the forward's predictions and the backward's recorded experts
        assert state.cache.stats.prefetch_hits > 0
    state.close()


def expert_shaped_saved(model: torch.nn.Module, cfg: TrainConfig) -> list[tuple[int, ...]]:
    """The shapes of the tensors autograd saves in one forward that look like stacked
    ``w1`` (``[N, D, 2F]``; no other tensor of the model has that shape: hidden states are
    ``[2, 16, D]``, attention's 2-D or 4-D)."""
    d, f = cfg.model.d_model, cfg.model.moe.d_ff
    found = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 3 and tuple(t.shape[-2:]) == (d, 2 * f):
            found.append(tuple(t.shape))
        return t

    inputs, targets = batches(n=1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, targets).loss
    loss.backward()
    return found


def test_autograd_holds_no_expert_weight(tmp_path: Path):
    """The streamed layer saves its inputs, routing and adapters for backward, never an
    expert's weights (the resident layer saves its stacked w1/w2: the check sees them)."""
    cfg = run_cfg("lora")
    assert expert_shaped_saved(build(cfg), cfg)  # resident: w1/w2 saved by the GEMMs
    streamed = build(cfg)
    attach_streaming(streamed, cfg, tmp_path).close()
    assert expert_shaped_saved(streamed, cfg) == []


def force_routing(model: torch.nn.Module, layer: int, experts_of: callable) -> None:
    """Route every token of ``layer`` to ``experts_of(T) -> [T, k]``, its combine weights the
    router's scores of those experts (so the router still gets gradients)."""
    router = model.moe_layers[layer].router

    def hook(module, args, routing: Routing) -> Routing:
        experts = experts_of(routing.scores.shape[0])
        weights = module.weights_of(routing.scores, experts)
        return Routing(routing.logits, weights, experts, routing.scores)

    router.register_forward_hook(hook)


def test_every_expert_in_one_layer_one_expert_in_the_other(tmp_path: Path):
    """top_k = 1 = the capacity: layer 0's tokens use all 8 experts (more than its slots: the
    call's own buffer), layer 1's a single one (loaded once, a hit ever after)."""
    cfg = run_cfg("routers+lora", capacity=1, model=tiny_cfg(top_k=1))
    models = []
    for _ in range(2):
        model = build(cfg, top_k=1)
        force_routing(model, 0, lambda t: (torch.arange(t) % 8).unsqueeze(1))
        force_routing(model, 1, lambda t: torch.full((t, 1), 3))
        models.append(model)
    resident_losses = train(models[0], cfg, steps=5)
    state = attach_streaming(models[1], cfg, tmp_path)
    served: list[tuple[int, list[int]]] = []
    serve = state.cache.serve
    state.cache.serve = lambda layer, experts: (
        served.append((layer, list(experts))) or serve(layer, experts)
    )
    assert train(models[1], cfg, steps=5) == resident_losses
    want, got = trained(models[0]), trained(models[1])
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert [layer for layer, _ in served] == [0, 1, 1, 0] * 5  # forward, then backward reversed
    assert all(set(e) == set(range(8)) for layer, e in served if layer == 0)
    assert all(set(e) == {3} for layer, e in served if layer == 1)
    metrics = state.metrics(5)
    # layer 1: expert 3 loaded once in 5 steps; layer 0: all 8 at every pass but the one
    # expert its single slot kept from the pass before
    assert metrics["cache/loads"] * 5 == pytest.approx(1 + 8 + 7 * 9)


def lru_replay(calls: list[tuple[int, list[int], bool]], capacity: int) -> tuple[int, int, int]:
    """(hits, misses, loads) of the counted calls of per-layer LRU caches of ``capacity``
    replaying ``calls`` (layer, requests, counted), a load being an expert of a call that
    was not resident when the call began (read once)."""
    caches: dict[int, OrderedDict[int, None]] = {}
    hits = misses = loads = 0
    for layer, requests, counted in calls:
        lru = caches.setdefault(layer, OrderedDict())
        loads += counted * len(set(requests) - set(lru))
        for e in requests:
            hit = e in lru
            hits += counted * hit
            misses += counted * (not hit)
            lru[e] = None
            lru.move_to_end(e)
            if len(lru) > capacity:
                lru.popitem(last=False)
    return hits, misses, loads


def test_backward_loads_counted(tmp_path: Path):
    """Each step requests every layer's experts in the forward and again in the backward
    (reverse layer order), and the per-step metrics are exactly an LRU replay of those
    requests; an evaluation in between moves the cache but is not training traffic."""
    cfg = run_cfg("routers", capacity=2)
    model = build(cfg)
    routed: list[tuple[int, list[int], bool]] = []
    for i, moe in enumerate(model.moe_layers):
        moe.router.register_forward_hook(
            lambda m, a, r, i=i: routed.append(
                (i, r.experts.reshape(-1).tolist(), torch.is_grad_enabled())
            )
        )
    state = attach_streaming(model, cfg, tmp_path)
    train(model, cfg, steps=3)
    evaluate(model.eval(), batches(n=2), torch.device("cpu"))
    model.train()
    train(model, cfg, steps=1)
    calls = []
    for first in range(0, len(routed), 2):
        forward = routed[first : first + 2]
        calls += forward + (forward[::-1] if forward[0][2] else [])  # a backward: reversed
    assert len(calls) == 4 * 4 + 2 * 2
    hits, misses, loads = lru_replay(calls, capacity=2)
    assert state.cache.stats.requests > hits + misses  # the evaluation's requests too
    metrics = state.metrics(4)
    assert metrics["cache/requests"] * 4 == hits + misses
    assert metrics["cache/hit_rate"] == hits / (hits + misses)
    assert metrics["cache/loads"] * 4 == loads
    assert metrics["cache/bytes_moved"] * 4 == loads * state.store.expert_bytes
    assert state.metrics(1)["cache/loads"] == 0  # nothing since the last call


@pytest.mark.parametrize("trainable", ["all", "routers+experts"])
def test_trained_experts_refused(trainable: str):
    with pytest.raises(ValueError, match=re.escape(f"trainable={trainable} trains them")):
        run_cfg(trainable)


def test_refusals(tmp_path: Path):
    with pytest.raises(ValueError, match="offload_experts='ssd' is unknown"):
        run_cfg("lora", mode="ssd")
    with pytest.raises(ValueError, match="compile=false"):
        TrainConfig(trainable="lora", offload_experts="host", compile=True)
    with pytest.raises(ValueError, match="cache.policy=belady is the offline bound"):
        run_cfg("lora", policy="belady")
    with pytest.raises(ValueError, match="runs with parallel.ep=1"):
        TrainConfig(trainable="lora", offload_experts="disk", parallel=ParallelConfig(ep=2))
    cfg = run_cfg("lora")
    cfg.trainable = "all"  # past the config's check
    with pytest.raises(MoestackError, match="trainable=all trains them"):
        attach_streaming(build(run_cfg("lora")), cfg, tmp_path)
    model = build(run_cfg("lora"))
    for moe in model.moe_layers:
        moe.w1 = torch.nn.Parameter(torch.empty(moe.w1.shape, device="meta"), False)
    with pytest.raises(MoestackError, match="holds no expert store"):
        attach_streaming(model, run_cfg("lora"), tmp_path / "none")
    assert attach_streaming(model, run_cfg("lora", mode="off"), tmp_path) is None


def test_several_processes_refused(tmp_path: Path, monkeypatch):
    """Every rank would write the same store: one process only, for now."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    cfg = run_cfg("lora")
    with pytest.raises(MoestackError, match="runs in one process for now.* has 2"):
        attach_streaming(build(cfg), cfg, tmp_path)
    assert not (tmp_path / "experts").exists()


def test_store_written_once_and_reused(tmp_path: Path):
    """A second start with the same experts reuses the store (a resumed run); a model with
    other experts (a resumed run whose experts were not read, say) is refused naming the
    store, which stays as it was."""
    cfg = run_cfg("routers")
    first = attach_streaming(build(cfg), cfg, tmp_path)
    index = tmp_path / "experts" / "index.json"
    written = index.stat().st_mtime_ns
    first.close()
    again = attach_streaming(build(cfg), cfg, tmp_path)
    assert index.stat().st_mtime_ns == written
    again.close()
    other = build(cfg, seed=1)
    with pytest.raises(MoestackError, match=f"expert store {tmp_path / 'experts'} was written "
                       "from other experts than this model's"):  # fmt: skip
        attach_streaming(other, cfg, tmp_path)
    assert index.stat().st_mtime_ns == written
    assert not other.moe_layers[0].w1.is_meta  # nothing released


def test_checkpoint_leaves_the_streamed_experts_out(tmp_path: Path):
    """The trainer's checkpoint of a streamed model holds every weight but the experts (in
    the store, not in memory), with the trained ones as they are in the model."""
    from safetensors import safe_open

    from moestack import checkpoint

    cfg = run_cfg("routers+lora")
    model = build(cfg)
    state = attach_streaming(model, cfg, tmp_path)
    train(model, cfg, steps=1)
    keys = set(model.state_dict())
    assert not [k for k in keys if k.endswith(("moe.w1", "moe.w2"))]
    assert {f"layers.{i}.moe.lora_w1_A" for i in range(2)} <= keys
    path = checkpoint.save_checkpoint(tmp_path / "ckpt", 1, model, cfg.model, {"step": 1})
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == keys - {"lm_head.weight"}  # noqa: SIM118 (tied: stored once)
        assert torch.equal(f.get_tensor("layers.1.moe.lora_w2_B"), model.moe_layers[1].lora_w2_B)
    state.close()
    assert "layers.0.moe.w1" in model.state_dict()  # the hook goes with close()


def test_resume_loads_a_checkpoint_without_experts(tmp_path: Path):
    """A resumed run builds its model (the frozen experts drawn again from the seed), loads
    the checkpoint's weights with the experts left out of the state dict, and attaches to
    the same store: it computes the interrupted run's losses."""
    from moestack import checkpoint
    from moestack.cache.streaming import experts_left_out

    cfg = run_cfg("routers+lora")
    first = build(cfg)
    attach_streaming(first, cfg, tmp_path)
    train(first, cfg, steps=2)
    path = checkpoint.save_checkpoint(tmp_path / "ckpt", 2, first, cfg.model, {"step": 2})
    written = (tmp_path / "experts" / "index.json").stat().st_mtime_ns
    resumed = build(cfg)
    with pytest.raises(MoestackError, match=r"missing layers\.0\.moe\.w1"):
        checkpoint.load_model_weights(path, resumed, cfg.model)  # what experts_left_out avoids
    with experts_left_out(resumed):
        checkpoint.load_model_weights(path, resumed, cfg.model)
    assert "layers.0.moe.w1" in resumed.state_dict()  # only inside
    state = attach_streaming(resumed, cfg, tmp_path)
    assert (tmp_path / "experts" / "index.json").stat().st_mtime_ns == written  # reused
    want, got = trained(first), trained(resumed)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    inputs, targets = batches(n=1)[0]
    with torch.no_grad():  # eval: no dropout draws
        want_loss = first.eval()(inputs, targets).loss
        assert torch.equal(resumed.eval()(inputs, targets).loss, want_loss)
    state.close()


def test_experts_never_in_memory(tmp_path: Path):
    """moestack's model built with its experts (and their adapters) on meta: the adapters
    drawn as the whole build draws them, the store written from the experts drawn one layer
    at a time likewise (the same digest as the whole model's experts), and training gives
    the resident run's losses."""
    from moestack import MoETransformer
    from moestack.cache.streaming import (
        drawn_expert_layers,
        experts_digest,
        materialize_expert_adapters,
        resident_layers,
    )
    from moestack.lora import add_adapters_for

    cfg = run_cfg("routers+lora")
    whole = MoETransformer(cfg.model, seed=7).train()
    add_adapters_for(whole, cfg.trainable, cfg.lora, cfg.seed)
    whole.set_trainable(cfg.trainable)
    lean = MoETransformer(cfg.model, seed=7, experts_on_meta=True).train()
    add_adapters_for(lean, cfg.trainable, cfg.lora, cfg.seed)
    lean.set_trainable(cfg.trainable)
    assert lean.moe_layers[0].w1.is_meta and lean.moe_layers[0].lora_w1_A.is_meta
    assert materialize_expert_adapters(lean, cfg.seed) == 4 * cfg.model.n_layers
    assert all(torch.equal(v, dict(lean.named_parameters())[k]) for k, v in trained(whole).items())
    layers = drawn_expert_layers(lean, seed=7)
    drawn = 0
    for (w1, w2), moe in zip(layers(), whole.moe_layers, strict=True):  # a layer at a time
        assert torch.equal(w1, moe.w1) and torch.equal(w2, moe.w2)
        assert all(m.w1.is_meta and m.w2.is_meta for m in lean.moe_layers)
        drawn += 1
    assert drawn == cfg.model.n_layers
    state = attach_streaming(lean, cfg, tmp_path, layers=layers)
    assert state.store.meta["source"] == experts_digest(resident_layers(whole.moe_layers))
    assert train(lean, cfg, steps=3) == train(whole, cfg, steps=3)
    state.close()


@pytest.mark.parametrize("trainable", ["routers", "lora"])
def test_transformers_folder_streamed_from_its_files(tmp_path: Path, trainable: str):
    """A transformers model folder (OLMoE): streamed, it trains as the resident model; built
    without its experts, the store is written from the folder's files one layer at a time
    (iter_hf_expert_layers), with the same digest, and gives the same losses."""
    pytest.importorskip("transformers")
    from helpers.hf import tiny_hf_model_dir

    from moestack.interop.hf_experts import iter_hf_expert_layers
    from moestack.interop.hf_model import HFModelConfig
    from moestack.lora import LoRAConfig, add_adapters_for

    path = tiny_hf_model_dir(tmp_path, "olmoe")
    cfg = dataclasses.replace(
        run_cfg(trainable), model=HFModelConfig(path=str(path), moe={"impl": "torch"}),
        lora=LoRAConfig(rank=2, dropout=0.1),
    ).resolve()  # fmt: skip

    def build_hf(experts: bool = True) -> torch.nn.Module:
        model = cfg.model.build(experts=experts).train()
        add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)
        model.set_trainable(cfg.trainable)
        return model

    want = train(build_hf(), cfg, steps=3)
    streamed = build_hf()
    first = attach_streaming(streamed, cfg, tmp_path / "run")
    assert train(streamed, cfg, steps=3) == want
    if trainable == "lora":  # adapters on meta experts are the trainer's to materialise
        return
    lean = build_hf(experts=False)
    dtype = lean.moe_layers[0].w1.dtype
    again = attach_streaming(  # a store of its own, written from the files
        lean, cfg, tmp_path / "lean", layers=lambda: iter_hf_expert_layers(path, dtype)
    )
    assert again.store.meta["source"] == first.store.meta["source"]
    assert train(lean, cfg, steps=3) == want


@pytest.mark.parametrize("checkpointing", ["moe", "block"])
def test_with_activation_checkpointing(tmp_path: Path, checkpointing: str):
    """model.checkpointing recomputes the block (or the layer) in backward around the
    streamed layer: the same losses and weights, and still two passes of requests a step
    (the recomputation stops once it has the streamed layer's saved inputs, before it
    would serve the experts again)."""
    from moestack import MoETransformer
    from moestack.lora import add_adapters_for

    model_cfg = dataclasses.replace(tiny_cfg(), checkpointing=checkpointing)
    cfg = run_cfg("routers+lora", capacity=6, model=model_cfg)

    def build_ckpt() -> torch.nn.Module:
        model = MoETransformer(model_cfg, seed=3).train()
        add_adapters_for(model, cfg.trainable, cfg.lora, cfg.seed)
        model.set_trainable(cfg.trainable)
        return model

    resident = build_ckpt()
    want = train(resident, cfg, steps=4)
    streamed = build_ckpt()
    state = attach_streaming(streamed, cfg, tmp_path)
    assert train(streamed, cfg, steps=4) == want
    assert all(torch.equal(trained(streamed)[k], v) for k, v in trained(resident).items())
    assert state.metrics(4)["cache/requests"] == 2 * 2 * (2 * 16 * 2)  # layers, passes, T x k


@pytest.mark.parametrize(("mode", "prefetch"), [("disk", True), ("host", False)])
def test_stream_plan_is_what_the_run_allocates(tmp_path: Path, mode: str, prefetch: bool):
    """The plan's slot buffer, host tier and experts are the bytes the streamed run holds."""
    from moestack.cache.streaming import stream_plan

    cfg = run_cfg("lora", mode, capacity=3, prefetch=prefetch)
    model = build(cfg)
    state = attach_streaming(model, cfg, tmp_path)
    train(model, cfg, steps=1)
    plan = stream_plan(cfg, state.store.expert_bytes, tokens=2 * 16, cuda=False)
    slots = state.cache._slots
    assert plan.slots == slots.flat_SB.numel() == slots.count * slots.slot_bytes
    assert slots.count == 2 * 3 + 2 + (2 if prefetch else 0)  # layers x capacity + top_k (x2)
    assert plan.experts == plan.disk == 2 * 8 * state.store.expert_bytes
    assert plan.host == (state.cache.host.nbytes if mode == "host" else 0)  # the HostTier's
    assert plan.working_set == 8 * (slots.slot_bytes + state.store.expert_bytes)  # dropout
    assert stream_plan(run_cfg("lora", "off"), 1, 1, cuda=False) is None
    state.close()
