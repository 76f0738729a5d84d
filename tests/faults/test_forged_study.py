"""Fault injection: forge a finished study's run folders, then evaluate and analyze it.

A micro study (three arms, one seed, two steps of real training) is trained and evaluated
once; each test copies it and forges one thing a person with write access to the run
folders could: an edited cached evaluation (with and without its digest recomputed), a
checkpoint copied from another arm (with and without the run's record rewritten to match),
another run's identity record or cached evaluation copied in, a record written before runs
recorded their identity. Each must be refused in one line naming the run folder or file,
never reported; a digest recomputed by hand is caught by the random recheck.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers.prereg import micro_study, write

from moestack import prereg
from moestack.errors import MoestackError

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The micro study, locked, trained and evaluated (its folder: study.yaml, its lock, out/)."""
    folder = tmp_path_factory.mktemp("forged")
    data = micro_study(width=16, layers=1, max_bytes=200_000, train=["ckpt_every=0"])
    data["runs"]["seeds"] = [0]
    path = write(folder, data)
    prereg.lock(path)
    prereg.run(path, folder / "out", progress=False)
    prereg.evaluate_finished(path, folder / "out")
    return folder


@pytest.fixture
def study(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A fresh copy of the trained study: (study file, out dir)."""
    copy = tmp_path / "study"
    shutil.copytree(trained, copy)
    return copy / "study.yaml", copy / "out"


def run_dir(out: Path, name: str) -> Path:
    return out / "runs" / name


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def reseal(path: Path, record: dict[str, Any], field: str) -> None:
    """Write ``record`` with its digest recomputed by hand, as a forger would: sha256 of the
    other fields as canonical JSON (sorted keys, no spaces)."""
    fields = {k: v for k, v in record.items() if k != field}
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    path.write_text(json.dumps({**fields, field: hashlib.sha256(blob.encode()).hexdigest()}))


def refused(path: Path, out: Path, **kwargs: Any) -> list[str]:
    """The one-line refusals of ``analyze`` and of ``evaluate`` (``prereg evaluate``)."""
    lines = []
    for step in (
        lambda: prereg.analyze(path, out, **kwargs),
        lambda: prereg.evaluate_finished(path, out),
    ):
        with pytest.raises(MoestackError) as err:
            step()
        assert "\n" not in str(err.value)
        lines.append(str(err.value))
    assert not (out / "report" / "report.md").exists()  # nothing was reported
    return lines


def test_a_finished_run_records_its_identity(study: tuple[Path, Path]) -> None:
    path, out = study
    lock = prereg.verify(path)
    for name in ("baseline-s0", "a-s0", "b-s0"):
        record = read(run_dir(out, name) / prereg.RUN_FILE)
        arm, seed = name.rsplit("-s", 1)
        assert (record["run"], record["arm"], record["seed"]) == (name, arm, int(seed))
        assert record["study_sha256"] == lock["study_sha256"] and record["status"] == "finished"
        assert (record["checkpoint"], record["step"]) == ("step_000002", 2)
        weights = run_dir(out, name) / "checkpoints" / "step_000002" / "model.safetensors"
        assert record["model_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
        cache = read(run_dir(out, name) / prereg.EVAL_FILE)
        assert (cache["run"], cache["model_sha256"]) == (name, record["model_sha256"])


def test_the_untouched_study_analyses(study: tuple[Path, Path]) -> None:
    path, out = study
    report = prereg.analyze(path, out)
    results = read(report.parent / "results.json")
    assert sorted(c["run"] for c in results["recheck"]) == ["a-s0", "b-s0", "baseline-s0"]
    assert {c["outcome"] for c in results["recheck"]} == {"matched"}
    assert "- Recheck: 3 cached evaluation(s), picked at random" in report.read_text()


def test_edited_metric_without_its_digest_is_refused(
    study: tuple[Path, Path], fault_report
) -> None:
    path, out = study
    cache = run_dir(out, "a-s0") / prereg.EVAL_FILE
    record = read(cache)
    record["metrics"]["perplexity"] = 1.01  # a failed budget made a pass
    cache.write_text(json.dumps(record))
    for line in refused(path, out):
        assert line.startswith(f"{cache} was edited after it was written")
        assert "eval_sha256" in line and "delete it" in line
    fault_report.add("prereg study: edited cached metric", injected=1, refused=1)


def test_edited_metric_with_a_recomputed_digest_is_caught_by_the_recheck(
    study: tuple[Path, Path],
    fault_report,
) -> None:
    path, out = study
    cache = run_dir(out, "a-s0") / prereg.EVAL_FILE
    record = read(cache)
    true = record["metrics"]["perplexity"]
    record["metrics"]["perplexity"] = true * 0.9
    reseal(cache, record, "eval_sha256")
    # the digest alone cannot tell (it is no signature): without the recheck it is reported
    report = prereg.analyze(path, out, out.parent / "unchecked", recheck=0)
    forged = {r["run"]: r for r in read(report.parent / "results.json")["runs"]}
    assert forged["a-s0"]["metrics"]["perplexity"] == pytest.approx(true * 0.9)
    assert "- Recheck: no cached evaluation was evaluated again." in report.read_text()
    with pytest.raises(MoestackError) as err:  # one seed: every arm's run is picked
        prereg.analyze(path, out, recheck=1)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{cache}: perplexity is {true * 0.9!r}")
    assert f"{true!r} evaluated again" in line and "were edited" in line
    fault_report.add("prereg study: edited cached metric, digest recomputed", injected=1, refused=1)


@pytest.mark.parametrize(
    "forge",
    [
        lambda m: m.pop("perplexity"),
        lambda m: m.update(perplexity="1.0"),
        lambda m: m.update(perplexity=True),
        lambda m: m.update(extra=0.5),
    ],
)
def test_resealed_cache_with_malformed_metrics_is_refused(
    study: tuple[Path, Path], fault_report, forge
) -> None:
    """A cache rewritten by hand, digest recomputed, whose metrics the analysis cannot read:
    refused, naming the file (not a KeyError or TypeError later)."""
    path, out = study
    cache = run_dir(out, "a-s0") / prereg.EVAL_FILE
    record = read(cache)
    forge(record["metrics"])
    reseal(cache, record, "eval_sha256")
    for line in refused(path, out, recheck=0):
        assert line.startswith(f"{cache}: 'metrics' is not one number for each")
    fault_report.add("prereg study: resealed cache with malformed metrics", injected=1, refused=1)


def test_a_cache_of_another_machine_is_evaluated_again_not_compared(
    study: tuple[Path, Path],
    fault_report,
) -> None:
    """A cache written under another torch, host or device cannot be compared to float
    noise: it is evaluated again, and its fresh numbers are the ones reported."""
    path, out = study
    cache = run_dir(out, "b-s0") / prereg.EVAL_FILE
    record = read(cache)
    true = record["metrics"]["perplexity"]
    record["metrics"]["perplexity"] = true * 0.9
    record["host"] = "another-machine"
    reseal(cache, record, "eval_sha256")
    report = prereg.analyze(path, out, recheck=1)
    results = read(report.parent / "results.json")
    assert {c["run"]: c["outcome"] for c in results["recheck"]}["b-s0"] == "re-evaluated"
    runs = {r["run"]: r for r in results["runs"]}
    assert runs["b-s0"]["metrics"]["perplexity"] == pytest.approx(true, rel=1e-6)
    assert read(cache)["metrics"]["perplexity"] == pytest.approx(true, rel=1e-6)
    fault_report.add(
        "prereg study: edited cache said to be another machine's", injected=1, recovered=1
    )


def test_checkpoint_copied_from_another_arm_is_refused(
    study: tuple[Path, Path], fault_report
) -> None:
    path, out = study
    target = run_dir(out, "a-s0") / "checkpoints" / "step_000002"
    shutil.rmtree(target)
    shutil.copytree(run_dir(out, "b-s0") / "checkpoints" / "step_000002", target)
    theirs = read(run_dir(out, "b-s0") / prereg.RUN_FILE)["model_sha256"]
    mine = read(run_dir(out, "a-s0") / prereg.RUN_FILE)["model_sha256"]
    for line in refused(path, out):
        assert line.startswith(f"{target}: the final checkpoint of a-s0 holds weights sha256")
        assert theirs[:12] in line and mine[:12] in line and "replaced" in line
    fault_report.add("prereg study: checkpoint copied from another arm", injected=1, refused=1)


def test_copied_checkpoint_with_its_record_rewritten_is_refused(
    study: tuple[Path, Path], fault_report
) -> None:
    """The forger also rewrites the run's record to the copied weights' digest and reseals
    it: two runs of different arms then hold the same weights, which training never gives."""
    path, out = study
    target = run_dir(out, "a-s0") / "checkpoints" / "step_000002"
    shutil.rmtree(target)
    shutil.copytree(run_dir(out, "b-s0") / "checkpoints" / "step_000002", target)
    record_file = run_dir(out, "a-s0") / prereg.RUN_FILE
    record = read(record_file)
    record["model_sha256"] = read(run_dir(out, "b-s0") / prereg.RUN_FILE)["model_sha256"]
    reseal(record_file, record, "record_sha256")
    for line in refused(path, out):
        assert str(run_dir(out, "a-s0")) in line and str(run_dir(out, "b-s0")) in line
        assert "hold the same final weights" in line
    fault_report.add("prereg study: copied checkpoint, run record resealed", injected=1, refused=1)


def test_identity_record_copied_from_another_run_is_refused(
    study: tuple[Path, Path], fault_report
) -> None:
    path, out = study
    record_file = run_dir(out, "a-s0") / prereg.RUN_FILE
    shutil.copy(run_dir(out, "b-s0") / prereg.RUN_FILE, record_file)
    for line in refused(path, out):
        assert line.startswith(f"{record_file} is the identity of another run")
        assert "run 'b-s0' (here 'a-s0')" in line and "arm 'b' (here 'a')" in line
    fault_report.add("prereg study: run record copied from another run", injected=1, refused=1)


def test_edited_identity_record_is_refused(study: tuple[Path, Path], fault_report) -> None:
    path, out = study
    record_file = run_dir(out, "a-s0") / prereg.RUN_FILE
    record = read(record_file)
    record["arm"] = "b"  # not resealed
    record_file.write_text(json.dumps(record))
    for line in refused(path, out):
        assert line.startswith(f"{record_file} was edited after the runner wrote it")
    fault_report.add("prereg study: edited run record", injected=1, refused=1)


def test_evaluation_copied_from_another_run_is_refused(
    study: tuple[Path, Path], fault_report
) -> None:
    path, out = study
    cache = run_dir(out, "a-s0") / prereg.EVAL_FILE
    shutil.copy(run_dir(out, "b-s0") / prereg.EVAL_FILE, cache)
    for line in refused(path, out):
        assert line.startswith(f"{cache} is not an evaluation of this run's final weights")
        assert "run 'b-s0' (the run: 'a-s0')" in line and "model_sha256" in line
    fault_report.add(
        "prereg study: cached evaluation copied from another run", injected=1, refused=1
    )


def test_run_without_an_identity_record_is_refused(study: tuple[Path, Path], fault_report) -> None:
    """A record as runs wrote it before they recorded their identity (study hash only)."""
    path, out = study
    record_file = run_dir(out, "a-s0") / prereg.RUN_FILE
    old = ("study", "file", "study_sha256", "sha256", "lock_record", "legacy_lock", "status",
           "started_at", "finished_at")  # fmt: skip
    record = read(record_file)
    record_file.write_text(json.dumps({k: record[k] for k in old}))
    for line in refused(path, out):
        assert line.startswith(f"{record_file} records no identity of the run")
        assert f"retrain it: delete {run_dir(out, 'a-s0')}" in line
    fault_report.add("prereg study: run record without the run's identity", injected=1, refused=1)


def keep_refused(path: Path, out: Path) -> str:
    """The one-line refusal of ``keep``: nothing of the study is kept."""
    with pytest.raises(MoestackError) as err:
        prereg.keep(path, out, out.parent / "kept")
    assert "\n" not in str(err.value)
    assert not (out.parent / "kept" / "b-s0").exists()
    return str(err.value)


def test_a_run_trained_by_other_code_than_its_lock_names_is_refused(
    study: tuple[Path, Path], fault_report
) -> None:
    """A run whose sealed record names code other than the lock's (trained by another
    checkout, its record resealed) is refused by evaluate and analyze, naming both hashes."""
    path, out = study
    locked = prereg.verify(path)["code_sha256"]
    record_file = run_dir(out, "b-s0") / prereg.RUN_FILE
    record = read(record_file)
    assert [t["code_sha256"] for t in record["trained_by"]] == [locked]
    other = hashlib.sha256(b"other code").hexdigest()
    record["trained_by"] = [{**record["trained_by"][0], "code_sha256": other}]
    reseal(record_file, record, "record_sha256")
    for step in (lambda: refused(path, out), lambda: [keep_refused(path, out)]):
        for line in step():
            assert line.startswith(
                f"{record_file}: run b-s0 was trained by code sha256 {other[:12]}"
            )
            assert locked[:12] in line
    fault_report.add("prereg study: run trained by other code", injected=1, refused=1)
