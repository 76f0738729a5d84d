"""scripts/bench_serve.py end to end at toy size on the CPU: every row of issue 31's serving
table is there with its figures, and the counts it reports agree with counts worked by hand
(requests per token, bytes per load, device slots), with a plain LRU replayed here on the
ceiling's routing (hits and misses of every LRU row), and with what a cache must do (the
ceiling hits every request, the cache decodes the ceiling's tokens). Then its parts on their
own: the order rows are measured in, the time budget on a fake clock, the repeats a short
budget cuts, the n/a rule of the miss time prefetch hides worked by hand (by the wall clock
and by the serving thread's stall), and the printed divisor of that figure.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from helpers.paths import REPO
from helpers.scripts import script_module

SCRIPT = REPO / "scripts" / "bench_serve.py"
# --tiny: 2 layers of 32 experts, top-2, hidden 64, expert width 32, bf16.
LAYERS, EXPERTS, TOP_K, HIDDEN, WIDTH = 2, 32, 2, 64, 32
EXPERT_BYTES = 3 * HIDDEN * WIDTH * 2  # w1 [64, 2 x 32] + w2 [32, 64] in bf16: 12288
SIZES = {"k": 2, "2k": 4, "25%": 8, "50%": 16}
PHASE_KEYS = {
    "tokens", "seconds", "tokens_per_s", "peak_device_bytes", "hit_rate", "bytes_per_token",
    "misses_per_token", "stall_s_per_token", "vs_resident", "vs_accelerate",
    "memory_vs_accelerate", "repeats", "repeats_wanted", "tokens_per_s_range",
    "tokens_per_s_each",
}  # fmt: skip
REPEATS = 3  # the default: every phase of every row, with no time budget


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
            p = row[phase]
            assert set(p) >= PHASE_KEYS, (name, phase)
            assert p["repeats"] == p["repeats_wanted"] == REPEATS == len(p["tokens_per_s_each"])
            low, high = p["tokens_per_s_range"]
            assert 0 < low <= p["tokens_per_s"] <= high  # the median of the repeats
            assert sorted(p["tokens_per_s_each"])[1] == p["tokens_per_s"]
            assert p["peak_device_bytes"] is None  # no device memory on the CPU
        if name != "resident":
            assert row["capacity"] == SIZES[row["capacity_label"]]
            assert row["same_tokens_as_resident"], name  # served experts, same tokens
            # the device tier: layers x capacity resident + top_k spare (+ top_k prefetch)
            slots = LAYERS * row["capacity"] + TOP_K + (TOP_K if row["prefetch"] else 0)
            assert row["device_slots"]["total"] == slots, name
            assert row["device_slots"]["bytes"] == slots * EXPERT_BYTES
    assert results["config"]["expert_bytes"] == EXPERT_BYTES
    assert {"tier", "policy", "capacity", "hidden_wall", "hidden_stall", "predicted"} <= set(
        results["prefetch"][0]
    )
    assert len(results["prefetch"]) == 9  # 4 sizes x 2 policies over host memory, 1 on disk
    assert "| resident" in stdout and "| cache lru 25%+prefetch" in stdout
    # measured in the plan's order, the skipped accelerate row listed with its reason
    assert [r["name"] for r in results["rows"]] == results["config"]["row_order"]
    assert results["skipped"] == [{"name": "accelerate", "reason": rows["accelerate"]["reason"]}]
    assert "skipped 1 of 20 rows" in stdout


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
    decode steps (the ceiling's first ones: same tokens), then each prefill of B."""
    results, _ = bench
    rows = {r["name"]: r for r in results["rows"]}
    forwards = rows["resident"]["routing"]  # [forward][layer] -> expert ids
    warmup = results["config"]["warmup"]
    decoded = rows["resident"]["decode"]["tokens"]  # over its repeats (windows back to back)
    prefills = rows["resident"]["prefill"]["repeats"]
    assert len(forwards) == 1 + warmup + decoded + prefills
    assert all(len(f) == LAYERS for f in forwards)
    checked = 0
    for name, row in rows.items():
        if row.get("policy") != "lru" or "decode" not in row:
            continue
        steps = row["decode"]["tokens"]
        if steps > decoded:  # the ceiling decoded fewer tokens: nothing to replay it on
            continue
        repeats = row["prefill"]["repeats"]  # prompt B each time, from an empty KV cache
        order = [*forwards[: 1 + warmup + steps], *[forwards[-1]] * repeats]
        decode = range(1 + warmup, 1 + warmup + steps)
        prefill = range(len(order) - repeats, len(order))
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


