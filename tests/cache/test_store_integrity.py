"""Expert store integrity (issue 13): nothing lost, nothing silent.

A folder that is not a store is never replaced; stale stores are; flipped bytes are caught
by the per-file checksums; index paths cannot leave the store; a wrong-but-parseable index
is refused with MoestackError naming the field, never another exception type.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cache import tiny_cfg, tiny_model

from moestack.cache import ExpertStore, open_or_write_store
from moestack.cache import store as store_mod
from moestack.errors import MoestackError


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def _index(path: Path) -> dict[str, Any]:
    return json.loads((path / "index.json").read_text())


def _write_index(path: Path, index: Any) -> None:
    (path / "index.json").write_text(json.dumps(index))


def _run_folder(root: Path, variant: str) -> Path:
    """A folder shaped like a training run (config, checkpoints, metrics), seeded bytes."""
    rng = random.Random(7)
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  d_model: 32\nsteps: 10\n")
    (run / "checkpoints" / "step_000010.safetensors").write_bytes(rng.randbytes(4096))
    (run / "metrics.jsonl").write_text('{"step": 10, "loss/train": 3.1}\n')
    if variant == "foreign_index":  # another tool's index.json
        (run / "index.json").write_text('{"files": ["checkpoints/step_000010.safetensors"]}')
    elif variant == "store_inside_run":  # a real store's files next to the run's own
        ExpertStore.write(tiny_model(), root / "tmp_store", layout="per_layer")
        for p in (root / "tmp_store").iterdir():
            shutil.move(str(p), run / p.name)
        (root / "tmp_store").rmdir()
    return run


# ---------------------------------------------------------------------- 1. data loss
@pytest.mark.parametrize("variant", ["plain", "foreign_index", "store_inside_run"])
def test_run_folder_as_store_dir_is_refused_and_untouched(tmp_path, variant):
    run = _run_folder(tmp_path, variant)
    before = _snapshot(tmp_path)
    model, cfg = tiny_model(seed=1), tiny_cfg()
    with pytest.raises(MoestackError, match="pick an empty folder or an expert store") as err:
        open_or_write_store(model, run, cfg, source="ckpt")
    assert str(run) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(MoestackError, match="not a moestack expert store"):
        ExpertStore.write(model, run, overwrite=True)
    assert _snapshot(tmp_path) == before  # byte-identical, no temporary folder left


def test_file_as_store_dir_is_refused(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    with pytest.raises(MoestackError, match=r"notes\.txt exists and is not a folder"):
        open_or_write_store(tiny_model(), target, tiny_cfg(), source="ckpt")
    assert target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_empty_or_missing_folder_is_written(tmp_path):
    model = tiny_model(seed=2)
    (tmp_path / "empty").mkdir()
    for name in ("empty", "missing"):
        store = open_or_write_store(model, tmp_path / name, tiny_cfg(), source="ckpt")
        assert torch.equal(store.load(1, 4)["w1"], model.moe_layers[1].w1[4].detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "missing"]


@pytest.mark.parametrize("stale", ["other_checkpoint", "other_model_shape"])
def test_stale_store_is_replaced(tmp_path, stale):
    path = tmp_path / "s"
    if stale == "other_checkpoint":
        ExpertStore.write(tiny_model(seed=5), path, layout="per_layer", meta={"source": "old"})
    else:
        ExpertStore.write(tiny_model(seed=5, num_experts=4), path, meta={"source": "new"})
    model = tiny_model(seed=6)
    store = open_or_write_store(model, path, tiny_cfg(), source="new")
    assert store.layout == "per_expert" and store.meta == {"source": "new"}
    for layer, moe in enumerate(model.moe_layers):
        assert torch.equal(store.load(layer, 7)["w2"], moe.w2[7].detach())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # old store and temp gone
    assert not (path / "layer_000.safetensors").exists()


# ---------------------------------------------------------------------- 2. checksums
@pytest.mark.parametrize("layout", ["per_layer", "per_expert"])
def test_flipped_byte_is_detected_naming_the_file(tmp_path, layout):
    path = tmp_path / "s"
    ExpertStore.write(tiny_model(seed=3), path, layout=layout)
    rng = random.Random(11)
    layer, expert = 1, rng.randrange(8)
    entry = ExpertStore(path).entry(layer, expert)
    file = path / entry.file
    data = bytearray(file.read_bytes())
    pos = rng.randrange(entry.w1.offset, entry.w2.offset + entry.w2.nbytes)
    data[pos] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(data))  # same size, valid header: only the checksum can tell
    store = ExpertStore(path)
    store.load(0, expert)  # another file: fine
    pattern = rf"{file.name}.*fails its checksum.*rebuild the store"
    with pytest.raises(MoestackError, match=pattern) as err:
        store.load(layer, expert)
    assert str(file) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(MoestackError, match=pattern):  # and again: never served
        store.load(layer, expert)


def test_each_file_is_verified_once_per_store(tmp_path, monkeypatch):
    path = tmp_path / "s"
    ExpertStore.write(tiny_model(), path, layout="per_layer")
    calls: list[Path] = []
    real = store_mod.fd_digest

    def counting(fd, size, file):
        calls.append(file)
        return real(fd, size, file)

    monkeypatch.setattr(store_mod, "fd_digest", counting)
    store = ExpertStore(path)
    for _ in range(3):
        for e in range(8):
            store.load(0, e)
    assert [p.name for p in calls] == ["layer_000.safetensors"]
    store.close()  # reopening descriptors does not verify again
    store.load(0, 1)
    store.load(1, 1)
    assert [p.name for p in calls] == ["layer_000.safetensors", "layer_001.safetensors"]


def test_version_1_store_is_read_unverified_with_a_warning(tmp_path, caplog):
    path = tmp_path / "s"
    model = tiny_model(seed=4)
    ExpertStore.write(model, path)
    index = _index(path)
    index["version"] = 1
    for record in index["files"]:
        del record["blake2b"]
    _write_index(path, index)
    with caplog.at_level(logging.WARNING, logger="moestack.cache.store"):
        store = ExpertStore(path, tiny_cfg())
    assert "version 1" in caplog.text and "unverified" in caplog.text
    assert torch.equal(store.load(1, 2)["w1"], model.moe_layers[1].w1[2].detach())


# ---------------------------------------------------------------------- 3. untrusted paths
def _point_file_at(path: Path, index: dict[str, Any], name: str) -> None:
    """Make the index's first file (and its experts) ``name``."""
    old = index["files"][0]["file"]
    index["files"][0]["file"] = name
    for row in index["experts"]:
        for item in row:
            if item["file"] == old:
                item["file"] = name
    _write_index(path, index)


