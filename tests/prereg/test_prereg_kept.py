"""Kept runs: a study's finished runs carried to another machine as their records
(``prereg keep`` / ``prereg restore``), checked there as analyze checks a run folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.prereg import evaluating_train, fake_evaluations, trained_study

from moestack import cli, prereg
from moestack.errors import MoestackError
from moestack.prereg.records import seal


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def no_training(cfg, out_dir: Path) -> dict:
    raise AssertionError(f"{out_dir} was trained again")


def verdicts(report: Path) -> dict[str, str]:
    results = json.loads((report.parent / "results.json").read_text())
    return {h["id"]: h["verdict"] for h in results["hypotheses"]}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A locked study whose 9 runs finished and were evaluated, trained once per module."""
    root = tmp_path_factory.mktemp("finished")
    trained_study(root)
    return root


@pytest.fixture
def study_copy(finished: Path, tmp_path: Path):
    """A copy of the finished study for one test: (file, out dir)."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    return tmp_path / "study.yaml", tmp_path / "out"


def kept_study(study_copy: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, Path]:
    """The finished study, its runs kept: (file, out dir, kept dir)."""
    path, out = study_copy
    kept = tmp_path / "kept"
    result = prereg.keep(path, out, kept)
    assert len(result.done) == 9 and not result.already and not result.waiting
    return path, out, kept


def test_kept_records_restore_a_study_on_a_machine_without_its_checkpoints(
    study_copy, tmp_path
) -> None:
    path, out, kept = kept_study(study_copy, tmp_path)
    for run_dir in sorted(kept.iterdir()):
        names = {p.name for p in run_dir.iterdir()}
        assert {"prereg_run.json", "prereg_eval.json", "summary.json", prereg.KEPT_META} <= names
        assert not (run_dir / "checkpoints").exists()
        meta = json.loads((run_dir / prereg.KEPT_META).read_text())
        record = prereg.read_run_record(run_dir)
        assert meta["checkpoint"] == record["checkpoint"] == "step_000003"
        assert meta["meta"]["sha256"]["model.safetensors"] == record["model_sha256"]
    assert not list(kept.glob(".*"))  # each run folder written beside, then moved in

    fresh = tmp_path / "elsewhere"  # the next machine: the repository, no run folders
    restored = prereg.restore(path, fresh, kept)
    assert len(restored.done) == 9
    for run_dir in (fresh / "runs").iterdir():
        assert prereg.is_kept(run_dir) and not (run_dir / "checkpoints").exists()
    prereg.run(path, fresh, train_fn=no_training, progress=False)  # all finished: none trains
    # the analysis takes the kept evaluations; the recheck cannot pick a run without weights
    report = prereg.analyze(path, fresh, tmp_path / "report", recheck=1)
    assert verdicts(report) == verdicts(prereg.analyze(path, out, evaluate=False))
    text = report.read_text()
    assert "Kept runs: 9 of the finished runs" in text
    assert "no cached evaluation was evaluated again" in text
    runs = json.loads((report.parent / "results.json").read_text())["runs"]
    assert all(r["kept"] for r in runs)


def test_keep_and_restore_again_change_nothing(study_copy, tmp_path) -> None:
    path, out, kept = kept_study(study_copy, tmp_path)
    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    again = prereg.keep(path, out, kept)
    assert not again.done and len(again.already) == 9
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before
    fresh = tmp_path / "elsewhere"
    prereg.restore(path, fresh, kept)
    assert len(prereg.restore(path, fresh, kept).already) == 9
    # a restored study kept again keeps the same records
    assert len(prereg.keep(path, fresh, kept).already) == 9


def test_keep_cleans_up_what_a_killed_keep_left(study_copy, tmp_path) -> None:
    """A keep killed mid-write leaves its half-written folder beside the kept run (named by
    its process): the next keep removes it, so it is never committed with the records; a live
    writer's folder stays."""
    path, out, kept = kept_study(study_copy, tmp_path)
    run = sorted(kept.iterdir())[0]
    half = run.with_name(f".{run.name}.tmp-{_dead_pid()}")
    half.mkdir()
    (half / "prereg_eval.json").write_text('{"half": ')
    live = run.with_name(f".{run.name}.tmp-{os.getppid()}")
    live.mkdir()
    again = prereg.keep(path, out, kept)
    assert len(again.already) == 9
    assert not half.exists() and live.is_dir()


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_study_in_pieces_keeps_what_is_evaluated_and_trains_the_rest(
    study_copy, tmp_path
) -> None:
    path, out = study_copy
    for name in ("a-s2", "b-s2"):
        (out / "runs" / name / prereg.EVAL_FILE).unlink()  # finished, not evaluated yet
    shutil.rmtree(out / "runs" / "baseline-s2")  # not trained on this machine
    kept = tmp_path / "kept"
    result = prereg.keep(path, out, kept)
    assert len(result.done) == 6 and sorted(result.waiting) == ["a-s2", "b-s2"]
    assert "not evaluated yet" in prereg.render_kept(result, "keep")

    fresh = tmp_path / "elsewhere"
    restored = prereg.restore(path, fresh, kept)
    assert len(restored.done) == 6 and len(restored.waiting) == 3
    calls: list[tuple[str, bool]] = []
    spec = prereg.load(path)
    prereg.run(path, fresh, train_fn=evaluating_train(spec, calls), progress=False)
    assert sorted(name for name, _ in calls) == ["a-s2", "b-s2", "baseline-s2"]


