"""RoutingTrace: save / load round-trip, streaming, clear errors on bad files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moestack.telemetry import RoutingTrace, TraceFormatError


def make_trace(path: Path | None = None, chunk_tokens: int = 1 << 18, probs: bool = False):
    rng = np.random.default_rng(0)
    trace = RoutingTrace(
        ["a.gate", "b.gate"],
        [2, 3],
        [8, 40000],
        expert_bytes=[100, None],
        record_probs=probs,
        path=path,
        chunk_tokens=chunk_tokens,
        meta={"model": "test"},
    )
    rows = []
    for call in range(5):
        n = 6
        seq = np.repeat(np.arange(2 * call, 2 * call + 2), 3)
        pos = np.tile(np.arange(3, dtype=np.int32), 2)
        e0 = rng.integers(0, 8, size=(n, 2))
        e1 = rng.integers(0, 40000, size=(n, 3))
        p = [rng.random((n, 8)).astype(np.float16), rng.random((n, 40000)).astype(np.float16)]
        trace.append(seq, pos, [e0, e1], p if probs else None)
        rows.append((seq, pos, e0, e1, p))
    return trace, rows


def check_equal(trace: RoutingTrace, rows, probs: bool = False) -> None:
    np.testing.assert_array_equal(trace.sequence_ids(), np.concatenate([r[0] for r in rows]))
    np.testing.assert_array_equal(trace.position_ids(), np.concatenate([r[1] for r in rows]))
    np.testing.assert_array_equal(trace.experts(0), np.concatenate([r[2] for r in rows]))
    np.testing.assert_array_equal(trace.experts(1), np.concatenate([r[3] for r in rows]))
    assert trace.experts(0).dtype == np.int16 and trace.experts(1).dtype == np.int32
    if probs:
        np.testing.assert_array_equal(trace.probs(0), np.concatenate([r[4][0] for r in rows]))
    # replay order: rows in order, slots in router order
    np.testing.assert_array_equal(
        trace.accesses(0), np.concatenate([r[2] for r in rows]).reshape(-1)
    )


def test_round_trip(tmp_path: Path) -> None:
    trace, rows = make_trace(probs=True)
    trace.save(tmp_path / "t")
    loaded = RoutingTrace.load(tmp_path / "t")
    assert loaded.layer_names == ["a.gate", "b.gate"] and loaded.top_k == [2, 3]
    assert loaded.num_experts == [8, 40000] and loaded.expert_bytes == [100, None]
    assert loaded.meta == {"model": "test"} and loaded.num_tokens == 30
    check_equal(loaded, rows, probs=True)
    assert RoutingTrace.load(tmp_path / "t" / "header.json").num_tokens == 30


def test_streaming_writes_chunks(tmp_path: Path) -> None:
    trace, rows = make_trace(tmp_path / "s", chunk_tokens=10)
    files = sorted(p.name for p in (tmp_path / "s").glob("chunk-*.safetensors"))
    assert len(files) == 2  # 30 rows, sealed at 12 and 24; 6 still pending
    assert len(trace._pending) == 1
    trace.flush()
    check_equal(RoutingTrace.load(tmp_path / "s"), rows)
    check_equal(trace, rows)


def test_memory_bound_drops_oldest() -> None:
    trace = RoutingTrace(["g"], [1], [4], chunk_tokens=4, max_memory_tokens=8)
    for i in range(10):
        trace.append(np.zeros(4), np.arange(4), [np.full((4, 1), i % 4)])
    assert trace.num_tokens <= 8 and trace.dropped_tokens == 32


def test_truncated_chunk_names_the_file(tmp_path: Path) -> None:
    trace, _ = make_trace()
    trace.save(tmp_path / "t")
    chunk = tmp_path / "t" / "chunk-000000.safetensors"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(TraceFormatError, match="chunk-000000.safetensors"):
        RoutingTrace.load(tmp_path / "t")


def test_truncated_header(tmp_path: Path) -> None:
    trace, _ = make_trace()
    trace.save(tmp_path / "t")
    header = tmp_path / "t" / "header.json"
    header.write_text(header.read_text()[:40])
    with pytest.raises(TraceFormatError, match="header.json"):
        RoutingTrace.load(tmp_path / "t")


def test_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "file.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(TraceFormatError, match="file.bin"):
        RoutingTrace.load(tmp_path / "file.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="header.json"):
        RoutingTrace.load(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "header.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(TraceFormatError, match="something-else"):
        RoutingTrace.load(tmp_path / "other")
    # a foreign safetensors file standing in for a chunk
    from safetensors.numpy import save_file

    trace, _ = make_trace()
    trace.save(tmp_path / "t")
    save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / "t" / "chunk-000000.safetensors"))
    with pytest.raises(TraceFormatError, match="chunk-000000"):
        RoutingTrace.load(tmp_path / "t")
    (tmp_path / "t" / "chunk-000000.safetensors").unlink()
    with pytest.raises(TraceFormatError, match="missing"):
        RoutingTrace.load(tmp_path / "t")


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    trace, _ = make_trace()
    trace.save(tmp_path / "t")
    with pytest.raises(FileExistsError):
        trace.save(tmp_path / "t")
