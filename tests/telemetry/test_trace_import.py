"""`moestack trace import`: both foreign layouts round-trip, bad input is one line and writes
nothing, the tokens/s estimate against values worked by hand, the shipped Qwen3-30B-A3B slice
replayed against a plain LRU, and the import + simulate command line end to end."""

from __future__ import annotations

import json
import math
import re
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from helpers.faults import dead_pid

from moestack import cli
from moestack.errors import MoestackError
from moestack.telemetry import RoutingTrace, ServingEstimate, import_trace, simulate

DATA = Path(__file__).parent / "data"
SLICE = DATA / "qwen3-30b-a3b-routing-slice.npz"
META = {"model": "test", "top_k": 4, "num_experts": 16, "n_moe_layers": 3}


def routing(layers: int = 3, tokens: int = 50, k: int = 4, experts: int = 16, seed: int = 0):
    """[layers, tokens, k] expert ids, each token's k distinct (as a router picks them)."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            np.stack([rng.choice(experts, size=k, replace=False) for _ in range(tokens)])
            for _ in range(layers)
        ]
    ).astype(np.int16)


def write_npz(path: Path, experts: np.ndarray | None, meta: object = None, **extra) -> Path:
    arrays = dict(extra)
    if experts is not None:
        arrays["experts"] = experts
    if meta is not None:
        arrays["meta"] = np.array(meta if isinstance(meta, str) else json.dumps(meta))
    np.savez(path, **arrays)
    return path


def record(layer: int, ids: np.ndarray) -> bytes:
    """One record of the tracer's stream, packed by hand: int32 layer, n_tokens, k, ids."""
    n, k = ids.shape
    return struct.pack("<3i", layer, n, k) + struct.pack(f"<{n * k}i", *ids.reshape(-1).tolist())


def write_records(path: Path, records: list[tuple[int, np.ndarray]]) -> Path:
    path.write_bytes(b"".join(record(layer, ids) for layer, ids in records))
    return path


def interleaved(ids: dict[int, np.ndarray], cuts: list[int]) -> list[tuple[int, np.ndarray]]:
    """Records as a tracer writes them: every layer's tokens cuts[i]:cuts[i+1], in turn."""
    out = []
    for start, stop in zip(cuts[:-1], cuts[1:], strict=True):
        out += [(layer, rows[start:stop]) for layer, rows in ids.items()]
    return out


def lru_misses(keys: list[int], capacity: int, skip: int) -> int:
    """A plain LRU cache of ``capacity`` keys: misses after the first ``skip`` requests."""
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for i, key in enumerate(keys):
        if key in cache:
            cache.move_to_end(key)
            continue
        misses += i >= skip
        if len(cache) == capacity:
            cache.popitem(last=False)
        cache[key] = None
    return misses


# --------------------------------------------------------------------------- round trips
def test_npz_round_trips_ids_order_and_layers(tmp_path):
    experts = routing()
    src = write_npz(tmp_path / "t.npz", experts, META)
    trace = import_trace(src, tmp_path / "out")
    again = RoutingTrace.load(tmp_path / "out")  # a trace folder like any other
    for t in (trace, again):
        assert t.num_layers == 3 and t.num_tokens == 50
        assert t.top_k == [4, 4, 4] and t.num_experts == [16, 16, 16]
        assert t.layer_names == ["layer0", "layer1", "layer2"]
        for layer in range(3):
            np.testing.assert_array_equal(t.experts(layer), experts[layer])
            # replay order: tokens in order, a token's slots in router order
            assert t.accesses(layer).tolist() == experts[layer].reshape(-1).tolist()
    (chunk,) = list(again.iter_chunks())
    assert chunk.seq.tolist() == [0] * 50 and chunk.pos.tolist() == list(range(50))
    assert again.meta["import_format"] == "npz" and again.meta["source"]["model"] == "test"


