"""The MoE layer's one experts back-end slot (``MoE.set_experts``): where its experts run is
chosen there, the parameters and their state_dict keys stay the layer's, and the expert
cache plugs in and out through it."""

from __future__ import annotations

import torch
from helpers.cache import batches, tiny_model
from helpers.moe import moe_layer, reference_moe

from moestack.cache import CachedExperts, ExpertCache, ExpertStore, offloaded
from moestack.moe import LOCAL_EXPERTS, LocalExperts


class Recorder:
    """A back-end that computes nothing: zeros, and what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, moe, x_TD, routing):
        self.calls.append((moe, tuple(x_TD.shape), tuple(routing.experts.shape)))
        return torch.zeros_like(x_TD)


def test_the_backend_set_is_the_one_that_runs_and_none_is_local_again():
    moe = moe_layer(d_model=8, num_experts=4, top_k=2, d_ff=6, seed=0)
    x = torch.randn(3, 5, 8)
    recorder = Recorder()
    moe.set_experts(recorder)
    assert moe.experts_backend is recorder
    with torch.no_grad():
        assert torch.equal(moe(x), torch.zeros(3, 5, 8))
    assert recorder.calls == [(moe, (15, 8), (15, 2))]  # flat tokens, top-2 routing
    moe.set_experts(None)
    assert isinstance(moe.experts_backend, LocalExperts)
    params = [p.detach().double() for p in (moe.router.weight, moe.w1, moe.w2)]
    with torch.no_grad():
        y = moe(x)
    want = reference_moe(x.reshape(-1, 8).double(), *params, top_k=2).reshape(x.shape)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-4)


def test_parameters_and_state_dict_keys_stay_the_layers_whatever_the_backend():
    moe = moe_layer(d_model=8, num_experts=4, top_k=2, d_ff=6, seed=0)
    keys = ["w1", "w2", "router.weight", "router.expert_bias"]  # as checkpoints hold them
    assert list(moe.state_dict()) == keys
    moe.set_experts(Recorder())
    assert list(moe.state_dict()) == keys
    assert [n for n, _ in moe.named_parameters()] == ["w1", "w2", "router.weight"]
    assert list(moe.children()) == [moe.router]  # a back-end is no submodule


def test_offloaded_plugs_the_cache_in_through_the_slot_and_back_out(tmp_path):
    model = tiny_model()
    store = ExpertStore.write(model, tmp_path / "store")
    inputs = batches(n=1)[0][0]
    with offloaded(model, ExpertCache(store, 2, "lru")), torch.no_grad():
        backends = [moe.experts_backend for moe in model.moe_layers]
        model(inputs)
    assert all(isinstance(b, CachedExperts) for b in backends)
    assert [b.layer for b in backends] == [0, 1]
    for moe in model.moe_layers:
        assert moe.experts_backend is LOCAL_EXPERTS  # the earlier back-end, back
        assert "experts" not in vars(moe)  # no attribute patched on the instance