# ------------------------------------------------------------------ its parts on their own
@pytest.fixture(scope="module")
def bs():
    pytest.importorskip("transformers")
    with script_module("bench_serve") as module:
        yield module


@pytest.fixture(scope="module")
def report():
    from moestack.cache import serve_report  # the figures and the table, bench_serve's import

    return serve_report


@pytest.fixture(scope="module")
def sb():
    from moestack.cache import serve_bench  # the budget, the device, the timed serving

    return serve_bench


class FakeClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rows_are_measured_key_comparisons_first(bs):
    names = [spec.name for spec in bs.ROWS]
    # the ceiling, the prefetch target's pair at 2k, the 2x target's at 25%, its baseline
    assert names[:6] == [
        "resident", "cache lru 2k", "cache lru 2k+prefetch", "cache lru 25%",
        "cache lru 25%+prefetch", "accelerate",
    ]  # fmt: skip
    cache = {
        f"{tier} {policy} {label}{suffix}"
        for tier, policy, label in [
            *(("cache", p, lab) for p in ("lru", "static") for lab in SIZES),
            ("disk", "lru", "2k"),
        ]
        for suffix in ("", "+prefetch")
    }
    assert sorted(names) == sorted({"resident", "accelerate"} | cache)  # each once
    for i, spec in enumerate(bs.ROWS):  # each size with prefetch right after it without
        if spec.prefetch:
            assert names[i - 1] == spec.name.removesuffix("+prefetch")
    kinds = {spec.name: spec.kind for spec in bs.ROWS}
    assert kinds["disk lru 2k"] == "disk" and kinds["cache static 50%"] == "cache"


def test_budget_judges_a_cache_row_by_cache_rows_only(sb):
    clock = FakeClock()
    budget = sb.Budget(55.0, start=0.0, clock=clock)
    clock.now = 10.0
    budget.record("resident", 4.0)
    clock.now = 50.0
    budget.record("accelerate", 40.0)  # slow: a model load and every expert at each forward
    # the first cache row runs, however slow the rows before and however little is left
    assert budget.skip_reason("cache") is None
    budget.record("cache", 2.0)
    clock.now = 52.0
    assert budget.skip_reason("cache") is None  # 52 + 2 = 54 <= 55
    budget.record("cache", 1.0)
    clock.now = 53.5  # 53.5 + the slowest cache row, 2 = 55.5 > 55
    reason = budget.skip_reason("cache")
    assert reason.startswith("time budget: 53.5 s spent + 2.0 s estimated (the slowest cache")
    assert reason.endswith("> --budget-s 55")
    assert budget.skip_reason("resident", always=True) is None  # the ceiling always runs
    assert "40.0 s estimated" in budget.skip_reason("accelerate")  # its own kind's time
    # a first disk row: the slowest cache row plus the disk's extra
    budget.extra_s["disk"] = (1.5, "reads")
    clock.now = 51.0
    assert budget.estimate("disk") == (3.5, "the slowest cache row + reads")
    assert budget.skip_reason("disk") is None  # 51 + 3.5 = 54.5
    clock.now = 52.0
    assert "3.5 s estimated" in budget.skip_reason("disk")
    assert sb.Budget(0.0, 0.0, clock).skip_reason("disk") is None  # 0: no budget
    assert sb.Budget(0.0, 0.0, clock).deadline() is None and budget.deadline() == 55.0


def measured_row(report) -> dict:
    phase = report.phase_figures([report.Measure({}, 4, 1.0, None)], 1)
    return {"decode": phase, "prefill": dict(phase), "decoded": [1, 2, 3]}


