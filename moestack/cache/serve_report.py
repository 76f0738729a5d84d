"""The figures and the printed table of scripts/bench_serve.py (its docstring says what they
mean): a phase's figures from its timed repeats, the ratios to the ceiling and to
accelerate, how much of the miss time prefetch hides (``hidden_wall`` and
``hidden_stall``, each n/a where its divisor is not well above the timing noise), and issue
31's targets met or missed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

NOISE_FACTOR = 4.0  # a hidden figure needs its divisor >= this x the noise (good to +-0.25)
MISS_SHARE = 0.2  # hidden_wall's miss >= this share of the seconds per token without prefetch


@dataclass
class Measure:
    """One timed repeat of a phase: its counters, tokens, seconds and peak device bytes."""

    counts: dict[str, float | None]
    tokens: int
    seconds: float
    peak: int | None


COUNT_KEYS = ("requests", "hits", "misses", "loads", "moved_bytes", "stall_s",
              "prefetch_issued", "prefetch_hits", "prefetch_wasted", "host_loads")  # fmt: skip


def phase_figures(measures: list[Measure], wanted: int) -> dict[str, Any]:
    """One timed phase's row fields from its repeats: tokens/s as the median of the repeats
    (with their range and each value); the counts summed over the repeats, and the
    per-token figures from the sums; the range of the repeats' stall per token (the noise of
    ``hidden_stall``); the largest peak."""
    counts: dict[str, float | None] = {}
    for key in COUNT_KEYS:
        values = [m.counts.get(key) for m in measures if key in m.counts]
        if values:
            counts[key] = None if None in values else sum(values)  # type: ignore[arg-type]
    tokens = sum(m.tokens for m in measures)
    rates = [m.tokens / m.seconds for m in measures if m.seconds > 0]
    peaks = [m.peak for m in measures if m.peak is not None]
    stall_each = [
        None if m.counts.get("stall_s") is None else m.counts["stall_s"] / m.tokens
        for m in measures
        if m.tokens
    ]
    requests, hits = counts.get("requests"), counts.get("hits")
    hit_rate = hits / requests if requests and hits is not None else None
    if any("hit_rate" in m.counts for m in measures):  # the probe says (accelerate: none)
        hit_rate = None
    moved, stall, misses = counts.get("moved_bytes"), counts.get("stall_s"), counts.get("misses")
    out: dict[str, Any] = {
        "repeats": len(measures),
        "repeats_wanted": wanted,
        "tokens": tokens,
        "seconds": sum(m.seconds for m in measures),
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_range": [min(rates), max(rates)] if rates else None,
        "tokens_per_s_each": rates,
        "peak_device_bytes": max(peaks) if peaks else None,
        "hit_rate": hit_rate,
        "bytes_per_token": moved / tokens if moved is not None and tokens else None,
        "misses_per_token": misses / tokens if misses is not None and tokens else None,
        "stall_s_per_token": stall / tokens if stall is not None and tokens else None,
        "stall_s_per_token_range": (
            [min(stall_each), max(stall_each)] if stall_each and None not in stall_each else None
        ),
    }
    for key in COUNT_KEYS:
        if key in counts and key not in ("moved_bytes", "stall_s"):
            out[key] = counts[key]
    return out


def brief(row: dict[str, Any]) -> str:
    if row.get("skipped") or row.get("error"):
        return row.get("reason") or row.get("error", "")
    d, p = row["decode"], row["prefill"]
    return f"decode {fmt(d['tokens_per_s'], 1)} tok/s, prefill {fmt(p['tokens_per_s'], 1)} tok/s"


def finish(out: dict[str, Any]) -> None:
    """Ratios to the ceiling and to accelerate, token checks, and the prefetch figures."""
    rows = {r["name"]: r for r in out["rows"] if "decode" in r}
    resident, accel = rows.get("resident"), rows.get("accelerate")
    for row in rows.values():
        for ph in ("decode", "prefill"):
            tps = row[ph]["tokens_per_s"]
            for key, ref in (("vs_resident", resident), ("vs_accelerate", accel)):
                base = ref[ph]["tokens_per_s"] if ref else None
                row[ph][key] = tps / base if tps and base else None
            mem, base_mem = row[ph]["peak_device_bytes"], accel and accel[ph]["peak_device_bytes"]
            row[ph]["memory_vs_accelerate"] = mem / base_mem if mem and base_mem else None
        if resident is not None and row is not resident:
            ref, got = resident["decoded"], row["decoded"]
            n = min(len(ref), len(got))  # every token the row decoded is the ceiling's
            row["same_tokens_as_resident"] = ref[:n] == got[:n]
    out["prefetch"] = prefetch_figures(out["rows"], out.get("link", {}).get("expert_load_s"))


def seconds_per_token(phase: dict[str, Any]) -> tuple[float | None, float | None]:
    """A decode phase's median seconds per token and the width of its repeats' range."""
    tps, span = phase.get("tokens_per_s"), phase.get("tokens_per_s_range")
    if not tps:
        return None, None
    width = 1 / span[0] - 1 / span[1] if span and span[0] > 0 and span[1] > 0 else None
    return 1 / tps, width


def not_above_noise(
    what: str,
    size: float | None,
    noise: float | None,
    repeats: int,
    share_of: float | None = None,
) -> str | None:
    """Why a hidden figure (a difference between the rows without and with prefetch over its
    divisor ``size``, ``what``'s seconds per decode token without prefetch) is n/a, or None
    where it stands: ``size`` missing or not positive; fewer than 2 ``repeats`` in one of the
    rows or no ``noise`` (the widths of the two rows' ranges over their repeats, summed: the
    most the difference is off within what the repeats show); ``size`` under NOISE_FACTOR x
    ``noise`` (the figure would be off by more than 1/NOISE_FACTOR); or, where ``share_of``
    (the seconds per token without prefetch) is given, ``size`` under MISS_SHARE of it."""
    if not size or size <= 0:
        return f"no {what} time without prefetch"
    if repeats < 2:
        return "fewer than 2 repeats: no estimate of the timing noise"
    if noise is None:
        return "no estimate of the timing noise"
    if size < NOISE_FACTOR * noise:
        return (
            f"{what} {size * 1e3:.3g} ms/token < {NOISE_FACTOR:g} x the timing noise "
            f"{noise * 1e3:.3g} ms/token"
        )
    if share_of is not None and size < MISS_SHARE * share_of:
        return (
            f"{what} {size * 1e3:.3g} ms/token < {MISS_SHARE:.0%} of the {share_of * 1e3:.3g} ms "
            "per token without prefetch"
        )
    return None


def hidden_wall(off: dict[str, Any], on: dict[str, Any], miss: float | None) -> dict[str, Any]:
    """``(s_off - s_on) / miss`` from two decode phases (bench_serve's docstring), or n/a with the
    reason (not_above_noise: ``miss`` against the ranges of the seconds per token, and
    MISS_SHARE of ``s_off``: drift between two rows measured at different moments is not in
    their ranges); outside [0, 1] clipped, with the raw value and a note."""
    (s_off, w_off), (s_on, w_on) = seconds_per_token(off), seconds_per_token(on)
    noise = w_off + w_on if w_off is not None and w_on is not None else None
    out: dict[str, Any] = {"hidden_wall": None, "hidden_wall_raw": None,
                           "hidden_wall_note": None, "timing_noise_s_per_token": noise}  # fmt: skip
    if s_off is None or s_on is None:
        why = "no decode timing"
    else:
        repeats = min(off.get("repeats", 0), on.get("repeats", 0))
        why = not_above_noise("miss", miss, noise, repeats, share_of=s_off)
    if why:
        out["hidden_wall_note"] = f"n/a: {why}"
        return out
    raw = (s_off - s_on) / miss  # type: ignore[operator]
    out["hidden_wall_raw"] = raw
    out["hidden_wall"] = min(1.0, max(0.0, raw))
    if raw < 0:
        out["hidden_wall_note"] = (
            f"raw {raw:.2f} clipped to 0: prefetch cost more than it hid (its prediction and "
            "wasted loads)"
        )
    elif raw > 1:
        out["hidden_wall_note"] = (
            f"raw {raw:.2f} clipped to 1: prefetch saved more than the miss time counted "
            "(work per miss besides it, such as the host's bookkeeping, was hidden too)"
        )
    return out


def hidden_stall(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """``1 - stall_on / stall_off`` from two decode phases, or n/a with the reason
    (not_above_noise: ``stall_off`` against the ranges of the two phases' stall per token over
    their repeats; no MISS_SHARE rule: the ratio takes no difference of whole token times,
    which is what drift between the two rows moves)."""
    stall_off, stall_on = off.get("stall_s_per_token"), on.get("stall_s_per_token")
    spans = [p.get("stall_s_per_token_range") for p in (off, on)]
    noise = sum(b - a for a, b in spans) if None not in spans else None  # type: ignore[misc]
    out: dict[str, Any] = {"hidden_stall": None, "hidden_stall_note": None,
                           "stall_noise_s_per_token": noise}  # fmt: skip
    if stall_on is None:
        why = "no stall counted with prefetch"
    else:
        repeats = min(off.get("repeats", 0), on.get("repeats", 0))
        why = not_above_noise("stall", stall_off, noise, repeats)
    if why:
        out["hidden_stall_note"] = f"n/a: {why}"
        return out
    out["hidden_stall"] = 1 - stall_on / stall_off  # type: ignore[operator]
    return out


def prefetch_figures(
    rows: list[dict[str, Any]], expert_load_s: float | None
) -> list[dict[str, Any]]:
    """How much of the miss time prefetch hides, per tier, policy and capacity (bench_serve's
    docstring), for each row with prefetch (measured or not) and the row without it: n/a,
    saying which, where one of the two was not measured. ``miss_s_per_token`` is the divisor
    used, ``miss_basis`` what it is: "link" (misses per token without prefetch x one
    expert's measured copy time ``expert_load_s``, over the host tier on a GPU), else
    "stall" (the seconds per token the serving thread waited on loads without prefetch)."""
    measured = {r["name"]: r for r in rows if "decode" in r}
    out = []
    for row in rows:
        if not row.get("prefetch"):
            continue
        base = row["name"].removesuffix("+prefetch")
        on, off = measured.get(row["name"]), measured.get(base)
        entry: dict[str, Any] = {
            "tier": row.get("tier"), "policy": row.get("policy"),
            "capacity_label": row.get("capacity_label"), "capacity": row.get("capacity"),
        }  # fmt: skip
        if on is None or off is None:
            missing = [n for n, r in ((base, off), (row["name"], on)) if r is None]
            note = f"n/a: {' and '.join(missing)} not measured"
            entry.update(hidden_wall=None, hidden_stall=None, predicted=None,
                         miss_s_per_token=None, miss_basis=None,
                         hidden_wall_note=note, hidden_stall_note=note)  # fmt: skip
            out.append(entry)
            continue
        d_on, d_off = on["decode"], off["decode"]
        stall_off = d_off["stall_s_per_token"]
        per_token = d_off["misses_per_token"]
        link = (
            per_token * expert_load_s
            if expert_load_s and per_token is not None and row.get("tier") == "host"
            else None
        )
        miss, basis = (link, "link") if link is not None else (stall_off, "stall")
        misses = d_on.get("misses") or 0
        entry.update(
            miss_s_per_token=miss, miss_basis=basis,
            stall_off_s_per_token=stall_off, link_miss_s_per_token=link,
            **hidden_wall(d_off, d_on, miss),
            **hidden_stall(d_off, d_on),
            predicted=d_on.get("prefetch_hits", 0) / misses if misses else None,
        )  # fmt: skip
        out.append(entry)
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_range(span: list[float] | None, digits: int = 1) -> str:
    return "-" if not span else f"{span[0]:.{digits}f}-{span[1]:.{digits}f}"


LABELS = ("k", "2k", "25%", "50%")


def table_order(row: dict[str, Any]) -> tuple:
    """resident, accelerate, the cache over host memory by policy and size, the disk tier."""
    tiers = ("device", "cpu", "host", "disk")
    label = row.get("capacity_label")
    return (
        tiers.index(row.get("tier", "host")),
        row.get("policy") or "",
        LABELS.index(label) if label in LABELS else -1,
        bool(row.get("prefetch")),
    )


def figure_notes(f: dict[str, Any]) -> str:
    """A prefetch line's notes: hidden_wall's and hidden_stall's, each named (once where the
    two are the same, such as a row not measured)."""
    wall, stall = f.get("hidden_wall_note"), f.get("hidden_stall_note")
    if wall and wall == stall:
        return f" ({wall})"
    notes = [f"{name} {note}" for name, note in (("wall", wall), ("stall", stall)) if note]
    return f" ({'; '.join(notes)})" if notes else ""


def print_table(out: dict[str, Any]) -> None:
    """The rows side by side; ratios to the ceiling (resident) and to accelerate; the notes
    on device memory, the skipped rows and the prefetch figures."""
    cfg = out["config"]
    mib = cfg["expert_bytes"] / 2**20
    print(
        f"\nbench_serve: {cfg['layers']} layers x {cfg['experts']} experts (top-{cfg['top_k']}, "
        f"hidden {cfg['hidden']}, width {cfg['expert_width']}, {cfg['dtype']}; "
        f"{mib:.2f} MiB an expert) on {cfg['device']}; prompt {cfg['prompt_tokens']} tokens, "
        f"batch 1; {cfg['repeats']} repeats a phase"
    )
    print(
        f"| {'row':<26}| {'decode tok/s':>12} | {'range':>13} | {'x res':>6} | {'x acc':>6} "
        f"| {'prefill tok/s':>13} | {'range':>15} | {'x res':>6} | {'x acc':>6} "
        f"| {'peak MiB':>9} | {'slots':>5} | {'MB/token':>9} | {'hit':>5} | {'stall ms/t':>10} "
        f"| reps | same |"
    )
    for row in sorted(out["rows"], key=table_order):
        if "decode" not in row:
            why = row.get("reason") or row.get("error")
            print(f"| {row['name']:<26}| {'skipped' if row.get('skipped') else 'ERROR'}: {why}")
            continue
        d, p = row["decode"], row["prefill"]
        peaks = [x for x in (d["peak_device_bytes"], p["peak_device_bytes"]) if x is not None]
        peak = max(peaks) / 2**20 if peaks else None
        slots = row.get("device_slots", {}).get("total")
        mb = d["bytes_per_token"] / 1e6 if d["bytes_per_token"] is not None else None
        stall = d["stall_s_per_token"] * 1e3 if d["stall_s_per_token"] is not None else None
        same = row.get("same_tokens_as_resident")
        print(
            f"| {row['name']:<26}| {fmt(d['tokens_per_s'], 1):>12} "
            f"| {fmt_range(d['tokens_per_s_range']):>13} | {fmt(d['vs_resident']):>6} "
            f"| {fmt(d['vs_accelerate']):>6} | {fmt(p['tokens_per_s'], 1):>13} "
            f"| {fmt_range(p['tokens_per_s_range'], 0):>15} | {fmt(p['vs_resident']):>6} "
            f"| {fmt(p['vs_accelerate']):>6} | {fmt(peak, 0):>9} | {slots or '-':>5} "
            f"| {fmt(mb, 1):>9} | {fmt(d['hit_rate']):>5} | {fmt(stall):>10} "
            f"| {d['repeats']}/{p['repeats']:<2}| {'-' if same is None else ('yes' if same else 'NO'):<4} |"
        )
    print_notes(out)
    print_prefetch(out)


def print_notes(out: dict[str, Any]) -> None:
    """What the table's columns mean, the device memory note, the skipped rows."""
    cfg = out["config"]
    mib = cfg["expert_bytes"] / 2**20
    print(
        "decode/prefill: the median tokens/s of the repeats (range: the lowest and highest); "
        "x res / x acc: over the resident ceiling's / accelerate's median; MB/token, hit, "
        "stall: decode phase, summed over its repeats; reps: decode/prefill repeats that ran; "
        "same: the tokens equal the ceiling's"
    )
    print(
        f"device memory: peak MiB as measured (max_memory_allocated), the larger of the two "
        f"phases, not judged against accelerate: the cache's device tier holds `slots` experts "
        f"of {mib:.2f} MiB (layers x capacity resident + top_k spare, + top_k prefetch with "
        f"prefetch) beside the non-expert weights; accelerate holds one layer's "
        f"{cfg['experts']} experts ({cfg['experts'] * mib:.0f} MiB) at a time"
    )
    if out["skipped"]:
        print(f"bench_serve: skipped {len(out['skipped'])} of {len(out['rows'])} rows "
              "(the reasons above and in the JSON's `skipped`)")  # fmt: skip
    if out.get("interrupted"):
        print(f"bench_serve: {out['interrupted']}")


def print_prefetch(out: dict[str, Any]) -> None:
    """The prefetch figures, one line per pair of rows (without and with prefetch)."""
    if out["prefetch"]:
        print("prefetch: miss time hidden (wall = (s_off - s_on) / miss per decode token, "
              "n/a unless miss >= "
              f"{NOISE_FACTOR:g} x the timing noise and >= {MISS_SHARE:.0%} of s_off, clipped to "
              "[0, 1]; miss: link = misses/token x one expert's measured copy, stall = the "
              "serving thread's wait on loads; stall = 1 - stall_on / stall_off, n/a unless "
              f"stall_off >= {NOISE_FACTOR:g} x the stall's timing noise; predicted = "
              "prefetch hits / misses)")  # fmt: skip
        for f in sorted(out["prefetch"], key=table_order):
            miss = f["miss_s_per_token"]
            wall = fmt(f["hidden_wall"]) if f["hidden_wall"] is not None else "n/a"
            stall = fmt(f["hidden_stall"]) if f["hidden_stall"] is not None else "n/a"
            note = figure_notes(f)
            print(
                f"|   {f['tier']:<5}{f['policy']:<7}{f['capacity_label']:>4} "
                f"({f['capacity'] or '-':>3}) | miss {fmt(miss and miss * 1e3, 3)} ms/token "
                f"({f['miss_basis'] or '-'}) | hidden wall {wall} | stall {stall} "
                f"| predicted {fmt(f['predicted'])} |{note}"
            )


def print_targets(out: dict[str, Any]) -> None:
    """Issue 31's GPU targets, met or missed (judged on this run alone, on a GPU only)."""
    rows = [r for r in out["rows"] if "decode" in r]
    # accelerate is left out: it computes with transformers' own experts (rounding may differ)
    bad = [
        r["name"]
        for r in rows
        if r.get("tier") in ("host", "disk") and r.get("same_tokens_as_resident") is False
    ]
    if bad:
        print(f"serve check: tokens differ from the ceiling's in {', '.join(bad)}")
    if not out["config"]["device"].startswith("cuda"):
        print("serve target: not judged off a GPU")
        return
    quarter = [
        r for r in rows
        if r.get("capacity_label") == "25%" and r.get("tier") == "host"
        and r["decode"]["vs_accelerate"] is not None
    ]  # fmt: skip
    accel = next((r for r in rows if r["name"] == "accelerate"), None)
    if quarter and accel:
        best = max(quarter, key=lambda r: r["decode"]["vs_accelerate"])
        d, a = best["decode"], accel["decode"]
        ok = d["vs_accelerate"] >= 2
        peak, a_peak = d["peak_device_bytes"], a["peak_device_bytes"]
        print(
            f"serve target: {'met' if ok else 'MISSED'}: cache at 25% ({best['name']}) decodes "
            f"{d['vs_accelerate']:.2f}x accelerate's tokens/s ({fmt(d['tokens_per_s'], 1)}, "
            f"range {fmt_range(d['tokens_per_s_range'])}, vs {fmt(a['tokens_per_s'], 1)}, range "
            f"{fmt_range(a['tokens_per_s_range'])}) (target >= 2x); device memory, measured: "
            f"{fmt(peak and peak / 2**20, 0)} MiB with {best['device_slots']['total']} expert "
            f"slots vs accelerate's {fmt(a_peak and a_peak / 2**20, 0)} MiB"
        )
    else:
        print("serve target: not judged: no accelerate row or no 25% cache row")
    hidden = [f for f in out["prefetch"] if f["tier"] == "host" and f["capacity_label"] == "2k"]
    for f in hidden:
        if f["hidden_wall"] is None:
            print(f"serve target: not judged: prefetch at 2k ({f['policy']}): "
                  f"{f['hidden_wall_note']}")  # fmt: skip
            continue
        ok = f["hidden_wall"] >= 0.5
        print(
            f"serve target: {'met' if ok else 'MISSED'}: prefetch hides {fmt(f['hidden_wall'])} "
            f"of the miss time at 2k ({f['policy']}; stall-based {fmt(f['hidden_stall'])}) "
            "(target >= 0.5)"
        )
