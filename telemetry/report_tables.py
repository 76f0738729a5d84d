"""The tables of ``moestack report``: built from the files a run leaves, never from the last
metrics record (which may be an evaluation-only one).

- the run's headline numbers from ``summary.json`` (a training run's, or a telemetry run's);
- cache hit rates per policy and capacity from ``telemetry_summary.json`` (training) or
  ``summary.json``'s ``metrics`` (telemetry runs);
- what produced the run from ``config.yaml``, ``provenance.json`` (or ``.hydra/``).

Every value cell carries its source key and exact value (``data-key``, ``data-value``), so a
reader or a test can check the table against the files.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moestack.telemetry.run_trace import JOINED

if TYPE_CHECKING:
    from moestack.telemetry.run_trace import RunTrace

HIT = re.compile(r"^telemetry/([^/]+)/cap(\d+)/hit_rate$")


@dataclass
class Cell:
    text: str
    key: str | None = None  # where the value comes from (a summary key)
    value: Any = None  # the exact value behind the text


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    note: str = ""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when absent or unreadable (a report never fails on it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)  # write_json stores NaN/inf as strings
    except ValueError:
        return None
    return number


def _fmt(value: Any, spec: str) -> str:
    number = _number(value)
    if number is None or not math.isfinite(number):
        return "n/a"
    if spec == "M":
        return f"{number / 1e6:.2f}M"
    return format(number, spec)


def _cell(summary: dict[str, Any], key: str, spec: str) -> Cell:
    return Cell(_fmt(summary.get(key), spec), key, summary.get(key))


_TRAINING = (
    ("train loss", "loss/train", ".4f"),
    ("validation loss", "loss/val", ".4f"),
    ("validation perplexity", "eval/perplexity", ".3f"),
    ("tokens/s", "perf/tokens_per_s", ".0f"),
    ("parameters", "params/total", "M"),
    ("parameters active per token", "params/active", "M"),
    ("skipped steps (non-finite loss)", "perf/bad_steps", ".0f"),
)
_TELEMETRY = (
    ("loss over the text", "loss", ".4f"),
    ("perplexity over the text", "perplexity", ".3f"),
    ("tokens routed", "tokens", ".0f"),
    ("sequences", "sequences", ".0f"),
    ("sequence length", "seq_len", ".0f"),
)


def summary_table(summary: dict[str, Any]) -> Table | None:
    """The run's headline numbers (summary.json), one row each, with what they are."""
    if not summary:
        return None
    table = Table("Summary", ["metric", "value"], note="from summary.json")
    if "loss/val" in summary:
        table.rows = [[Cell(name), _cell(summary, key, spec)] for name, key, spec in _TRAINING]
        layers = sorted(k for k in summary if re.fullmatch(r"router/layer\d+/imbalance", k))
        layers.sort(key=lambda k: int(k.split("/")[1][5:]))
        table.rows += [
            [
                Cell(f"router imbalance, layer {k.split('/')[1][5:]} (max/mean)"),
                _cell(summary, k, ".2f"),
            ]
            for k in layers
        ]
        return table
    for name, key in (("model", "model"), ("text", "text"), ("tokenizer", "tokenizer")):
        if key in summary:
            table.rows.append([Cell(name), Cell(str(summary[key]), key, summary[key])])
    table.rows += [
        [Cell(name), _cell(summary, key, spec)] for name, key, spec in _TELEMETRY if key in summary
    ]
    return table


def hit_rate_table(metrics: dict[str, Any], source: str) -> Table | None:
    """Hit rate per policy (rows) and capacity (columns) over the whole run."""
    found = {(m.group(1), int(m.group(2))): k for k in metrics if (m := HIT.match(k))}
    if not found:
        return None
    policies = list(dict.fromkeys(policy for policy, _ in found))
    capacities = sorted({cap for _, cap in found})
    table = Table(
        "Cache hit rate",
        ["policy", *(f"{cap} experts per layer" for cap in capacities)],
        note=f"every request of the run replayed through each cache after warm-up ({source})",
    )
    for policy in policies:
        row = [Cell(policy)]
        for cap in capacities:
            key = found.get((policy, cap))
            row.append(_cell(metrics, key, ".3f") if key else Cell("-"))
        table.rows.append(row)
    return table


def _overrides(run: Path, start: dict[str, Any]) -> tuple[list[str] | None, dict[str, str]]:
    """The run's command-line overrides (None: not recorded) and chosen group options."""
    if start:
        return list(start.get("overrides") or []), dict(start.get("choices") or {})
    if not (run / ".hydra" / "overrides.yaml").is_file():
        return None, {}  # trained from Python, or before runs recorded them
    overrides = read_yaml(run / ".hydra" / "overrides.yaml") or []
    hydra = read_yaml(run / ".hydra" / "hydra.yaml") or {}
    choices = ((hydra.get("hydra") or {}).get("runtime") or {}).get("choices") or {}
    plain = {k: str(v) for k, v in choices.items() if not str(k).startswith("hydra/")}
    return [str(o) for o in overrides], plain


