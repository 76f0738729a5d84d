"""Which code trained and evaluated each run of a study: recorded in the run's records,
compared with the code hash its lock names (``moestack.prereg.sources``)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.prereg import trained_study

from moestack import prereg
from moestack.prereg import sources

REPO = Path(__file__).resolve().parents[2]
# The package's source folders as installed (pyproject.toml's package-dir).
INSTALLED = {
    "moestack": "moestack",
    "kernels": "moestack/kernels",
    "telemetry": "moestack/telemetry",
}


def files_code_sha256() -> str:
    """The code hash worked out here from the checkout's files: sha256 of the canonical JSON
    of {installed path: sha256} over every .py and .cpp file of moestack/, kernels/ and
    telemetry/ (the host kernels' C++ is code the runs execute)."""
    files = {}
    for top, prefix in INSTALLED.items():
        for file in (p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".cpp")):
            rel = file.relative_to(REPO / top)
            if "__pycache__" in rel.parts or (top == "moestack" and rel.parts[0] in INSTALLED):
                continue
            files[f"{prefix}/{rel.as_posix()}"] = hashlib.sha256(file.read_bytes()).hexdigest()
    blob = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def commit_or_skip(short: str) -> str:
    try:
        return git("rev-parse", "--verify", f"{short}^{{commit}}")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"commit {short} is not in this checkout's history")


def is_head_or_before(commit: str) -> bool:
    """Whether ``commit`` is HEAD or an ancestor (HEAD moves on when the checkout commits
    while the tests run)."""
    done = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO)
    return done.returncode == 0


def read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("code")
    trained_study(root)
    return root


def test_a_run_records_the_code_and_commit_that_trained_it(finished: Path) -> None:
    record = read(finished / "out" / "runs" / "a-s1" / prereg.RUN_FILE)
    assert prereg.records.is_sealed(record, "record_sha256")
    (trained,) = record["trained_by"]
    assert trained["code_sha256"] == files_code_sha256()
    assert trained["code_sha256"] == prereg.verify(finished / "study.yaml")["code_sha256"]
    assert is_head_or_before(trained["git_commit"])
    assert isinstance(trained["git_dirty"], bool)


def test_an_evaluation_records_the_code_that_evaluated_it(finished: Path) -> None:
    cache = read(finished / "out" / "runs" / "b-s2" / prereg.EVAL_FILE)
    assert prereg.records.is_sealed(cache, "eval_sha256")
    assert cache["evaluated_by"]["code_sha256"] == files_code_sha256()
    assert is_head_or_before(cache["evaluated_by"]["git_commit"])


def test_the_report_names_the_code_of_every_run(finished: Path, tmp_path: Path) -> None:
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    report = prereg.analyze(tmp_path / "study.yaml", tmp_path / "out", evaluate=False)
    results = read(report.parent / "results.json")
    rows = {r["run"]: r for r in results["code"]["runs"]}
    assert len(rows) == 9
    locked = prereg.verify(tmp_path / "study.yaml")["code_sha256"]
    assert results["code"]["lock"] == [locked]
    for row in rows.values():
        assert row["source"] == "record" and row["as_locked"] is True and row["flag"] is None
        assert [t["code_sha256"] for t in row["trained_by"]] == [locked]
        assert row["evaluated_by"]["code_sha256"] == files_code_sha256()
    text = report.read_text()
    assert "## Code of the runs" in text
    assert "- Training code: all 9 finished runs record the code that trained them" in text


@pytest.mark.parametrize(
    ("study", "short"),
    [("prereg_cpu_v3", "772bdf4"), ("prereg_cpu_v3_e16", "989d76c")],
)
def test_the_code_hash_of_a_commit_is_the_one_its_lock_recorded(study: str, short: str) -> None:
    """Computed from git's objects of the commit that committed the lock, it equals the code
    hash ``prereg lock`` recorded from the files of the checkout then."""
    lock = read(REPO / "experiments" / f"{study}.yaml.lock.json")
    assert sources.code_at_commit(commit_or_skip(short)) == lock["code_sha256"]
    assert sources.code_at_commit("0" * 40) is None  # no such commit: unknown
    assert sources.code_at_commit("--output=x") is None  # no object name: never given to git


def configs_at(commit: str, folder: Path) -> Path:
    """The packaged configs/ as ``commit`` held them, written under ``folder``."""
    names = git("ls-tree", "-r", "--name-only", commit, "--", "configs").splitlines()
    for name in names:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(subprocess.run(
            ["git", "show", f"{commit}:{name}"], cwd=REPO, capture_output=True, check=True
        ).stdout)  # fmt: skip
    return folder / "configs"


