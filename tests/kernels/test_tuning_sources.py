"""Where each tile config came from (measured here, read from the tuned table, or an untimed
default; a seed or measured, as its table entry says), what may be exported and saved as
measured and with which provenance, and ``tuning.retune``: on the CPU, with a fake GPU name, a
fake timer and tables written by hand."""

from __future__ import annotations

import json

import pytest
import torch

from moestack.kernels import tuned_table, tuning

GPU = "Fake GPU"
CPU = torch.device("cpu")
KEY_MM = tuning.make_key("mm", 8, 256, 512, torch.bfloat16, "g0s0c0z0t1", 4096)
KEY_WGRAD = tuning.make_key("wgrad", 8, 256, 512, torch.bfloat16, "g00", 4096)
SEED = tuning.KernelConfig(64, 64, 32, 8, 4, 4)  # in the table, never timed here


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A GPU name, a table holding SEED for KEY_MM and KEY_WGRAD, autotuning on, and a fake
    timer under which the last candidate of every kind is the fastest."""
    pytest.importorskip("triton")  # _benchmark names triton's errors
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    table = tmp_path / "table.json"
    entry = tuned_table.table_entry(SEED)
    payload = {"format": tuned_table.TABLE_FORMAT, "gpus": {GPU: {KEY_MM: entry, KEY_WGRAD: entry}}}
    table.write_text(json.dumps(payload))
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(table))
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "1")
    launched: list[tuning.KernelConfig] = []
    monkeypatch.setattr(tuning, "_time_ms", lambda fn: (fn(), 1.0 / (1 + len(launched)))[1])
    tuning.clear_cache()
    yield launched
    tuning.clear_cache()


def choose(kind: str, key: str, launched: list) -> tuning.KernelConfig:
    return tuning.choose_config(
        kind, key, CPU, 256, 512, torch.bfloat16, launched.append, interpret=False
    )


def test_table_entries_are_not_exported_as_measured(fake_gpu):
    """A config read from the table is used, but export_cache (what gets saved and stamped
    as this run's measurement) leaves it out; a measured one is in it."""
    assert choose("mm", KEY_MM, fake_gpu) == SEED and not fake_gpu  # read, not timed
    other = KEY_MM.replace("K=256", "K=128")  # no entry at any bucket: autotuned
    measured = choose("mm", other, fake_gpu)
    assert measured == tuning.candidates("mm", 256, 512, torch.bfloat16, CPU)[-1]
    assert list(tuning.export_cache()[GPU]) == [other]
    assert tuning.cache_sources()[GPU] == {KEY_MM: "table", other: "measured"}
    assert set(tuning.export_cache(measured_only=False)[GPU]) == {KEY_MM, other}


def test_untimed_defaults_are_not_exported(fake_gpu, monkeypatch):
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    key = KEY_MM.replace("E=8", "E=16")
    assert choose("mm", key, fake_gpu) == tuning.default_config("mm", 256, 512, torch.bfloat16)
    assert tuning.cache_sources()[GPU] == {key: "default"}
    assert tuning.export_cache() == {}


def test_retune_ignores_the_table_for_its_kinds_only(fake_gpu):
    """Inside retune("mm"), the mm entry is measured against every candidate (the persistent
    ones included) and exported; the wgrad entry is still read from the table."""
    choose("mm", KEY_MM, fake_gpu)  # read from the table before: dropped on entry
    with tuning.retune(["mm"]):
        got = choose("mm", KEY_MM, fake_gpu)
        assert choose("wgrad", KEY_WGRAD, fake_gpu) == SEED
    cands = tuning.candidates("mm", 256, 512, torch.bfloat16, CPU)
    assert fake_gpu == cands and got == cands[-1] and got.persistent  # every candidate timed
    assert tuning.cache_sources()[GPU] == {KEY_MM: "measured", KEY_WGRAD: "table"}
    assert list(tuning.export_cache()[GPU]) == [KEY_MM]
    assert not tuning.retuning()  # left as it was
    with (
        pytest.raises(ValueError, match=r"retune kinds \['nope'\] are unknown"),
        tuning.retune(["mm", "nope"]),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"retune sources \['seeds'\] are unknown; use some"),
        tuning.retune(["mm"], ["seeds"]),
    ):
        pass
    with pytest.raises(ValueError, match=r"retune got no sources"), tuning.retune(["mm"], []):
        pass


def test_nested_retune_blocks_add_up_and_a_kind_may_be_named_alone():
    """A block inside another leaves unread what either leaves unread, and the outer block's
    sources come back when the inner one ends; retune("mm") names the kind mm."""
    with tuning.retune(["mm"], ["measured"]):
        with tuning.retune("mm", ["seed"]):
            assert tuning.retuning() == {"mm": ("seed", "measured")}
        assert tuning.retuning() == {"mm": ("measured",)}
    assert not tuning.retuning()


