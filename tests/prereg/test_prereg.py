"""Pre-registration: file validation, lock and verify, the resumable runner, the analysis."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.paths import EXPERIMENTS
from helpers.prereg import (
    ARMS,
    BASE,
    fake_finish,
    finished_run,
    full_metrics,
    micro_study,
    study,
    two_arm_micro_study,
    write,
)

from moestack import prereg
from moestack.errors import MoestackError


# ------------------------------------------------------------------ validation
def _break(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = data
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [
        ("study", "bad name!", "study"),
        ("budget.steps", KeyError, "budget.steps"),
        ("budget.steps", 0, "budget.steps"),
        ("runs.baseline", "nope", "runs.baseline"),
        ("runs.seeds", [0, 0], "runs.seeds"),
        ("runs.arms.a", ["router.temporal"], "runs.arms.a[0]"),
        ("runs.arms.a", ["seed=3"], "runs.arms.a[0]"),
        ("analysis.policies", ["lru", "fifo"], "analysis.policies[1]"),
        ("analysis.warmup", 1.5, "analysis.warmup"),
        ("analysis.colour", 1, "analysis.colour"),
        ("hypotheses.0.metric", "lru/cap8/miss_rate", "hypotheses[0] (H1).metric"),
        ("hypotheses.0.metric", "accuracy", "hypotheses[0] (H1).metric"),
        ("hypotheses.0.metric", "lru/cap4/b8/miss_rate", "hypotheses[0] (H1).metric"),
        ("analysis.serve_batches", [1, 0], "analysis.serve_batches"),
        ("hypotheses.1.op", "<", "hypotheses[1] (H2).op"),
        ("hypotheses.1.threshold", "small", "hypotheses[1] (H2).threshold"),
        ("hypotheses.2.arms", ["baseline"], "hypotheses[2] (H3).arms[0]"),
        ("hypotheses.2.comparison", "ratio", "hypotheses[2] (H3).comparison"),
        ("hypotheses.3.of", ["H9"], "hypotheses[3] (H4).of[0]"),
        # values a YAML file can hold that once ended in a TypeError or OverflowError
        ("budget.steps", float("nan"), "budget.steps"),
        ("budget.steps", float("inf"), "budget.steps"),
        ("runs.seeds", [0, float("inf")], "runs.seeds[1]"),
        ("runs.baseline", ["baseline"], "runs.baseline"),
        ("hypotheses.2.arms", [["a"]], "hypotheses[2] (H3).arms[0]"),
        ("hypotheses.3.of", [{"H1": 1}], "hypotheses[3] (H4).of[0]"),
    ],
)
def test_validation_errors_name_the_field(where: str, value: Any, named: str) -> None:
    with pytest.raises(MoestackError) as err:
        prereg.parse(_break(study(), where, value))
    assert str(err.value).startswith(named + ":"), str(err.value)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, study(budget={"steps": -1}))
    with pytest.raises(MoestackError, match=r"study\.yaml: budget\.steps"):
        prereg.load(path)


def test_shipped_studies_are_valid_and_compose() -> None:
    for name, runs in (
        ("prereg_cpu", 8),
        ("prereg_137m", 21),
        ("prereg_cpu_v2", 240),
        ("prereg_hf_finetune", 24),
        ("prereg_cpu_v3_e16", 60),
    ):
        spec = prereg.load(EXPERIMENTS / f"{name}.yaml")
        assert spec.study == name and len(prereg.plan(spec)) == runs
    # v3's two models: the controls as few experts as the top_k + 1 (fine64) and the 25%
    # (16 experts) cache holds, and a dense FFN, all at the same active size
    for name, base, fewer in (("prereg_cpu_v3", (64, 8), 9), ("prereg_cpu_v3_e16", (16, 2), 4)):
        v3 = prereg.load(EXPERIMENTS / f"{name}.yaml")
        if (EXPERIMENTS / f"{name}.yaml.lock.json").exists():
            prereg.verify(v3.path)
        shapes = {}
        for arm in v3.arms:
            moe = prereg.compose_config(v3.overrides(arm, 0)).model.moe
            shapes[arm] = (moe.num_experts, moe.top_k, moe.top_k * moe.d_ff)
        assert shapes["baseline"] == (*base, 512) and v3.runs.controls == ("fewer", "dense")
        assert shapes["fewer"] == (fewer, base[1], 512) and shapes["dense"] == (1, 1, 512)
        assert fewer in v3.analysis.capacities
    spec = prereg.load(EXPERIMENTS / "prereg_cpu.yaml")
    cfg = prereg.compose_config(spec.overrides("pin", 1))
    assert (cfg.seed, cfg.steps, cfg.router.pin, cfg.model.moe.num_experts) == (1, 150, 0.1, 8)


def test_shipped_cpu_study_matches_its_lock() -> None:
    """The committed report was produced from this exact file."""
    record = prereg.verify(EXPERIMENTS / "prereg_cpu.yaml")
    assert record["study"] == "prereg_cpu"


# ------------------------------------------------------------------ lock and verify
def test_lock_records_hash_commit_time_and_refuses_overwrite(tmp_path: Path) -> None:
    path = write(tmp_path, study())
    lock = prereg.lock(path)
    assert lock == tmp_path / "study.yaml.lock.json"
    record = json.loads(lock.read_text())
    assert record["sha256"] == prereg.sha256_file(path)
    assert record["git_commit"]  # a commit id, or "unknown" outside a repository
    assert record["locked_at"].endswith("+00:00")
    with pytest.raises(MoestackError, match="already locked"):
        prereg.lock(path)
    again = json.loads(prereg.lock(path, force=True).read_text())
    assert again["replaces"] == record["sha256"]
    assert prereg.verify(path)["sha256"] == record["sha256"]


def test_changed_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, study())
    with pytest.raises(MoestackError, match="is not locked"):
        prereg.analyze(path, tmp_path / "out")
    prereg.lock(path)
    data = study()
    data["hypotheses"][0]["threshold"] = -0.10  # moving the goalposts after the lock
    write(tmp_path, data)
    for step in (prereg.analyze, prereg.run):
        with pytest.raises(MoestackError, match="changed since it was locked") as err:
            step(path, tmp_path / "out")
        assert "git checkout" in str(err.value)


# ------------------------------------------------------------------ runner
def _fake_train(calls: list[tuple[str, bool]]):
    def train(cfg, out_dir: Path) -> dict[str, Any]:
        calls.append((Path(out_dir).name, cfg.resume))
        assert Path(cfg.out_dir) == Path(out_dir)
        fake_finish(cfg, out_dir)
        return {}

    return train


def test_runner_skips_finished_runs_and_resumes_interrupted(tmp_path: Path) -> None:
    data = study()
    data["runs"]["seeds"] = [0, 1]
    data["runs"]["arms"] = {k: v for k, v in data["runs"]["arms"].items() if k != "b"}
    data["hypotheses"] = [h for h in data["hypotheses"] if h["id"] in ("H1",)]
    data["hypotheses"][0]["arms"] = ["a"]
    path = write(tmp_path, data)
    with pytest.raises(MoestackError, match="is not locked"):
        prereg.run(path, tmp_path / "out", train_fn=_fake_train([]))
    prereg.lock(path)
    runs = tmp_path / "out" / "runs"
    (runs / "baseline-s0").mkdir(parents=True)
    (runs / "baseline-s0" / "summary.json").write_text("{}")  # finished
    ckpt = runs / "a-s1" / "checkpoints" / "step_000002"  # interrupted at step 2
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 2}))
    for name in ("baseline-s0", "a-s1"):  # both trained under this lock
        prereg.write_run_record(runs / name, prereg.verify(path), "started")

    calls: list[tuple[str, bool]] = []
    dirs = prereg.run(path, tmp_path / "out", train_fn=_fake_train(calls), progress=False)
    assert [d.name for d in dirs] == ["baseline-s0", "a-s0", "baseline-s1", "a-s1"]
    assert calls == [("a-s0", False), ("baseline-s1", False), ("a-s1", True)]
    calls.clear()
    prereg.run(path, tmp_path / "out", train_fn=_fake_train(calls), progress=False)
    assert calls == []


def _two_seed_study(tmp_path: Path) -> Path:
    data = study()
    data["runs"]["seeds"] = [0, 1]
    path = write(tmp_path, data)
    prereg.lock(path)
    return path


@contextlib.contextmanager
def held_claim(run_dir: Path):
    """Another live process holding the run's claim (its flock) while the block runs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir / prereg.CLAIM_FILE)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_runner_leaves_held_runs_and_takes_free_claims(tmp_path: Path) -> None:
    """A run another process holds is left to it; the claim file of a runner that died (its
    lock is gone with it), empty or not, is taken."""
    path = _two_seed_study(tmp_path)
    runs = tmp_path / "out" / "runs"
    for name, text in (("baseline-s1", '{"host": "gone", "pid": 1}'), ("a-s1", "")):
        (runs / name).mkdir(parents=True)
        (runs / name / prereg.CLAIM_FILE).write_text(text)
    calls: list[tuple[str, bool]] = []
    with held_claim(runs / "a-s0"):
        assert prereg.claimed(runs / "a-s0") and not prereg.claimed(runs / "a-s1")
        prereg.run(path, tmp_path / "out", train_fn=_fake_train(calls), progress=False)
        assert prereg.claimed(runs / "a-s0")  # still the other process's
    assert [c[0] for c in calls] == ["baseline-s0", "b-s0", "baseline-s1", "a-s1", "b-s1"]
    assert not any(prereg.claimed(d) for d in runs.iterdir())  # every claim released
    mine = json.loads((runs / "a-s1" / prereg.CLAIM_FILE).read_text())
    assert mine == {"host": socket.gethostname(), "pid": os.getpid()}


