#!/usr/bin/env bash
# The pre-registered CPU study (experiments/prereg_cpu_v2.yaml, docs/prereg.md, docs/research.md): lock (unless locked), run its 240 runs on two runners (resumable: run it again after a stop), write the report into docs/prereg_cpu_v2/.
set -euo pipefail; m=${MOESTACK:-.venv/bin/moestack}; f=experiments/prereg_cpu_v2.yaml; out=runs/prereg/prereg_cpu_v2; [ -f "$f.lock.json" ] || $m prereg lock "$f"; $m prereg run "$f" --out "$out" --jobs 2 && $m prereg analyze "$f" --out "$out" --jobs 2 --report docs/prereg_cpu_v2
