"""Fault injection on the tuned-kernel table (``MOESTACK_TUNED_CONFIGS``): a file that is no
table (a list, JSON nested 100,000 deep, not JSON, unreadable), a table of the wrong
structure, and entries whose values the kernels cannot launch (a tile of 2^40, a tile given
as the string "128", a tile not a power of two, an unknown field) are refused in one
ValueError naming the file (and the GPU, key and field), the kernels' way of refusing bad
input, before any config reaches a launch; no AttributeError or RecursionError, and no
config handed on as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moestack.kernels import tuned_table, tuning

pytestmark = pytest.mark.faults

GPU = "Fancy GPU"
KEY = tuning.make_key("mm", 8, 256, 512, torch.bfloat16, "g0s0c0z0t1", 4096)
GOOD = {"block_m": 64, "block_n": 64, "block_k": 32, "source": "seed"}
H200 = {"gpu": GPU, "date": "2026-11-30", "torch": "2.11.0", "triton": "3.6.0"}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Point MOESTACK_TUNED_CONFIGS at ``tmp_path/table.json`` (written by each test); the
    GPU's name is GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(tmp_path / "table.json"))
    tuning.clear_cache()
    yield tmp_path / "table.json"
    tuning.clear_cache()


def choose() -> tuning.KernelConfig:
    """The config a launch of KEY would get (the table read; nothing timed or launched)."""

    def never(cfg):
        raise AssertionError(f"nothing is launched here, not {cfg}")

    return tuning.choose_config("mm", KEY, torch.device("cpu"), 256, 512, torch.bfloat16,
                                never, interpret=False)  # fmt: skip


def refused(table: Path, fault_report, kind: str) -> str:
    """The table is refused: one ValueError line naming its file (returned)."""
    with pytest.raises(ValueError) as err:
        choose()
    assert type(err.value) is ValueError, repr(err.value)
    line = str(err.value)
    assert "\n" not in line and str(table) in line, line
    fault_report.add(f"tuned-kernel table: {kind}", injected=1, refused=1)
    return line


def with_entry(table: Path, entry: object, gpus: object = None) -> None:
    gpus = {GPU: {KEY: entry}} if gpus is None else gpus
    table.write_text(json.dumps({"format": tuned_table.TABLE_FORMAT, "gpus": gpus}))


def test_a_good_entry_is_chosen(table):
    with_entry(table, GOOD)
    assert choose() == tuning.KernelConfig(64, 64, 32)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[]", "holds a list"),
        ('{"format": 4, "gpus": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
        ('{"format": 4, "gpus": {', "not valid JSON"),
        ("\udcff", "cannot be read"),
    ],
    ids=["a list", "nested 100000 deep", "not JSON", "not UTF-8"],
)
def test_a_file_that_is_no_table_is_refused(table, fault_report, text, said):
    if text == "\udcff":
        table.write_bytes(b'{"format": 4, "gpus": {"\xff": {}}}')
    else:
        table.write_text(text)
    line = refused(table, fault_report, "a file that is no table")
    assert said in line and "MOESTACK_TUNED_CONFIGS" in line


@pytest.mark.parametrize(
    ("gpus", "said"),
    [
        ([GOOD], "'gpus' is a list"),
        ({GPU: [GOOD]}, f"'gpus'[{GPU!r}] is a list"),
        ({GPU: {KEY: [64, 64, 32]}}, "is a list, not an object"),
        ({GPU: {KEY: "128x128x64"}}, "is a str, not an object"),
    ],
    ids=["gpus a list", "a GPU's entries a list", "an entry a list", "an entry a string"],
)
def test_a_table_of_the_wrong_structure_is_refused(table, fault_report, gpus, said):
    with_entry(table, None, gpus=gpus)
    line = refused(table, fault_report, "a table of the wrong structure")
    assert said in line


def test_format_3_sources_of_the_wrong_structure_are_refused(table, fault_report):
    table.write_text(json.dumps({"format": 3, "gpus": {GPU: {KEY: GOOD}}, "sources": [1]}))
    line = refused(table, fault_report, "a table of the wrong structure")
    assert "'sources' is a list" in line


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"block_m": 2**40}, f"block_m={2**40}"),
        ({"block_m": "128"}, "block_m='128'"),
        ({"block_n": 96}, "block_n=96"),
        ({"block_k": 8}, "block_k=8"),
        ({"block_k": 64.0}, "block_k=64.0"),
        ({"block_m": True}, "block_m=True"),
        ({"num_warps": 3}, "num_warps=3"),
        ({"num_warps": 64}, "num_warps=64"),
        ({"num_stages": 0}, "num_stages=0"),
        ({"group_m": -8}, "group_m=-8"),
        ({"persistent": "yes"}, "persistent='yes'"),
        ({"num_programs": 2**40, "persistent": True}, f"num_programs={2**40}"),
        ({"backend": 7}, "backend=7"),
        ({"blockm": 64}, "'blockm'"),
        ({"source": "measured", "provenance": "H200"}, "provenance='H200'"),
        ({"source": "measured", "provenance": {**H200, "date": 20261130}}, "provenance"),
        ({"source": ["seed"]}, "source=['seed']"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_an_entry_the_kernels_cannot_launch_is_refused(table, fault_report, change, said):
    """Each field is checked: tiles and warps powers of two in the kernels' range, stages
    and groups positive integers, booleans booleans, no unknown field."""
    with_entry(table, {**GOOD, **change})
    line = refused(table, fault_report, "an entry the kernels cannot launch")
    assert said in line and KEY in line and GPU in line
