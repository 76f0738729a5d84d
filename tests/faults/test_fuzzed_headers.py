"""Fault injection: on-disk headers that parse as JSON but have the wrong structure.

Each mutation replaces one node of the document (or the document itself) with a value of
another type, deletes a key, or plants a path outside the folder; the loader must refuse it
in one clear error (MoestackError/ValueError) or load exactly what was written. Counts go to
the fault report (docs/reliability.md).
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from helpers.faults import CLEAR, same

from moestack import checkpoint
from moestack.cache import ExpertStore
from moestack.model import MoETransformer

pytestmark = pytest.mark.faults

MUTATIONS = 60  # per format
ODD_VALUES = [None, [], {}, "x", -1, 0, 2**63, True, 1.5, "../../outside", "/etc/hostname"]


def nodes(doc, path=()):
    """Every (path, value) in a JSON document, the root included."""
    yield path, doc
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from nodes(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from nodes(value, (*path, i))


def mutate(doc, rng: random.Random):
    """A copy of ``doc`` with one structural change."""
    doc = copy.deepcopy(doc)
    path, _ = rng.choice(list(nodes(doc)))
    if not path:
        return rng.choice([[], [doc], "x", 7, None])
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(ODD_VALUES)
    return doc


def fuzz(tmp: Path, source: Path, header: str, load, fault_report, kind: str) -> dict:
    pristine = load(source)
    original = json.loads((source / header).read_text())
    counts = {"refused": 0, "harmless": 0, "silent": 0, "crashed": 0}
    rng = random.Random(kind)
    for i in range(MUTATIONS):
        target = tmp / f"{i}"
        shutil.copytree(source, target)
        (target / header).write_text(json.dumps(mutate(original, rng)))
        try:
            loaded = load(target)
        except CLEAR:
            counts["refused"] += 1
        except Exception:  # noqa: BLE001 (any other type is the finding)
            counts["crashed"] += 1
        else:
            counts["harmless" if same(loaded, pristine) else "silent"] += 1
        shutil.rmtree(target)
    fault_report.add(f"fuzzed header: {kind}", injected=MUTATIONS, **counts)
    return counts


def test_fuzzed_checkpoint_meta(tmp_path, fault_report):
    from helpers.runs import small_config

    cfg = small_config()
    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    ckpt = checkpoint.save_checkpoint(tmp_path / "c", 3, model, cfg.model, {"x": torch.ones(3)})

    def load(path: Path) -> object:
        fresh = MoETransformer(cfg.model)
        meta = checkpoint.load_model_weights(path, fresh, cfg.model)
        return {"step": meta["step"], "weights": fresh.state_dict(),
                "state": checkpoint.load_train_state(path)}  # fmt: skip

    counts = fuzz(
        tmp_path / "f", ckpt, checkpoint.META_FILE, load, fault_report, "checkpoint meta.json"
    )
    assert counts["silent"] == counts["crashed"] == 0, counts


@pytest.mark.parametrize("layout", ["per_layer", "per_expert"])
def test_fuzzed_expert_store_index(tmp_path, layout, fault_report):
    from helpers.runs import small_config

    torch.manual_seed(0)
    model = MoETransformer(small_config().model)
    source = ExpertStore.write(model, tmp_path / "store", layout=layout).path

    def load(path: Path) -> object:
        with ExpertStore(path) as store:
            return [store.load(layer, e) for layer in range(store.num_layers)
                    for e in range(store.num_experts)]  # fmt: skip

    counts = fuzz(tmp_path / "f", source, "index.json", load, fault_report,
                  f"expert store index.json ({layout})")  # fmt: skip
    assert counts["silent"] == counts["crashed"] == 0, counts


def test_fuzzed_trace_header(tmp_path, fault_report):
    from helpers.faults import load_trace

    from moestack.telemetry import attach

    torch.manual_seed(0)
    from helpers.runs import small_config

    model = MoETransformer(small_config().model)
    source = tmp_path / "trace"
    with attach(model, trace_dir=str(source), max_memory_tokens=0) as tel, torch.no_grad():
        model(torch.randint(0, 256, (2, 32)))
        tel.flush()
    counts = fuzz(
        tmp_path / "f", source, "header.json", load_trace, fault_report, "trace header.json"
    )
    assert counts["silent"] == counts["crashed"] == 0, counts


def test_fuzzed_prereg_lock(tmp_path, fault_report):
    from helpers.faults import verify_lock
    from helpers.prereg import study, write

    from moestack import prereg

    folder = tmp_path / "study"
    folder.mkdir()
    path = write(folder, study())
    prereg.lock(path)
    prereg.lock(path, amend="a second record in the chain")
    lock = next(folder.glob("*.lock.json")).name
    counts = fuzz(tmp_path / "f", folder, lock, verify_lock, fault_report, "prereg lock")
    assert counts["silent"] == counts["crashed"] == 0, counts