def test_bench_runs_the_first_cache_row_after_a_slow_accelerate_row(bs, report, tmp_path):
    clock = FakeClock()
    args = SimpleNamespace(budget_s=10.0, only="", json=str(tmp_path / "out.json"))
    bench = bs.Bench(args, {"device": "cpu"}, start=0.0, clock=clock)
    deadlines = []

    def takes(seconds):
        def run(deadline):
            deadlines.append(deadline)
            clock.now += seconds
            return measured_row(report)

        return run

    specs = {spec.name: spec for spec in bs.ROWS}
    bench.row(specs["resident"], {"tier": "device"}, takes(3.0), always=True)
    bench.row(specs["accelerate"], {"tier": "cpu"}, takes(6.0))  # t = 9
    for name in ("cache lru 2k", "cache lru 2k+prefetch", "cache lru 25%"):
        bench.row(specs[name], {"tier": "host"}, takes(0.5))
    bench.row(specs["disk lru 2k"], {"tier": "disk"}, takes(0.1))  # no estimate: it runs
    rows = {r["name"]: r for r in bench.out["rows"]}
    assert rows["cache lru 2k"]["row_s"] == 0.5  # first cache row: t 9 -> 9.5
    assert rows["cache lru 2k+prefetch"]["row_s"] == 0.5  # 9.5 + 0.5 <= 10
    assert rows["cache lru 25%"]["skipped"]  # 10 + 0.5 > 10
    assert "the slowest cache row so far" in rows["cache lru 25%"]["reason"]
    assert deadlines == [10.0] * 5  # each run is told when the budget ends
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["skipped"] == [
        {"name": "cache lru 25%", "reason": rows["cache lru 25%"]["reason"]}
    ]
    args.only = "disk"  # rows left out by --only are listed as skipped too
    bench.row(specs["cache static k"], {"tier": "host"}, takes(0.0))
    assert bench.out["skipped"][-1] == {
        "name": "cache static k",
        "reason": "not selected by --only",
    }


class FakeLM:
    """A transformers-like causal LM: next token = last token + 1; a KV cache that counts."""

    class Past:
        def __init__(self, n: int) -> None:
            self.n = n

        def get_seq_length(self) -> int:
            return self.n

    def __call__(self, input_ids, past_key_values, use_cache, logits_to_keep):
        past = self.Past((past_key_values.n if past_key_values else 0) + input_ids.shape[1])
        logits = torch.nn.functional.one_hot((input_ids[:, -1:] + 1) % 64, 64).float()
        return SimpleNamespace(logits=logits, past_key_values=past)


def test_repeats_stop_where_the_budget_ends(sb):
    args = argparse.Namespace(warmup=1, repeats=3, row_seconds=60.0, decode_tokens=5)
    prompts = {"a": torch.zeros(1, 4, dtype=torch.long), "b": torch.zeros(1, 6, dtype=torch.long)}
    dev = sb.Device(torch.device("cpu"))
    full = sb.serve(FakeLM(), sb.Probe(), prompts, args, dev)
    assert [full[p]["repeats"] for p in ("decode", "prefill")] == [3, 3]
    assert full["decode"]["tokens"] == 15 and full["prefill"]["tokens"] == 18
    assert full["decoded"] == list(range(1, 1 + 1 + 1 + 15))  # prefill A, warm-up, windows
    # a budget that has already ended: one repeat of each phase, and the JSON says so
    short = sb.serve(FakeLM(), sb.Probe(), prompts, args, dev, deadline=time.monotonic() - 1)
    for phase in ("decode", "prefill"):
        assert (short[phase]["repeats"], short[phase]["repeats_wanted"]) == (1, 3)
    assert short["decode"]["tokens"] == 5


def phase(tps: float, low: float, high: float, repeats: int = 3) -> dict:
    return {"tokens_per_s": tps, "tokens_per_s_range": [low, high], "repeats": repeats}