def test_records_round_trip_in_file_order_per_layer(tmp_path):
    """Layers 2, 5, 7 (the tracer's indices, not 0..L-1), records of uneven sizes and an
    empty one, interleaved as a tracer writes them: each layer is its records in order."""
    full = routing(layers=3, tokens=30, k=4, experts=16, seed=1)
    ids = {2: full[0], 5: full[1], 7: full[2]}
    records = interleaved(ids, [0, 7, 8, 20, 30])
    records.insert(3, (5, full[1][:0]))  # a record with no tokens
    src = write_records(tmp_path / "t.bin", records)
    trace = import_trace(src, tmp_path / "out", num_experts=16)
    assert trace.layer_names == ["layer2", "layer5", "layer7"]
    assert trace.num_tokens == 30 and trace.top_k == [4, 4, 4] and trace.num_experts == [16] * 3
    for layer in range(3):
        np.testing.assert_array_equal(trace.experts(layer), full[layer])
    assert trace.meta["import_format"] == "records" and trace.meta["source"]["layers"] == [2, 5, 7]


def test_records_layers_may_differ_in_k(tmp_path):
    a, b = routing(1, 10, 2, seed=2)[0], routing(1, 10, 3, seed=3)[0]
    src = write_records(tmp_path / "t.bin", [(0, a[:4]), (1, b[:4]), (0, a[4:]), (1, b[4:])])
    trace = import_trace(src, tmp_path / "out", num_experts=16)
    assert trace.top_k == [2, 3]
    np.testing.assert_array_equal(trace.experts(1), b)


# --------------------------------------------------------------------------- refusals
def _good() -> tuple[np.ndarray, dict[int, np.ndarray]]:
    full = routing(layers=2, tokens=20, k=4, experts=16, seed=4)
    return full, {0: full[0], 1: full[1]}


def _bad_id(full: np.ndarray, layer: int, token: int, slot: int, value: int) -> np.ndarray:
    bad = full.copy()
    bad[layer, token, slot] = value
    return bad


def _records_bytes(ids: dict[int, np.ndarray], cuts=(0, 10, 20)) -> bytes:
    return b"".join(record(layer, rows) for layer, rows in interleaved(ids, list(cuts)))


def _case_records_id_too_big(tmp):
    full, _ = _good()
    bad = _bad_id(full, 1, 12, 3, 16)
    return write_records(tmp / "t.bin", interleaved({0: bad[0], 1: bad[1]}, [0, 10, 20])), 16


def _case_records_negative_id(tmp):
    full, _ = _good()
    bad = _bad_id(full, 0, 3, 0, -1)
    return write_records(tmp / "t.bin", interleaved({0: bad[0], 1: bad[1]}, [0, 10, 20])), 16


def _case_unequal_layers(tmp):
    full, _ = _good()
    records = [(0, full[0][:10]), (1, full[1][:10]), (0, full[0][10:])]
    return write_records(tmp / "t.bin", records), 16


def _case_truncated_ids(tmp):
    _, ids = _good()
    data = _records_bytes(ids)
    (tmp / "t.bin").write_bytes(data[:-8])  # the last record lost its last two ids
    return tmp / "t.bin", 16


def _case_truncated_word(tmp):
    _, ids = _good()
    (tmp / "t.bin").write_bytes(_records_bytes(ids)[:-1])
    return tmp / "t.bin", 16


def _case_truncated_header(tmp):
    _, ids = _good()
    (tmp / "t.bin").write_bytes(_records_bytes(ids) + struct.pack("<2i", 0, 5))
    return tmp / "t.bin", 16


def _case_k_changes(tmp):
    full, _ = _good()
    records = [(0, full[0][:10]), (1, full[1][:10]), (0, full[0][10:, :3]), (1, full[1][10:])]
    return write_records(tmp / "t.bin", records), 16


def _case_bad_record_header(tmp):
    (tmp / "t.bin").write_bytes(struct.pack("<3i", 0, -4, 2) + b"\0" * 32)
    return tmp / "t.bin", 16


def _case_k_above_num_experts(tmp):
    return write_records(tmp / "t.bin", [(0, np.arange(8).reshape(1, 8))]), 4


def _case_records_no_num_experts(tmp):
    _, ids = _good()
    (tmp / "t.bin").write_bytes(_records_bytes(ids))
    return tmp / "t.bin", None


def _case_num_experts_zero(tmp):
    _, ids = _good()
    (tmp / "t.bin").write_bytes(_records_bytes(ids))
    return tmp / "t.bin", 0


def _case_missing_file(tmp):
    return tmp / "nope.bin", 16


def _case_folder(tmp):
    (tmp / "d").mkdir()
    return tmp / "d", 16


def _case_empty_file(tmp):
    (tmp / "t.bin").write_bytes(b"")
    return tmp / "t.bin", 16


