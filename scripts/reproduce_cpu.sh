#!/usr/bin/env bash
# The pre-registered CPU study (experiments/prereg_cpu.yaml, docs/prereg.md): lock (unless locked), run the 8 runs (resumable), write the report into docs/prereg_cpu/.
set -euo pipefail; m=${MOESTACK:-.venv/bin/moestack}; f=experiments/prereg_cpu.yaml; [ -f "$f.lock.json" ] || $m prereg lock "$f"; $m prereg run "$f" --out runs/prereg/prereg_cpu && $m prereg analyze "$f" --out runs/prereg/prereg_cpu --report docs/prereg_cpu
