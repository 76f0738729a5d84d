#!/usr/bin/env bash
# The pre-registered 137M study (experiments/prereg_137m.yaml, docs/prereg.md), for one CUDA GPU: lock (unless locked), run 12 runs (resumable), write the report into docs/prereg_137m/.
set -euo pipefail; m=${MOESTACK:-.venv/bin/moestack}; f=experiments/prereg_137m.yaml; [ -f "$f.lock.json" ] || $m prereg lock "$f"; $m prereg run "$f" --out runs/prereg/prereg_137m && $m prereg analyze "$f" --out runs/prereg/prereg_137m --report docs/prereg_137m
