"""The report: markdown tables, the figures, results.json, and ``analyze``."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moestack.errors import MoestackError
from moestack.prereg.analysis import (
    RECHECK_RTOL,
    collect,
    control_rows,
    evaluate_hypotheses,
    misses_rows,
    steered_rows,
    tested_against,
)
from moestack.prereg.analysis import recheck as recheck_runs
from moestack.prereg.decision import ONE_SIDED, rule
from moestack.prereg.evaluate import checked_study, evaluate_in_parallel
from moestack.prereg.hashing import changed_files, code_files
from moestack.prereg.plain import is_control
from moestack.prereg.runner import is_finished
from moestack.prereg.sources import render_lines as render_code_lines
from moestack.prereg.sources import with_evaluations
from moestack.prereg.spec import Prereg
from moestack.prereg.stats import t_quantile

log = logging.getLogger(__name__)


# Markdown's structure characters, backslash-escaped wherever a quoted string holds them.
_ESCAPE = frozenset("\\`*_[]<>|~$&#")
_SPACES = frozenset("\n\r\t\v\f\x85\u2028\u2029")
_LINE_START = re.compile(r"^(?:([-+=])|(\d+)([.)]))")  # a list item, a setext underline


def md(value: Any, *, code: bool = False) -> str:
    """``value`` (any string the study file or the lock holds) as Markdown text that shows it
    and cannot make structure, wherever the report quotes it: in a line or a table cell.

    Newlines, tabs and other line breaks become spaces and other control characters (NUL,
    ANSI escapes, bidirectional controls) U+FFFD, so nothing starts a line; the ends are
    stripped (no indented code block). Markdown's punctuation (backslash, backticks, ``*``,
    ``_``, ``[``, ``]``, ``<``, ``>``, ``|``, ``~``, ``$``, ``&``, ``#``) is backslash-escaped,
    but for ``_`` between letters or digits (``top_k``: no emphasis), and so is a leading
    ``-``, ``+``, ``=`` or ``1.``. ``code``: a code span instead, its fence longer than any
    backtick run inside and ``|`` escaped (as a table cell needs even there)."""
    text = "".join(
        " " if ch in _SPACES else ("\ufffd" if is_control(ch) else ch) for ch in str(value)
    ).strip()
    if code:
        if not text:
            return ""
        text = text.replace("|", "\\|")
        fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
        pad = " " if text.startswith("`") or text.endswith("`") else ""
        return f"{fence}{pad}{text}{pad}{fence}"
    out = []
    for i, ch in enumerate(text):
        inside_word = 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum()
        out.append("\\" + ch if ch in _ESCAPE and not (ch == "_" and inside_word) else ch)
    return _LINE_START.sub(lambda m: f"\\{m[1]}" if m[1] else f"{m[2]}\\{m[3]}", "".join(out), 1)


def _fmt(value: Any, digits: int = 4, pct: bool = False, pp: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if pct:
        return f"{100 * value:+.1f}%"
    if pp:  # a distance between two percentages: percentage points
        return f"{100 * value:+.1f} pp"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _verdict(ok: bool | None, inconclusive: bool = False) -> str:
    if ok is None:
        return "inconclusive" if inconclusive else "n/a"
    return "pass" if ok else "fail"


def _claim(hyp: dict[str, Any]) -> str:
    if hyp["comparison"] == "joint":
        need = "any arm" if hyp["require"] == "any" else "every arm"
        return f"one arm passes {' and '.join(map(md, hyp['of']))} together ({need})"
    metric = md(hyp["metric"])
    need = "any arm passing suffices" if hyp["require"] == "any" else "every arm must pass"
    if hyp["comparison"] == "gap_fraction":
        control, f = md(hyp["control"]), _fmt(hyp["threshold"])
        return (
            f"{metric}: (arm / baseline - 1) - {f} x ({control} / baseline - 1) {hyp['op']} 0, "
            f"i.e. the arm's change {hyp['op']} {f} of the baseline-to-{control} gap; {need}"
        )
    lhs = {
        "relative_change": f"{metric} (arm / baseline - 1)",
        "difference": f"{metric} (arm - baseline)",
        "value": metric,
    }[hyp["comparison"]]
    pct = hyp["comparison"] == "relative_change"
    return f"{lhs} {hyp['op']} {_fmt(hyp['threshold'], pct=pct)}; {need}"


def _relative(h: dict[str, Any]) -> bool:
    """Whether a hypothesis's estimates are relative changes (shown in percent)."""
    return h["comparison"] in ("relative_change", "gap_fraction")