def test_hidden_wall_worked_by_hand(report):
    # s_off = 1/50 = 20 ms, s_on = 1/62.5 = 16 ms a token; the timing noise is the widths of
    # the repeats' ranges in s/token: (1/48 - 1/52) + (1/62 - 1/63) = 1.6026 + 0.2560 ms
    off, on = phase(50, 48, 52), phase(62.5, 62, 63)
    noise = (1 / 48 - 1 / 52) + (1 / 62 - 1 / 63)
    got = report.hidden_wall(off, on, 8e-3)  # 8 ms >= 4 x 1.8586 = 7.43 ms, >= 20% of 20 ms
    assert got["timing_noise_s_per_token"] == pytest.approx(noise)
    assert got["hidden_wall"] == pytest.approx((0.020 - 0.016) / 0.008) == pytest.approx(0.5)
    assert got["hidden_wall_note"] is None
    noisy = report.hidden_wall(off, on, 7e-3)  # 7 ms < 7.43 ms: not well above the noise
    assert noisy["hidden_wall"] is None
    assert noisy["hidden_wall_note"].startswith("n/a: miss 7 ms/token < 4 x the timing noise")
    # quiet repeats, but a miss time of 1.5 ms against 10 ms a token: under 20% of it
    small = report.hidden_wall(phase(100, 99.9, 100.1), phase(110, 109.9, 110.1), 1.5e-3)
    assert (
        small["hidden_wall"] is None and "< 20% of the 10 ms per token" in small["hidden_wall_note"]
    )
    once = report.hidden_wall(phase(50, 50, 50, repeats=1), on, 8e-3)
    assert once["hidden_wall"] is None and "fewer than 2 repeats" in once["hidden_wall_note"]
    assert "no miss time" in report.hidden_wall(off, on, 0.0)["hidden_wall_note"]
    # outside [0, 1]: clipped, the raw value kept
    slower = report.hidden_wall(phase(50, 49.9, 50.1), phase(40, 39.9, 40.1), 8e-3)
    assert slower["hidden_wall"] == 0.0
    assert slower["hidden_wall_raw"] == pytest.approx((0.020 - 0.025) / 0.008)  # -0.625
    assert "clipped to 0" in slower["hidden_wall_note"]
    faster = report.hidden_wall(phase(50, 49.9, 50.1), phase(100, 99.9, 100.1), 8e-3)
    assert faster["hidden_wall"] == 1.0 and faster["hidden_wall_raw"] == pytest.approx(1.25)
    assert "clipped to 1" in faster["hidden_wall_note"]


def test_the_printed_miss_time_is_the_divisor_used(report, capsys):
    def row(name, tps, low, high, prefetch, stall):
        decode = {**phase(tps, low, high), "stall_s_per_token": stall, "misses_per_token": 4.0,
                  "misses": 40, "prefetch_hits": 20 if prefetch else 0,
                  "stall_s_per_token_range": [stall - 5e-5, stall + 5e-5]}  # fmt: skip
        return {"name": name, "tier": "host", "policy": "lru", "capacity": 16,
                "capacity_label": "2k", "prefetch": prefetch, "decode": decode}  # fmt: skip

    rows = [
        row("cache lru 2k", 50, 48, 52, False, 1e-3),
        row("cache lru 2k+prefetch", 62.5, 62, 63, True, 0.5e-3),
    ]
    # on a GPU: misses/token (4) x one expert's measured copy (2 ms) = 8 ms, not the stall
    [link] = report.prefetch_figures(rows, expert_load_s=2e-3)
    assert (link["miss_s_per_token"], link["miss_basis"]) == (pytest.approx(8e-3), "link")
    assert link["stall_off_s_per_token"] == 1e-3
    assert link["hidden_wall"] == pytest.approx((0.020 - 0.016) / 8e-3)
    assert link["hidden_stall"] == pytest.approx(0.5) and link["predicted"] == 0.5
    out = {"config": {"layers": 4, "experts": 128, "top_k": 8, "hidden": 2048,
                      "expert_width": 768, "dtype": "bfloat16", "expert_bytes": 9437184,
                      "device": "cuda:0", "prompt_tokens": 512, "repeats": 3},
           "rows": [], "skipped": [], "prefetch": [link]}  # fmt: skip
    report.print_table(out)
    printed = capsys.readouterr().out
    assert "miss 8.000 ms/token (link) | hidden wall 0.50 |" in printed
    # on the CPU (no copy time measured): the stall is the divisor, and it is what is printed
    [stall] = report.prefetch_figures(rows, expert_load_s=None)
    assert (stall["miss_s_per_token"], stall["miss_basis"]) == (1e-3, "stall")
    assert stall["hidden_wall"] is None  # 1 ms < 4 x 1.86 ms of timing noise
    report.print_table({**out, "prefetch": [stall]})
    assert "miss 1.000 ms/token (stall) | hidden wall n/a |" in capsys.readouterr().out
    # a pair of which one row was skipped: listed, n/a, saying which
    skipped = {**rows[1], "skipped": True, "reason": "time budget"}
    del skipped["decode"]
    [half] = report.prefetch_figures([rows[0], skipped], 2e-3)
    assert half["hidden_wall"] is None
    assert half["hidden_wall_note"] == "n/a: cache lru 2k+prefetch not measured"
    assert half["hidden_stall"] is None and half["hidden_stall_note"] == half["hidden_wall_note"]


