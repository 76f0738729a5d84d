"""ExpertStore: round trip against direct safetensors reads, one-expert reads, bad files."""

from __future__ import annotations

import errno
import json
import os

import pytest
import safetensors
import safetensors.torch
import torch
from helpers.cache import tiny_cfg, tiny_model
from helpers.faults import dead_pid

from moestack.cache import ExpertStore, open_or_write_store
from moestack.cache import store as store_mod
from moestack.errors import MoestackError


def _direct(path, layout, layer, expert):
    """Read one expert with safetensors itself (the independent reference)."""
    if layout == "per_layer":
        with safetensors.safe_open(str(path / f"layer_{layer:03d}.safetensors"), "pt") as f:
            return f.get_tensor(f"e{expert:04d}.w1"), f.get_tensor(f"e{expert:04d}.w2")
    with safetensors.safe_open(
        str(path / f"layer_{layer:03d}" / f"expert_{expert:04d}.safetensors"), "pt"
    ) as f:
        return f.get_tensor("w1"), f.get_tensor("w2")


@pytest.mark.parametrize("layout", ["per_layer", "per_expert"])
def test_round_trip_matches_model_and_safetensors(tmp_path, layout):
    model = tiny_model()
    store = ExpertStore.write(model, tmp_path / "s", layout=layout)
    reopened = ExpertStore(tmp_path / "s", tiny_cfg())
    assert reopened.expert_bytes == (32 * 32 + 16 * 32) * 4
    for layer, moe in enumerate(model.moe_layers):
        for e in range(8):
            got = reopened.load(layer, e)
            w1, w2 = _direct(tmp_path / "s", layout, layer, e)
            assert torch.equal(got["w1"], w1) and torch.equal(got["w2"], w2)
            assert torch.equal(got["w1"], moe.w1[e].detach())
            assert torch.equal(got["w2"], moe.w2[e].detach())
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    assert index["version"] == 2 and index["layout"] == layout  # 2: files carry checksums
    assert index["model"] == {
        "num_layers": 2,
        "num_experts": 8,
        "d_model": 32,
        "d_ff": 16,
        "top_k": 2,
        "dtype": "F32",
    }
    assert store.top_k == 2


def test_state_dict_input_and_bf16(tmp_path):
    model = tiny_model().to(torch.bfloat16)
    store = ExpertStore.write(model.state_dict(), tmp_path / "s")
    assert store.dtype == torch.bfloat16 and store.top_k is None
    got = store.load(1, 5)
    assert got["w1"].dtype == torch.bfloat16
    assert torch.equal(got["w1"], model.moe_layers[1].w1[5].detach())
    assert torch.equal(got["w2"], model.moe_layers[1].w2[5].detach())


def test_load_reads_only_that_expert(tmp_path, monkeypatch):
    store = ExpertStore.write(tiny_model(), tmp_path / "s")
    entry = store.entry(1, 3)
    reads = []
    real = os.preadv

    def spy(fd, buffers, offset, *flags):
        n = real(fd, buffers, offset, *flags)
        reads.append((offset, n))
        return n

    monkeypatch.setattr(store_mod.os, "preadv", spy)
    store.load(1, 3)
    assert reads == [(entry.w1.offset, store.expert_bytes)]
    # a large expert is read in parallel chunks, all inside its own byte range
    big = {
        "layers.0.moe.w1": torch.randn(3, 256, 2048),
        "layers.0.moe.w2": torch.randn(3, 1024, 256),
    }
    big_store = ExpertStore.write(big, tmp_path / "big")
    lo = big_store.entry(0, 1).w1.offset
    for nowait in (True, False):  # page-cache read first, or straight to parallel chunks
        big_store._nowait = nowait
        reads.clear()
        got = big_store.load(0, 1)
        assert sum(max(n, 0) for _, n in reads) == big_store.expert_bytes
        assert all(lo <= off and off + n <= lo + big_store.expert_bytes for off, n in reads)
        assert nowait or len(reads) > 1
        assert torch.equal(got["w1"], big["layers.0.moe.w1"][1])
        assert torch.equal(got["w2"], big["layers.0.moe.w2"][1])


def test_disk_full_leaves_nothing(tmp_path, monkeypatch):
    real = store_mod._write_file
    calls = []

    def full(path, data):
        calls.append(path)
        if len(calls) == 2:  # second file: half written, then the disk is full
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(store_mod, "_write_file", full)
    with pytest.raises(MoestackError, match="disk full"):
        ExpertStore.write(tiny_model(), tmp_path / "s")
    assert list(tmp_path.iterdir()) == []