def _setup_rows(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """A few lines saying what was trained, from config.yaml."""
    model, data, optim = cfg.get("model") or {}, cfg.get("data") or {}, cfg.get("optim") or {}
    moe = model.get("moe") or {}
    tokens = (
        (cfg.get("batch_size") or 0) * (cfg.get("grad_accum") or 1) * (data.get("seq_len") or 0)
    )
    return [
        ("model", f"{model.get('n_layers')} layers x {model.get('d_model')} wide, "
         f"{moe.get('num_experts')} experts, top-{moe.get('top_k')}, expert width {moe.get('d_ff')}"),
        ("training", f"{cfg.get('steps')} steps of {tokens} tokens, {optim.get('name')} at lr "
         f"{optim.get('lr')}, seed {cfg.get('seed')}"),
        ("data", f"{data.get('source')}, sequences of {data.get('seq_len')} tokens"),
    ]  # fmt: skip


def _start_overrides(run: Path, starts: list[dict[str, Any]]) -> tuple[str, dict[str, str]]:
    """The overrides of every start, one line each, and the last start's group options."""
    if not starts:
        overrides, choices = _overrides(run, {})
        if overrides is None:
            return "not recorded (no provenance.json or .hydra/ in the run folder)", choices
        return " ".join(overrides) or "none (the defaults)", choices
    lines = []
    for i, start in enumerate(starts, 1):
        overrides, choices = _overrides(run, start)
        said = " ".join(overrides or []) or "none (the defaults)"
        lines.append(f"start {i} ({start.get('started_at')}): {said}" if len(starts) > 1 else said)
    return "\n".join(lines), choices


def setup_table(run: Path) -> Table | None:
    """What produced the run: every start's overrides, group options, the config's
    essentials, versions."""
    cfg = read_yaml(run / "config.yaml")
    starts = [
        s for s in read_json(run / "provenance.json").get("starts") or [] if isinstance(s, dict)
    ]
    start = starts[-1] if starts else {}
    if not isinstance(cfg, dict) and not start:
        return None
    said, choices = _start_overrides(run, starts)
    rows = [
        ("overrides", said),
        ("config groups", " ".join(f"{k}={v}" for k, v in sorted(choices.items())) or "-"),
    ]
    if isinstance(cfg, dict):
        rows += _setup_rows(cfg)
    if start:
        commit = start.get("git_commit")
        dirty = " (uncommitted changes)" if start.get("git_dirty") else ""
        versions = start.get("versions") or {}
        rows += [
            ("moestack", f"{start.get('moestack')}" + (f", commit {commit[:12]}{dirty}" if commit else "")),
            ("torch", f"{versions.get('torch')} on {start.get('device')} ({start.get('device_name')})"),
            ("started", f"{start.get('started_at')} ({len(starts)} start(s), last {start.get('status')})"),
        ]  # fmt: skip
    table = Table("Setup", ["setting", "value"], note="from config.yaml and provenance.json")
    table.rows = [[Cell(name), Cell(text)] for name, text in rows]
    return table


def trace_table(found: RunTrace) -> Table:
    """The routing trace the charts replay: its size, and each part of a resumed run with
    the tokens kept and those cut (recorded again by the next part)."""
    trace = found.trace
    note = f"{found.root}; {JOINED}, each cut before the step where the next one starts"
    if not found.exact:
        note += " (a part records no start step: joined whole, overlap may be counted twice)"
    table = Table("Routing trace", ["trace", "value"], note=note)
    table.rows = [
        [Cell("tokens"), Cell(str(trace.num_tokens), "num_tokens", trace.num_tokens)],
        [Cell("MoE layers"), Cell(str(trace.num_layers))],
        [Cell("experts per layer"), Cell(str(max(trace.num_experts)))],
        [Cell("parts"), Cell(f"{len(found.parts)}, {JOINED}", "parts", len(found.parts))],
    ]
    for part in found.parts:
        step = "?" if part.start_step is None else str(part.start_step)
        text = f"from step {step}: {part.kept} tokens kept, {part.cut} cut"
        table.rows.append([Cell(f"part {part.name}"), Cell(text, f"parts/{part.name}", part.kept)])
    return table


def table_html(table: Table) -> str:
    """A table as HTML: a heading, a header row, cells with their source key and value."""

    def cell(c: Cell, tag: str = "td") -> str:
        attrs = ""
        if c.key is not None:
            attrs = f' data-key="{html.escape(c.key)}" data-value="{html.escape(str(c.value))}"'
        return f"<{tag}{attrs}>{html.escape(c.text)}</{tag}>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.header)
    body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in table.rows)
    note = f"<p class='note'>{html.escape(table.note)}</p>" if table.note else ""
    thead = f"<thead><tr>{head}</tr></thead>" if any(table.header) else ""
    return f"<section><h2>{html.escape(table.title)}</h2><table>{thead}<tbody>{body}</tbody></table>{note}</section>"
