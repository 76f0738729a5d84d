"""`moestack trace import` refuses a token whose top-k expert ids repeat, in both formats."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from moestack.errors import MoestackError
from moestack.telemetry import import_trace

META = {"model": "test", "top_k": 2, "num_experts": 8, "n_moe_layers": 2}


def ids_with_repeat() -> np.ndarray:
    """[layers=2, tokens=6, k=2] distinct ids per token, except layer 1 token 4: [3, 3]."""
    rng = np.random.default_rng(0)
    full = np.stack([[rng.choice(8, 2, replace=False) for _ in range(6)] for _ in range(2)])
    full[1, 4] = [3, 3]
    return full.astype(np.int16)


def write_npz(tmp, full):
    path = tmp / "t.npz"
    np.savez(path, experts=full, meta=np.array(json.dumps(META)))
    return path, None


def write_records(tmp, full):
    path = tmp / "t.bin"
    data = b""
    for lo, hi in ((0, 3), (3, 6)):  # the tracer's stream: every layer in turn per batch
        for layer in range(2):
            rows = full[layer, lo:hi].astype(np.int32)
            data += struct.pack("<3i", layer, rows.shape[0], 2) + rows.tobytes()
    path.write_bytes(data)
    return path, 8


@pytest.mark.parametrize("write", [write_npz, write_records], ids=["npz", "records"])
def test_repeated_expert_id_is_refused(tmp_path, write):
    src, num_experts = write(tmp_path, ids_with_repeat())
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(MoestackError) as err:
        import_trace(src, tmp_path / "out", num_experts=num_experts)
    text = str(err.value)
    assert len(text.splitlines()) == 1, text
    assert text.startswith(f"{src}: "), text
    assert re.search(r"layer1 token 4: expert ids \[3, 3\] repeat an id", text), text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("write", [write_npz, write_records], ids=["npz", "records"])
def test_distinct_ids_still_import(tmp_path, write):
    full = ids_with_repeat()
    full[1, 4] = [3, 5]
    src, num_experts = write(tmp_path, full)
    trace = import_trace(src, tmp_path / "out", num_experts=num_experts)
    assert trace.num_tokens == 6
    np.testing.assert_array_equal(trace.experts(1), full[1])
