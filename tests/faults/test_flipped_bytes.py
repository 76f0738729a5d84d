"""Fault injection: flip one random bit in each kind of file moestack writes, then load it.

Every outcome is one of: refused (one clear error naming the file), harmless (what loads is
exactly what was written, e.g. a flip in JSON whitespace), silent (loads, but differs: a
wrong answer nobody is told about) or crashed (another exception type). The suite requires
silent == crashed == 0 and records the counts in the fault report (docs/reliability.md).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.faults import CLEAR, load_trace, same, verify_lock

from moestack import checkpoint
from moestack.cache import ExpertStore
from moestack.model import MoETransformer

pytestmark = pytest.mark.faults

FLIPS = 40  # per kind of file


def flip_bit(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def outcome(load: Callable[[Path], object], pristine: object, copy: Path) -> str:
    try:
        loaded = load(copy)
    except CLEAR:
        return "refused"
    except Exception:  # noqa: BLE001 (any other type is the finding)
        return "crashed"
    return "harmless" if same(loaded, pristine) else "silent"


def run_flips(tmp: Path, source: Path, target: str, load, fault_report, kind: str) -> dict:
    pristine = load(source)
    counts = {"refused": 0, "harmless": 0, "silent": 0, "crashed": 0}
    rng = random.Random(kind)
    for i in range(FLIPS):
        copy = tmp / f"{kind.replace(' ', '_')}-{i}"
        shutil.copytree(source, copy)
        flip_bit(copy / target, rng)
        counts[outcome(load, pristine, copy)] += 1
        shutil.rmtree(copy)
    fault_report.add(f"flipped bit: {kind}", injected=FLIPS, **counts)
    return counts


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from helpers.runs import small_config

    root = tmp_path_factory.mktemp("saved")
    cfg = small_config()
    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    state = {"optimizer": {"state": {0: {"exp_avg": torch.randn(5)}}}, "step": 3}
    ckpt = checkpoint.save_checkpoint(root / "ckpts", 3, model, cfg.model, state)
    stores = {
        layout: ExpertStore.write(model, root / f"store_{layout}", layout=layout).path
        for layout in ("per_layer", "per_expert")
    }
    return cfg, ckpt, stores


@pytest.mark.parametrize("target", [checkpoint.MODEL_FILE, checkpoint.STATE_FILE,
                                    checkpoint.META_FILE])  # fmt: skip
def test_flipped_checkpoint_bytes_never_load_silently(saved, tmp_path, target, fault_report):
    cfg, ckpt, _ = saved

    def load(path: Path) -> object:
        model = MoETransformer(cfg.model)
        meta = checkpoint.load_model_weights(path, model, cfg.model)
        return {"meta": meta, "weights": model.state_dict(),
                "state": checkpoint.load_train_state(path)}  # fmt: skip

    counts = run_flips(tmp_path, ckpt, target, load, fault_report, f"checkpoint {target}")
    assert counts["silent"] == counts["crashed"] == 0, counts


@pytest.mark.parametrize("layout", ["per_layer", "per_expert"])
@pytest.mark.parametrize("target", ["index.json", "data"])
def test_flipped_expert_store_bytes_never_load_silently(saved, tmp_path, layout, target,
                                                         fault_report):  # fmt: skip
    _, _, stores = saved
    source = stores[layout]
    data_files = sorted(p.relative_to(source) for p in source.rglob("*.safetensors"))
    name = "index.json" if target == "index.json" else str(data_files[len(data_files) // 2])

    def load(path: Path) -> object:
        with ExpertStore(path) as store:
            return [store.load(layer, e) for layer in range(store.num_layers)
                    for e in range(store.num_experts)]  # fmt: skip

    counts = run_flips(
        tmp_path, source, name, load, fault_report, f"expert store {layout} {target}"
    )
    assert counts["silent"] == counts["crashed"] == 0, counts


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    from helpers.runs import small_config

    from moestack.telemetry import attach

    torch.manual_seed(0)
    model = MoETransformer(small_config().model)
    path = tmp_path_factory.mktemp("trace") / "trace"
    with attach(model, trace_dir=str(path), max_memory_tokens=0) as tel, torch.no_grad():
        for _ in range(3):
            model(torch.randint(0, 256, (2, 32)))
            tel.flush()  # three chunks
    return path


@pytest.mark.parametrize("target", ["header.json", "chunk"])
def test_flipped_trace_bytes_never_load_silently(trace_dir, tmp_path, target, fault_report):
    chunks = sorted(p.name for p in trace_dir.glob("chunk-*.safetensors"))
    name = "header.json" if target == "header.json" else chunks[1]
    counts = run_flips(tmp_path, trace_dir, name, load_trace, fault_report, f"trace {target}")
    assert counts["crashed"] == 0, counts
    # A chunk carries no checksum (traces are measurements, rewritten cheaply): a flip in
    # the expert ids that stays in range is the one thing that can load; count it.
    assert counts["silent"] <= FLIPS // 2, counts


@pytest.fixture(scope="module")
def locked_study(tmp_path_factory):
    from helpers.prereg import study, write

    from moestack import prereg

    root = tmp_path_factory.mktemp("study")
    path = write(root, study())
    prereg.lock(path)
    prereg.lock(path, amend="a changed threshold, for the chain to have two records")
    return path


def test_flipped_prereg_lock_bytes_never_verify_silently(locked_study, tmp_path, fault_report):
    folder = locked_study.parent
    lock = next(folder.glob("*.lock.json")).name
    counts = run_flips(tmp_path, folder, lock, verify_lock, fault_report, "prereg lock")
    assert counts["silent"] == counts["crashed"] == 0, counts
