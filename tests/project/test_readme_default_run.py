"""README's words about the default run (`make run`) against the configs it runs: its steps,
batch and tokens, and the sample table's training time against its tokens/s; and no time
promised without the machine it holds on."""

from __future__ import annotations

import re

import yaml
from helpers.paths import CONFIGS, REPO


def _readme() -> str:
    return " ".join((REPO / "README.md").read_text().split())


def test_the_default_run_is_described_as_configured():
    train = yaml.safe_load((CONFIGS / "train.yaml").read_text())
    data = yaml.safe_load((CONFIGS / "data" / "stdlib.yaml").read_text())
    steps, batch, seq = train["steps"], train["batch_size"], data["seq_len"]
    tokens = steps * batch * train["grad_accum"] * seq
    said = re.search(
        r"The default run is (\d+) steps of (\d+) x (\d+) byte tokens \(([\d.]+)M", _readme()
    )
    assert said is not None
    assert [int(said.group(i)) for i in (1, 2, 3)] == [steps, batch, seq]
    assert float(said.group(4)) == round(tokens / 1e6, 2)


def test_the_sample_table_time_is_its_tokens_over_its_rate():
    text = _readme()
    rate, seconds = re.search(r"tokens/s (\d+) training steps only \((\d+) s\)", text).groups()
    tokens = float(re.search(r"byte tokens \(([\d.]+)M tokens\)", text).group(1)) * 1e6
    assert abs(tokens / int(rate) - int(seconds)) / int(seconds) < 0.01
    assert f"trained for {seconds} s" in text  # the sentence that gives the shared-machine time


def test_the_make_run_line_promises_no_time_without_its_machine():
    line = next(
        x for x in (REPO / "README.md").read_text().splitlines() if x.startswith("make run")
    )
    assert "min" not in line  # the time is given below it, per machine (free or shared cores)