def _reseal_record(path: Path, **changes) -> None:
    record = json.loads(path.read_text())
    record.pop("record_sha256")
    path.write_text(json.dumps(seal({**record, **changes}, "record_sha256")))


def test_restore_refuses_records_that_do_not_tie_to_their_kept_weights(
    study_copy, tmp_path
) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    # another weights sha256 written into the record and resealed: the kept meta says otherwise
    _reseal_record(kept / "a-s0" / "prereg_run.json", model_sha256="0" * 64)
    fresh = tmp_path / "elsewhere"
    with pytest.raises(MoestackError) as err:
        prereg.restore(path, fresh, kept)
    text = one_line(err)
    assert prereg.KEPT_META in text and "a-s0" in text and "000000000000" in text
    assert not (fresh / "runs" / "a-s0").exists()  # the refused run is not left behind


def test_restore_refuses_an_edited_kept_meta(study_copy, tmp_path) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    meta_path = kept / "b-s1" / prereg.KEPT_META
    kept_meta = json.loads(meta_path.read_text())
    kept_meta["meta"]["step"] = 4  # digest not recomputed
    meta_path.write_text(json.dumps(kept_meta))
    with pytest.raises(MoestackError) as err:
        prereg.restore(path, tmp_path / "elsewhere", kept)
    assert "meta_sha256" in one_line(err) and str(meta_path) in one_line(err)


def test_restore_refuses_another_runs_records(study_copy, tmp_path) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    shutil.rmtree(kept / "b-s0")
    shutil.copytree(kept / "a-s0", kept / "b-s0")  # a's records offered as b's
    with pytest.raises(MoestackError) as err:
        prereg.restore(path, tmp_path / "elsewhere", kept)
    text = one_line(err)
    assert "identity of another run" in text and "b-s0" in text


def test_an_edited_kept_evaluation_is_refused(study_copy, tmp_path) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    eval_path = kept / "a-s1" / prereg.EVAL_FILE
    cached = json.loads(eval_path.read_text())
    cached["metrics"]["perplexity"] = 9.0  # a better perplexity, digest not recomputed
    eval_path.write_text(json.dumps(cached))
    fresh = tmp_path / "elsewhere"
    with pytest.raises(MoestackError) as err:
        prereg.restore(path, fresh, kept)
    assert "edited after it was written" in one_line(err) and str(eval_path) in one_line(err)
    # restored behind restore's back, the analysis refuses it too
    shutil.copytree(kept / "a-s1", fresh / "runs" / "a-s1")
    with pytest.raises(MoestackError) as err:
        prereg.analyze(path, fresh, tmp_path / "report", interim=True)
    assert "edited after it was written" in one_line(err) and "a-s1" in one_line(err)


