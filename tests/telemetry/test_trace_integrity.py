"""Routing traces lose nothing and refuse bad input in one line (issue 13).

flush() puts a short run on disk; a killed writer's folder loads with what was flushed;
expert ids, empty traces, chunk paths and header structure are checked at load.
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moestack import ModelConfig, MoEConfig, MoETransformer
from moestack.telemetry import RoutingTrace, TraceFormatError, attach, simulate

SEED = 1234


def tiny_model() -> MoETransformer:
    torch.manual_seed(SEED)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, moe=MoEConfig(8, 2, 32))
    model = MoETransformer(cfg).eval()
    for moe in model.moe_layers:  # spread the router scores so top-k is unambiguous
        nn.init.normal_(moe.router.weight, std=1.0)
    return model


def record_routers(model: MoETransformer) -> tuple[list[list[np.ndarray]], list]:
    """The experts each router returned, seen by the test's own forward hooks."""
    seen: list[list[np.ndarray]] = [[] for _ in model.moe_layers]

    def hook(layer: int):
        return lambda mod, args, out: seen[layer].append(out.experts.detach().cpu().numpy())

    handles = [m.router.register_forward_hook(hook(i)) for i, m in enumerate(model.moe_layers)]
    return seen, handles


def random_trace(path: Path | None, rng: np.random.Generator, rows: int = 40) -> RoutingTrace:
    trace = RoutingTrace(["l0", "l1"], [2, 2], [8, 8], path=path, chunk_tokens=16)
    for start in range(0, rows, 10):
        n = min(10, rows - start)
        ids = [rng.integers(0, 8, size=(n, 2)) for _ in range(2)]
        trace.append(np.zeros(n, np.int64), np.arange(start, start + n), ids)
    trace.flush()
    return trace


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------- flush
def test_flush_puts_a_short_run_on_disk(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model()
    seen, handles = record_routers(model)
    gen = torch.Generator().manual_seed(SEED)
    tel = attach(model, trace_dir=str(tmp_path / "trace"))  # chunks of 262144 tokens
    with torch.no_grad():
        for _ in range(3):
            model(torch.randint(0, 256, (2, 16), generator=gen))
    assert tel.flush() == 96  # a checkpoint: far fewer tokens than a chunk
    assert tel.flush() == 96  # nothing new: no new chunk
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8), generator=gen))
    assert tel.flush() == 104
    flushed = [np.concatenate(s) for s in seen]
    with torch.no_grad():  # recorded after the last flush, then the process "dies"
        model(torch.randint(0, 256, (2, 16), generator=gen))
    # debris of a writer killed mid-write: a temp chunk and a chunk not yet listed
    (tmp_path / "trace" / "chunk-000002.safetensors.tmp").write_bytes(b"\x00" * 10)
    (tmp_path / "trace" / "chunk-000002.safetensors").write_bytes(b"\x00" * 10)
    with caplog.at_level(logging.WARNING):
        loaded = RoutingTrace.load(tmp_path / "trace")
    assert "chunk-000002.safetensors" in caplog.text
    assert loaded.num_tokens == 104
    for layer in range(2):
        np.testing.assert_array_equal(loaded.experts(layer), flushed[layer])
    seq = np.concatenate([np.repeat(np.arange(6), 16), np.full(8, 6)])
    np.testing.assert_array_equal(loaded.sequence_ids(), seq)
    tel.detach()
    for h in handles:
        h.remove()


def test_killed_writer_leaves_a_loadable_trace(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import numpy as np
        from moestack.telemetry.trace import RoutingTrace
        rng = np.random.default_rng({SEED})
        trace = RoutingTrace(["a", "b"], [2, 1], [8, 4], path=sys.argv[1], chunk_tokens=1000)
        for i in range(5):
            ids = [rng.integers(0, 8, (7, 2)), rng.integers(-1, 4, (7, 1))]
            trace.append(np.full(7, i), np.arange(7), ids)
            if i == 2:
                trace.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = tmp_path / "trace"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], check=False)
    assert proc.returncode != 0  # killed: no close(), two batches never flushed
    rng = np.random.default_rng(SEED)
    expected = [[rng.integers(0, 8, (7, 2)), rng.integers(-1, 4, (7, 1))] for _ in range(3)]
    loaded = RoutingTrace.load(out)
    assert loaded.num_tokens == 21
    for layer in range(2):
        want = np.concatenate([e[layer] for e in expected])
        np.testing.assert_array_equal(loaded.experts(layer), want)


