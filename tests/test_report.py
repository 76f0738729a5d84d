"""moestack report: tables built from summary.json (not the last metrics record), one
question per chart, readable in a real browser."""

import json
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from moestack.config import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
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
    cfg = TrainConfig(
        model=ModelConfig(
            d_model=32, n_layers=2, n_heads=2, max_seq_len=32,
            moe=MoEConfig(num_experts=4, top_k=2, d_ff=32),
        ),
        optim=OptimConfig(warmup_steps=2),
        data=DataConfig(seq_len=32, max_bytes=300_000),
        telemetry=TelemetryConfig(policies=["lru", "static"]),
        steps=8, batch_size=4, eval_every=4, eval_batches=1, log_every=2, ckpt_every=0,
        progress=False, wandb_mode="disabled", threads=1,
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
