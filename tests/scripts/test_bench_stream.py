"""scripts/bench_stream.py runs end to end at a toy size: every mode in its own process,
the streamed modes' losses the resident run's, their cache traffic reported and equal to what
the run's routing predicts for an LRU cache (the bench's own replay, checked by hand here)."""

import json
import subprocess
import sys

import pytest
from helpers.paths import REPO


def test_bench_stream_at_toy_size(tmp_path):
    out = tmp_path / "stream.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_stream.py"),
         *("--experts-mb", "0.5", "--experts", "8", "--top-k", "2", "--d-model", "32"),
         *("--d-ff", "32", "--capacity", "2", "--steps", "2", "--batch", "2", "--seq", "16"),
         *("--threads", "1", "--mmap-threshold-kb", "128", "--store-dir", str(tmp_path)),
         *("--json", str(out))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"resident", "host", "disk"}
    assert all("error" not in row for row in rows.values()), rows
    assert rows["resident"]["n_layers"] == 5  # 0.5 MiB of experts, 8 x 3 x 32 x 32 x 4 B a layer
    for mode in ("host", "disk"):
        assert rows[mode]["losses_equal_resident"] is True
        assert rows[mode]["losses_max_rel_diff"] == 0.0
        assert rows[mode]["cache"]["cache/loads"] > 0
    assert rows["host"]["cache"]["cache/bytes_read"] == 0  # served from the host tier
    assert rows["disk"]["cache"]["cache/bytes_read"] == rows["disk"]["cache"]["cache/bytes_moved"]
    for mode in ("host", "disk"):  # every load the routing asks for, and no other
        cache, predicted = rows[mode]["cache"], rows[mode]["predicted"]
        assert cache["cache/loads"] == predicted["loads"] > 0
        assert cache["cache/requests"] == predicted["requests"] == 2 * 5 * 2 * 16 * 2
        assert cache["cache/hit_rate"] == pytest.approx(predicted["hit_rate"], abs=1e-12)
        assert cache["cache/bytes_moved"] == predicted["loads"] * rows[mode]["expert_bytes"]
        assert predicted == rows["resident"]["predicted"]  # the same routing in every mode
    assert rows["disk"]["expert_bytes"] == 3 * 32 * 32 * 4
    assert list(tmp_path.iterdir()) == [out]  # the stores' temporary folder removed


def test_predicted_traffic_by_hand():
    """Two layers, capacity 2, one step: forward layer 0 [0, 1, 0], layer 1 [2]; backward
    layer 1 [2], layer 0 [0, 1, 0]. Loads: {0, 1}, {2}, none, none = 3; hits: the second 0,
    then every backward request (2, 0, 1, 0) = 5 of 8."""
    from helpers.scripts import script_module

    with script_module("bench_stream") as bench:
        got = bench.predicted_traffic([[0, 1, 0], [2]], layers=2, capacity=2)
        assert got == {"loads": 3.0, "requests": 8.0, "hit_rate": 5 / 8}
        # capacity 1: layer 0's forward [0, 1, 0] misses all three and ends holding 0; its
        # backward hits 0, then misses 1 and 0: loads {0, 1}, {2}, none, {1} = 4; hits: 2 (the
        # backward's 2 and its first 0)
        got = bench.predicted_traffic([[0, 1, 0], [2]], layers=2, capacity=1)
        assert got == {"loads": 4.0, "requests": 8.0, "hit_rate": 2 / 8}


def test_a_mode_whose_process_dies_without_a_row_is_an_error_row():
    """A mode's process killed before it reports (for memory, say) gives an error row, not a
    benchmark waiting on its queue for ever."""
    import multiprocessing
    import os

    from helpers.scripts import script_module

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=os._exit, args=(3,))
    proc.start()
    with script_module("bench_stream") as bench:
        row = bench.result_of(proc, queue, "disk")
    proc.join()
    assert row == {"mode": "disk", "error": "its process ended (exit code 3) without a result"}
