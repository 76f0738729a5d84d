"""moestack report: tables built from summary.json (not the last metrics record), one
question per chart, readable in a real browser; a resumed run reported whole."""

import json
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from helpers.runs import TOKENS_PER_STEP, killed_and_resumed, small_config

from moestack.config import DataConfig, OptimConfig, TelemetryConfig
from moestack.metrics import read_metrics
from moestack.telemetry import render_report
from moestack.telemetry import report_plots as plots
from moestack.trainer import train


class Cells(HTMLParser):
    """The page's value cells (data-key -> data-value), its headers and whether it dumps JSON."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.headers = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-key" in attrs:
            self.values[attrs["data-key"]] = attrs["data-value"]
        self.headers += tag == "th"
        self.pre += tag == "pre"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A short run with telemetry, evaluated mid-run and at the end (its last metrics record
    holds only the final evaluation)."""
    out = tmp_path_factory.mktemp("run")
    cfg = small_config(
        optim=OptimConfig(warmup_steps=2),
        data=DataConfig(seq_len=32, max_bytes=300_000),
        telemetry=TelemetryConfig(policies=["lru", "static"]),
        steps=8, eval_every=4, eval_batches=1, log_every=2, ckpt_every=0,
    )  # fmt: skip
    train(cfg, out)
    assert set(read_metrics(out / "metrics.jsonl")[-1]) == {"step", "loss/val", "eval/perplexity"}
    render_report(out)
    return out


def page(run: Path) -> Cells:
    cells = Cells()
    cells.feed((run / "report" / "index.html").read_text())
    return cells


def test_summary_table_equals_summary_json(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    cells = page(run_dir)
    wanted = ["loss/train", "loss/val", "eval/perplexity", "perf/tokens_per_s", "params/total"]
    wanted += ["params/active", "router/layer0/imbalance", "router/layer1/imbalance"]
    for key in wanted:
        assert float(cells.values[key]) == pytest.approx(float(summary[key]), rel=1e-12), key
    hit_rates = json.loads((run_dir / "telemetry_summary.json").read_text())["metrics"]
    for key in ("telemetry/lru/cap2/hit_rate", "telemetry/static/cap4/hit_rate"):
        assert float(cells.values[key]) == pytest.approx(hit_rates[key], rel=1e-12), key
    assert cells.headers >= 6 and cells.pre == 0  # tables with headers, no raw JSON dump
    html = (run_dir / "report" / "index.html").read_text()
    assert "8 steps of 128 tokens" in html  # the setup table, from config.yaml


def test_loss_and_perplexity_are_separate_panels_with_validation(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    chart = plots.loss_chart(rows)
    loss_ax, ppl_ax = chart.figure.axes
    assert {line.get_label() for line in loss_ax.lines} == {"train", "validation"}
    assert {line.get_label() for line in ppl_ax.lines} == {"train", "validation"}
    assert ppl_ax.get_yscale() == "log"
    assert max(max(line.get_ydata()) for line in loss_ax.lines) < 10  # no perplexity here
    router = plots.router_loss_chart(rows)
    titles = [ax.get_title() for ax in router.figure.axes]
    assert any("z-loss" in t for t in titles) and any("weighted" in t for t in titles)
    names = {p.name for p in (run_dir / "report").glob("*.png")}
    assert {"loss.png", "router_losses.png", "hit_rate.png", "expert_usage.png"} <= names


def test_hit_rates_get_a_panel_per_capacity_along_the_tokens_routed():
    policies = ["lru", "lfu", "static", "lru+static", "belady"]
    rows = [
        {"step": i, "tokens_seen": 1000 * (i + 1)}
        | {f"telemetry/{p}/cap{c}/hit_rate": 0.1 * c for p in policies for c in (2, 4)}
        for i in range(5)
    ]
    fig = plots.hit_rate_chart(rows).figure
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert len(ax.lines) == 5 and ax.get_legend() is None  # the legend sits outside
        assert ax.get_xlabel() == "tokens routed"
    assert fig.legends


def test_expert_usage_has_a_labelled_colorbar_and_its_title_inside():
    fig = plots.usage_heatmap_figure(np.arange(32).reshape(4, 8))
    fig.canvas.draw()
    heatmap, colorbar = fig.axes
    assert colorbar.get_ylabel() == "share of the layer's requests"
    box = heatmap.title.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_browser() is None, reason="no headless browser installed")
def test_the_page_renders_in_a_headless_browser(run_dir, tmp_path):
    shot = tmp_path / "report.png"
    width, height = 1200, 1600
    subprocess.run(
        [
            _browser(),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--window-size={width},{height}",
            f"--screenshot={shot}",
            (run_dir / "report" / "index.html").as_uri(),
        ],  # fmt: skip
        capture_output=True,
        timeout=120,
        check=True,
    )
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (width, height)
    assert len(data) > 50_000  # tables and charts, not a blank page


class Bar:
    """A tqdm stand-in that records its total at every update."""

    made: list["Bar"] = []

    def __init__(self, *args, total=None, **kwargs):
        self.total, self.n, self.totals = total, 0, []
        Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.totals.append(self.total)
        self.n += n

    def refresh(self):
        pass


def test_the_progress_total_is_fixed_from_the_first_update(run_dir, tmp_path, monkeypatch):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    Bar.made.clear()
    render_report(run_dir, out_dir=tmp_path, progress=True)
    (bar,) = Bar.made
    # 5 metric charts, then the sweep: 5 policies x 1..4 experts, lru+static from 2
    assert bar.totals == [5 + 5 * 4 - 1] * bar.n and bar.n == 24


@pytest.fixture(scope="module")
def resumed_dir(tmp_path_factory):
    """A killed-and-resumed run reported, with the charts caught before they are saved."""
    out = tmp_path_factory.mktemp("resumed")
    killed_and_resumed(out)
    saved = []
    original = plots.Chart.save

    def keep(chart, folder):
        saved.append(chart)
        return original(chart, folder)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots.Chart, "save", keep)
        render_report(out)
    return out, saved