@pytest.mark.parametrize("kind", ["dotdot", "nested_dotdot", "absolute"])
def test_path_outside_the_store_is_refused(tmp_path, kind):
    path = tmp_path / "s"
    ExpertStore.write(tiny_model(), path, layout="per_layer")
    outside = tmp_path / "outside.safetensors"  # a valid copy: only the path is wrong
    shutil.copy(path / "layer_000.safetensors", outside)
    name = {
        "dotdot": "../outside.safetensors",
        "nested_dotdot": "layer_000/../../outside.safetensors",
        "absolute": str(outside),
    }[kind]
    _point_file_at(path, _index(path), name)
    with pytest.raises(MoestackError, match=r"files\[0\]\.file.*outside the store folder"):
        ExpertStore(path)


def test_expert_entry_path_outside_is_refused(tmp_path):
    path = tmp_path / "s"
    ExpertStore.write(tiny_model(), path, layout="per_layer")
    index = _index(path)
    index["experts"][1][3]["file"] = "../../etc/passwd"
    _write_index(path, index)
    with pytest.raises(MoestackError, match=r"experts\[1\]\[3\]\.file.*outside the store"):
        ExpertStore(path)


def test_symlink_leading_out_of_the_store_is_refused(tmp_path):
    path = tmp_path / "s"
    ExpertStore.write(tiny_model(), path, layout="per_layer")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(str(path / "layer_001.safetensors"), outside)
    (path / "layer_001.safetensors").symlink_to(outside)
    with pytest.raises(MoestackError, match=r"'layer_001\.safetensors'.*outside the store"):
        ExpertStore(path)