def test_restore_copies_only_the_kept_records(study_copy, tmp_path) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    (kept / "b-s1" / "notes.txt").write_text("not a record")
    fresh = tmp_path / "elsewhere"
    prereg.restore(path, fresh, kept)
    assert not (fresh / "runs" / "b-s1" / "notes.txt").exists()
    (kept / "b-s2" / "summary.json").unlink()
    shutil.rmtree(fresh)
    with pytest.raises(MoestackError) as err:
        prereg.restore(path, fresh, kept)
    assert str(kept / "b-s2") in one_line(err) and "summary.json" in one_line(err)


def test_keep_refuses_to_replace_a_kept_run_of_other_weights(study_copy, tmp_path) -> None:
    path, out, kept = kept_study(study_copy, tmp_path)
    _reseal_record(kept / "b-s2" / "prereg_run.json", model_sha256="f" * 64)
    with pytest.raises(MoestackError) as err:
        prereg.keep(path, out, kept)
    text = one_line(err)
    assert "trained again" in text and str(kept / "b-s2") in text


def test_restore_refuses_a_folder_holding_the_run_unfinished(study_copy, tmp_path) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    fresh = tmp_path / "elsewhere"
    partial = fresh / "runs" / "a-s0" / "checkpoints"
    partial.mkdir(parents=True)  # an interrupted run of this machine
    with pytest.raises(MoestackError) as err:
        prereg.restore(path, fresh, kept)
    assert "unfinished run" in one_line(err) and str(fresh / "runs" / "a-s0") in one_line(err)


def test_cli_keep_and_restore(study_copy, tmp_path, capsys) -> None:
    path, out = study_copy
    kept = tmp_path / "kept"
    cli.main(["prereg", "keep", str(path), "--out", str(out), "--kept", str(kept)])
    assert f"9 runs kept now ({kept})" in capsys.readouterr().out
    fresh = tmp_path / "elsewhere"
    cli.main(["prereg", "restore", str(path), "--out", str(fresh), "--kept", str(kept)])
    assert "9 runs restored now" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["prereg", "status", str(path), "--out", str(out), "--kept", str(kept)])
    assert "--kept belongs to `prereg keep`, `restore` and `audit`" in capsys.readouterr().err
    scratch = tmp_path / "audit"
    cli.main(["prereg", "audit", str(path), "--out", str(scratch), "--kept", str(kept)])
    assert "picked 3 kept runs to train again" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["prereg", "audit", str(path), "--kept", str(kept)])
    assert "prereg audit needs --out" in capsys.readouterr().err


def test_the_audit_trains_picked_kept_runs_again_and_compares_their_weights(
    study_copy, tmp_path
) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    scratch = tmp_path / "audit"
    first = prereg.audit(path, scratch, kept, per_arm=1)
    assert first["rows"] is None and len(first["picks"]) == 3  # one of each arm
    assert sorted(p.rsplit("-s", 1)[0] for p in first["picks"]) == ["a", "b", "baseline"]
    assert "train them with the lock's code" in prereg.render_audit(first, path)
    # the lock's runner trains exactly the picks (fake_finish: a run's weights are its own)
    calls: list[tuple[str, bool]] = []
    spec = prereg.load(path)
    prereg.run(path, scratch, train_fn=evaluating_train(spec, calls), progress=False)
    assert sorted(name for name, _ in calls) == sorted(first["picks"])
    second = prereg.audit(path, scratch, kept, per_arm=1)
    assert [r["outcome"] for r in second["rows"]] == ["matched"] * 3
    text = prereg.render_audit(second, path)
    assert "3 kept runs trained again, 3 to the kept bits" in text
    code = prereg.verify(path)["code_sha256"][:12]
    for name in first["picks"]:  # which code trained each run again, and evaluated it
        assert f"{name}: trained again by code `{code}` at commit `" in text
        assert "(prereg_run.json), the lock's code: yes; evaluated by not recorded" in text