def test_analyze_flags_runs_of_a_study_locked_before_runs_recorded_their_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prereg_cpu_v3's kept runs (trained before runs recorded their code) analyse, each
    flagged; one given a provenance.json naming its lock's commit is matched to the lock's
    code by that commit's files, one naming another study's lock commit is flagged as other
    code, never refused: nothing sealed says which code trained them. (The study is
    verified against the config files of its lock commit: what the checkout holds now is
    not this test's subject.)"""
    study = REPO / "experiments" / "prereg_cpu_v3.yaml"
    same, other = commit_or_skip("772bdf4"), commit_or_skip("989d76c")
    monkeypatch.setattr(sources.hashing, "CONFIG_ROOT", configs_at(same, tmp_path / "lock"))
    out = tmp_path / "out"
    prereg.restore(study, out, REPO / "docs" / "prereg_cpu_v3" / "runs")
    for name, commit in (("baseline-s0", same), ("temporal-s3", other)):
        starts = [{"status": "finished", "git_commit": commit, "git_dirty": False}]
        (out / "runs" / name / "provenance.json").write_text(json.dumps({"starts": starts}))
    report = prereg.analyze(study, out, tmp_path / "report", recheck=0)
    code = read(report.parent / "results.json")["code"]
    locked = read(study.with_name(study.name + ".lock.json"))["code_sha256"]
    assert code["lock"] == [locked]
    rows = {r["run"]: r for r in code["runs"]}
    assert len(rows) == 72
    assert rows["baseline-s0"]["source"] == "provenance.json"
    assert rows["baseline-s0"]["trained_by"][0]["code_sha256"] == locked
    assert rows["baseline-s0"]["as_locked"] is True
    assert rows["temporal-s3"]["as_locked"] is False
    assert rows["temporal-s3"]["trained_by"][0]["git_commit"] == other
    unrecorded = [r for r in rows.values() if r["source"] is None]
    assert len(unrecorded) == 70
    assert all(r["as_locked"] is None and r["flag"] for r in unrecorded)
    assert all(r["evaluated_by"] is None for r in rows.values())  # evaluated before it too
    text = report.read_text()
    assert "70 finished runs record no code" in text
    assert "1 of them by other code than the lock names" in text


def test_keep_carries_a_runs_provenance(finished: Path, tmp_path: Path) -> None:
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    path, out, kept = tmp_path / "study.yaml", tmp_path / "out", tmp_path / "kept"
    starts = {"starts": [{"status": "finished", "git_commit": git("rev-parse", "HEAD")}]}
    (out / "runs" / "a-s0" / "provenance.json").write_text(json.dumps(starts))
    prereg.keep(path, out, kept)
    assert read(kept / "a-s0" / "provenance.json") == starts
    elsewhere = tmp_path / "elsewhere"
    prereg.restore(path, elsewhere, kept)
    assert read(elsewhere / "runs" / "a-s0" / "provenance.json") == starts


def test_runs_of_a_runner_that_recorded_no_code_are_flagged_not_refused(
    finished: Path, tmp_path: Path
) -> None:
    """The study's records as a runner before this one wrote them (no ``trained_by``,
    resealed); a provenance.json naming prereg_cpu_v3's lock commit (other code than this
    study's lock names) and one naming a commit git does not know are flagged as such."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    path, out = tmp_path / "study.yaml", tmp_path / "out"
    for record_file in (out / "runs").glob("*/" + prereg.RUN_FILE):
        record = read(record_file)
        record.pop("trained_by")
        record_file.write_text(json.dumps(prereg.records.seal(record, "record_sha256")))
    old = commit_or_skip("772bdf4")
    for name, commit in (("a-s0", old), ("b-s0", "f" * 40)):
        starts = [{"status": "finished", "git_commit": commit, "git_dirty": False}]
        (out / "runs" / name / "provenance.json").write_text(json.dumps({"starts": starts}))
    report = prereg.analyze(path, out, evaluate=False)
    rows = {r["run"]: r for r in read(report.parent / "results.json")["code"]["runs"]}
    v3 = read(REPO / "experiments" / "prereg_cpu_v3.yaml.lock.json")["code_sha256"]
    assert rows["a-s0"]["trained_by"] == [
        {"code_sha256": v3, "git_commit": old, "git_dirty": False}
    ]
    assert rows["a-s0"]["as_locked"] is False and "is NOT the lock's" in rows["a-s0"]["flag"]
    assert rows["b-s0"]["trained_by"][0]["code_sha256"] is None
    assert rows["b-s0"]["as_locked"] is None and "cannot be compared" in rows["b-s0"]["flag"]
    others = [r for n, r in rows.items() if n not in ("a-s0", "b-s0")]
    assert len(others) == 7 and all(r["source"] is None and r["flag"] for r in others)
    text = report.read_text()
    assert "7 finished runs record no code (trained before runs recorded it)" in text
    assert "2 finished runs trained before runs recorded their code are named by" in text


def test_a_code_amendment_covers_the_runs_trained_before_it(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs trained under the lock's first record, then a code change put on record (an
    amendment with another code hash): the runs are still the lock's code."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    path, out = tmp_path / "study.yaml", tmp_path / "out"
    real = sources.hashing.code_files
    monkeypatch.setattr(
        sources.hashing, "code_files", lambda: {**real(), "moestack/added.py": "0" * 64}
    )
    prereg.lock(path, amend="a module the runs do not use", out_dir=out)
    history = prereg.verify(path)["history"]
    assert [r["action"] for r in history] == ["lock", "amend"]
    assert history[0]["code_sha256"] != history[1]["code_sha256"]
    monkeypatch.undo()
    result = prereg.evaluate_finished(path, out)  # not refused
    assert result["finished"] == 9
    report = prereg.analyze(path, out, evaluate=False)
    code = read(report.parent / "results.json")["code"]
    assert code["lock"] == sorted(r["code_sha256"] for r in history)
    assert all(r["as_locked"] is True for r in code["runs"])
