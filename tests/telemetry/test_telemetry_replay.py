"""simulate / sweep against reference replays; the standalone run and its report."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from moestack.telemetry import RoutingTrace, render_report, run_telemetry, simulate, sweep


def skewed_trace(seed: int = 0, tokens: int = 400, layers: int = 2) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    experts = []
    for _ in range(layers):
        p = rng.dirichlet(np.full(8, 0.4))
        rows = np.stack([rng.choice(8, size=2, replace=False, p=p) for _ in range(tokens)])
        experts.append(rows)
    return RoutingTrace.from_arrays(experts, num_experts=8, expert_bytes=1000)


def ref_lru_misses(keys: list[int], cap: int, skip: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for i, k in enumerate(keys):
        if k in cache:
            cache.move_to_end(k)
            continue
        misses += i >= skip
        if len(cache) == cap:
            cache.popitem(last=False)
        cache[k] = None
    return misses


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_simulate_lru_matches_reference(cap: int) -> None:
    trace = skewed_trace()
    stats = simulate(trace, "lru", cap, warmup=0.25)
    total = 0
    for layer in range(2):
        keys = trace.experts(layer).reshape(-1).tolist()
        skip = int(0.25 * len(keys))
        misses = ref_lru_misses(keys, cap, skip)
        assert stats.layers[layer].misses == misses
        assert stats.layers[layer].accesses == len(keys) - skip
        assert stats.layers[layer].bytes_loaded == 1000 * misses
        total += misses
    assert stats.misses == total and stats.bytes_loaded == 1000 * total
    assert stats.hit_rate == pytest.approx(stats.hits / stats.accesses)
    assert stats.accesses_per_s > 0
    # reuse histogram: first requests + distances, over the counted requests
    assert sum(stats.reuse_distance_hist[0]) == stats.layers[0].accesses


def test_static_experts_and_capacity_bytes() -> None:
    trace = skewed_trace(1)
    pins = [[0, 1], [2, 3]]
    stats = simulate(trace, "static", 2, warmup=0, static_experts=pins)
    for layer in range(2):
        keys = trace.experts(layer).reshape(-1)
        in_pins = np.isin(keys, pins[layer])
        # every request of a pinned expert hits except its first one
        assert stats.layers[layer].hits == int(in_pins.sum()) - len(set(keys[in_pins].tolist()))
    by_bytes = simulate(trace, "lru", None, capacity_bytes=3500, warmup=0)
    assert by_bytes.capacity == 3 and by_bytes.hits == simulate(trace, "lru", 3, warmup=0).hits
    with pytest.raises(ValueError, match="capacity_bytes"):
        simulate(trace, "lru", None, capacity_bytes=10)
    with pytest.raises(ValueError, match="unknown"):
        simulate(trace, "fifo", 2)


def test_sweep_lru_monotone_and_belady_best() -> None:
    trace = skewed_trace(2)
    results = sweep(trace)  # every policy, capacities 1..8, the first 10% as warm-up
    by = {(r.policy, r.capacity): r for r in results}
    lru = [by[("lru", c)].hit_rate for c in range(1, 9)]
    assert lru == sorted(lru)  # LRU's inclusion property
    for (name, cap), r in by.items():
        assert by[("belady", cap)].misses <= r.misses, (name, cap)


def test_run_telemetry_and_report(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    out = run_telemetry(
        "qwen3_moe", text, tmp_path / "run", seq_len=32, batch_size=2, max_tokens=400
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[0]["step"] == 0 and "telemetry/lru/cap2/hit_rate" in rows[0]
    assert all(np.isfinite(r["perplexity"]) for r in rows)
    trace = RoutingTrace.load(out / "trace")
    assert trace.num_tokens == 12 * 32 and trace.num_layers == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == 12 * 32
    for name in ("index.html", "hit_rate.png", "expert_usage.png", "capacity_sweep.png"):
        assert (out / "report" / name).is_file(), name
    index = render_report(out, out_dir=tmp_path / "again", policies=("lru",))
    assert "capacity_sweep.png" in index.read_text()
    with pytest.raises(FileExistsError):
        run_telemetry("qwen3_moe", text, out, seq_len=32, max_tokens=400)
