"""The report: markdown tables, the two figures, results.json, and ``analyze``."""

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
from moestack.prereg.analysis import collect, evaluate_hypotheses, t_quantile
from moestack.prereg.decision import ONE_SIDED, rule
from moestack.prereg.evaluate import checked_study, evaluate_in_parallel
from moestack.prereg.power import power_lines
from moestack.prereg.runner import is_finished
from moestack.prereg.spec import Prereg

log = logging.getLogger(__name__)


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
        return f"one arm passes {' and '.join(hyp['of'])} together ({need})"
    lhs = {
        "relative_change": f"{hyp['metric']} (arm / baseline - 1)",
        "difference": f"{hyp['metric']} (arm - baseline)",
        "value": hyp["metric"],
    }[hyp["comparison"]]
    pct = hyp["comparison"] == "relative_change"
    need = "any arm passing suffices" if hyp["require"] == "any" else "every arm must pass"
    return f"{lhs} {hyp['op']} {_fmt(hyp['threshold'], pct=pct)}; {need}"


def render_markdown(
    spec: Prereg,
    lock_record: dict[str, Any],
    records: Sequence[dict[str, Any]],
    hypotheses: Sequence[dict[str, Any]],
    figures: Sequence[str],
) -> str:
    """The report: provenance, the verdicts, one table per hypothesis, the runs, the figures."""
    lines = _provenance(spec, lock_record, records)
    lines += ["## Verdicts", "", "| id | hypothesis | verdict |", "|---|---|---|"]
    lines += [f"| {h['id']} | {h['statement']} | **{h['verdict']}** |" for h in hypotheses]
    lines.append("")
    for h in hypotheses:
        lines += [f"## {h['id']}: {h['verdict']}", "", h["statement"], ""]
        lines += [f"Test: {_claim(h)}.", ""]
        lines += _joint_table(h) if h["comparison"] == "joint" else _arm_table(h)
    lines += _runs_table(spec, records)
    if figures:
        lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    return "\n".join(lines)


