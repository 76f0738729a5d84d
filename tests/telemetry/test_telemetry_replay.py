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


def _batched_trace(seed: int = 3, seqs: int = 10, length: int = 12) -> RoutingTrace:
    """``seqs`` sequences of ``length`` tokens (one with padding at its end), top-3 of 16
    experts, recorded as a model flattens [B, S]: sequences one after another."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.choice(16, size=3, replace=False) for _ in range(seqs * length)])
    seq = np.repeat(np.arange(100, 100 + seqs), length)  # ids need not start at 0
    pos = np.tile(np.arange(length, dtype=np.int32), seqs)
    pos[length - 2 : length] = -1  # the first sequence's last two tokens are padding
    return RoutingTrace.from_arrays([rows], num_experts=16, seq=seq, pos=pos, expert_bytes=10)


def _set_union_lru_misses(trace: RoutingTrace, batch: int, cap: int) -> tuple[int, int]:
    """Serve ``batch`` sequences at a time, a position at a time: the set of experts the
    batch asks for at that position goes through a plain LRU (in first-asked order)."""
    experts, seq, pos = trace.experts(0), trace.sequence_ids(), trace.position_ids()
    order = list(dict.fromkeys(seq.tolist()))
    cache: OrderedDict[int, None] = OrderedDict()
    misses = requests = 0
    for start in range(0, len(order), batch):
        group = order[start : start + batch]
        for p in range(int(pos.max()) + 1):
            wanted: list[int] = []
            for s in group:
                for row in np.flatnonzero((seq == s) & (pos == p)):
                    wanted += [e for e in experts[row].tolist() if e not in wanted]
            for e in wanted:
                requests += 1
                if e in cache:
                    cache.move_to_end(e)
                    continue
                misses += 1
                if len(cache) == cap:
                    cache.popitem(last=False)
                cache[e] = None
    return misses, requests


@pytest.mark.parametrize("batch", [1, 3, 8, 32])
def test_batched_replay_matches_a_set_union_lru(batch: int) -> None:
    trace = _batched_trace()
    stats = simulate(trace, "lru", 6, warmup=0, batch_size=batch)
    misses, requests = _set_union_lru_misses(trace, batch, 6)
    assert (stats.misses, stats.accesses) == (misses, requests)
    assert stats.tokens == 10 * 12 - 2  # token rows, padding left out
    assert stats.misses_per_token == pytest.approx(misses / 118)
    if batch == 1:  # the trace's own replay order
        assert stats.misses == simulate(trace, "lru", 6, warmup=0).misses


def test_batching_shares_loads_and_bad_batch_sizes_are_refused() -> None:
    trace = _batched_trace()
    one, eight = (simulate(trace, "lru", 6, warmup=0, batch_size=b) for b in (1, 8))
    assert eight.accesses < one.accesses  # the union asks for a shared expert once
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            simulate(trace, "lru", 6, batch_size=bad)
