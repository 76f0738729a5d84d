"""Where the checkout's files are, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
EXPERIMENTS = REPO / "experiments"
SCRIPTS = REPO / "scripts"