def _case_npy_file(tmp):
    np.save(tmp / "t.npy", routing())
    return tmp / "t.npy", None


def _case_npz_id_too_big(tmp):
    return write_npz(tmp / "t.npz", _bad_id(routing(), 2, 7, 1, 99), META), None


def _case_npz_no_meta(tmp):
    return write_npz(tmp / "t.npz", routing()), None


def _case_npz_no_experts(tmp):
    return write_npz(tmp / "t.npz", None, META, ids=routing()), None


def _case_meta_not_json(tmp):
    return write_npz(tmp / "t.npz", routing(), "{'top_k': 4"), None


def _case_meta_not_object(tmp):
    return write_npz(tmp / "t.npz", routing(), "[4, 16]"), None


def _case_meta_no_num_experts(tmp):
    return write_npz(tmp / "t.npz", routing(), {"top_k": 4}), None


def _case_meta_num_experts_not_int(tmp):
    return write_npz(tmp / "t.npz", routing(), {**META, "num_experts": "16"}), None


def _case_meta_top_k_differs(tmp):
    return write_npz(tmp / "t.npz", routing(), {**META, "top_k": 2}), None


def _case_meta_layers_differ(tmp):
    return write_npz(tmp / "t.npz", routing(), {**META, "n_moe_layers": 48}), None


def _case_meta_numeric(tmp):
    np.savez(tmp / "t.npz", experts=routing(), meta=np.array([1.0]))
    return tmp / "t.npz", None


def _case_npz_float_ids(tmp):
    return write_npz(tmp / "t.npz", routing().astype(np.float32), META), None


def _case_npz_wrong_shape(tmp):
    return write_npz(tmp / "t.npz", routing()[0], META), None


def _case_npz_num_experts_differs(tmp):
    return write_npz(tmp / "t.npz", routing(), META), 64


