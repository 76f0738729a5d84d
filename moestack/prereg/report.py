"""The report: its text (the provenance, the lock, the integrity checks, the verdicts), the
tables (``report_tables``) and figures (``report_plots``) put together (``render_markdown``),
results.json, and ``analyze``."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.analysis import RECHECK_RTOL, collect
from moestack.prereg.analysis import recheck as recheck_runs
from moestack.prereg.decision import ONE_SIDED, rule
from moestack.prereg.evaluate import checked_study, evaluate_in_parallel
from moestack.prereg.hashing import changed_files, code_files
from moestack.prereg.markdown import md
from moestack.prereg.report_plots import plot_all
from moestack.prereg.report_tables import hypothesis_lines, result_lines
from moestack.prereg.runner import is_finished
from moestack.prereg.sources import render_lines as render_code_lines
from moestack.prereg.sources import with_evaluations
from moestack.prereg.spec import Prereg
from moestack.prereg.stats import t_quantile
from moestack.prereg.verdicts import (
    control_rows,
    evaluate_hypotheses,
    misses_rows,
    steered_rows,
)

log = logging.getLogger(__name__)


def render_markdown(
    spec: Prereg,
    lock_record: dict[str, Any],
    records: Sequence[dict[str, Any]],
    hypotheses: Sequence[dict[str, Any]],
    figures: Sequence[str],
    checks: Sequence[dict[str, Any]] | None = None,
    code: dict[str, Any] | None = None,
) -> str:
    """The report: provenance, the code of the runs, the verdicts, one table per hypothesis,
    the runs, the figures. Every string from the study file or the lock is quoted through
    ``md``; ``checks`` are the runs the analysis evaluated again (``analysis.recheck``;
    None: not asked for); ``code`` which code trained them (``sources``; None: not shown)."""
    lines = _provenance(spec, lock_record, records, checks)
    lines += render_code_lines(code, md)
    lines += ["## Verdicts", "", "| id | hypothesis | verdict |", "|---|---|---|"]
    lines += [f"| {md(h['id'])} | {md(h['statement'])} | **{h['verdict']}** |" for h in hypotheses]
    lines.append("")
    for h in hypotheses:
        lines += hypothesis_lines(h)
    lines += result_lines(spec, records)
    if figures:
        lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    return "\n".join(lines)


def _provenance(
    spec: Prereg,
    lock_record: dict[str, Any],
    records: Sequence[dict[str, Any]],
    checks: Sequence[dict[str, Any]] | None,
) -> list[str]:
    """The report's head: the lock, the runs and the evaluation, then the runs' overrides."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    lines = [
        f"# Pre-registered study: {md(spec.title)}",
        "",
        f"- Study {md(spec.study, code=True)}, file {md(spec.path.name, code=True)}, sha256 "
        f"{md(lock_record['sha256'], code=True)}",
        f"- Locked at {md(lock_record.get('locked_at'))} (git commit "
        f"{md(lock_record.get('git_commit'), code=True)}); the file matches its lock.",
        *_lock_lines(lock_record, records),
        _analysis_code_line(lock_record),
        *_integrity_lines(records, checks),
        f"- Runs: {len(done)} of {len(records)} finished and evaluated "
        f"({len(spec.arms)} arms x {len(spec.seeds)} seeds).",
        f"- Evaluation: final checkpoint, {a.eval_batches} validation batches from "
        f"{_share_text(a.eval_windows)} of the validation split; cache replay "
        f"with the first {a.warmup:.0%} of each layer's requests as warm-up (not counted); "
        f"seeds paired with the baseline, mean and {a.confidence:.0%} t interval; "
        f"decision rule: {a.decision}{_rule_note(spec)}"
        + (
            f"; with {len(spec.seeds)} seeds the interval is mean +- "
            f"{t_quantile(0.5 + a.confidence / 2, len(spec.seeds) - 1):.2f} x sd / sqrt(n)."
            if len(spec.seeds) > 1
            else "."
        ),
        "",
    ]
    if spec.question:
        lines += [f"Question: {md(spec.question)}", ""]
    lines += _power_lines(spec)
    lines += _selection_lines(spec)
    lines += _history_lines(lock_record.get("history") or [])
    shared = md(" ".join(spec.base_overrides), code=True)
    lines += ["## Runs as registered", "", f"Shared: {shared}", ""]
    lines += ["| arm | overrides |", "|---|---|"]
    lines += [f"| {md(arm)} | {md(' '.join(ov), code=True)} |" for arm, ov in spec.arms.items()]
    seeds = ", ".join(map(str, spec.seeds))
    lines += ["", f"Seeds: {seeds}; baseline: {md(spec.baseline)}.", ""]
    return lines


