"""Fault injection for training with streamed experts: a byte of the expert store flipped on
disk after it was opened (and verified) is refused at the next load of that expert, naming
the file, instead of being trained on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cache import tiny_model
from helpers.streaming import build, run_cfg, train

from moestack.cache import ExpertStore
from moestack.cache.streaming import attach_streaming
from moestack.errors import MoestackError

pytestmark = pytest.mark.faults


def flip(path: Path, offset_from_end: int = 5) -> None:
    """Flip every bit of one byte of the tensor data (near the end of the file)."""
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_load_checked_against_the_checksum(tmp_path: Path):
    """verify_loads: the second load of an expert whose file changed since the first is
    refused naming the file; the default (once per file) serves the changed bytes, which is
    why training asks for verify_loads."""
    store_dir = tmp_path / "store"
    ExpertStore.write(tiny_model(), store_dir).close()
    file = store_dir / "layer_000" / "expert_0001.safetensors"
    once = ExpertStore(store_dir)
    every = ExpertStore(store_dir, verify_loads=True)
    before = every.load(0, 1)["w2"].clone()
    assert torch.equal(once.load(0, 1)["w2"], before)
    flip(file)
    assert not torch.equal(once.load(0, 1)["w2"], before)  # the once-per-file check
    with pytest.raises(MoestackError, match=f"expert file {file} fails its checksum"):
        every.load(0, 1)
    assert torch.equal(every.load(0, 2)["w2"], ExpertStore(store_dir).load(0, 2)["w2"])
    with pytest.raises(MoestackError, match=f"expert file {file} fails its checksum"):
        ExpertStore(store_dir, verify_loads=True).load(0, 1)  # a fresh store: the same


def test_per_layer_store_refused_for_every_load(tmp_path: Path):
    ExpertStore.write(tiny_model(), tmp_path / "s", layout="per_layer").close()
    with pytest.raises(MoestackError, match="per_layer: checking every load needs one expert"):
        ExpertStore(tmp_path / "s", verify_loads=True)


def test_flipped_byte_mid_run_refused_naming_the_file(tmp_path: Path):
    """Training streams from the store with every load checked: flip a byte of every expert
    file of layer 1 after a step, and a later step's load of one of them is refused."""
    cfg = run_cfg("routers", capacity=2)
    model = build(cfg)
    attach_streaming(model, cfg, tmp_path)
    train(model, cfg, steps=1)
    files = sorted((tmp_path / "experts" / "layer_001").glob("expert_*.safetensors"))
    for file in files:
        flip(file)
    with pytest.raises(MoestackError, match=r"expert file .*layer_001/expert_\d{4}\.safetensors "
                       "fails its checksum"):  # fmt: skip
        train(model, cfg, steps=3)