def test_the_audit_refuses_a_kept_record_that_training_does_not_give(study_copy, tmp_path) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    scratch = tmp_path / "audit"

    class Picks:  # the audit's picks, made known: every run of each arm
        @staticmethod
        def sample(names, k):
            return sorted(names)[:k]

    picks = prereg.kept.audit_prepare(path, scratch, kept, per_arm=1, rng=Picks())
    assert sorted(picks) == ["a-s0", "b-s0", "baseline-s0"]
    prereg.run(path, scratch, train_fn=evaluating_train(prereg.load(path)), progress=False)
    # a forger who rewrote a-s0's records to other weights, consistently (record and meta)
    record_path = kept / "a-s0" / "prereg_run.json"
    _reseal_record(record_path, model_sha256="e" * 64)
    with pytest.raises(MoestackError) as err:
        prereg.kept.audit_compare(path, scratch, picks, kept)
    text = one_line(err)
    assert str(record_path) in text and "eeeeeeeeeeee" in text and "trained again" in text


def test_the_audit_reports_a_run_kept_from_another_machine_kind(study_copy, tmp_path) -> None:
    """Training is bitwise repeatable on one machine kind only: a run kept from another CPU
    that ends with other weights is reported with its metric differences, not refused."""
    path, _, kept = kept_study(study_copy, tmp_path)
    machine = json.loads((kept / "a-s0" / prereg.kept.KEPT_MACHINE).read_text())
    assert machine == prereg.kept.machine() and machine["cpu_capability"]
    scratch = tmp_path / "audit"

    class Picks:
        @staticmethod
        def sample(names, k):
            return sorted(names)[:k]

    picks = prereg.kept.audit_prepare(path, scratch, kept, per_arm=1, rng=Picks())
    prereg.run(path, scratch, train_fn=evaluating_train(prereg.load(path)), progress=False)
    fake_evaluations(path, scratch)
    _reseal_record(kept / "a-s0" / "prereg_run.json", model_sha256="e" * 64)
    other = {**machine, "cpu_capability": "AVX512", "cpu": "another CPU"}
    (kept / "a-s0" / prereg.kept.KEPT_MACHINE).write_text(json.dumps(other))
    eval_path = kept / "a-s0" / prereg.EVAL_FILE
    cached = json.loads(eval_path.read_text())
    cached["metrics"]["perplexity"] *= 1.01  # the kept run's perplexity, 1% above this one's
    eval_path.write_text(json.dumps(cached))
    rows = {r["run"]: r for r in prereg.kept.audit_compare(path, scratch, picks, kept)}
    assert rows["a-s0"]["outcome"] == "other machine"
    assert rows["a-s0"]["differences"]["perplexity"] == pytest.approx(1 / 1.01 - 1)
    assert rows["b-s0"]["outcome"] == "matched"
    text = prereg.render_audit({"rows": list(rows.values()), "picks": picks}, path)
    assert "another machine kind" in text and "perplexity differs by -0.99%" in text
    assert "3 kept runs trained again, 2 to the kept bits" in text


def test_the_audit_waits_for_every_run_to_be_kept(study_copy, tmp_path) -> None:
    path, _, kept = kept_study(study_copy, tmp_path)
    shutil.rmtree(kept / "b-s2")
    with pytest.raises(MoestackError) as err:
        prereg.audit(path, tmp_path / "audit", kept)
    assert "keeps 8 of the 9 runs" in one_line(err) and "b-s2" in one_line(err)
    assert not (tmp_path / "audit").exists()


def test_the_audit_needs_an_empty_scratch_folder(study_copy, tmp_path) -> None:
    path, out, kept = kept_study(study_copy, tmp_path)
    with pytest.raises(MoestackError) as err:
        prereg.audit(path, out, kept)
    assert str(out) in one_line(err) and "not empty" in one_line(err)
