"""The report's tables: the test and table of each hypothesis (``hypothesis_lines``), and the
tables of the results beside them (``result_lines``: the controls, the LRU misses per token,
the steered evaluations, the per-run results). Every string from the study file is quoted
through ``md``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moestack.prereg.markdown import fmt, md, verdict_text
from moestack.prereg.spec import Prereg
from moestack.prereg.verdicts import control_rows, misses_rows, steered_rows, tested_against


def hypothesis_lines(h: dict[str, Any]) -> list[str]:
    """One hypothesis's section: its verdict, statement, test and table (results.json's
    dict ``h``), with the notes on non-finite runs and on the control's gap."""
    lines = [f"## {md(h['id'])}: {h['verdict']}", "", md(h["statement"]), ""]
    lines += [f"Test: {_claim(h)}.", ""]
    if h["comparison"] == "joint":
        lines += _joint_table(h)
    else:
        lines += _arm_table(h) + _nonfinite_lines(h)
    return lines + _gap_lines(h)


def result_lines(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[str]:
    """The tables after the hypotheses: the controls, the LRU misses per token, the steered
    evaluations and the per-run results."""
    lines = _control_lines(spec, records)
    lines += misses_lines(misses_rows(spec, records))
    lines += steered_lines(steered_rows(spec, records))
    return lines + _runs_table(spec, records)


def _claim(hyp: dict[str, Any]) -> str:
    if hyp["comparison"] == "joint":
        need = "any arm" if hyp["require"] == "any" else "every arm"
        return f"one arm passes {' and '.join(map(md, hyp['of']))} together ({need})"
    metric = md(hyp["metric"])
    need = "any arm passing suffices" if hyp["require"] == "any" else "every arm must pass"
    if hyp["comparison"] == "gap_fraction":
        control, f = md(hyp["control"]), fmt(hyp["threshold"])
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
    return f"{lhs} {hyp['op']} {fmt(hyp['threshold'], pct=pct)}; {need}"


def _relative(h: dict[str, Any]) -> bool:
    """Whether a hypothesis's estimates are relative changes (shown in percent)."""
    return h["comparison"] in ("relative_change", "gap_fraction")


def _tested(h: dict[str, Any]) -> str:
    """The threshold column: the op and what the estimate is tested against."""
    return f"{h['op']} {fmt(tested_against(_Hyp(h)), pct=_relative(h))}"


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
            share = f"{fmt(row['fraction'], 3)} of the gap"
        lines.append(
            f"- {md(row['arm'])}: perplexity {fmt(row['change'], pct=True)} against a "
            f"baseline-to-{md(h['control'])} gap of {fmt(row['gap'], pct=True)} "
            f"[{fmt(ci[0], pct=True)}, {fmt(ci[1], pct=True)}]: {share}"
        )
    if unclear:
        lines += ["", _unclear_gap(h)]
    return [*lines, ""] if lines else []


def _unclear_gap(h: dict[str, Any]) -> str:
    """How a gap_fraction hypothesis reads where its gap is not clearly above 0."""
    control, f = md(h["control"]), fmt(h["threshold"])
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


def _joint_table(h: dict[str, Any]) -> list[str]:
    lines = ["| arm | " + " | ".join(map(md, h["of"])) + " | min margin | pass |"]
    lines += ["|---|" + "---|" * len(h["of"]) + "---|---|"]
    for row in h["rows"]:
        states = row.get("part_states") or {}
        parts = " | ".join(
            verdict_text(row["parts"][ref], states.get(ref) == "inconclusive") for ref in h["of"]
        )
        ok = verdict_text(row["pass"], bool(row.get("inconclusive")))
        lines.append(f"| {md(row['arm'])} | {parts} | {fmt(row['margin'])} | {ok} |")
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
            f"| {md(row['arm'])} | {row['n']} | {fmt(row.get('baseline_mean'))} | "
            f"{fmt(row.get('arm_mean'))} | {fmt(row['estimate'], pct=pct)} | "
            f"[{fmt(ci[0], pct=pct)}, {fmt(ci[1], pct=pct)}] | "
            f"{_tested(h)} | {fmt(row['margin'], pp=pct)} | "
            f"{row.get('ci_verdict', 'n/a')} | **{verdict_text(row['pass'])}** |"
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
            f"| {md(row['arm'])} | {row['n']} | {fmt(row['estimate'], pct=pct)} | "
            f"{fmt(row.get('bound'), pct=pct)} | {fmt(row.get('other_bound'), pct=pct)} | "
            f"{_tested(h)} | {p('pass')} | {p('fail')} | "
            f"**{verdict_text(row['pass'], bool(row.get('inconclusive')))}** |"
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
            f"{fmt(row['gap'], pct=True)} against the baseline [{fmt(ci[0], pct=True)}, "
            f"{fmt(ci[1], pct=True)}] over {row['n']} seeds.",
            "",
            "| arm | seeds | perplexity change | fraction of the gap |",
            "|---|---|---|---|",
        ]
        for arm, a in row["arms"].items():
            lines.append(
                f"| {md(arm)} | {a['n']} | {fmt(a['change'], pct=True)} | {fmt(a['fraction'], 3)} |"
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
    text = fmt(cell["mean"]) + (f" +- {fmt(cell['sd'], 2)}" if cell["sd"] is not None else "")
    return text + (f" (n = {cell['n']})" if cell["n"] != seeds else "")


def misses_lines(table: dict[str, Any]) -> list[str]:
    """The absolute LRU misses per token, per arm and capacity, a column per serving batch
    (``verdicts.misses_rows``): the figures behind the relative hypothesis tables."""
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


def steered_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
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
            f"{fmt(r['misses_per_token'])} | {fmt(r['misses_vs_unsteered'], pct=True)} | "
            f"{fmt(r['misses_vs_baseline'], pct=True)} | {fmt(r['perplexity'])} | "
            f"{fmt(r['perplexity_vs_unsteered'], pct=True)} | "
            f"{fmt(r['perplexity_vs_baseline'], pct=True)} |"
        )
    return lines + [""]


def _runs_table(spec: Prereg, records: Sequence[dict[str, Any]]) -> list[str]:
    a = spec.analysis
    metrics = ["perplexity"] + [f"{p}/cap{c}/hit_rate" for p in a.policies for c in a.capacities]
    lines = ["## Per-run results", "", "| run | status | " + " | ".join(metrics) + " |"]
    lines.append("|---|---|" + "---|" * len(metrics))
    for r in records:
        vals = [fmt(r.get("metrics", {}).get(m)) for m in metrics]
        lines.append(f"| {md(r['run'])} | {r['status']} | " + " | ".join(vals) + " |")
    return lines + [""]