# --------------------------------------------------------------------------- expert ids
def test_bad_expert_ids_refused_when_recorded() -> None:
    rng = np.random.default_rng(SEED)
    for bad in (-2 - int(rng.integers(0, 100)), 8 + int(rng.integers(0, 100))):
        ids = rng.integers(0, 8, size=(5, 2))
        ids[rng.integers(0, 5), rng.integers(0, 2)] = bad
        trace = RoutingTrace(["l0"], [2], [8])
        with pytest.raises(ValueError, match=str(bad)) as err:
            trace.append(np.zeros(5), np.arange(5), [ids])
        one_line(err)
        assert trace.num_tokens == 0
    with pytest.raises(ValueError, match="40000"):  # would wrap around in int16
        RoutingTrace.from_arrays([np.full((3, 1), 40000)], num_experts=100)


def test_num_experts_below_the_ids_refused_at_load(tmp_path: Path) -> None:
    random_trace(tmp_path / "t", np.random.default_rng(SEED))
    header_file = tmp_path / "t" / "header.json"
    header = json.loads(header_file.read_text())
    ids = RoutingTrace.load(tmp_path / "t").experts(1)
    header["layers"][1]["num_experts"] = int(ids.max())  # below the largest id present
    header_file.write_text(json.dumps(header))
    with pytest.raises(TraceFormatError, match=r"layer 1 .*num_experts") as err:
        RoutingTrace.load(tmp_path / "t")
    one_line(err)


def _rewrite_chunk(file: Path, layer: int, ids: np.ndarray, metadata: dict[str, str]) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(file))
    tensors[f"experts.{layer}"] = ids
    save_file(tensors, str(file), metadata=metadata)
    # As an older writer's chunk: no checksum in the header (it would refuse the rewrite).
    header_file = file.parent / "header.json"
    header = json.loads(header_file.read_text())
    for entry in header["chunks"]:
        entry.pop("blake2b", None)
    header_file.write_text(json.dumps(header))


@pytest.mark.parametrize("bad", [-5, 8, 300])
def test_bad_ids_in_a_chunk_refused(tmp_path: Path, bad: int) -> None:
    rng = np.random.default_rng(SEED + bad)
    random_trace(tmp_path / "t", rng)
    chunk = tmp_path / "t" / "chunk-000000.safetensors"
    ids = RoutingTrace.load(tmp_path / "t").experts(0)[:20].copy()  # the first chunk
    ids[rng.integers(0, 20), rng.integers(0, 2)] = bad
    base = {"format": "moestack-routing-trace", "version": "1"}
    _rewrite_chunk(chunk, 0, ids, base)  # no id ranges (an older writer): ids read at load
    with pytest.raises(TraceFormatError, match=rf"chunk-000000.*{bad}") as err:
        RoutingTrace.load(tmp_path / "t")
    one_line(err)
    lying = {**base, "expert_ranges": json.dumps([[0, 7], [0, 7]])}
    _rewrite_chunk(chunk, 0, ids, lying)  # ranges that lie: caught when the rows are read
    trace = RoutingTrace.load(tmp_path / "t")
    with pytest.raises(TraceFormatError, match=rf"chunk-000000.*{bad}"):
        trace.experts(0)
    with pytest.raises(TraceFormatError, match=str(bad)):
        simulate(trace, "lru", 2)


# --------------------------------------------------------------------------- empty traces
def test_empty_trace_refused(tmp_path: Path) -> None:
    RoutingTrace(["l0"], [2], [8], path=tmp_path / "never")  # header, no chunk
    with pytest.raises(TraceFormatError, match="holds no tokens") as err:
        RoutingTrace.load(tmp_path / "never")
    one_line(err)
    model = tiny_model()
    with attach(model, trace_dir=str(tmp_path / "unused")) as tel:
        assert tel.flush() == 0
    with pytest.raises(TraceFormatError, match="holds no tokens"):
        RoutingTrace.load(tmp_path / "unused")
    empty = RoutingTrace(["l0"], [2], [8])
    with pytest.raises(ValueError, match="holds no tokens") as err:
        simulate(empty, "lru", 2)
    one_line(err)
    padding = RoutingTrace.from_arrays([np.ones((6, 2), np.int64)], pos=np.full(6, -1))
    with pytest.raises(ValueError, match="no expert requests"):
        simulate(padding, "lru", 2)


# --------------------------------------------------------------------------- paths
def _point_chunk_at(trace_dir: Path, name: str) -> None:
    header_file = trace_dir / "header.json"
    header = json.loads(header_file.read_text())
    header["chunks"][0]["file"] = name
    header_file.write_text(json.dumps(header))