def _share_text(windows: tuple[float, float]) -> str:
    lo, hi = windows
    return "all" if (lo, hi) == (0.0, 1.0) else f"the share [{lo:g}, {hi:g})"


def _selection_lines(spec: Prereg) -> list[str]:
    """Where the arms' settings were chosen (the tuning split), apart from the test."""
    if spec.selection is None:
        return []
    s = spec.selection
    return [
        "## Selection (as registered)",
        "",
        f"- Tuned on {_share_text(s.windows)} of the validation split, by "
        f"{md(s.pilot, code=True)}; the test reads {_share_text(spec.analysis.eval_windows)} "
        "of it (disjoint: checked at the lock).",
        f"- What and why: {md(s.reason)}",
        "",
    ]


def _power_lines(spec: Prereg) -> list[str]:
    """The report's record of the power analysis the study file states (none: no lines)."""
    if spec.power is None:
        return []
    p = spec.power
    return [
        "## Power analysis (as registered)",
        "",
        f"- Pilot: {md(p.pilot, code=True)}; target: {p.confidence:.0%} interval half-width "
        f"<= {p.half_width:g}; seeds chosen: {p.seeds}.",
        f"- Why: {md(p.reason)}",
        "- Recompute: "
        + md(f"moestack prereg power {spec.path.name} --pilot {p.pilot}", code=True)
        + ".",
        "",
    ]


def analysis_code(lock_record: dict[str, Any]) -> dict[str, Any] | None:
    """The moestack sources this analysis runs with against the newest lock's: ``changed``
    lists the files that differ (None: a lock older than the code hash)."""
    locked = lock_record.get("code")
    if not isinstance(locked, dict):
        return None
    return {"changed": changed_files(locked, code_files())}


def _analysis_code_line(lock_record: dict[str, Any]) -> str:
    """Whether the analysis ran with the code that trained (the lock's) or with newer code."""
    code = analysis_code(lock_record)
    if code is None:
        return "- Analysis code: not compared (the lock predates the code hash)."
    changed = code["changed"]
    if not changed:
        return "- Analysis code: the lock's moestack sources, the code the runs trained with."
    shown = ", ".join(md(name, code=True) for name in changed[:8])
    more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    return (
        f"- Analysis code: moestack sources that differ from the lock's in {len(changed)} "
        f"files ({shown}{more}); the runs trained with the lock's (`prereg run` refuses "
        "other code), and each evaluation is cached with the run it scored."
    )


def _integrity_lines(
    records: Sequence[dict[str, Any]], checks: Sequence[dict[str, Any]] | None
) -> list[str]:
    """What ties the numbers to the runs: identities, sealed caches and the recheck."""
    if not any(r.get("status") == "done" for r in records):
        return []
    lines = [
        "- Integrity: each finished run's record names its study hash, arm, seed and the "
        "sha256 of its final checkpoint's weights, and matches its folder and checkpoint; "
        "each cached evaluation matches its digest and names that run and those weights "
        "(edit evidence, no signature)."
    ]
    kept = [r for r in records if r.get("kept")]
    if kept:
        lines.append(
            f"- Kept runs: {len(kept)} of the finished runs were trained on other machines and "
            "restored here from the records kept in the repository (no checkpoint): each "
            "identity was checked against its kept checkpoint meta.json and the evaluation is "
            "the kept one. The recheck cannot evaluate them again; their audit is to train some "
            "again and compare their weights' sha256 with their records (bit for bit on the "
            "machine kind they were kept from: `moestack prereg audit`)."
        )
    if checks is None:
        lines.append("- Recheck: none (the analysis evaluated nothing).")
    elif not checks:
        lines.append("- Recheck: no cached evaluation was evaluated again.")
    else:
        outcome = {"matched": "matched its cache", "re-evaluated": "re-evaluated (cached under "
                   "another torch, host or device: its fresh numbers are used)"}  # fmt: skip
        said = "; ".join(f"{md(c['run'])} {outcome[c['outcome']]}" for c in checks)
        lines.append(
            f"- Recheck: {len(checks)} cached evaluation(s), picked at random, evaluated again "
            f"from their checkpoints (relative tolerance {RECHECK_RTOL:g}): {said}."
        )
    return lines