def test_retune_by_source_reads_measured_entries_and_remeasures_seeds(
    fake_gpu, tmp_path, monkeypatch
):
    """Inside retune(kinds, sources=("seed",)), a seed entry of those kinds is measured
    against every candidate, a measured one is read as it is, and so is every entry of the
    other kinds; a neighbouring bucket's measured entry is a seed at a key it was not timed
    at, so that key is measured too. Cached seeds of those kinds are dropped on entry, a
    cached measured entry stays."""
    h200 = {"gpu": GPU, "date": "2026-11-30", "torch": "2.11.0", "triton": "3.6.0"}
    measured_cfg = tuning.KernelConfig(128, 128, 32, 8, 4, 4)
    key_seed = KEY_MM.replace("E=8", "E=16")
    key_near = KEY_MM.replace("R=4096", "R=8192")  # KEY_MM's bucket neighbour
    key_swiglu = tuning.make_key("mm_swiglu", 8, 256, 512, torch.bfloat16, "g1s0c0z1t0", 4096)
    seed = {**tuned_table.table_entry(SEED), "source": "seed"}
    table = {
        KEY_MM: {**tuned_table.table_entry(measured_cfg), "source": "measured", "provenance": h200},
        key_seed: seed,
        key_swiglu: seed,
    }
    path = tmp_path / "v4.json"
    path.write_text(json.dumps({"format": tuned_table.TABLE_FORMAT, "gpus": {GPU: table}}))
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(path))
    tuning.clear_cache()
    assert choose("mm", key_seed, fake_gpu) == SEED  # read before: dropped on entry
    assert choose("mm", KEY_MM, fake_gpu) == measured_cfg  # read before: kept
    assert not fake_gpu
    cands = tuning.candidates("mm", 256, 512, torch.bfloat16, CPU)
    with tuning.retune(["mm"], sources=("seed",)):
        assert tuning.retuning() == {"mm": ("seed",)}
        assert choose("mm", KEY_MM, fake_gpu) == measured_cfg and not fake_gpu
        assert choose("mm_swiglu", key_swiglu, fake_gpu) == SEED and not fake_gpu
        got = choose("mm", key_seed, fake_gpu)
        assert fake_gpu == cands and got == cands[-1]  # every candidate timed
        fake_gpu.clear()
        assert choose("mm", key_near, fake_gpu) == cands[-1] and fake_gpu == cands
    assert not tuning.retuning()
    assert tuning.cache_sources()[GPU] == {
        KEY_MM: "table",
        key_near: "measured",
        key_seed: "measured",
        key_swiglu: "table",
    }
    assert set(tuning.export_cache()[GPU]) == {key_near, key_seed}
    # The same run with the default sources: the measured entry is not read either.
    tuning.clear_cache()
    fake_gpu.clear()
    with tuning.retune(["mm"]):
        assert choose("mm", KEY_MM, fake_gpu) == cands[-1] and fake_gpu == cands


def test_cache_config_records_agree(fake_gpu):
    """A cached config, where it came from and its table entry are one record: an untimed
    default has no entry, an entry is that of the config cached, a measured config's entry
    is a measured one; a config put in by hand reads as measured."""
    entry = tuning.TableEntry(SEED, "seed", None, KEY_MM)
    tuning.cache_config(GPU, KEY_MM, SEED, "table", entry)
    tuning.cache_config(GPU, KEY_WGRAD, SEED)
    assert tuning.cache_sources()[GPU] == {KEY_MM: "table", KEY_WGRAD: "measured"}
    assert tuning.cached_entry(GPU, KEY_MM) == entry
    assert tuning.source_of(GPU, "mm|not cached") == "measured"
    other = tuning.KernelConfig(128, 128, 64)
    for source, bad, match in [
        ("nope", None, r"source='nope' is unknown"),
        ("default", entry, r"an untimed default has no table entry"),
        ("table", tuning.TableEntry(other, "seed", None, KEY_MM), r"is not the cached"),
        ("measured", entry, r'a config measured here has a "measured" entry'),
    ]:
        with pytest.raises(ValueError, match=match):
            tuning.cache_config(GPU, KEY_MM, SEED, source, bad)


@pytest.fixture
def tune_kernels():
    """The tuned-table save that scripts/tune_kernels.py and bench_moe.py --save-tuned use."""
    from moestack import bench

    return bench


def test_save_writes_and_stamps_only_what_was_measured(fake_gpu, tune_kernels, tmp_path):
    """A run that only read the table saves nothing and leaves the old stamp; a run that
    measured one key writes that key as measured with this run's provenance, and keeps the
    other entries and their sources as they were: a format 3 table's seed (no record) stays a
    seed, its recorded entry becomes measured with that record, in the current format."""
    out = tmp_path / "tuned.json"
    old = {"date": "2000-01-01", "torch": "2.0.0", "triton": "3.0.0"}
    seed_entry = tuned_table.table_entry(SEED)
    key_old = KEY_WGRAD.replace("R=4096", "R=64")
    out.write_text(
        json.dumps(
            {
                "format": 3,
                "gpus": {GPU: {KEY_WGRAD: seed_entry, key_old: seed_entry}},
                "measured": {GPU: old},
                "sources": {GPU: {key_old: old}},
            }
        )
    )
    choose("mm", KEY_MM, fake_gpu)
    choose("wgrad", KEY_WGRAD, fake_gpu)
    before = out.read_text()
    assert tune_kernels.save_tuned(out) == 0
    assert out.read_text() == before  # nothing measured: untouched, old stamp kept

    with tuning.retune(["mm"]):
        got = choose("mm", KEY_MM, fake_gpu)
    assert tune_kernels.save_tuned(out) == 1
    table = json.loads(out.read_text())
    stamp = tuning.run_provenance(GPU)
    assert stamp["gpu"] == GPU and stamp["torch"] == torch.__version__
    assert table["format"] == tuned_table.TABLE_FORMAT and "sources" not in table
    assert table["gpus"][GPU] == {
        KEY_MM: {**tuned_table.table_entry(got), "source": "measured", "provenance": stamp},
        KEY_WGRAD: {**seed_entry, "source": "seed"},
        key_old: {**seed_entry, "source": "measured", "provenance": {"gpu": GPU, **old}},
    }
    assert table["measured"][GPU] == stamp