def test_chunk_paths_stay_inside_the_folder(tmp_path: Path) -> None:
    random_trace(tmp_path / "t", np.random.default_rng(SEED))
    chunk = tmp_path / "t" / "chunk-000000.safetensors"
    outside = tmp_path / "outside.safetensors"  # a valid chunk, so only the path is wrong
    outside.write_bytes(chunk.read_bytes())
    link = tmp_path / "t" / "link.safetensors"
    link.symlink_to(outside)
    for name, why in [
        ("../outside.safetensors", "'..'"),
        ("sub/../../outside.safetensors", "'..'"),
        (str(outside), "absolute"),
        ("link.safetensors", "symlink"),
        ("", "not a chunk file"),
    ]:
        _point_chunk_at(tmp_path / "t", name)
        with pytest.raises(TraceFormatError, match=rf"chunks\[0\]\.file.*{why}") as err:
            RoutingTrace.load(tmp_path / "t")
        one_line(err)
    _point_chunk_at(tmp_path / "t", "chunk-000001.safetensors")  # listed twice
    with pytest.raises(TraceFormatError, match="twice"):
        RoutingTrace.load(tmp_path / "t")


# --------------------------------------------------------------------------- header schema
def _valid_header(tmp_path: Path) -> dict:
    random_trace(tmp_path / "t", np.random.default_rng(SEED))
    return json.loads((tmp_path / "t" / "header.json").read_text())


def _set(obj: dict, path: tuple, value) -> dict:
    obj = copy.deepcopy(obj)
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


_DELETE = object()

WRONG = [
    ((), None),  # the whole header replaced below
    (("layers",), _DELETE),
    (("layers",), []),
    (("layers",), {"name": "x"}),
    (("layers", 0), "l0"),
    (("layers", 0, "name"), 3),
    (("layers", 0, "top_k"), _DELETE),
    (("layers", 0, "top_k"), 2.0),
    (("layers", 0, "top_k"), 0),
    (("layers", 0, "top_k"), 9),
    (("layers", 1, "num_experts"), -8),
    (("layers", 1, "num_experts"), "8"),
    (("layers", 0, "expert_bytes"), -1),
    (("record_probs",), "no"),
    (("record_probs",), _DELETE),
    (("num_tokens",), -40),
    (("num_tokens",), 39),
    (("num_tokens",), None),
    (("version",), True),
    (("version",), "1"),
    (("chunks",), {"file": "chunk-000000.safetensors"}),
    (("chunks", 0), ["chunk-000000.safetensors", 16]),
    (("chunks", 0, "file"), 0),
    (("chunks", 0, "file"), _DELETE),
    (("chunks", 0, "tokens"), -16),
    (("chunks", 0, "tokens"), "16"),
    (("dropped_tokens",), -1),
    (("meta",), [1, 2]),
]


@pytest.mark.parametrize("path,value", WRONG, ids=[str(i) for i in range(len(WRONG))])
def test_wrong_header_structure_refused(tmp_path: Path, path: tuple, value) -> None:
    header = _valid_header(tmp_path)
    bad = [header, header] if not path else _set(header, path, value)
    (tmp_path / "t" / "header.json").write_text(json.dumps(bad))
    with pytest.raises(TraceFormatError, match="header.json") as err:
        RoutingTrace.load(tmp_path / "t")
    one_line(err)
    if path:
        assert str(path[0]) in str(err.value)


def _leaves(obj, prefix=()):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        if isinstance(value, (dict, list)) and value:
            yield from _leaves(value, (*prefix, key))
        yield (*prefix, key)


def test_fuzzed_headers_refused_or_loaded_never_crash(tmp_path: Path) -> None:
    rng = np.random.default_rng(SEED)
    header = _valid_header(tmp_path)
    leaves = list(_leaves(header))
    junk = [None, True, -3, 0, 2**40, 1.5, "x", "../x", [], [1], {}, {"file": 1}, _DELETE]
    refused = 0
    for _ in range(150):
        bad = header
        for _ in range(int(rng.integers(1, 4))):
            path = leaves[rng.integers(len(leaves))]
            try:
                bad = _set(bad, path, junk[rng.integers(len(junk))])
            except (KeyError, IndexError, TypeError):
                continue  # an earlier mutation removed the parent
        (tmp_path / "t" / "header.json").write_text(json.dumps(bad))
        try:
            trace = RoutingTrace.load(tmp_path / "t")
            assert trace.experts(0).shape[0] == trace.sequence_ids().shape[0]
        except TraceFormatError as err:
            assert "\n" not in str(err)
            refused += 1
    assert refused > 100


def test_written_trace_passes_its_own_checks(tmp_path: Path) -> None:
    rng = np.random.default_rng(SEED)
    trace = random_trace(tmp_path / "t", rng)
    loaded = RoutingTrace.load(tmp_path / "t")
    assert loaded.num_tokens == 40 and len(loaded._disk) == 2  # sealed at 20 rows, twice
    for layer in range(2):
        np.testing.assert_array_equal(loaded.experts(layer), trace.experts(layer))
    assert not list((tmp_path / "t").glob("*.tmp"))