def test_a_claim_file_deleted_while_held_is_claimed_anew(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = prereg.claim(run_dir)
    assert first is not None and prereg.claim(run_dir) is None  # held (also within a process)
    (run_dir / prereg.CLAIM_FILE).unlink()  # by hand, or by a runner of an older version
    second = prereg.claim(run_dir)
    assert second is not None  # the new file's lock: the old holder no longer counts
    assert prereg.claimed(run_dir)
    prereg.release(first)
    prereg.release(second)
    assert not prereg.claimed(run_dir)


def test_concurrent_runners_train_every_run_once(tmp_path: Path) -> None:
    """Two runner processes over one folder (hydra's global state keeps runners out of threads)."""
    path = _two_seed_study(tmp_path)
    trained = tmp_path / "trained.txt"

    def slow_train(cfg, out_dir: Path) -> dict[str, Any]:
        time.sleep(0.2)  # long enough that the two runners overlap
        with open(trained, "a") as f:
            f.write(Path(out_dir).name + "\n")
        fake_finish(cfg, out_dir)
        return {}

    fork = multiprocessing.get_context("fork")
    kwargs = {"train_fn": slow_train, "progress": False}
    workers = [fork.Process(target=prereg.run, args=(path, tmp_path / "out"), kwargs=kwargs)]
    workers.append(fork.Process(target=prereg.run, args=(path, tmp_path / "out"), kwargs=kwargs))
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    names = sorted(trained.read_text().split())
    assert names == sorted(f"{arm}-s{seed}" for arm in ("baseline", "a", "b") for seed in (0, 1))
    assert not any(prereg.claimed(d) for d in (tmp_path / "out" / "runs").iterdir())


def test_status_counts_runs_by_state_and_shows_no_results(tmp_path: Path, capsys) -> None:
    path = _two_seed_study(tmp_path)
    runs = tmp_path / "out" / "runs"
    for name, minutes in (("baseline-s0", 3), ("a-s0", 5), ("b-s0", 4)):  # finished
        (runs / name).mkdir(parents=True)
        (runs / name / "summary.json").write_text(json.dumps({"eval/perplexity": 9.87}))
        record = {"study_sha256": "x", "started_at": "2026-01-01T10:00:00+00:00",
                  "finished_at": f"2026-01-01T10:0{minutes}:00+00:00"}  # fmt: skip
        (runs / name / prereg.RUN_FILE).write_text(json.dumps(record))
    ckpt = runs / "a-s1" / "checkpoints" / "step_000002"  # interrupted
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 2}))
    with held_claim(runs / "baseline-s1"):  # running: a live runner's claim
        result = prereg.status(path, tmp_path / "out")
    assert result["total"] == {"finished": 3, "running": 1, "interrupted": 1, "waiting": 1}
    assert result["arms"]["a"] == {"finished": 1, "running": 0, "interrupted": 1, "waiting": 0}
    assert result["median_run_s"] == 240.0  # 3, 4 and 5 minutes
    assert result["eta_s"] == 3 * 240.0  # three runs left, one runner
    from moestack.cli import main as cli_main

    cli_main(["prereg", "status", str(path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert f"3 of 6 runs finished in {tmp_path / 'out'}" in out and "9.87" not in out
    assert "about 0.2 h with 1 runner(s)" in out


# ------------------------------------------------------------------ analysis
def fake_runs(spec: prereg.Prereg, root: Path, skip: tuple[str, ...] = ()) -> None:
    """Run dirs as a finished study leaves them, with the cached per-run evaluation."""
    key = prereg.analysis_key(spec)
    lock = prereg.verify(spec.path)
    for item in prereg.plan(spec, root):
        if item.name in skip:
            continue
        metrics = BASE if item.arm == "baseline" else ARMS[item.arm][item.seed]
        finished_run(item, lock, key, full_metrics(metrics))


def test_analysis_gives_known_verdicts_and_margins(tmp_path: Path) -> None:
    path = write(tmp_path, study())
    prereg.lock(path)
    spec = prereg.load(path)
    fake_runs(spec, tmp_path / "out")
    report = prereg.analyze(path, tmp_path / "out", evaluate=False)
    results = json.loads((report.parent / "results.json").read_text())
    hyp = {h["id"]: h for h in results["hypotheses"]}
    assert {k: h["verdict"] for k, h in hyp.items()} == {
        "H1": "pass", "H2": "fail", "H3": "pass", "H4": "pass"
    }  # fmt: skip
    a, b = hyp["H1"]["rows"]
    assert a["estimate"] == pytest.approx(-0.40) and a["margin"] == pytest.approx(0.10)
    half = 4.302653 * 0.1 / math.sqrt(3)  # t(0.975, 2) x sd / sqrt(n)
    assert a["ci"] == pytest.approx([-0.40 - half, -0.40 + half], rel=1e-5)
    assert a["ci_verdict"] == "inconclusive" and a["pass"] is True
    assert b["estimate"] == pytest.approx(-0.10) and b["margin"] == pytest.approx(-0.20)
    assert b["ci_verdict"] == "refuted" and b["pass"] is False
    a2, b2 = hyp["H2"]["rows"]
    assert a2["margin"] == pytest.approx(0.005) and a2["pass"] is True
    assert b2["margin"] == pytest.approx(-0.01) and b2["pass"] is False
    (b3,) = hyp["H3"]["rows"]
    assert b3["estimate"] == pytest.approx(0.15) and b3["margin"] == pytest.approx(0.05)
    assert [r["pass"] for r in hyp["H4"]["rows"]] == [True, False]
    text = report.read_text()
    assert "| H2 | perplexity within +1% | **fail** |" in text
    for png in ("hit_rate_vs_perplexity.png", "hit_rate_vs_capacity.png"):
        assert (report.parent / png).stat().st_size > 1000 and png in text


def test_ci_decision_and_missing_runs(tmp_path: Path) -> None:
    data = study()
    data["analysis"]["decision"] = "ci"
    path = write(tmp_path, data)
    prereg.lock(path)
    spec = prereg.load(path)
    fake_runs(spec, tmp_path / "out", skip=("b-s0", "b-s1", "b-s2", "baseline-s2"))
    with pytest.raises(MoestackError, match="4 of 9 registered runs are not finished"):
        prereg.analyze(path, tmp_path / "out", evaluate=False)  # an early look is refused
    report = prereg.analyze(path, tmp_path / "out", evaluate=False, interim=True)
    assert report.read_text().startswith("> **Interim look: 5 of 9 registered runs finished")
    hyp = {
        h["id"]: h for h in json.loads((report.parent / "results.json").read_text())["hypotheses"]
    }
    a, b = hyp["H1"]["rows"]
    assert a["n"] == 2 and a["per_seed"] == pytest.approx([-0.4, -0.5])  # seed 2 has no baseline
    assert a["pass"] is False  # the CI's upper end is above -30%
    assert b["n"] == 0 and b["pass"] is None
    assert hyp["H1"]["verdict"] == "incomplete" and hyp["H3"]["verdict"] == "incomplete"
    assert "| b-s0 | missing |" in report.read_text()


def test_t_quantile() -> None:
    for df, expected in ((1, 12.7062), (2, 4.3027), (5, 2.5706), (30, 2.0423)):
        assert prereg.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)
    mean, lo, hi = prereg.mean_ci([1.0], 0.95)
    assert mean == 1.0 and math.isnan(lo) and math.isnan(hi)


def test_end_to_end_micro_study(tmp_path: Path, caplog) -> None:
    """The real train and evaluation on a micro model: two arms, one seed, two steps."""
    data = two_arm_micro_study()
    data["hypotheses"][0]["metric"] = "lru/cap2/b2/miss_rate"  # at cap 4 nothing misses
    data["analysis"]["serve_batches"] = [1, 2]  # also served two sequences at a time
    path = write(tmp_path, data)
    prereg.lock(path)
    with caplog.at_level("INFO"):
        prereg.run(path, tmp_path / "out", progress=False)
    assert "a-s0: training" in caplog.text  # the runner says what it does ...
    assert "val loss" not in caplog.text and "perplexity" not in caplog.text  # ... not results
    report = prereg.analyze(path, tmp_path / "out")
    results = json.loads((report.parent / "results.json").read_text())
    run = results["runs"][1]
    assert run["run"] == "a-s0" and run["step"] == 2 and run["router"]["temporal"] == 0.1
    assert 0 <= run["metrics"]["lru/cap2/hit_rate"] <= 1 and run["metrics"]["perplexity"] > 1
    assert run["metrics"]["lru/cap4/hit_rate"] == 1.0  # 4 slots hold all 4 experts
    assert run["metrics"]["lru/cap4/b2/hit_rate"] == 1.0  # served two at a time too
    assert 0 <= run["metrics"]["lru/cap2/b2/miss_rate"] <= 1
    assert {h["verdict"] for h in results["hypotheses"]} <= {"pass", "fail"}
    for cache in (tmp_path / "out" / "runs").glob(f"*/{prereg.EVAL_FILE}"):
        cache.unlink()  # evaluated again, in two processes: the same report
    again = prereg.analyze(path, tmp_path / "out", tmp_path / "again", jobs=2)
    parallel = json.loads((again.parent / "results.json").read_text())
    assert parallel["hypotheses"] == results["hypotheses"]
    assert [r["metrics"] for r in parallel["runs"]] == [r["metrics"] for r in results["runs"]]


def test_jobs_train_a_study_with_several_runner_processes(tmp_path: Path) -> None:
    """Two runner processes (real training, micro model), one progress bar: every run
    trained once, each runner's output in its log, no claim left."""
    data = micro_study(width=16, layers=1, max_bytes=200_000, train=["ckpt_every=0"])
    path = write(tmp_path, data)
    with pytest.raises(MoestackError, match="not locked"):
        prereg.run_jobs(path, tmp_path / "out", jobs=2)
    prereg.lock(path)
    with pytest.raises(MoestackError, match="--jobs 0"):
        prereg.run_jobs(path, tmp_path / "out", jobs=0)
    dirs = prereg.run_jobs(path, tmp_path / "out", jobs=2, poll_s=0.2, progress=False)
    assert len(dirs) == 9 and all((d / "summary.json").is_file() for d in dirs)
    records = [json.loads((d / prereg.RUN_FILE).read_text()) for d in dirs]
    assert {r["status"] for r in records} == {"finished"}
    assert sorted(p.name for p in (tmp_path / "out").glob("runner-*.log")) == [
        "runner-0.log", "runner-1.log"]  # fmt: skip
    assert not any(prereg.claimed(d) for d in (tmp_path / "out" / "runs").iterdir())


def test_capacity_plot_takes_arms_whose_seeds_agree(tmp_path) -> None:
    """An arm whose seeds give equal hit rates (an un-tuned model) has a mean that rounds
    past them (0.1 x 3 / 3 > 0.1): its bar must not go negative (matplotlib refuses it)."""
    from moestack.prereg.report_plots import plot_capacity

    spec = prereg.load(EXPERIMENTS / "prereg_cpu.yaml")
    a = spec.analysis
    records = [
        {
            "arm": arm,
            "seed": seed,
            "status": "done",
            "metrics": {f"{p}/cap{c}/hit_rate": 0.1 for p in a.policies for c in a.capacities},
        }
        for arm in spec.arms
        for seed in range(3)
    ]
    path = plot_capacity(spec, records, tmp_path)
    assert path is not None and path.stat().st_size > 0


def test_batch_curves_are_each_arms_seed_mean_and_range(tmp_path) -> None:
    """Misses per token against the serving batch: batch 1 is the one-stream replay, each
    point the mean of the arm's finished seeds with their min and max (worked by hand); an
    unfinished run counts for nothing. The figure is drawn; a one-stream study has none."""
    from moestack.prereg.report_plots import batch_curves, plot_batches

    spec = prereg.load(EXPERIMENTS / "prereg_cpu_v3.yaml")
    a = spec.analysis
    assert sorted(set(a.serve_batches) | {1}) == [1, 8, 32]
    rng = random.Random(7)
    records = []
    for arm in spec.arms:
        for seed in range(3):
            metrics = {}
            for c in a.capacities:
                metrics[f"lru/cap{c}/misses_per_token"] = rng.uniform(0.5, 4)
                for b in (8, 32):
                    metrics[f"lru/cap{c}/b{b}/misses_per_token"] = rng.uniform(0.05, 1)
            records.append({"arm": arm, "seed": seed, "status": "done", "metrics": metrics})
    records.append({"arm": spec.baseline, "seed": 9, "status": "failed", "metrics": {}})
    curves = batch_curves(spec, records)
    assert sorted(curves) == sorted(a.capacities)
    cap, arm = a.capacities[1], "temporal"
    seeds = [r["metrics"] for r in records if r["arm"] == arm and r["status"] == "done"]
    b8 = [m[f"lru/cap{cap}/b8/misses_per_token"] for m in seeds]
    one = [m[f"lru/cap{cap}/misses_per_token"] for m in seeds]
    got = curves[cap][arm]
    assert got["batch"] == [1.0, 8.0, 32.0]
    assert got["mean"][0] == pytest.approx((one[0] + one[1] + one[2]) / 3)
    assert got["mean"][1] == pytest.approx((b8[0] + b8[1] + b8[2]) / 3)
    assert (got["min"][1], got["max"][1]) == (min(b8), max(b8))
    assert set(curves[cap]) == set(spec.arms)
    path = plot_batches(spec, records, tmp_path)
    assert path is not None and path.name == "misses_vs_batch.png" and path.stat().st_size > 0
    one_stream = prereg.load(EXPERIMENTS / "prereg_cpu.yaml")
    assert set(one_stream.analysis.serve_batches) <= {1}
    assert plot_batches(one_stream, records, tmp_path / "none") is None


def test_evaluate_ahead_fills_the_cache_and_shows_nothing(tmp_path: Path, capsys, monkeypatch):
    """Finished runs are evaluated while the rest wait (counts only, no metric printed); the
    analysis then reuses those evaluations instead of computing them again."""
    data = micro_study(width=16, layers=1, max_bytes=200_000, train=["ckpt_every=0"])
    data["runs"]["seeds"] = [0]
    path = write(tmp_path, data)
    out = tmp_path / "out"
    with pytest.raises(MoestackError, match="not locked"):
        prereg.evaluate_finished(path, out)
    prereg.lock(path)
    prereg.run(path, out, progress=False)
    shutil.rmtree(out / "runs" / "b-s0")  # as if b-s0 were still waiting
    from moestack.cli import main as cli_main

    cli_main(["prereg", "evaluate", str(path), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "evaluated 2 run(s) now; 2 of 2 finished runs evaluated (3 registered)" in printed
    assert "perplexity" not in printed
    assert sorted(p.parent.name for p in out.glob(f"runs/*/{prereg.EVAL_FILE}")) == [
        "a-s0", "baseline-s0"]  # fmt: skip
    assert prereg.evaluate_finished(path, out)["evaluated_now"] == 0  # nothing left to do
    where = prereg.status(path, out)
    assert where["evaluated"] == 2 and where["eval_left_cpu_s"] > 0  # one run left to evaluate
    prereg.run(path, out, progress=False)  # b-s0 trained from scratch
    record = json.loads((out / "runs" / "a-s0" / prereg.EVAL_FILE).read_text())
    identity = prereg.read_run_record(out / "runs" / "a-s0")
    assert record["model_sha256"] == identity["model_sha256"] and record["torch_threads"] >= 1
    calls: list[str] = []
    real = prereg.analysis.evaluate_run
    monkeypatch.setattr(
        prereg.analysis, "evaluate_run", lambda d, *a: calls.append(Path(d).name) or real(d, *a)
    )
    report = prereg.analyze(path, out, recheck=0)
    assert calls == ["b-s0"]  # the other two evaluations are reused
    calls.clear()
    prereg.analyze(path, out, tmp_path / "rechecked")  # one cached run per arm evaluated again
    assert sorted(calls) == ["a-s0", "b-s0", "baseline-s0"]  # each arm's only run
    results = json.loads((tmp_path / "rechecked" / "results.json").read_text())
    assert {c["run"]: c["outcome"] for c in results["recheck"]} == dict.fromkeys(
        ("baseline-s0", "a-s0", "b-s0"), "matched"
    )
    first = json.loads((report.parent / "results.json").read_text())
    assert results["hypotheses"] == first["hypotheses"]