def _rule_note(spec: Prereg) -> str:
    """The correction, the hypotheses with a rule of their own, and the reason for "mean"."""
    notes = []
    a, n = spec.analysis, len(spec.seeds)
    if n > 1 and any(
        h.comparison != "joint" and rule(spec, h) in ONE_SIDED for h in spec.hypotheses
    ):
        t = t_quantile(a.confidence, n - 1)
        notes.append(f"one-sided {a.confidence:.0%} bounds: mean +- {t:.2f} x sd / sqrt(n)")
    if spec.analysis.correction == "holm":
        notes.append("Holm correction across the arms of each hypothesis")
    own = [f"{md(h.id)}: {h.decision}" for h in spec.hypotheses if h.decision]
    if own:
        notes.append("own rules " + ", ".join(own))
    if spec.analysis.decision_reason:
        notes.append(f"why: {md(spec.analysis.decision_reason)}")
    return f" ({'; '.join(notes)})" if notes else ""


def _lock_lines(lock_record: dict[str, Any], records: Sequence[dict[str, Any]]) -> list[str]:
    """What the lock covers, and which lock record the finished runs were trained under."""
    lines = []
    if lock_record.get("legacy") or "study_sha256" not in lock_record:
        lines.append(
            "- Legacy lock: it predates the lock hash chain and the config-group hashing (it "
            "hashes the study file only; runs trained before the chain recorded no study hash)."
        )
    else:
        configs = lock_record.get("configs") or {}
        lines.append(
            f"- Study sha256 {md(lock_record['study_sha256'], code=True)}: the file and the "
            f"{len(configs)} config files its runs load ({', '.join(map(md, configs))}); the "
            "lock's hash chain verifies."
        )
    head = (lock_record.get("history") or [{"n": 0}])[-1]["n"]
    counts: dict[tuple[int, bool], int] = {}
    for r in records:
        if r.get("trained_under") is not None:
            key = (r["trained_under"]["n"], r["trained_under"]["recorded"])
            counts[key] = counts.get(key, 0) + 1
    parts = []
    for (n, recorded), count in sorted(counts.items()):
        where = "the current lock" if n == head else f"lock record #{n} (amended since)"
        note = "" if recorded else ", no recorded study hash (legacy)"
        parts.append(f"{count} under {where}{note}")
    if parts:
        lines.append(f"- Trained under: {'; '.join(parts)}.")
    return lines


def _history_lines(history: Sequence[dict[str, Any]]) -> list[str]:
    """The lock history, oldest first: every lock, re-lock and amendment (time, reason, hashes)."""
    if not history:
        return []
    lines = ["## Lock history", ""]
    lines += ["| # | locked at | action | reason | study sha256 before | study sha256 after |"]
    lines += ["|---|---|---|---|---|---|"]
    before = None
    for r in history:
        action = {"lock": "lock", "relock": "re-lock (--force)", "amend": "**amendment**"}
        what = action[r["action"]] + (" (legacy)" if r["legacy"] else "")
        reason = md(r["reason"]) if r.get("reason") else ("none recorded" if r["n"] else "")
        locked_at = md(r["locked_at"]) if r.get("locked_at") else "unknown"
        lines.append(
            f"| {r['n']} | {locked_at} | {what} | {reason} | "
            f"{md(before, code=True) if before else ''} | {md(r['study_sha256'], code=True)} |"
        )
        before = r["study_sha256"]
    amended = [r for r in history if r["action"] == "amend"]
    lines += ["", f"Amendments (re-locks with a reason on record): {len(amended)}."]
    if any(r["legacy"] for r in history):
        lines.append(
            "Legacy records predate the hash chain and the config-group hashing: their hash is "
            "the study file's sha256 alone, verified the old way (against the file), and a "
            "replaced legacy lock is known only by the hash its successor recorded."
        )
    return lines + [""]


def _interim_banner(finished: int, registered: int) -> str:
    return (
        f"> **Interim look: {finished} of {registered} registered runs "
        "finished. Not a verdict**: the decision rules hold for the registered seeds only, "
        "and stopping on what an interim look shows is optional stopping."
    )


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# A run's fields left out of results.json: where it lies and how its cache is keyed.
_NOT_RESULTS = ("run_dir", "checkpoint", "analysis_key", "eval_sha256", "source", "host")