def test_a_resumed_run_is_reported_whole_with_both_parts(resumed_dir):
    run, _ = resumed_dir
    html = (run / "report" / "index.html").read_text()
    cells = page(run).values
    assert cells["num_tokens"] == str(10 * TOKENS_PER_STEP)  # steps 0-9, each once
    assert cells["parts"] == "2" and "parts joined in training order" in html
    assert cells["parts/from-0000000"] == str(5 * TOKENS_PER_STEP)
    assert cells["parts/from-0000005"] == str(5 * TOKENS_PER_STEP)
    kept_cut = "from step 0: 640 tokens kept, 384 cut"  # 8 steps recorded, 3 past step 5
    assert kept_cut in html and "from step 5: 640 tokens kept, 0 cut" in html
    assert "the run&#x27;s 2 trace parts joined in training order" in html  # hit-rate table
    names = {p.name for p in (run / "report").glob("*.png")}
    assert {"loss.png", "hit_rate.png", "layer_hit_rate.png", "capacity_sweep.png"} <= names


def test_every_chart_over_steps_marks_where_the_run_resumed(resumed_dir):
    _, saved = resumed_dir
    by_name = {chart.name: chart for chart in saved}
    over_steps = ["loss.png", "router_losses.png", "routing.png", "hit_rate.png"]
    for name in [*over_steps, "layer_hit_rate.png"]:
        chart = by_name[name]
        assert chart.resumed == (5,), name
        for ax in (a for a in chart.figure.axes if a.get_visible()):
            marks = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
            assert [list(ln.get_xdata()) for ln in marks] == [[5, 5]], name
            assert [t.get_text().strip() for t in ax.texts] == ["resumed"], name
    assert by_name["capacity_sweep.png"].resumed == ()  # its axis is the cache size


def test_the_overrides_row_lists_every_start(resumed_dir):
    run, _ = resumed_dir
    html = (run / "report" / "index.html").read_text()
    (said,) = re.findall(r"<td>overrides</td><td>(.*?)</td>", html, flags=re.S)
    first, second = said.split("\n")
    assert re.fullmatch(r"start 1 \(\S+\): steps=10 ckpt_every=5", first)
    assert re.fullmatch(r"start 2 \(\S+\): resume=true", second)