def test_the_stall_per_token_range_is_over_the_repeats(report):
    # 0.4 s of stall over 100 tokens (4 ms a token), 0.6 s over 200 (3 ms a token)
    measures = [report.Measure({"stall_s": 0.4}, 100, 1.0, None),
                report.Measure({"stall_s": 0.6}, 200, 1.0, None)]  # fmt: skip
    got = report.phase_figures(measures, 2)
    assert got["stall_s_per_token"] == pytest.approx(1.0 / 300)
    assert got["stall_s_per_token_range"] == pytest.approx([3e-3, 4e-3])
    counted_once = [*measures, report.Measure({"stall_s": None}, 100, 1.0, None)]
    assert report.phase_figures(counted_once, 3)["stall_s_per_token_range"] is None


def test_hidden_stall_worked_by_hand(report, capsys):
    def row(name, prefetch, stall, low, high):
        decode = {**phase(50, 49.9, 50.1), "misses_per_token": 4.0, "misses": 40,
                  "prefetch_hits": 20 if prefetch else 0, "stall_s_per_token": stall,
                  "stall_s_per_token_range": [low, high]}  # fmt: skip
        return {"name": name, "tier": "host", "policy": "lru", "capacity": 16,
                "capacity_label": "2k", "prefetch": prefetch, "decode": decode}  # fmt: skip

    # stall_off 0.5 ms a token within its repeats' spread: noise (0.9 - 0.1) + (1.0 - 0.2) =
    # 1.6 ms, and 0.5 ms < 4 x 1.6 = 6.4 ms; the plain ratio, 1 - 0.6 / 0.5 = -0.2, is noise
    noisy = [row("cache lru 2k", False, 0.5e-3, 0.1e-3, 0.9e-3),
             row("cache lru 2k+prefetch", True, 0.6e-3, 0.2e-3, 1.0e-3)]  # fmt: skip
    [na] = report.prefetch_figures(noisy, expert_load_s=None)
    note = "n/a: stall 0.5 ms/token < 4 x the timing noise 1.6 ms/token"
    assert na["hidden_stall"] is None and na["hidden_stall_note"] == note
    # a clear stall_off, 4 ms a token; noise (4.2 - 3.8) + (1.1 - 0.9) = 0.6 ms, and
    # 4 ms >= 4 x 0.6 = 2.4 ms: 1 - 1 / 4 = 0.75
    clear = [row("cache lru 2k", False, 4e-3, 3.8e-3, 4.2e-3),
             row("cache lru 2k+prefetch", True, 1e-3, 0.9e-3, 1.1e-3)]  # fmt: skip
    [got] = report.prefetch_figures(clear, expert_load_s=None)
    assert got["stall_noise_s_per_token"] == pytest.approx(0.6e-3)
    assert got["hidden_stall"] == pytest.approx(0.75) and got["hidden_stall_note"] is None
    # no stall without prefetch, or a single repeat: n/a, saying why
    zero = [row("cache lru 2k", False, 0.0, 0.0, 0.0), clear[1]]
    assert report.prefetch_figures(zero, None)[0]["hidden_stall_note"] == (
        "n/a: no stall time without prefetch"
    )
    once = [{**clear[0], "decode": {**clear[0]["decode"], "repeats": 1}}, clear[1]]
    [single] = report.prefetch_figures(once, None)
    assert single["hidden_stall"] is None and "fewer than 2 repeats" in single["hidden_stall_note"]
    # the table prints n/a with the reason in the line's note, beside hidden_wall's
    out = {"config": {"layers": 4, "experts": 128, "top_k": 8, "hidden": 2048,
                      "expert_width": 768, "dtype": "bfloat16", "expert_bytes": 9437184,
                      "device": "cpu", "prompt_tokens": 512, "repeats": 3},
           "rows": [], "skipped": [], "prefetch": [na]}  # fmt: skip
    report.print_table(out)
    line = next(x for x in capsys.readouterr().out.splitlines() if "hidden wall" in x)
    assert "| stall n/a |" in line and f"stall {note}" in line
    assert f"wall {na['hidden_wall_note']}" in line
    report.print_table({**out, "prefetch": [got]})
    assert "| stall 0.75 |" in capsys.readouterr().out