def _case_npz_truncated(tmp):
    data = write_npz(tmp / "x.npz", routing(), META).read_bytes()
    (tmp / "x.npz").unlink()
    (tmp / "t.npz").write_bytes(data[: len(data) // 2])
    return tmp / "t.npz", None


def _with_repeat(full: np.ndarray, layer: int, token: int) -> np.ndarray:
    """``full`` with one token's first two ids made equal (a router never picks twice)."""
    bad = full.copy()
    bad[layer, token, 1] = bad[layer, token, 0]
    return bad


def _case_records_repeated_id(tmp):
    full, _ = _good()
    bad = _with_repeat(full, 1, 14)
    return write_records(tmp / "t.bin", interleaved({0: bad[0], 1: bad[1]}, [0, 10, 20])), 16


def _case_npz_repeated_id(tmp):
    return write_npz(tmp / "t.npz", _with_repeat(routing(), 1, 4), META), None


REFUSALS = {
    "records_id_too_big": (
        _case_records_id_too_big,
        r"layer1 token 12 slot 3: expert id 16 is outside \[0, num_experts=16\)",
    ),
    "records_negative_id": (_case_records_negative_id, r"layer0 token 3 slot 0: expert id -1"),
    "unequal_layers": (
        _case_unequal_layers,
        r"layers of unequal length: layer 0 has 20 tokens, layer 1 10",
    ),
    "truncated_ids": (_case_truncated_ids, r"truncated record: record 3 .*needs 40 ids, .* 38"),
    "truncated_word": (_case_truncated_word, r"truncated record: .* not a whole number of int32"),
    "truncated_header": (_case_truncated_header, r"truncated record: record 4 .* 2 of the 3"),
    "k_changes": (_case_k_changes, r"record 2 .*layer 0 changes k from 4 \(record 0\) to 3"),
    "bad_record_header": (_case_bad_record_header, r"record 0 .*n_tokens=-4.*not a record"),
    "k_above_num_experts": (_case_k_above_num_experts, r"layer 0 has k=8 > num_experts=4"),
    "records_no_num_experts": (_case_records_no_num_experts, r"--num-experts N"),
    "num_experts_zero": (_case_num_experts_zero, r"num_experts=0 must be an integer >= 1"),
    "missing_file": (_case_missing_file, r"not found; give the trace file"),
    "folder": (_case_folder, r"not a file; give the trace file"),
    "empty_file": (_case_empty_file, r"the file is empty"),
    "npy_file": (_case_npy_file, r"a single \.npy array, not an \.npz archive"),
    "npz_id_too_big": (_case_npz_id_too_big, r"layer2 token 7 slot 1: expert id 99 is outside"),
    "npz_no_meta": (_case_npz_no_meta, r"no 'meta' array"),
    "npz_no_experts": (_case_npz_no_experts, r"no 'experts' array \(it holds \['ids', 'meta'\]\)"),
    "meta_not_json": (_case_meta_not_json, r"meta is not valid JSON"),
    "meta_not_object": (_case_meta_not_object, r"meta must be a JSON object, got list"),
    "meta_no_num_experts": (_case_meta_no_num_experts, r"meta has no 'num_experts'"),
    "meta_num_experts_not_int": (
        _case_meta_num_experts_not_int,
        r"meta num_experts='16' must be an integer >= 1",
    ),
    "meta_top_k_differs": (_case_meta_top_k_differs, r"meta top_k=2 but experts holds k=4"),
    "meta_layers_differ": (_case_meta_layers_differ, r"n_moe_layers=48 but experts holds 3"),
    "meta_numeric": (_case_meta_numeric, r"meta must be one JSON string, got dtype float64"),
    "npz_float_ids": (_case_npz_float_ids, r"experts has dtype float32; expected integer ids"),
    "npz_wrong_shape": (_case_npz_wrong_shape, r"experts has shape \(50, 4\); expected \[layers"),
    "npz_num_experts_differs": (
        _case_npz_num_experts_differs,
        r"num_experts=64 given but the meta says 16",
    ),
    "npz_truncated": (_case_npz_truncated, r"not a readable \.npz archive"),
    "records_repeated_id": (
        _case_records_repeated_id,
        r"layer1 token 14: expert ids \[(\d+), \1, \d+, \d+\] repeat an id",
    ),
    "npz_repeated_id": (
        _case_npz_repeated_id,
        r"layer1 token 4: expert ids \[(\d+), \1, \d+, \d+\] repeat an id",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_one_line_naming_the_file_and_writes_nothing(tmp_path, case):
    make, message = REFUSALS[case]
    src, num_experts = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(MoestackError) as err:
        import_trace(src, tmp_path / "out", num_experts=num_experts)
    text = str(err.value)
    assert len(text.splitlines()) == 1, text
    assert text.startswith(f"{src}: "), text
    assert re.search(message, text), text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT, no hidden folder


def test_an_existing_out_is_refused_and_left_alone(tmp_path):
    src = write_npz(tmp_path / "t.npz", routing(), META)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(MoestackError, match="exists; give a new folder"):
        import_trace(src, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert import_trace(src, tmp_path / "empty").num_tokens == 50


def test_a_killed_import_s_folder_is_removed_by_the_next(tmp_path):
    src = write_npz(tmp_path / "t.npz", routing(), META)
    dead = dead_pid()
    (tmp_path / f".out.tmp-{dead}").mkdir()  # what an import killed midway left
    (tmp_path / f".out.tmp-{dead}" / "header.json").write_text("{")
    trace = import_trace(src, tmp_path / "out")
    np.testing.assert_array_equal(trace.experts(0), routing()[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.npz"]


def test_a_write_that_fails_leaves_no_folder(tmp_path, monkeypatch):
    import moestack.telemetry.trace_import as trace_import

    def fail(tmp, path):
        raise OSError("disk went away")

    monkeypatch.setattr(trace_import, "install_dir", fail)
    src = write_npz(tmp_path / "t.npz", routing(), META)
    with pytest.raises(OSError, match="disk went away"):
        import_trace(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]
    # the folders it created above out are removed again; one that was there stays
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError, match="disk went away"):
        import_trace(src, tmp_path / "kept" / "new" / "deeper" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "t.npz"]
    assert list((tmp_path / "kept").iterdir()) == []


# --------------------------------------------------------------------------- estimate
def test_estimate_matches_the_formula_worked_by_hand():
    # 1 MB per load over 1 GB/s is 1 ms; 2 ms compute + 3 loads = 5 ms: 200 tokens/s
    assert ServingEstimate(1e6, 1.0, 2.0).token_ms(3.0) == pytest.approx(5.0)
    assert ServingEstimate(1e6, 1.0, 2.0).est_tokens_per_s(3.0) == pytest.approx(200.0)
    # a bf16 expert of 3 x 2048 x 768 (9437184 bytes) over 25 GB/s, 260 misses per token:
    # 260 * 9437184 / 25e6 = 98.1467136 ms, + 5 ms = 103.1467136 ms
    assert ServingEstimate(9437184, 25, 5).est_tokens_per_s(260) == pytest.approx(
        1000 / 103.1467136, rel=1e-12
    )
    assert ServingEstimate(9437184, 25, 5).est_tokens_per_s(0) == pytest.approx(200.0)


@pytest.mark.parametrize("field", ["expert_bytes", "link_gbps", "compute_ms"])
@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True])
def test_estimate_refuses_what_is_not_a_positive_finite_number(field, value):
    if field == "compute_ms" and value == 0 and value is not True:
        return  # allowed: test_estimate_without_compute
    args = {"expert_bytes": 1e6, "link_gbps": 1.0, "compute_ms": 2.0, field: value}
    what = "a finite number >= 0" if field == "compute_ms" else "a positive finite number"
    with pytest.raises(ValueError, match=f"{field}=.* must be {what}"):
        ServingEstimate(**args)


def test_estimate_without_compute():
    # C = 0: the loads alone; 3 loads of 1 MB over 1 GB/s = 3 ms: 1000 / 3 tokens/s
    assert ServingEstimate(1e6, 1.0, 0).token_ms(3.0) == pytest.approx(3.0)
    assert ServingEstimate(1e6, 1.0, 0.0).est_tokens_per_s(3.0) == pytest.approx(1000 / 3)
    assert ServingEstimate(1e6, 1.0, 0).est_tokens_per_s(0) == math.inf  # nothing to wait for


# --------------------------------------------------------------------------- the real slice
def test_shipped_slice_carries_its_licence():
    notice = (DATA / "LICENSE").read_text()
    assert notice.startswith("MIT License")
    assert "Copyright (c) 2026 Shriniwas Ramesh Suram" in notice
    assert "The above copyright notice and this permission notice shall be included" in notice
    assert "qwen3-30b-a3b-routing-slice.npz" in (DATA / "README.md").read_text()
    assert SLICE.stat().st_size < 200_000


@pytest.mark.parametrize("warmup", [0, 0.1])
def test_shipped_slice_replays_like_a_plain_lru(tmp_path, warmup):
    with np.load(SLICE, allow_pickle=False) as z:  # read here with numpy alone
        experts = z["experts"]
    trace = import_trace(SLICE, tmp_path / "out")
    assert trace.num_layers == 4 and trace.num_tokens == 2000 and trace.num_experts == [128] * 4
    for capacity in (8, 16, 32):
        stats = simulate(trace, "lru", capacity, warmup=warmup, reuse=False)
        for layer in range(4):
            keys = experts[layer].reshape(-1).tolist()  # tokens in order, slots in order
            skip = int(warmup * len(keys))
            assert stats.layers[layer].misses == lru_misses(keys, capacity, skip), (
                capacity,
                layer,
            )


# --------------------------------------------------------------------------- command line
def test_import_then_simulate_on_the_command_line(tmp_path, capsys):
    full = routing(layers=2, tokens=40, k=2, experts=8, seed=5)
    src = write_records(tmp_path / "t.bin", interleaved({3: full[0], 4: full[1]}, [0, 16, 40]))
    out = tmp_path / "trace"
    cli.main(["trace", "import", str(src), str(out), "--num-experts", "8"])
    assert f"into {out}" in capsys.readouterr().out
    rows_file = tmp_path / "rows.json"
    argv = ["simulate", str(out), "--policies", "lru", "--capacities", "2,4", "--warmup", "0"]
    est = ["--expert-bytes", "2e6", "--link-gbps", "4", "--compute-ms", "1.5"]
    cli.main([*argv, *est, "--json", str(rows_file)])
    table = capsys.readouterr().out
    assert "est tok/s" in table and "token_ms = 1.5 ms compute" in table
    rows = json.loads(rows_file.read_text())
    assert [(r["policy"], r["capacity"]) for r in rows] == [("lru", 2), ("lru", 4)]
    for row in rows:
        misses = [lru_misses(full[i].reshape(-1).tolist(), row["capacity"], 0) for i in (0, 1)]
        assert [layer["misses"] for layer in row["layers"]] == misses
        assert row["misses"] == sum(misses)
        assert row["misses_per_token"] == pytest.approx(sum(misses) / 40)
        assert row["hit_rate"] == pytest.approx(1 - sum(misses) / 160)
        # 2e6 bytes over 4 GB/s: 0.5 ms per load
        assert row["est_tokens_per_s"] == pytest.approx(1000 / (1.5 + 0.5 * sum(misses) / 40))
        assert f"{row['est_tokens_per_s']:>10.2f}" in table
        assert row["bytes_loaded"] == sum(misses) * 2_000_000  # every load is N bytes
        assert [layer["bytes_loaded"] for layer in row["layers"]] == [m * 2e6 for m in misses]
    cli.main([*argv, "--json", str(rows_file)])  # without the options: no estimate
    assert "est tok/s" not in capsys.readouterr().out
    plain = json.loads(rows_file.read_text())
    assert all("est_tokens_per_s" not in r for r in plain)
    assert all(r["bytes_loaded"] == 0 for r in plain)  # the imported trace has no sizes
    no_compute = ["--expert-bytes", "2e6", "--link-gbps", "4", "--compute-ms", "0"]
    cli.main([*argv, *no_compute, "--json", str(rows_file)])
    capsys.readouterr()
    for row in json.loads(rows_file.read_text()):
        assert row["est_tokens_per_s"] == pytest.approx(1000 / (0.5 * row["misses"] / 40))


def test_simulate_help_states_the_formula(capsys):
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "token_ms = C + misses_per_token * N / (G * 1e6)" in text
    assert "est_tokens_per_s = 1000 / token_ms" in text


def test_simulate_at_several_batch_sizes_on_the_command_line(tmp_path, capsys):
    """--batch-sizes 1,4: a row per batch size; batch 1 is the plain replay. The trace is
    one sequence (an import), so batching changes nothing but the column."""
    from moestack.telemetry import RoutingTrace, simulate

    src = write_npz(tmp_path / "t.npz", routing(), META)
    import_trace(src, tmp_path / "trace")
    rows_file = tmp_path / "rows.json"
    argv = ["simulate", str(tmp_path / "trace"), "--policies", "lru", "--capacities", "4"]
    cli.main([*argv, "--batch-sizes", "1,4", "--json", str(rows_file)])
    table = capsys.readouterr().out
    assert "batch: sequences served together" in table and " batch " in table
    rows = json.loads(rows_file.read_text())
    assert [r["batch_size"] for r in rows] == [1, 4]
    plain = simulate(RoutingTrace.load(tmp_path / "trace"), "lru", 4)
    assert rows[0]["misses"] == rows[1]["misses"] == plain.misses
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--batch-sizes", "0,8"])
    assert exit_info.value.code == 2
    assert "whole numbers >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--expert-bytes", "1e6"], "--expert-bytes needs --link-gbps and --compute-ms too"),
        (
            ["--link-gbps", "25", "--compute-ms", "5"],
            "--link-gbps and --compute-ms need --expert-bytes too",
        ),
        (
            ["--expert-bytes", "1e6", "--link-gbps", "0", "--compute-ms", "5"],
            "link_gbps=0.0 must be a positive finite number",
        ),
        (
            ["--expert-bytes", "nan", "--link-gbps", "1", "--compute-ms", "5"],
            "expert_bytes=nan must be a positive finite number",
        ),
    ],
)
def test_simulate_refuses_a_partial_or_bad_estimate_in_one_line(tmp_path, capsys, argv, message):
    src = write_npz(tmp_path / "t.npz", routing(), META)
    import_trace(src, tmp_path / "trace")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["simulate", str(tmp_path / "trace"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_import_refusal_on_the_command_line_is_one_line(tmp_path, capsys):
    src = write_npz(tmp_path / "t.npz", routing(), {**META, "top_k": 3})
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["trace", "import", str(src), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moestack trace import: error: ") and len(err.splitlines()) == 1
    assert "meta top_k=3 but experts holds k=4" in err
    assert not (tmp_path / "out").exists()


def test_help_states_the_formula():
    parser = cli.build_parser()
    simulate_help = parser._subparsers._group_actions[0].choices["simulate"].format_help()
    assert "token_ms = C + misses_per_token * N / (G * 1e6)" in " ".join(simulate_help.split())
