"""scripts/bench_serve.py end to end at toy size on the CPU: every row of issue 31's serving
table is there with its figures, and the counts it reports agree with counts worked by hand
(requests per token, bytes per load) and with what a cache must do (the ceiling hits every
request, LRU hits never fall as its capacity grows, the cache decodes the ceiling's tokens).
"""

import json
import os
import subprocess
import sys

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
    proc = run_script("--tiny", "--device", "cpu", "--dir", str(tmp), "--json", str(out))
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
            if row["tier"] == "host" and not row["prefetch"]:
                # without prefetch every load is one expert copied from host memory
                assert p["bytes_per_token"] * p["tokens"] == p["loads"] * EXPERT_BYTES
    lru = [rows[f"cache lru {label}"]["decode"]["hit_rate"] for label in SIZES]
    assert lru[0] >= 0 and 0 < lru[-1] <= 1
    # LRU's stack property: on the same requests a larger cache never hits less
    assert lru == sorted(lru), lru
    hits = rows["cache lru 2k+prefetch"]["decode"]
    assert hits["prefetch_issued"] > 0  # the next layer's experts were predicted and read
    assert 0 <= hits["prefetch_hits"] <= hits["misses"]


def test_full_sizes_are_refused_on_the_cpu():
    proc = run_script("--device", "cpu", timeout=60)
    assert proc.returncode == 2 and "on the CPU use --tiny" in proc.stderr