# ---------------------------------------------------------------------- 4. structure
def _set(keys: tuple[Any, ...], value: Any):
    def mutate(index: Any) -> Any:
        node = index
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        return index

    return mutate


def _drop(*keys: Any):
    def mutate(index: Any) -> Any:
        node = index
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
        return index

    return mutate


WRONG = {
    "a list": (lambda index: [index], r"\(top level\) is list"),
    "no model": (_drop("model"), r"field model is missing"),
    "no d_ff": (_drop("model", "d_ff"), r"field model\.d_ff is missing"),
    "string size": (_set(("model", "d_model"), "32"), r"field model\.d_model is str"),
    "unknown dtype": (_set(("model", "dtype"), "F8"), r"field model\.dtype is 'F8'"),
    "entry dtype": (_set(("experts", 0, 1, "w1", "dtype"), "I8"), r"experts\[0\]\[1\]\.w1\.dtype"),
    "bad layout": (_set(("layout",), "diagonal"), r"field layout is 'diagonal'"),
    "negative size": (_set(("files", 0, "size"), -5), r"files\[0\]\.size is -5"),
    "negative nbytes": (_set(("experts", 1, 2, "w2", "nbytes"), -1), r"w2\.nbytes is -1"),
    "float offset": (_set(("experts", 0, 0, "w1", "offset"), 8.5), r"w1\.offset is float"),
    "bool top_k": (_set(("model", "top_k"), True), r"model\.top_k is bool"),
    "unknown version": (_set(("version",), 99), r"field version is 99"),
    "files not a list": (_set(("files",), {"a": 1}), r"field files is dict"),
    "row too short": (lambda i: i["experts"][1].pop() and i, r"experts\[1\] has 7 items"),
    "shape of strings": (_set(("experts", 0, 0, "w2", "shape"), ["a", 1]), r"shape\[0\]"),
    "no checksum": (_drop("files", 1, "blake2b"), r"files\[1\]\.blake2b is missing"),
    "meta a string": (_set(("meta",), "x"), r"field meta is str"),
    "past the end": (_set(("experts", 1, 7, "w2", "offset"), 10**9), r"past the file size"),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_index_structure_is_refused_naming_the_field(tmp_path, case):
    path = tmp_path / "s"
    ExpertStore.write(tiny_model(), path, layout="per_layer")
    mutate, field = WRONG[case]
    _write_index(path, mutate(_index(path)))
    with pytest.raises(MoestackError, match=field) as err:
        ExpertStore(path)
    assert "index.json" in str(err.value) and "\n" not in str(err.value)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON tree (the root excluded)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        out.append((*prefix, k))
        if isinstance(v, dict | list):
            out.extend(_paths(v, (*prefix, k)))
    return out


JUNK = [None, -1, 0, 7, 1.5, True, "x", "../x", "F16", [], {}, [1, 2], {"a": 1}, 10**12]


@pytest.mark.parametrize("layout", ["per_layer", "per_expert"])
def test_fuzzed_indexes_raise_only_moestack_or_value_errors(tmp_path, layout):
    path = tmp_path / "s"
    ExpertStore.write(tiny_model(num_experts=4), path, layout=layout)
    good = _index(path)
    paths = _paths(good)
    rng = random.Random(13)
    outcomes = {"refused": 0, "opened": 0}
    for _ in range(150):
        index = copy.deepcopy(good)
        for _ in range(rng.choice((1, 1, 2))):
            keys = rng.choice(paths)
            try:
                parent = index
                for k in keys[:-1]:
                    parent = parent[k]
                if isinstance(parent, dict) and rng.random() < 0.3:
                    del parent[keys[-1]]
                else:
                    parent[keys[-1]] = copy.deepcopy(rng.choice(JUNK))
            except (KeyError, IndexError, TypeError):
                pass  # an earlier mutation removed this path
        _write_index(path, index)
        try:
            store = ExpertStore(path)
            for layer in range(store.num_layers):
                for e in range(store.num_experts):
                    store.load(layer, e)
            store.close()
            outcomes["opened"] += 1  # e.g. a mutation inside meta
        except (MoestackError, ValueError) as err:
            assert "\n" not in str(err)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100
