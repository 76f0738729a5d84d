"""scripts/bench_serve.py end to end at toy size on the CPU: every row of issue 31's serving
table is there with its figures, and the counts it reports agree with counts worked by hand
(requests per token, bytes per load), with a plain LRU replayed here on the ceiling's routing
(hits and misses of every LRU row), and with what a cache must do (the ceiling hits every
request, the cache decodes the ceiling's tokens).
"""

import json
import os
import subprocess
import sys
from collections import OrderedDict

import pytest
from helpers.paths import REPO

SCRIPT = REPO / "scripts" / "bench_serve.py"
# --tiny: 2 layers of 32 experts, top-2, hidden 64, expert width 32, bf16.
LAYERS, EXPERTS, TOP_K, HIDDEN, WIDTH = 2, 32, 2, 64, 32
EXPERT_BYTES = 3 * HIDDEN * WIDTH * 2  # w1 [64, 2 x 32] + w2 [32, 64] in bf16: 12288
SIZES = {"k": 2, "2k": 4, "25%": 8, "50%": 16}
PHASE_KEYS = {
    "tokens", "seconds", "tokens_per_s", "peak_device_bytes", "hit_rate", "bytes_per_token",
    "misses_per_token", "stall_s_per_token", "vs_resident", "vs_accelerate",
    "memory_vs_accelerate",
}  # fmt: skip


def run_script(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("bench_serve")
    out = tmp / "serve.json"
    proc = run_script(
        "--tiny", "--device", "cpu", "--dir", str(tmp), "--json", str(out), "--record-routing"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not [p for p in tmp.iterdir() if p != out]  # the scratch folder was removed
    return json.loads(out.read_text()), proc.stdout


def test_every_row_of_the_table_is_measured_or_says_why_not(bench):
    results, stdout = bench
    rows = {r["name"]: r for r in results["rows"]}
    cache = {
        f"cache {policy} {label}{suffix}"
        for policy in ("lru", "static")
        for label in SIZES
        for suffix in ("", "+prefetch")
    }
    disk = {"disk lru 2k", "disk lru 2k+prefetch"}
    assert set(rows) == {"resident", "accelerate"} | cache | disk
    # on the CPU nothing is offloaded: the baseline says why it did not run
    assert rows["accelerate"]["skipped"] and rows["accelerate"]["reason"]
    for name in {"resident"} | cache | disk:
        row = rows[name]
        assert "error" not in row and not row.get("skipped"), row
        for phase in ("decode", "prefill"):
            assert set(row[phase]) >= PHASE_KEYS, (name, phase)
            assert row[phase]["tokens_per_s"] > 0
            assert row[phase]["peak_device_bytes"] is None  # no device memory on the CPU
        if name != "resident":
            assert row["capacity"] == SIZES[row["capacity_label"]]
            assert row["same_tokens_as_resident"], name  # served experts, same tokens
    assert results["config"]["expert_bytes"] == EXPERT_BYTES
    assert {"tier", "policy", "capacity", "hidden_wall", "hidden_stall", "predicted"} <= set(
        results["prefetch"][0]
    )
    assert len(results["prefetch"]) == 9  # 4 sizes x 2 policies over host memory, 1 on disk
    assert "| resident" in stdout and "| cache lru 25%+prefetch" in stdout


def test_hit_rates_and_counts_agree_with_counts_by_hand(bench):
    results, _ = bench
    rows = {r["name"]: r for r in results["rows"]}
    for phase in ("decode", "prefill"):
        assert rows["resident"][phase]["hit_rate"] == 1.0  # every expert resident
        assert rows["resident"][phase]["bytes_per_token"] == 0
    for name, row in rows.items():
        if "capacity" not in row:
            continue
        for phase in ("decode", "prefill"):
            p = row[phase]
            # one request per token, layer and routing slot; each a hit or a miss
            assert p["requests"] == p["tokens"] * LAYERS * TOP_K, (name, phase)
            assert p["hits"] + p["misses"] == p["requests"]
            assert p["hit_rate"] == pytest.approx(p["hits"] / p["requests"])
            moved = p["bytes_per_token"] * p["tokens"]
            if row["tier"] == "host":
                # every expert read from host memory is copied to the device once
                assert moved == p["host_loads"] * EXPERT_BYTES, (name, phase)
                fetched = p["loads"] - p["prefetch_hits"]  # loads not served by a prefetch
                if not row["prefetch"]:
                    assert p["host_loads"] == p["loads"], (name, phase)
                else:  # plus the prefetches that were read (used or wasted)
                    assert fetched <= p["host_loads"] <= fetched + p["prefetch_issued"]
                    assert p["host_loads"] >= fetched + p["prefetch_hits"]
            else:  # from disk: one read and one copy per load, or per prefetch read
                copies = moved / EXPERT_BYTES
                fetched = p["loads"] - p["prefetch_hits"]
                assert fetched + p["prefetch_hits"] <= copies <= fetched + p["prefetch_issued"]
                assert row["prefetch"] or copies == p["loads"]
    hits = rows["cache lru 2k+prefetch"]["decode"]
    assert hits["prefetch_issued"] > 0  # the next layer's experts were predicted and read
    assert 0 < hits["prefetch_hits"] <= hits["misses"]


def lru_replay(calls: list[list[int]], capacity: int, counted: range) -> tuple[int, int]:
    """Hits and misses of a plain LRU of ``capacity`` fed ``calls`` in order (one layer),
    counting the requests of the calls in ``counted`` only."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = misses = 0
    for i, call in enumerate(calls):
        for expert in call:
            hit = expert in cache
            cache[expert] = None
            cache.move_to_end(expert)
            if len(cache) > capacity:
                cache.popitem(last=False)
            if i in counted:
                hits += hit
                misses += not hit
    return hits, misses


def test_lru_rows_equal_a_plain_lru_on_the_ceilings_routing(bench):
    """Each LRU row's hits and misses, decode and prefill, equal an OrderedDict LRU fed the
    ceiling's routing in the order the row served it: prefill A, the warm-up and the row's
    decode steps (the ceiling's first ones: same tokens), then prefill B."""
    results, _ = bench
    rows = {r["name"]: r for r in results["rows"]}
    forwards = rows["resident"]["routing"]  # [forward][layer] -> expert ids
    warmup = results["config"]["warmup"]
    decoded = rows["resident"]["decode"]["tokens"]
    assert len(forwards) == 1 + warmup + decoded + 1
    assert all(len(f) == LAYERS for f in forwards)
    checked = 0
    for name, row in rows.items():
        if row.get("policy") != "lru" or "decode" not in row:
            continue
        steps = row["decode"]["tokens"]
        if steps > decoded:  # the ceiling decoded fewer tokens: nothing to replay it on
            continue
        order = [*forwards[: 1 + warmup + steps], forwards[-1]]
        decode = range(1 + warmup, 1 + warmup + steps)
        prefill = range(len(order) - 1, len(order))
        for phase, counted in (("decode", decode), ("prefill", prefill)):
            hits = misses = 0
            for layer in range(LAYERS):
                h, m = lru_replay([f[layer] for f in order], row["capacity"], counted)
                hits, misses = hits + h, misses + m
            assert (row[phase]["hits"], row[phase]["misses"]) == (hits, misses), (name, phase)
        checked += 1
    assert checked >= 8  # 4 sizes x prefetch off/on over host memory (+ the disk tier)


def test_full_sizes_are_refused_on_the_cpu():
    proc = run_script("--device", "cpu", timeout=60)
    assert proc.returncode == 2 and "on the CPU use --tiny" in proc.stderr