def test_export_round_trips_each_entrys_source(fake_gpu, tune_kernels, tmp_path, monkeypatch):
    """A table of a seeded and a measured entry, read by a run that measures a third key:
    ``entry_sources`` tells the seed from the two measured ones; the export of everything
    gives the two read entries back as the table has them (the measured one's provenance
    untouched, not this run's) and the third as measured with this run's provenance; saved
    and read back, each lookup reports the same source and provenance."""
    h200 = {"gpu": GPU, "date": "2026-11-30", "torch": "2.11.0", "triton": "3.6.0"}
    measured_cfg = tuning.KernelConfig(128, 128, 32, 8, 4, 4)
    table = {
        KEY_MM: {**tuned_table.table_entry(SEED), "source": "seed"},
        KEY_WGRAD: {
            **tuned_table.table_entry(measured_cfg),
            "source": "measured",
            "provenance": h200,
        },
    }
    path = tmp_path / "v4.json"
    path.write_text(json.dumps({"format": tuned_table.TABLE_FORMAT, "gpus": {GPU: table}}))
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(path))
    tuning.clear_cache()
    assert choose("mm", KEY_MM, fake_gpu) == SEED
    assert choose("wgrad", KEY_WGRAD, fake_gpu) == measured_cfg
    assert not fake_gpu  # both read, neither timed
    other = KEY_MM.replace("K=256", "K=128")  # no entry at any bucket: measured here
    got = choose("mm", other, fake_gpu)
    assert tuning.cache_sources()[GPU] == {KEY_MM: "table", KEY_WGRAD: "table", other: "measured"}
    assert tuning.entry_sources()[GPU] == {KEY_MM: "seed", KEY_WGRAD: "measured", other: "measured"}
    stamp = tuning.run_provenance(GPU)
    fresh = {**tuned_table.table_entry(got), "source": "measured", "provenance": stamp}
    assert tuning.export_cache(measured_only=False)[GPU] == {**table, other: fresh}
    assert tuning.export_cache()[GPU] == {other: fresh}  # the table's own never re-stamped

    out = tmp_path / "saved.json"
    out.write_text(path.read_text())
    assert tune_kernels.save_tuned(out) == 1
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(out))
    tuning.clear_cache()
    back = {key: tuning.lookup_entry(GPU, key) for key in (KEY_MM, KEY_WGRAD, other)}
    assert {k: (e.config, e.source, e.provenance) for k, e in back.items()} == {
        KEY_MM: (SEED, "seed", None),
        KEY_WGRAD: (measured_cfg, "measured", h200),
        other: (got, "measured", stamp),
    }


def test_a_neighbours_entry_or_a_default_is_exported_as_a_seed(fake_gpu, monkeypatch, tmp_path):
    """A measured entry read for another row bucket was never timed at that key, nor was an
    untimed default: both export as seeds (never as measured)."""
    h200 = {"gpu": GPU, "date": "2026-11-30", "torch": "2.11.0", "triton": "3.6.0"}
    entry = {**tuned_table.table_entry(SEED), "source": "measured", "provenance": h200}
    path = tmp_path / "v4.json"
    path.write_text(
        json.dumps({"format": tuned_table.TABLE_FORMAT, "gpus": {GPU: {KEY_WGRAD: entry}}})
    )
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(path))
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    tuning.clear_cache()
    near = KEY_WGRAD.replace("R=4096", "R=8192")  # takes KEY_WGRAD's entry
    default = KEY_MM.replace("E=8", "E=16")  # no entry: the untimed default
    assert choose("wgrad", near, fake_gpu) == SEED
    choose("wgrad", KEY_WGRAD, fake_gpu)
    choose("mm", default, fake_gpu)
    assert tuning.cache_sources()[GPU] == {near: "table", KEY_WGRAD: "table", default: "default"}
    want = {near: "seed", KEY_WGRAD: "measured", default: "seed"}
    assert tuning.entry_sources()[GPU] == want
    exported = tuning.export_cache(measured_only=False)[GPU]
    assert {k: e["source"] for k, e in exported.items()} == want
    assert exported[KEY_WGRAD] == entry
    assert "provenance" not in exported[near] and "provenance" not in exported[default]