def test_existing_path_needs_overwrite(tmp_path):
    ExpertStore.write(tiny_model(), tmp_path / "s")
    with pytest.raises(MoestackError, match="overwrite=True"):
        ExpertStore.write(tiny_model(), tmp_path / "s")
    model = tiny_model(seed=3)
    store = ExpertStore.write(model, tmp_path / "s", overwrite=True)
    assert torch.equal(store.load(0, 0)["w1"], model.moe_layers[0].w1[0].detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_leftovers_of_a_killed_writer_are_removed_by_the_next(tmp_path):
    """A writer killed midway leaves ``.s.tmp-PID`` (and, overwriting, ``.s.old-PID``); the
    next write of ``s`` removes a dead process's and puts an ``.old`` back where ``s`` is
    missing; another live writer's folder is left alone."""
    ExpertStore.write(tiny_model(), tmp_path / "s")
    dead = dead_pid()
    os.rename(tmp_path / "s", tmp_path / f".s.old-{dead}")  # killed between the two renames
    (tmp_path / f".s.tmp-{dead}").mkdir()
    (tmp_path / f".s.tmp-{os.getppid()}").mkdir()  # a live writer's
    with pytest.raises(MoestackError, match="overwrite=True"):  # the old copy is back
        ExpertStore.write(tiny_model(seed=3), tmp_path / "s")
    model = tiny_model(seed=3)
    ExpertStore.write(model, tmp_path / "s", overwrite=True)
    got = ExpertStore(tmp_path / "s").load(0, 1)["w1"]
    assert torch.equal(got, model.moe_layers[0].w1[1].detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s", f".s.tmp-{os.getppid()}"])


def test_truncated_file(tmp_path):
    ExpertStore.write(tiny_model(), tmp_path / "s", layout="per_layer")
    file = tmp_path / "s" / "layer_001.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with pytest.raises(MoestackError, match=r"layer_001\.safetensors is \d+ bytes.*truncated"):
        ExpertStore(tmp_path / "s")


def test_corrupt_header(tmp_path):
    ExpertStore.write(tiny_model(), tmp_path / "s", layout="per_layer")
    file = tmp_path / "s" / "layer_000.safetensors"
    data = bytearray(file.read_bytes())
    data[8:12] = b"#!#!"  # the JSON header's first bytes, same size
    file.write_bytes(bytes(data))
    with pytest.raises(MoestackError, match=r"layer_000\.safetensors: not a valid safetensors"):
        ExpertStore(tmp_path / "s")


def test_header_disagrees_with_index(tmp_path):
    ExpertStore.write(tiny_model(), tmp_path / "s", layout="per_expert")
    # a valid safetensors file of the same size whose tensor is transposed
    file = tmp_path / "s" / "layer_000" / "expert_0002.safetensors"
    with safetensors.safe_open(str(file), "pt") as f:
        tensors = {"w1": f.get_tensor("w1"), "w2": f.get_tensor("w2").T.contiguous()}
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(MoestackError, match=r"expert_0002\.safetensors: tensor w2"):
        ExpertStore(tmp_path / "s")


def test_missing_file_and_index(tmp_path):
    ExpertStore.write(tiny_model(), tmp_path / "s", layout="per_expert")
    (tmp_path / "s" / "layer_001" / "expert_0007.safetensors").unlink()
    with pytest.raises(MoestackError, match=r"expert_0007\.safetensors is missing"):
        ExpertStore(tmp_path / "s")
    (tmp_path / "s" / "index.json").unlink()
    with pytest.raises(MoestackError, match="index.json is missing"):
        ExpertStore(tmp_path / "s")
    with pytest.raises(MoestackError, match="does not exist"):
        ExpertStore(tmp_path / "nowhere")


def test_other_model_shape_and_bad_ids(tmp_path):
    store = ExpertStore.write(tiny_model(), tmp_path / "s")
    with pytest.raises(MoestackError, match=r"model.moe.num_experts=8, this model has 4"):
        ExpertStore(tmp_path / "s", tiny_cfg(num_experts=4))
    with pytest.raises(MoestackError, match=r"model.d_model=32, this model has 64"):
        store.check_model(tiny_cfg(d_model=64))
    with pytest.raises(ValueError, match="layer=2 out of range"):
        store.load(2, 0)
    with pytest.raises(ValueError, match="expert=8 out of range"):
        store.load(0, 8)


def test_open_or_write_store_rewrites_other_source(tmp_path):
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    cfg = tiny_cfg()
    sa = open_or_write_store(a, tmp_path / "s", cfg, source="ckpt-a")
    assert torch.equal(sa.load(0, 1)["w2"], a.moe_layers[0].w2[1].detach())
    again = open_or_write_store(b, tmp_path / "s", cfg, source="ckpt-a")  # same source: reused
    assert torch.equal(again.load(0, 1)["w2"], a.moe_layers[0].w2[1].detach())
    sb = open_or_write_store(b, tmp_path / "s", cfg, source="ckpt-b")
    assert torch.equal(sb.load(0, 1)["w2"], b.moe_layers[0].w2[1].detach())
