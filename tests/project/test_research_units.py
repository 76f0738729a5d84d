"""docs/research.md's budgets in the units it names, recomputed here: a change r per byte is
(1 + r)^b - 1 per token of b bytes (the same nats over fewer units), so a +1% per byte is the
looser budget; the per-token figures it gives for prereg_cpu_v3 come from the study's own
results.json; each study's lock is named by the commit that added the lock file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from helpers.paths import REPO

RESEARCH = REPO / "docs" / "research.md"


def _text() -> str:
    return " ".join(RESEARCH.read_text().split())  # line breaks as spaces


def _per_token(per_byte: float, bytes_per_token: int) -> float:
    return (1 + per_byte) ** bytes_per_token - 1


def test_a_percent_per_byte_is_the_looser_budget():
    text = _text()
    low, high = _per_token(0.01, 3), _per_token(0.01, 4)  # +3.0% and +4.1% per token
    assert f"+{100 * low:.1f}% per token at 3 bytes a token and +{100 * high:.1f}% at 4" in text
    per_byte = [(1.01 ** (1 / b) - 1) * 100 for b in (4, 3)]  # the published +1% per token
    assert f"+{per_byte[0]:.2f}% to +{per_byte[1]:.2f}% per byte" in text
    assert "three to four times looser than a subword +1%" in text
    assert "stricter" not in text


def test_prereg_cpu_v3_per_token_figures_come_from_its_results():
    results = json.loads((REPO / "docs" / "prereg_cpu_v3" / "results.json").read_text())
    h2a = next(h for h in results["hypotheses"] if h["id"] == "H2a")
    row = next(r for r in h2a["rows"] if r["arm"] == "consistency")
    est = [100 * _per_token(row["estimate"], b) for b in (3, 4)]
    bound = [100 * _per_token(row["bound"], b) for b in (3, 4)]
    want = f"+{est[0]:.2f}% to +{est[1]:.2f}% (bound +{bound[0]:.2f}% to +{bound[1]:.2f}%)"
    assert want in _text(), want


@pytest.mark.parametrize("study", ["prereg_cpu_v3", "prereg_cpu_v3_e16"])
def test_each_lock_is_named_by_the_commit_that_added_it(study):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    added = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%h", "--abbrev=7", "--",
         f"experiments/{study}.yaml.lock.json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    if not added:
        pytest.skip("the lock's history is not in this checkout")
    section = re.search(rf"\*\*{study}: run,.*?lock commit `(\w+)`", _text())
    assert section is not None and section.group(1) == added[-1]