def _provenance(
    spec: Prereg, lock_record: dict[str, Any], records: Sequence[dict[str, Any]]
) -> list[str]:
    """The report's head: the lock, the runs and the evaluation, then the runs' overrides."""
    a = spec.analysis
    done = [r for r in records if r.get("status") == "done"]
    lines = [
        f"# Pre-registered study: {spec.title}",
        "",
        f"- Study `{spec.study}`, file `{spec.path.name}`, sha256 `{lock_record['sha256']}`",
        f"- Locked at {lock_record.get('locked_at')} (git commit "
        f"`{lock_record.get('git_commit')}`); the file matches its lock.",
        *_lock_lines(lock_record, records),
        f"- Runs: {len(done)} of {len(records)} finished and evaluated "
        f"({len(spec.arms)} arms x {len(spec.seeds)} seeds).",
        f"- Evaluation: final checkpoint, {a.eval_batches} validation batches; cache replay "
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
        lines += [f"Question: {spec.question}", ""]
    lines += power_lines(spec)
    lines += _history_lines(lock_record.get("history") or [])
    lines += ["## Runs as registered", "", f"Shared: `{' '.join(spec.base_overrides)}`", ""]
    lines += ["| arm | overrides |", "|---|---|"]
    lines += [f"| {arm} | `{' '.join(ov)}` |" for arm, ov in spec.arms.items()]
    lines += ["", f"Seeds: {', '.join(map(str, spec.seeds))}; baseline: {spec.baseline}.", ""]
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
    own = [f"{h.id}: {h.decision}" for h in spec.hypotheses if h.decision]
    if own:
        notes.append("own rules " + ", ".join(own))
    if spec.analysis.decision_reason:
        notes.append(f"why: {spec.analysis.decision_reason}")
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
            f"- Study sha256 `{lock_record['study_sha256']}`: the file and the {len(configs)} "
            f"config files its runs load ({', '.join(configs)}); the lock's hash chain verifies."
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
        reason = r.get("reason") or ("none recorded" if r["n"] else "")
        lines.append(
            f"| {r['n']} | {r.get('locked_at') or 'unknown'} | {what} | {reason} | "
            f"{f'`{before}`' if before else ''} | `{r['study_sha256']}` |"
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
    lines = ["| arm | " + " | ".join(h["of"]) + " | min margin | pass |"]
    lines += ["|---|" + "---|" * len(h["of"]) + "---|---|"]
    for row in h["rows"]:
        states = row.get("part_states") or {}
        parts = " | ".join(
            _verdict(row["parts"][ref], states.get(ref) == "inconclusive") for ref in h["of"]
        )
        ok = _verdict(row["pass"], bool(row.get("inconclusive")))
        lines.append(f"| {row['arm']} | {parts} | {_fmt(row['margin'])} | {ok} |")
    return lines + [""]


def _arm_table(h: dict[str, Any]) -> list[str]:
    if any("bound" in row for row in h["rows"]):
        return _one_sided_table(h)
    pct = h["comparison"] == "relative_change"
    lines = [
        "| arm | seeds | baseline mean | arm mean | estimate | CI | threshold | margin "
        "| CI says | pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in h["rows"]:
        ci = row.get("ci", [None, None])
        lines.append(
            f"| {row['arm']} | {row['n']} | {_fmt(row.get('baseline_mean'))} | "
            f"{_fmt(row.get('arm_mean'))} | {_fmt(row['estimate'], pct=pct)} | "
            f"[{_fmt(ci[0], pct=pct)}, {_fmt(ci[1], pct=pct)}] | "
            f"{h['op']} {_fmt(h['threshold'], pct=pct)} | {_fmt(row['margin'], pp=pct)} | "
            f"{row.get('ci_verdict', 'n/a')} | **{_verdict(row['pass'])}** |"
        )
    return lines + [""]


def _one_sided_table(h: dict[str, Any]) -> list[str]:
    """The table of a one-sided rule: the bound on the failing side decides pass, the other
    bound fail, neither inconclusive; p-values of both tests (Holm-adjusted when stated)."""
    pct = h["comparison"] == "relative_change"
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
            f"| {row['arm']} | {row['n']} | {_fmt(row['estimate'], pct=pct)} | "
            f"{_fmt(row.get('bound'), pct=pct)} | {_fmt(row.get('other_bound'), pct=pct)} | "
            f"{h['op']} {_fmt(h['threshold'], pct=pct)} | {p('pass')} | {p('fail')} | "
            f"**{_verdict(row['pass'], bool(row.get('inconclusive')))}** |"
        )
    return lines + [""]


def _runs_table(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[str]:
    a = spec.analysis
    metrics = ["perplexity"] + [f"{p}/cap{c}/hit_rate" for p in a.policies for c in a.capacities]
    lines = ["## Per-run results", "", "| run | status | " + " | ".join(metrics) + " |"]
    lines.append("|---|---|" + "---|" * len(metrics))
    for r in records:
        vals = [_fmt(r.get("metrics", {}).get(m)) for m in metrics]
        lines.append(f"| {r['run']} | {r['status']} | " + " | ".join(vals) + " |")
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
        ax.set_xlabel("validation perplexity")
        ax.set_ylabel(f"{policy} hit rate, capacity {cap}")
        ax.set_title(f"{policy} cache, {cap} slots/layer")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "hit_rate_vs_perplexity.png"
    fig.savefig(path)
    return path


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
            # clamped at 0: the mean of equal values can round past them (0.1 x 3 / 3)
            low = [max(0.0, m - min(y)) for m, y in zip(mean, ys, strict=True)]
            high = [max(0.0, max(y) - m) for m, y in zip(mean, ys, strict=True)]
            ax.errorbar(
                a.capacities,
                mean,
                yerr=[low, high],
                color=colors[arm],
                marker="o",
                capsize=3,
                label=arm,
            )
        ax.set_xlabel("cache capacity (experts per layer)")
        ax.set_ylabel("hit rate")
        ax.set_title(f"{policy}")
        ax.set_xticks(list(a.capacities))
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "hit_rate_vs_capacity.png"
    fig.savefig(path)
    return path


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def analyze(
    path: Path | str,
    out_dir: Path | str | None = None,
    report_dir: Path | str | None = None,
    *,
    evaluate: bool = True,
    interim: bool = False,
    jobs: int = 1,
) -> Path:
    """Check the lock and the study hash every finished run was trained under, evaluate the
    runs, write the report; returns report.md.

    ``out_dir`` is the study directory given to ``run``; the report goes to ``report_dir``
    (default ``<out_dir>/report``): report.md, results.json, hit_rate_vs_perplexity.png,
    hit_rate_vs_capacity.png. A study with unfinished runs is refused unless ``interim``:
    then the report says on its first line that it is an interim look, not a verdict, and
    the missing runs make hypotheses "incomplete". ``jobs`` > 1 evaluates the runs in that
    many processes first (each with its share of the cores).
    """
    record, spec, root, grid, trained = checked_study(path, out_dir, jobs)
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
    if evaluate and jobs > 1:
        evaluate_in_parallel(path, root, jobs)
    records = collect(spec, root, evaluate=evaluate)
    for r in records:
        r["trained_under"] = trained.get(r["run"])
    hypotheses = evaluate_hypotheses(spec, records)
    figures = [
        p.name
        for p in (plot_scatter(spec, records, report), plot_capacity(spec, records, report))
        if p is not None
    ]
    results = {
        "study": spec.study,
        "interim": {"finished": len(grid) - len(unfinished), "registered": len(grid)}
        if unfinished
        else None,
        "lock": {k: v for k, v in record.items() if k != "path"},
        "analysis": dataclasses.asdict(spec.analysis),
        "analyzed_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hypotheses": hypotheses,
        "runs": [
            {k: v for k, v in r.items() if k not in ("run_dir", "checkpoint", "analysis_key")}
            for r in records
        ],
    }
    (report / "results.json").write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    md = report / "report.md"
    text = render_markdown(spec, record, records, hypotheses, figures)
    if unfinished:
        banner = (
            f"> **Interim look: {len(grid) - len(unfinished)} of {len(grid)} registered runs "
            "finished. Not a verdict**: the decision rules hold for the registered seeds only, "
            "and stopping on what an interim look shows is optional stopping."
        )
        text = banner + "\n\n" + text
    md.write_text(text)
    log.info("report: %s", md)
    return md
