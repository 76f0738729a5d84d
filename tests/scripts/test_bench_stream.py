"""scripts/bench_stream.py runs end to end at a toy size: every mode in its own process,
the streamed modes' losses the resident run's, their cache traffic reported."""

import json
import subprocess
import sys

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
        assert rows[mode]["cache"]["cache/loads"] > 0
    assert rows["host"]["cache"]["cache/bytes_read"] == 0  # served from the host tier
    assert rows["disk"]["cache"]["cache/bytes_read"] == rows["disk"]["cache"]["cache/bytes_moved"]
    assert list(tmp_path.iterdir()) == [out]  # the stores' temporary folder removed