def _tested(h: dict[str, Any]) -> str:
    """The threshold column: the op and what the estimate is tested against."""
    return f"{h['op']} {_fmt(tested_against(_Hyp(h)), pct=_relative(h))}"


class _Hyp:
    """A hypothesis's dict (results.json) seen as its fields."""

    def __init__(self, h: dict[str, Any]) -> None:
        self.comparison, self.threshold = h["comparison"], h["threshold"]


def _gap_lines(h: dict[str, Any]) -> list[str]:
    """Under a gap_fraction table: each arm's change, the control's gap (with its interval),
    their ratio; where the gap is not clearly above 0 the ratio is n/a with its reason, and a
    sentence says how the hypothesis's test reads then."""
    if h["comparison"] != "gap_fraction":
        return []
    lines, unclear = [], False
    for row in h["rows"]:
        if row.get("gap") is None:
            continue
        ci = row.get("gap_ci") or [None, None]
        if row.get("fraction") is None:
            unclear = True
            share = f"fraction of the gap n/a ({row.get('fraction_note') or 'no gap'})"
        else:
            share = f"{_fmt(row['fraction'], 3)} of the gap"
        lines.append(
            f"- {md(row['arm'])}: perplexity {_fmt(row['change'], pct=True)} against a "
            f"baseline-to-{md(h['control'])} gap of {_fmt(row['gap'], pct=True)} "
            f"[{_fmt(ci[0], pct=True)}, {_fmt(ci[1], pct=True)}]: {share}"
        )
    if unclear:
        lines += ["", _unclear_gap(h)]
    return [*lines, ""] if lines else []


def _unclear_gap(h: dict[str, Any]) -> str:
    """How a gap_fraction hypothesis reads where its gap is not clearly above 0."""
    control, f = md(h["control"]), _fmt(h["threshold"])
    return (
        f"Where the fraction is n/a, the ratio would flip sign or have no bound; read "
        f"{md(h['id'])} from its test, which is unchanged: per seed, the arm's change must be at "
        f"most {f} x {control}'s change. With {control} no worse than the baseline that allows "
        f"no rise at all (the arm must improve on the baseline by {f} of {control}'s "
        f"improvement); with a gap whose interval includes 0 it allows at most {f} x a gap "
        "that may be nil."
    )


def _nonfinite_lines(h: dict[str, Any]) -> list[str]:
    """Under a hypothesis's table: the rows a non-finite metric decided, and how."""
    lines = []
    for row in h["rows"]:
        bad = row.get("nonfinite")
        if not bad:
            continue
        runs = ", ".join(f"{md(x['arm'])} seed {x['seed']} ({x['value']})" for x in bad)
        if any(x["role"] == "arm" for x in bad):
            what = "counted as a fail (a broken run of the arm never passes)"
        else:
            what = "no estimate (the comparison with a broken baseline or control run is undefined)"
        lines.append(f"- {md(row['arm'])}: {md(h['metric'])} is not finite in {runs}: {what}.")
    return [*lines, ""] if lines else []


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
        lines += [f"## {md(h['id'])}: {h['verdict']}", "", md(h["statement"]), ""]
        lines += [f"Test: {_claim(h)}.", ""]
        if h["comparison"] == "joint":
            lines += _joint_table(h)
        else:
            lines += _arm_table(h) + _nonfinite_lines(h)
        lines += _gap_lines(h)
    lines += _control_lines(spec, records)
    lines += _misses_lines(misses_rows(spec, records))
    lines += _steered_lines(steered_rows(spec, records))
    lines += _runs_table(spec, records)
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


def _joint_table(h: dict[str, Any]) -> list[str]:
    lines = ["| arm | " + " | ".join(map(md, h["of"])) + " | min margin | pass |"]
    lines += ["|---|" + "---|" * len(h["of"]) + "---|---|"]
    for row in h["rows"]:
        states = row.get("part_states") or {}
        parts = " | ".join(
            _verdict(row["parts"][ref], states.get(ref) == "inconclusive") for ref in h["of"]
        )
        ok = _verdict(row["pass"], bool(row.get("inconclusive")))
        lines.append(f"| {md(row['arm'])} | {parts} | {_fmt(row['margin'])} | {ok} |")
    return lines + [""]


