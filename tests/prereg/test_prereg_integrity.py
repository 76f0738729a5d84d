"""Pre-registration integrity: the lock's hash chain, amendments, the study hash each run was
trained under, the config files the study hash covers, and legacy locks."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.paths import EXPERIMENTS, REPO
from helpers.prereg import evaluating_train, fake_evaluations, study, trained_study, write

import moestack.configs
from moestack import cli, prereg
from moestack.errors import MoestackError


def move_threshold(path: Path, value: float) -> None:
    """H2's threshold changed after the runs: the goalposts moved."""
    data = study()
    data["hypotheses"][1]["threshold"] = value
    write(path.parent, data, path.name)


def verdicts(report: Path) -> dict[str, str]:
    results = json.loads((report.parent / "results.json").read_text())
    return {h["id"]: h["verdict"] for h in results["hypotheses"]}


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------ runs record their hash
def test_runner_records_the_study_hash_of_every_run(tmp_path: Path) -> None:
    path, out, sha = trained_study(tmp_path)
    for run_dir in sorted((out / "runs").iterdir()):
        record = prereg.read_run_record(run_dir)
        assert record["study_sha256"] == sha and record["status"] == "finished"
        assert record["finished_at"].endswith("+00:00")
        # the run's identity: its arm and seed, and the weights of its final checkpoint
        arm, seed = run_dir.name.rsplit("-s", 1)
        assert (record["run"], record["arm"], record["seed"]) == (run_dir.name, arm, int(seed))
        assert (record["checkpoint"], record["step"]) == ("step_000003", 3)
        weights = run_dir / "checkpoints" / "step_000003" / "model.safetensors"
        assert record["model_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
        fields = {k: v for k, v in record.items() if k != "record_sha256"}
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        assert record["record_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()
        assert not list(run_dir.glob(".*.tmp"))  # written through a temporary, renamed
    assert verdicts(prereg.analyze(path, out, evaluate=False))["H2"] == "fail"


def test_delete_lock_and_relock_does_not_launder_runs(tmp_path: Path) -> None:
    path, out, old = trained_study(tmp_path)
    move_threshold(path, 0.05)  # b's +2% perplexity would now pass H2
    prereg.lock_path(path).unlink()
    prereg.lock(path)
    new = prereg.verify(path)["study_sha256"]
    assert new != old
    for step in (prereg.analyze, prereg.run):
        with pytest.raises(MoestackError) as err:
            step(path, out)
        text = one_line(err)
        assert str(out / "runs" / "baseline-s0") in text
        assert old[:12] in text and new[:12] in text
        assert "--amend" in text and "rerun" in text


def test_changed_threshold_after_runs_needs_amend_and_is_reported(tmp_path: Path) -> None:
    path, out, old = trained_study(tmp_path)
    move_threshold(path, 0.05)
    with pytest.raises(MoestackError, match="changed since it was locked"):
        prereg.analyze(path, out, evaluate=False)
    with pytest.raises(MoestackError, match="already locked"):
        prereg.lock(path)
    with pytest.raises(MoestackError) as err:
        prereg.lock(path, force=True, out_dir=out)
    assert "--amend" in one_line(err) and str(out / "runs") in str(err.value)
    with pytest.raises(MoestackError, match="needs a reason"):
        prereg.lock(path, amend="  ", out_dir=out)
    reason = "H2's budget was meant to be 5%"
    prereg.lock(path, amend=reason, out_dir=out)
    new = prereg.verify(path)["study_sha256"]

    calls: list[tuple[str, bool]] = []
    prereg.run(path, out, train_fn=evaluating_train(prereg.load(path), calls), progress=False)
    assert calls == []  # the amendment covers the finished runs
    report = prereg.analyze(path, out, evaluate=False)
    assert verdicts(report)["H2"] == "pass"
    text = report.read_text()
    assert "## Lock history" in text and "**amendment**" in text and reason in text
    assert f"| `{old}` | `{new}` |" in text  # old and new hash of the amendment
    assert "Trained under: 9 under lock record #0 (amended since)." in text
    history = json.loads((report.parent / "results.json").read_text())["lock"]["history"]
    assert [(r["action"], r["reason"]) for r in history] == [("lock", None), ("amend", reason)]
    assert history[1]["replaces"] == history[0]["sha256"]


# ------------------------------------------------------------------ tamper evidence
def _edit_head_sha(doc: dict[str, Any], sha: str) -> None:
    doc["sha256"] = doc["chain"][-1]["sha256"] = sha


def _edit_top_sha(doc: dict[str, Any], sha: str) -> None:
    doc["sha256"] = sha


def _edit_study_sha(doc: dict[str, Any], sha: str) -> None:
    doc["chain"][-1]["study_sha256"] = doc["study_sha256"] = sha


def _drop_first_record(doc: dict[str, Any], sha: str) -> None:
    del doc["chain"][0]


@pytest.mark.parametrize(
    "edit", [_edit_head_sha, _edit_top_sha, _edit_study_sha, _drop_first_record]
)
def test_hand_edited_lock_is_refused(tmp_path: Path, edit) -> None:
    path = write(tmp_path, study())
    prereg.lock(path)
    prereg.lock(path, force=True)  # two records, so that one can be dropped
    move_threshold(path, 0.05)
    target = prereg.lock_path(path)
    doc = json.loads(target.read_text())
    edit(doc, prereg.sha256_file(path))  # "re-lock" the changed file by hand
    target.write_text(json.dumps(doc, indent=2))
    for step in (prereg.verify, lambda p: prereg.lock(p, amend="why")):
        with pytest.raises(MoestackError) as err:
            step(path)
        text = one_line(err)
        assert text.startswith(f"{target}: the lock's hash chain does not verify")
        assert "git checkout" in text


# ------------------------------------------------------------------ runs of another study hash
def _foreign_run(run_dir: Path, lock_info: dict[str, Any], finished: bool) -> None:
    run_dir.mkdir(parents=True)
    prereg.write_run_record(run_dir, {**lock_info, "study_sha256": "f" * 64}, "started")
    if finished:
        (run_dir / "summary.json").write_text("{}")
    else:
        ckpt = run_dir / "checkpoints" / "step_000002"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": 2}))


@pytest.mark.parametrize("finished", [True, False])
def test_run_trained_under_another_hash_is_refused(tmp_path: Path, finished: bool) -> None:
    path = write(tmp_path, study())
    prereg.lock(path)
    info = prereg.verify(path)
    run_dir = tmp_path / "out" / "runs" / "a-s1"
    _foreign_run(run_dir, info, finished)
    steps = [
        lambda: prereg.run(path, tmp_path / "out", train_fn=evaluating_train(prereg.load(path)))
    ]
    if finished:
        steps.append(lambda: prereg.analyze(path, tmp_path / "out", evaluate=False))
    for step in steps:
        with pytest.raises(MoestackError) as err:
            step()
        text = one_line(err)
        assert str(run_dir) in text and "f" * 12 in text and info["study_sha256"][:12] in text
    assert not (tmp_path / "out" / "runs" / "baseline-s0").exists()  # refused before training


def test_run_without_a_record_is_refused_under_a_chained_lock(tmp_path: Path) -> None:
    path = write(tmp_path, study())
    prereg.lock(path)
    run_dir = tmp_path / "out" / "runs" / "b-s2"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    with pytest.raises(MoestackError) as err:
        prereg.analyze(path, tmp_path / "out", evaluate=False)
    assert str(run_dir) in one_line(err) and prereg.RUN_FILE in str(err.value)


# ------------------------------------------------------------------ config files in the hash
def test_config_group_files_are_in_the_study_hash(tmp_path: Path, monkeypatch) -> None:
    configs = tmp_path / "configs"
    packaged = Path(moestack.configs.__file__).parent
    shutil.copytree(packaged, configs, ignore=shutil.ignore_patterns("experiment"))
    monkeypatch.setattr("moestack.prereg.hashing.CONFIG_ROOT", configs)  # the file set's root
    path = write(tmp_path, study())
    spec = prereg.load(path)
    files = prereg.config_files(spec)
    assert set(files) == {
        "train.yaml", "model/tiny.yaml", "data/stdlib.yaml", "optim/adamw.yaml",
        "cache/lru.yaml", "telemetry/off.yaml", "router/baseline.yaml", "router/temporal.yaml",
        "router/pin.yaml",
    }  # fmt: skip
    before = prereg.fingerprint(spec)
    with (configs / "router" / "window.yaml").open("a") as f:  # not loaded by this study
        f.write("window: 0.5\n")
    assert prereg.fingerprint(spec) == before
    prereg.lock(path)
    with (configs / "router" / "temporal.yaml").open("a") as f:
        f.write("# a comment counts: the file is what the runs load\n")
    after = prereg.fingerprint(spec)
    assert after.sha256 == before.sha256 and after.study_sha256 != before.study_sha256
    assert after.changed_configs(before.configs) == ["router/temporal.yaml"]
    with pytest.raises(MoestackError) as err:
        prereg.verify(path)
    assert "router/temporal.yaml" in one_line(err) and "--amend" in str(err.value)


# ------------------------------------------------------------------ legacy locks
def legacy_study(tmp_path: Path) -> tuple[Path, Path]:
    """The committed prereg_cpu study and its legacy lock, copied, with 8 finished runs that
    recorded no study hash (as its runs did), one of them interrupted."""
    for name in ("prereg_cpu.yaml", "prereg_cpu.yaml.lock.json"):
        shutil.copy(EXPERIMENTS / name, tmp_path / name)
    path, out = tmp_path / "prereg_cpu.yaml", tmp_path / "out"
    spec = prereg.load(path)
    train = evaluating_train(spec)
    for item in prereg.plan(spec, out):
        item.run_dir.mkdir(parents=True)
        if item.name == "pin-s1":
            ckpt = item.run_dir / "checkpoints" / "step_000050"
            ckpt.mkdir(parents=True)
            (ckpt / "meta.json").write_text(json.dumps({"step": 50}))
        else:
            train(prereg.compose_config(item.overrides), item.run_dir)
    return path, out


def _legacy_report(path: Path, out: Path) -> str:
    """The report's text for the runs as the lock accepts them (no evaluation: the analysis
    itself refuses runs without an identity, below)."""
    spec, lock = prereg.load(path), prereg.verify(path)
    grid = prereg.plan(spec, out)
    trained = prereg.check_runs(grid, lock)
    records = [
        {"run": r.name, "arm": r.arm, "seed": r.seed, "status": "not evaluated",
         "trained_under": trained.get(r.name)}
        for r in grid
    ]  # fmt: skip
    hypotheses = prereg.evaluate_hypotheses(spec, records)
    return prereg.render_markdown(spec, lock, records, hypotheses, [])


def test_legacy_lock_is_a_history_and_its_unrecorded_runs_need_retraining(tmp_path: Path) -> None:
    path, out = legacy_study(tmp_path)
    lock = prereg.verify(path)
    assert lock["legacy"] and lock["study_sha256"] == prereg.sha256_file(path)
    committed = json.loads((EXPERIMENTS / "prereg_cpu.yaml.lock.json").read_text())
    assert [(r["action"], r["sha256"]) for r in lock["history"]] == [
        ("lock", committed["replaces"]), ("relock", committed["sha256"])
    ]  # fmt: skip
    calls: list[tuple[str, bool]] = []
    prereg.run(path, out, train_fn=evaluating_train(prereg.load(path), calls), progress=False)
    assert calls == [("pin-s1", True)]  # the old behaviour: resumed, the rest reused
    assert prereg.read_run_record(out / "runs" / "pin-s1")["legacy_lock"] is True
    text = _legacy_report(path, out)  # the lock covers the unrecorded runs ...
    assert "Legacy lock: it predates the lock hash chain" in text
    assert "7 under the current lock, no recorded study hash (legacy)" in text
    assert "| 1 | 2026-11-29T23:09:51+00:00 | re-lock (--force) (legacy) |" in text
    with pytest.raises(MoestackError) as err:  # ... but nothing ties their checkpoints to them
        prereg.analyze(path, out, evaluate=False)
    text = one_line(err)
    assert f"{out / 'runs' / 'baseline-s0'} has no {prereg.RUN_FILE}" in text
    assert "retrain it: delete" in text

    with pytest.raises(MoestackError, match="--amend"):
        prereg.lock(path, force=True, out_dir=out)
    prereg.lock(path, amend="a later fix of the study", out_dir=out)
    doc = json.loads(prereg.lock_path(path).read_text())
    assert doc["format"] == 2 and doc["chain"][0]["legacy"] == committed  # kept verbatim
    text = _legacy_report(path, out)  # amended: still covered
    assert "**amendment**" in text and "a later fix of the study" in text

    prereg.lock_path(path).unlink()  # a fresh chain has no legacy record to cover them
    prereg.lock(path)
    with pytest.raises(MoestackError, match="has no prereg_run.json"):
        prereg.analyze(path, out, evaluate=False)
    shutil.rmtree(out / "runs")  # retrained, as the refusal says: then analysed
    prereg.run(path, out, train_fn=evaluating_train(prereg.load(path)), progress=False)
    fake_evaluations(path, out)
    report = prereg.analyze(path, out, evaluate=False)
    assert "Trained under: 8 under the current lock." in report.read_text()


# ------------------------------------------------------------------ the command line
def test_cli_amend(tmp_path: Path, capsys) -> None:
    path, out, _ = trained_study(tmp_path)
    move_threshold(path, 0.05)
    with pytest.raises(SystemExit) as code:
        cli.main(["prereg", "lock", str(path), "--force", "--out", str(out)])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1 and "--amend" in err
    cli.main(["prereg", "lock", str(path), "--amend", "typo in H2", "--out", str(out)])
    assert "amended:" in capsys.readouterr().out
    assert prereg.verify(path)["reason"] == "typo in H2"


# ------------------------------------------------------------------ the code in the lock
def test_the_lock_records_every_source_file_of_the_installed_package(tmp_path: Path) -> None:
    path = write(tmp_path, study())
    prereg.lock(path)
    head = prereg.verify(path)
    files = {
        "moestack/trainer.py": REPO / "moestack" / "trainer.py",
        "moestack/kernels/__init__.py": REPO / "kernels" / "__init__.py",
        "moestack/telemetry/__init__.py": REPO / "telemetry" / "__init__.py",
        "moestack/kernels/host_tiered.cpp": REPO / "kernels" / "host_tiered.cpp",
    }
    for name, file in files.items():  # the kernels and telemetry folders install apart
        assert head["code"][name] == hashlib.sha256(file.read_bytes()).hexdigest(), name
    assert not [n for n in head["code"] if "__pycache__" in n or not n.endswith((".py", ".cpp"))]
    assert head["code_sha256"] == prereg.hashing.digest(head["code"])


def test_prereg_run_refuses_other_code_unless_the_change_is_on_record(
    tmp_path: Path, monkeypatch
) -> None:
    """Sources that differ from the lock's train nothing; with --amend the change is locked as
    an amendment (the files and the reason), the runs train, and the report lists it."""
    path = write(tmp_path, study())
    prereg.lock(path)
    locked = prereg.verify(path)["code"]
    edited = {**locked, "moestack/trainer.py": "0" * 64, "moestack/new_module.py": "1" * 64}
    monkeypatch.setattr(prereg.hashing, "code_files", lambda: edited)
    out, calls = tmp_path / "out", []
    train = evaluating_train(prereg.load(path), calls)
    with pytest.raises(
        MoestackError, match=r"moestack/new_module\.py, moestack/trainer\.py.*--amend"
    ) as err:
        prereg.run(path, out, train_fn=train, progress=False)
    assert calls == [] and "\n" not in str(err.value)
    with pytest.raises(MoestackError, match="needs a reason"):
        prereg.run(path, out, train_fn=train, progress=False, amend="  ")
    prereg.run(path, out, train_fn=train, progress=False, amend="a log message changed")
    assert len(calls) == 9
    head = prereg.verify(path)
    assert head["action"] == "amend" and head["code"] == edited
    assert "moestack/trainer.py" in head["reason"] and "a log message changed" in head["reason"]
    prereg.run(path, out, train_fn=train, progress=False)  # the amended code is the lock's now
    fake_evaluations(path, out)
    report = Path(prereg.analyze(path, out, evaluate=False)).read_text()
    assert "**amendment**" in report and "a log message changed" in report
    monkeypatch.setattr(prereg.hashing, "code_files", lambda: locked)  # back: refused again
    with pytest.raises(MoestackError, match="moestack/trainer.py"):
        prereg.run(path, out, train_fn=train, progress=False)


def test_cli_takes_amend_for_lock_and_run_only(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, study())
    with pytest.raises(SystemExit) as code:
        cli.main(["prereg", "status", str(path), "--amend", "why"])
    assert code.value.code == 2 and "`prereg lock` and `run`" in capsys.readouterr().err


# ------------------------------------------------------------------ quoted text in the report
@pytest.mark.parametrize(
    ("reason", "named"),
    [
        ("typo\n| H1 | pass |", "a newline (U+000A) at character 5"),
        ("typo\r\nmore", "a carriage return (U+000D) at character 5"),
        ("H2\tmoved", "a tab (U+0009) at character 3"),
        ("\x1b[31mred", "an escape (ANSI) (U+001B) at character 1"),
        ("nul\x00", "a NUL (U+0000) at character 4"),
        ("line\u2028break", "a control character (U+2028) at character 5"),
        ("bidi \u202eevil", "a control character (U+202E) at character 6"),
    ],
)
def test_amend_reason_with_control_characters_is_refused(
    tmp_path: Path, reason: str, named: str
) -> None:
    path = write(tmp_path, study())
    prereg.lock(path)
    before = prereg.lock_path(path).read_text()
    with pytest.raises(MoestackError) as err:
        prereg.lock(path, amend=reason)
    assert one_line(err).startswith(f"--amend reason: {named}; give it as one line")
    assert prereg.lock_path(path).read_text() == before  # nothing appended


def test_cli_refuses_a_multi_line_amend_reason(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, study())
    prereg.lock(path)
    with pytest.raises(SystemExit) as code:
        cli.main(["prereg", "lock", str(path), "--amend", "typo\n| H1 | pass |"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1 and "a newline (U+000A)" in err


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain words, 30% or more.", "plain words, 30% or more."),
        ("2 x top_k slots; lru/cap4/miss_rate", "2 x top_k slots; lru/cap4/miss_rate"),
        ("a | b", "a \\| b"),
        ("_emphasis_ and *strong*", "\\_emphasis\\_ and \\*strong\\*"),
        ("# heading", "\\# heading"),
        ("- item", "\\- item"),
        ("+ item", "\\+ item"),
        ("12. item", "12\\. item"),
        ("=== underline", "\\=== underline"),
        ("> quote <b>", "\\> quote \\<b\\>"),
        ("[link](http://x) ![img](y)", "\\[link\\](http://x) !\\[img\\](y)"),
        ("`code` ~~gone~~ $math$ &amp; \\", "\\`code\\` \\~\\~gone\\~\\~ \\$math\\$ \\&amp; \\\\"),
        ("two\nlines\tand\r\na tab", "two lines and  a tab"),
        ("esc\x1b[31m nul\x00 bidi\u202e", "esc\ufffd\\[31m nul\ufffd bidi\ufffd"),
        ("    indented  ", "indented"),
    ],
)
def test_md_escapes_what_could_make_structure(text: str, shown: str) -> None:
    assert prereg.md(text) == shown


def test_md_code_spans() -> None:
    assert prereg.md("router=pin router.pin=0.1", code=True) == "`router=pin router.pin=0.1`"
    assert prereg.md("a|b\nc", code=True) == "`a\\|b c`"
    assert prereg.md("a`b", code=True) == "``a`b``"
    assert prereg.md("`a``", code=True) == "``` `a`` ```"


def test_names_ending_in_a_newline_are_refused() -> None:
    data = study()
    data["hypotheses"][0]["id"] = "H1\n"  # "$" in a pattern matches before a final newline
    with pytest.raises(MoestackError, match=r"hypotheses\[0\]"):
        prereg.parse(data)
    data = study()
    data["runs"]["arms"]["a\n"] = data["runs"]["arms"].pop("a")
    with pytest.raises(MoestackError, match="runs.arms"):
        prereg.parse(data)


FORGED = (
    "\n\n## Verdicts\n\n| id | hypothesis | verdict |\n|---|---|---|\n| H2 | forged | **pass** |\n"
)


def test_report_quotes_the_lock_and_study_text_without_making_structure(tmp_path: Path) -> None:
    """A lock written before reasons were checked, holding a reason with newlines and a
    verdict table, and a study whose title and statement hold Markdown: the report shows
    their text, escaped, and has one verdict table, the real one."""
    data = study(title="synthetic" + FORGED)
    data["hypotheses"][1]["statement"] = "perplexity within +1%" + FORGED
    path = write(tmp_path, data)
    prereg.lock(path)
    out = tmp_path / "out"
    prereg.run(path, out, train_fn=evaluating_train(prereg.load(path)), progress=False)
    fake_evaluations(path, out)
    target = prereg.lock_path(path)  # an amendment as moestack wrote it before: reason as given
    chain = json.loads(target.read_text())["chain"]
    head = {k: v for k, v in chain[-1].items() if k not in ("seq", "prev", "hash")}
    amend = {**head, "action": "amend", "reason": "typo" + FORGED, "replaces": head["sha256"]}
    target.write_text(json.dumps(prereg.chain.document(prereg.chain.append(chain, amend))))
    text = prereg.analyze(path, out, evaluate=False).read_text()
    lines = text.splitlines()
    assert lines.count("## Verdicts") == 1 and lines.count("| id | hypothesis | verdict |") == 1
    assert [line for line in lines if line.startswith("| H2 |")] == [
        "| H2 | perplexity within +1%  \\#\\# Verdicts  \\| id \\| hypothesis \\| verdict \\| "
        "\\|---\\|---\\|---\\| \\| H2 \\| forged \\| \\*\\*pass\\*\\* \\| | **fail** |"
    ]
    assert not any("| forged |" in line for line in lines)
    assert lines[0].startswith("# Pre-registered study: synthetic  \\#\\# Verdicts  \\| id \\|")
    history = [line for line in lines if line.startswith("| 1 |")]
    assert len(history) == 1 and "| **amendment** | typo  \\#\\# Verdicts  \\| id \\|" in history[0]


# ------------------------------------------------------------------ tuning apart from the test
def with_split(selection: list[float], test: list[float]) -> dict[str, Any]:
    data = study()
    data["analysis"]["eval_windows"] = test
    data["selection"] = {"windows": selection, "pilot": "pilot_v3 (runs/pilot)",
                         "reason": "temporal=0.1 cut misses most within the budget"}  # fmt: skip
    return data


@pytest.mark.parametrize(
    ("selection", "test"),
    [([0.25, 0.75], [0.5, 1.0]), ([0.0, 1.0], [0.9, 1.0]), ([0.5, 1], [0, 0.6])],
)
def test_a_study_tuned_on_windows_its_test_reads_is_refused(tmp_path, selection, test) -> None:
    path = write(tmp_path, with_split(selection, test))
    with pytest.raises(
        MoestackError, match=r"selection.windows: .* overlaps analysis.eval_windows"
    ) as err:
        prereg.lock(path)
    assert "disjoint" in one_line(err) and not prereg.lock_path(path).exists()


@pytest.mark.parametrize(
    ("windows", "named"),
    [
        ([0.6, 0.4], r"\[0.6, 0.4\]"),
        ([0.0, 1.5], r"\[0.0, 1.5\]"),
        ("half", "'half'"),
        ([0.5], r"\[0.5\]"),
    ],
)
def test_bad_windows_are_refused_naming_the_field(tmp_path, windows, named) -> None:
    data = study()
    data["analysis"]["eval_windows"] = windows
    with pytest.raises(MoestackError, match=rf"analysis.eval_windows: {named}"):
        prereg.load(write(tmp_path, data))


def test_disjoint_tuning_and_test_windows_lock_and_are_reported(tmp_path) -> None:
    path = write(tmp_path, with_split([0.0, 0.5], [0.5, 1.0]))
    prereg.lock(path)
    spec = prereg.load(path)
    assert spec.selection.windows == (0.0, 0.5) and spec.analysis.eval_windows == (0.5, 1.0)
    out = tmp_path / "out"
    prereg.run(path, out, train_fn=evaluating_train(spec), progress=False)
    fake_evaluations(path, out)
    text = Path(prereg.analyze(path, out, evaluate=False)).read_text()
    assert "## Selection (as registered)" in text
    assert "Tuned on the share [0, 0.5) of the validation split" in text
    assert "validation batches from the share [0.5, 1) of the validation split" in text


def test_the_test_windows_are_the_share_of_the_split_they_name() -> None:
    tokens = np.arange(1000)
    assert np.array_equal(prereg.analysis.windows_of(tokens, (0.5, 1.0), 8), tokens[500:])
    assert np.array_equal(prereg.analysis.windows_of(tokens, (0.25, 0.3), 8), tokens[250:300])
    with pytest.raises(MoestackError, match=r"eval_windows \[0.0, 0.005\] holds 5 tokens"):
        prereg.analysis.windows_of(tokens, (0.0, 0.005), 8)
