"""A normal forward's recorded trace and simulate()'s results on it stay exactly as pinned.

The expert ids are checked against the routers' own top-k (computed here from the captured
router inputs); sequence / position ids and metadata against the batch shapes; simulate()'s
numbers and the trace's digest against values recorded from the code as it was pinned.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from helpers.telemetry import small_moestack
from torch import nn

from moestack.telemetry import attach, simulate

SHAPES = ((3, 16), (2, 8), (4, 12))
# Recorded from the code when this test was written (a normal forward must not change them).
DIGEST = "73df68898125a6fca113939f7ea54492f5ae70ab03f0fa8f58ead42e4908b22c"
SIMULATED = {
    "lru/2": [0.17326732673267325, 3.3069306930693068],
    "lru/2/b2": [0.10840108401084012, 3.257425742574257],
    "lru/4": [0.4158415841584158, 2.3366336633663365],
    "lru/4/b2": [0.39295392953929537, 2.217821782178218],
    "static/2": [0.26485148514851486, 2.9405940594059405],
    "static/2/b2": [0.2601626016260163, 2.702970297029703],
    "static/4": [0.49504950495049505, 2.01980198019802],
    "static/4/b2": [0.5013550135501355, 1.8217821782178218],
    "lru+static/2": [0.17326732673267325, 3.3069306930693068],
    "lru+static/2/b2": [0.16802168021680217, 3.0396039603960396],
    "lru+static/4": [0.4405940594059406, 2.237623762376238],
    "lru+static/4/b2": [0.3983739837398374, 2.198019801980198],
    "belady/2": [0.45544554455445546, 2.1782178217821784],
    "belady/2/b2": [0.4173441734417344, 2.128712871287129],
    "belady/4": [0.7004950495049505, 1.198019801980198],
    "belady/4/b2": [0.6829268292682927, 1.1584158415841583],
}


def record() -> tuple[object, list[list[torch.Tensor]], list[nn.Module]]:
    model = small_moestack()
    routers = [m.router for m in model.moe_layers]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    handles = [
        r.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0].detach().clone()))
        for i, r in enumerate(routers)
    ]
    g = torch.Generator().manual_seed(5)
    tel = attach(model, policies=("lru", "static"), capacities=(2, 4), max_memory_tokens=1000,
                 entropy=False)  # fmt: skip
    with tel, torch.no_grad():
        for b, s in SHAPES:
            x = torch.randint(0, 256, (b, s), generator=g)
            model(x, torch.randint(0, 256, (b, s), generator=g))
    for h in handles:
        h.remove()
    return tel.trace, seen, routers


def digest(trace) -> str:
    h = hashlib.sha256()
    for arr in [trace.sequence_ids(), trace.position_ids()] + [
        trace.experts(i) for i in range(trace.num_layers)
    ]:
        h.update(np.ascontiguousarray(arr).tobytes())
        h.update(str(arr.dtype).encode())
    return h.hexdigest()


def simulated(trace) -> dict[str, list[float]]:
    out = {}
    for policy in ("lru", "static", "lru+static", "belady"):
        for cap in (2, 4):
            st = simulate(trace, policy, cap, warmup=0.1, reuse=False)
            out[f"{policy}/{cap}"] = [st.hit_rate, st.misses_per_token]
            st = simulate(trace, policy, cap, warmup=0.1, reuse=False, batch_size=2)
            out[f"{policy}/{cap}/b2"] = [st.hit_rate, st.misses_per_token]
    return out


def test_trace_of_normal_forwards_is_pinned() -> None:
    trace, seen, routers = record()
    for layer, router in enumerate(routers):
        ref = torch.cat(
            [torch.topk(torch.softmax(x.float() @ router.weight.float().T, -1), 2).indices
             for x in seen[layer]]
        )  # fmt: skip
        np.testing.assert_array_equal(trace.experts(layer), ref.numpy())
        assert trace.experts(layer).dtype == np.int16
    seq, pos, start = [], [], 0
    for b, s in SHAPES:
        seq.append(np.repeat(np.arange(start, start + b), s))
        pos.append(np.tile(np.arange(s), b))
        start += b
    np.testing.assert_array_equal(trace.sequence_ids(), np.concatenate(seq))
    np.testing.assert_array_equal(trace.position_ids(), np.concatenate(pos))
    assert trace.num_tokens == sum(b * s for b, s in SHAPES)
    assert trace.meta["model"] == "MoETransformer"
    assert trace.meta["router_kinds"] == ["moestack", "moestack"]
    assert trace.top_k == [2, 2] and trace.num_experts == [8, 8]
    assert digest(trace) == DIGEST
    got = simulated(trace)
    assert got.keys() == SIMULATED.keys()
    for key, want in SIMULATED.items():
        assert got[key] == want, key  # exact: the same trace must replay the same