def analyze(
    path: Path | str,
    out_dir: Path | str | None = None,
    report_dir: Path | str | None = None,
    *,
    evaluate: bool = True,
    interim: bool = False,
    jobs: int = 1,
    recheck: int = 1,
) -> Path:
    """Check the lock, the study hash every finished run was trained under and each run's
    identity, evaluate the runs, recheck cached evaluations, write the report; returns
    report.md.

    ``out_dir`` is the study directory given to ``run``; the report goes to ``report_dir``
    (default ``<out_dir>/report``): report.md, results.json, hit_rate_vs_perplexity.png,
    hit_rate_vs_capacity.png and, when it replays batches, misses_vs_batch.png. A study with
    unfinished runs is refused unless ``interim``: then the report says on its first line that
    it is an interim look, not a verdict, and the missing runs make hypotheses "incomplete".
    ``jobs`` > 1 evaluates the runs in that many processes first (each with its share of the
    cores). ``recheck`` runs of each arm whose numbers came from the cache are picked at
    random and evaluated again, and a difference beyond float noise is refused
    (``analysis.recheck``; 0: none). With ``evaluate=False`` nothing is evaluated, the recheck
    included (cached runs only).
    """
    if recheck < 0:
        raise MoestackError(f"--recheck {recheck}: give 0 (no recheck) or more runs per arm")
    record, spec, root, grid, trained, identities, code = checked_study(path, out_dir, jobs)
    unfinished = [r.name for r in grid if not is_finished(r.run_dir)]
    if unfinished and not interim:
        raise MoestackError(
            f"{spec.study}: {len(unfinished)} of {len(grid)} registered runs are not finished "
            f"({', '.join(unfinished[:3])}{', ...' if len(unfinished) > 3 else ''}); analyse "
            f"once all are done (`moestack prereg status {path}`), or pass --interim for a "
            "report labelled as an interim look (stopping on what it shows is optional stopping)"
        )
    report = Path(report_dir) if report_dir else root / "report"
    report.mkdir(parents=True, exist_ok=True)
    fresh = set(evaluate_in_parallel(path, root, jobs)) if evaluate and jobs > 1 else set()
    records = collect(spec, root, evaluate=evaluate, identities=identities)
    for r in records:
        r["trained_under"] = trained.get(r["run"])
        if r["run"] in fresh:
            r["source"] = "evaluated"
    checks = recheck_runs(spec, records, identities, recheck) if evaluate else None
    figures = plot_all(spec, records, report)
    interim_counts = (
        {"finished": len(grid) - len(unfinished), "registered": len(grid)} if unfinished else None
    )
    results, text = decide_and_report(
        spec, record, records, figures=figures, checks=checks, interim=interim_counts, code=code
    )
    (report / "results.json").write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    md_file = report / "report.md"
    md_file.write_text(text)
    log.info("report: %s", md_file)
    return md_file


def decide_and_report(
    spec: Prereg,
    lock_record: dict[str, Any],
    records: Sequence[dict[str, Any]],
    *,
    figures: Sequence[str] = (),
    checks: Sequence[dict[str, Any]] | None = None,
    interim: dict[str, int] | None = None,
    code: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """The step of ``analyze`` after the runs are evaluated: from the runs' records (``collect``)
    the verdicts and every table, as results.json's content (before ``_json_safe``) and the
    text of report.md. ``lock_record`` is the verified lock; ``checks`` the recheck's
    outcome; ``interim`` the counts of finished and registered runs when some are unfinished
    (the report then opens with the interim banner); ``code`` the code that trained the
    runs (``sources.check_study_code``; None: not shown)."""
    hypotheses = evaluate_hypotheses(spec, records)
    code = with_evaluations(code, records) if code is not None else None
    results = {
        "study": spec.study,
        "interim": interim,
        "lock": {k: v for k, v in lock_record.items() if k != "path"},
        "analysis": dataclasses.asdict(spec.analysis),
        "analyzed_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hypotheses": hypotheses,
        "controls": control_rows(spec, records),
        "misses": misses_rows(spec, records),
        "steered": steered_rows(spec, records),
        "recheck": checks,
        "analysis_code": analysis_code(lock_record),
        "code": code,
        "runs": [{k: v for k, v in r.items() if k not in _NOT_RESULTS} for r in records],
    }
    text = render_markdown(spec, lock_record, records, hypotheses, figures, checks, code)
    if interim:
        text = _interim_banner(interim["finished"], interim["registered"]) + "\n\n" + text
    return results, text