def _arm_table(h: dict[str, Any]) -> list[str]:
    if any("bound" in row for row in h["rows"]):
        return _one_sided_table(h)
    pct = _relative(h)
    lines = [
        "| arm | seeds | baseline mean | arm mean | estimate | CI | threshold | margin "
        "| CI says | pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in h["rows"]:
        ci = row.get("ci", [None, None])
        lines.append(
            f"| {md(row['arm'])} | {row['n']} | {_fmt(row.get('baseline_mean'))} | "
            f"{_fmt(row.get('arm_mean'))} | {_fmt(row['estimate'], pct=pct)} | "
            f"[{_fmt(ci[0], pct=pct)}, {_fmt(ci[1], pct=pct)}] | "
            f"{_tested(h)} | {_fmt(row['margin'], pp=pct)} | "
            f"{row.get('ci_verdict', 'n/a')} | **{_verdict(row['pass'])}** |"
        )
    return lines + [""]


def _one_sided_table(h: dict[str, Any]) -> list[str]:
    """The table of a one-sided rule: the bound on the failing side decides pass, the other
    bound fail, neither inconclusive; p-values of both tests (Holm-adjusted when stated)."""
    pct = _relative(h)
    side = ("upper", "lower") if h["op"] == "<=" else ("lower", "upper")
    lines = [
        f"| arm | seeds | estimate | one-sided {side[0]} bound | {side[1]} bound | threshold "
        "| p (pass test) | p (fail test) | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in h["rows"]:
        adj = row.get("p_adjusted") or {}
        raw = row.get("p") or {}

        def p(key: str, raw: dict[str, Any] = raw, adj: dict[str, Any] = adj) -> str:
            if key not in raw:
                return "n/a"
            return f"{raw[key]:.3g}" + (f" (Holm {adj[key]:.3g})" if key in adj else "")

        lines.append(
            f"| {md(row['arm'])} | {row['n']} | {_fmt(row['estimate'], pct=pct)} | "
            f"{_fmt(row.get('bound'), pct=pct)} | {_fmt(row.get('other_bound'), pct=pct)} | "
            f"{_tested(h)} | {p('pass')} | {p('fail')} | "
            f"**{_verdict(row['pass'], bool(row.get('inconclusive')))}** |"
        )
    return lines + [""]


def _control_lines(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[str]:
    """The controls: each one's perplexity change against the baseline (the gap the experts
    close), and every other arm's change in units of that gap beside its change in percent
    (n/a, with the reason, where the gap is not clearly above 0)."""
    rows = control_rows(spec, records)
    if not rows:
        return []
    lines = ["## Controls", ""]
    for row in rows:
        ci = row["ci"]
        lines += [
            f"{md(row['control'])} ({md(' '.join(spec.arms[row['control']]))}): perplexity "
            f"{_fmt(row['gap'], pct=True)} against the baseline [{_fmt(ci[0], pct=True)}, "
            f"{_fmt(ci[1], pct=True)}] over {row['n']} seeds.",
            "",
            "| arm | seeds | perplexity change | fraction of the gap |",
            "|---|---|---|---|",
        ]
        for arm, a in row["arms"].items():
            lines.append(
                f"| {md(arm)} | {a['n']} | {_fmt(a['change'], pct=True)} | "
                f"{_fmt(a['fraction'], 3)} |"
            )
        lines.append("")
        if row.get("fraction_note"):
            lines += [f"Fraction of the gap n/a: {row['fraction_note']}.", ""]
        odd = [f"{md(arm)}: {a['fraction_note']}" for arm, a in row["arms"].items()
               if a.get("fraction_note")]  # fmt: skip
        if odd:
            lines += [f"Fraction of the gap n/a for {'; '.join(odd)}.", ""]
    left = rows[0].get("nonfinite") or []
    if left:
        runs = ", ".join(f"{md(x['arm'])} seed {x['seed']} ({x['value']})" for x in left)
        lines += [f"Left out of these means (perplexity not finite): {runs}.", ""]
    return lines


def _misses_cell(cell: dict[str, Any], seeds: int) -> str:
    """One batch's seed mean +- sd (n when fewer runs than the row's hold a finite value)."""
    if cell["mean"] is None:
        return "n/a"
    text = _fmt(cell["mean"]) + (f" +- {_fmt(cell['sd'], 2)}" if cell["sd"] is not None else "")
    return text + (f" (n = {cell['n']})" if cell["n"] != seeds else "")


def _misses_lines(table: dict[str, Any]) -> list[str]:
    """The absolute LRU misses per token, per arm and capacity, a column per serving batch
    (``analysis.misses_rows``): the figures behind the relative hypothesis tables."""
    if not table["rows"]:
        return []
    batches = table["batches"]
    lines = [
        "## LRU misses per token",
        "",
        "Absolute LRU misses per token (summed over layers), beside the relative changes the "
        "hypotheses test: the seed mean +- the sample sd over each arm's finished runs, per "
        "cache capacity (slots per layer) and serving batch (sequences served together; 1: "
        "one stream).",
        "",
        "| arm | capacity | seeds | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|---|---|" + "---|" * len(batches),
    ]
    for r in table["rows"]:
        cells = " | ".join(_misses_cell(c, r["seeds"]) for c in r["cells"])
        lines.append(f"| {md(r['arm'])} | {r['capacity']} | {r['seeds']} | {cells} |")
    lines.append("")
    odd = [f"{md(r['arm'])} capacity {r['capacity']} batch {c['batch']}: {c['nonfinite']}"
           for r in table["rows"] for c in r["cells"] if c["nonfinite"]]  # fmt: skip
    if odd:
        lines += [f"Non-finite values left out (runs): {'; '.join(odd)}.", ""]
    if table["skipped"]:
        skipped = "; ".join(f"{md(s['arm'])} ({s['why']})" for s in table["skipped"])
        lines += [f"Not shown: {skipped}.", ""]
    return lines


def _steered_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The steered evaluations: each arm's misses and perplexity with its tokens steered
    toward the cache, against itself and against the baseline, both unsteered."""
    if not rows:
        return []
    lines = [
        "## Steered routing",
        "",
        "Each run evaluated again with its tokens steered one at a time toward an LRU cache "
        "(rerouteT: a non-resident pick goes to a resident expert scoring at least (1 - T) of "
        "the token's best; biasB: B added to the resident experts' scores). Seed means; "
        "changes paired by seed.",
        "",
        "| arm | steering | capacity | seeds | misses per token | vs unsteered | vs baseline "
        "unsteered | perplexity | vs unsteered | vs baseline unsteered |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {md(r['arm'])} | {r['steering']} | {r['capacity']} | {r['n']} | "
            f"{_fmt(r['misses_per_token'])} | {_fmt(r['misses_vs_unsteered'], pct=True)} | "
            f"{_fmt(r['misses_vs_baseline'], pct=True)} | {_fmt(r['perplexity'])} | "
            f"{_fmt(r['perplexity_vs_unsteered'], pct=True)} | "
            f"{_fmt(r['perplexity_vs_baseline'], pct=True)} |"
        )
    return lines + [""]


def _runs_table(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[str]:
    a = spec.analysis
    metrics = ["perplexity"] + [f"{p}/cap{c}/hit_rate" for p in a.policies for c in a.capacities]
    lines = ["## Per-run results", "", "| run | status | " + " | ".join(metrics) + " |"]
    lines.append("|---|---|" + "---|" * len(metrics))
    for r in records:
        vals = [_fmt(r.get("metrics", {}).get(m)) for m in metrics]
        lines.append(f"| {md(r['run'])} | {r['status']} | " + " | ".join(vals) + " |")
    return lines + [""]


def _arm_colors(arms: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {arm: cmap(i % 10) for i, arm in enumerate(arms)}


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _finish_panel(ax: Any, first: bool, xlabel: str, ylabel: str, title: str) -> None:
    """Label one panel; the first of a figure carries the legend (one colour per arm)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if first:
        ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    return path


def _spread_bars(
    mean: Sequence[float], low: Sequence[float], high: Sequence[float]
) -> list[list[float]]:
    """matplotlib's asymmetric ``yerr`` for a min..max bar about each mean, clamped at 0: the
    mean of equal values can round past them (0.1 x 3 / 3)."""
    below = [max(0.0, m - lo) for m, lo in zip(mean, low, strict=True)]
    above = [max(0.0, hi - m) for m, hi in zip(mean, high, strict=True)]
    return [below, above]


def plot_scatter(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Hit rate (each policy) vs validation perplexity: one point per run, one colour per arm."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        return None
    cap = a.scatter_capacity or a.capacities[min(1, len(a.capacities) - 1)]
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(a.policies), 3.8)
    for i, policy in enumerate(a.policies):
        ax = fig.add_subplot(1, len(a.policies), i + 1)
        for arm in spec.arms:
            pts = [r for r in done if r["arm"] == arm]
            if pts:
                ax.scatter(
                    [r["metrics"]["perplexity"] for r in pts],
                    [r["metrics"][f"{policy}/cap{cap}/hit_rate"] for r in pts],
                    color=colors[arm],
                    label=arm,
                    s=36,
                )
        base = [r["metrics"]["perplexity"] for r in done if r["arm"] == spec.baseline]
        if base:
            budget = sum(base) / len(base) * 1.01
            ax.axvline(budget, color="grey", ls="--", lw=1, label="baseline +1% ppl")
        title = f"{policy} cache, {cap} slots/layer"
        _finish_panel(
            ax, i == 0, "validation perplexity", f"{policy} hit rate, capacity {cap}", title
        )
    return _save(fig, out / "hit_rate_vs_perplexity.png")


def plot_capacity(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Hit rate vs capacity per policy: the mean over seeds of each arm, a bar for min..max."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    if not done:
        return None
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(a.policies), 3.8)
    for i, policy in enumerate(a.policies):
        ax = fig.add_subplot(1, len(a.policies), i + 1)
        for arm in spec.arms:
            pts = [r for r in done if r["arm"] == arm]
            if not pts:
                continue
            ys = [[r["metrics"][f"{policy}/cap{c}/hit_rate"] for r in pts] for c in a.capacities]
            mean = [sum(y) / len(y) for y in ys]
            yerr = _spread_bars(mean, [min(y) for y in ys], [max(y) for y in ys])
            ax.errorbar(
                a.capacities, mean, yerr=yerr, color=colors[arm], marker="o", capsize=3, label=arm
            )
        ax.set_xticks(list(a.capacities))
        _finish_panel(ax, i == 0, "cache capacity (experts per layer)", "hit rate", policy)
    return _save(fig, out / "hit_rate_vs_capacity.png")


def batch_curves(
    spec: Prereg, records: Sequence[dict[str, Any]], policy: str = "lru"
) -> dict[int, dict[str, dict[str, list[float]]]]:
    """Misses per token against the serving batch (``analysis.serve_batches``), per capacity
    and arm: {capacity: {arm: {"batch", "mean", "min", "max"}}} over the arm's finished seeds.
    Batch 1 is the one-stream replay (``<policy>/cap<c>/misses_per_token``)."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    batches = sorted(set(a.serve_batches) | {1})

    def metric(cap: int, batch: int) -> str:
        at = f"{policy}/cap{cap}" + (f"/b{batch}" if batch > 1 else "")
        return f"{at}/misses_per_token"

    curves: dict[int, dict[str, dict[str, list[float]]]] = {}
    for cap in a.capacities:
        for arm in spec.arms:
            runs = [r["metrics"] for r in done if r["arm"] == arm]
            runs = [m for m in runs if all(metric(cap, b) in m for b in batches)]
            if not runs:
                continue
            values = [[m[metric(cap, b)] for m in runs] for b in batches]
            curves.setdefault(cap, {})[arm] = {
                "batch": [float(b) for b in batches],
                "mean": [sum(v) / len(v) for v in values],
                "min": [min(v) for v in values],
                "max": [max(v) for v in values],
            }
    return curves


def plot_batches(
    spec: Prereg, records: Sequence[dict[str, Any]], out: Path, policy: str = "lru"
) -> Path | None:
    """Misses per token against the serving batch, a panel per capacity: whether an arm's
    gain at one stream survives batched serving (a batch loads the union of its sequences'
    experts). None when the study replays one stream only or has no finished run."""
    if len(set(spec.analysis.serve_batches) | {1}) < 2 or policy not in spec.analysis.policies:
        return None
    curves = batch_curves(spec, records, policy)
    if not curves:
        return None
    colors = _arm_colors(list(spec.arms))
    fig = _figure(4.2 * len(curves), 3.8)
    for i, (cap, arms) in enumerate(curves.items()):
        ax = fig.add_subplot(1, len(curves), i + 1)
        for arm, c in arms.items():
            yerr = _spread_bars(c["mean"], c["min"], c["max"])
            ax.errorbar(
                c["batch"],
                c["mean"],
                yerr=yerr,
                color=colors[arm],
                marker="o",
                capsize=3,
                label=arm,
            )
        batches = next(iter(arms.values()))["batch"]
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(int(b)) for b in batches])
        title = f"{policy} cache, {cap} slots/layer"
        xlabel = "sequences served together (batch)"
        _finish_panel(ax, i == 0, xlabel, f"{policy} misses per token", title)
    return _save(fig, out / "misses_vs_batch.png")


def plot_all(spec: Prereg, records: Sequence[dict[str, Any]], out: Path) -> list[str]:
    """Draw every figure of the report into ``out``; the file names of those drawn."""
    drawn = (
        plot_scatter(spec, records, out),
        plot_capacity(spec, records, out),
        plot_batches(spec, records, out),
    )
    return [p.name for p in drawn if p is not None]


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
