"""scripts/study_belady.py: Belady's bound beside LRU for a study's trained runs, computed on
the very routing its evaluation scored (a micro study, really trained and evaluated)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.prereg import two_arm_micro_study, write
from helpers.scripts import script_module

from moestack import prereg

CAPS = (2, 4)  # 4 slots hold all 4 experts
BATCHES = (1, 2)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[Path, Path]:
    """A locked micro study (baseline and arm a, seed 0) trained and evaluated: (file, out)."""
    root = tmp_path_factory.mktemp("belady")
    data = two_arm_micro_study()
    # no warmup: every request counts, so Belady's misses can be no more than LRU's
    data["analysis"].update(capacities=list(CAPS), serve_batches=list(BATCHES), warmup=0.0)
    path = write(root, data)
    prereg.lock(path)
    prereg.run(path, root / "out", progress=False)
    prereg.evaluate_finished(path, root / "out")
    return path, root / "out"


@pytest.fixture
def study(evaluated, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the evaluated study for one test: (file, out)."""
    path, out = evaluated
    shutil.copytree(path.parent, tmp_path / "study")
    return tmp_path / "study" / path.name, tmp_path / "study" / out.name


def bound(study: tuple[Path, Path], docs: Path) -> dict:
    path, out = study
    with script_module("study_belady") as m:
        assert m.main([str(path), "--runs", str(out), "--out", str(docs)]) == 0
    return json.loads((docs / "belady.json").read_text())


def test_belady_is_bounded_by_lru_on_the_evaluated_routing(study, tmp_path) -> None:
    docs = tmp_path / "docs"
    result = bound(study, docs)
    assert result["exploratory"] is True and sorted(result["runs"]) == ["a-s0", "baseline-s0"]
    for name, run in result["runs"].items():
        evaluation = json.loads((study[1] / "runs" / name / prereg.EVAL_FILE).read_text())
        assert run["model_sha256"] == evaluation["model_sha256"]
        misses = run["misses_per_token"]
        for cap in CAPS:
            for batch in BATCHES:
                served = f"/b{batch}" if batch > 1 else ""
                lru = misses[f"lru/cap{cap}{served}/misses_per_token"]
                opt = misses[f"belady/cap{cap}{served}/misses_per_token"]
                assert lru == evaluation["metrics"][f"lru/cap{cap}{served}/misses_per_token"]
                assert 0 <= opt <= lru
        # every expert fits: both miss only on each expert's first use, the same requests
        assert misses["lru/cap4/misses_per_token"] == misses["belady/cap4/misses_per_token"]
    assert misses["belady/cap2/misses_per_token"] < misses["lru/cap2/misses_per_token"]
    table = (docs / "belady.md").read_text()
    assert "| baseline |" in table and "| a |" in table and "2 slots | 4 slots" in table
    assert (docs / "belady.png").stat().st_size > 0


def test_a_finished_sweep_is_not_evaluated_again(study, tmp_path, monkeypatch) -> None:
    docs = tmp_path / "docs"
    first = bound(study, docs)
    with script_module("study_belady") as m:
        monkeypatch.setattr(m, "bound_run", lambda run, analysis, evaluated: pytest.fail(run.name))
        assert m.main([str(study[0]), "--runs", str(study[1]), "--out", str(docs)]) == 0
    assert json.loads((docs / "belady.json").read_text()) == first


def _edit_evaluation(run_dir: Path, **changes) -> None:
    path = run_dir / prereg.EVAL_FILE
    record = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "metric":
            record["metrics"][value] *= 1.5
        else:
            record[key] = value
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"metric": "lru/cap2/b2/misses_per_token"}, "differs from the evaluated one"),
        ({"model_sha256": "0" * 64}, "are not the ones"),
    ],
)
def test_a_run_its_evaluation_does_not_describe_is_refused(study, tmp_path, change, message):
    _edit_evaluation(study[1] / "runs" / "a-s0", **change)
    with script_module("study_belady") as m, pytest.raises(m.MoestackError, match=message):
        m.main([str(study[0]), "--runs", str(study[1]), "--out", str(tmp_path / "docs")])
