#!/usr/bin/env bash
# Beside scripts/reproduce_locked.sh STUDY: while the study's runners train, evaluate its
# finished runs and keep their records in docs/STUDY/runs every INTERVAL seconds (default
# 600), so that a sitting cut short loses at most the runs in training: commit
# docs/STUDY/runs as it fills (docs/prereg.md, "A study across machines"). The evaluation
# runs at the priority it is given (not idle: with a runner on every core an idle-priority
# evaluation never runs, and a run is kept only once evaluated), with this checkout's
# moestack, as reproduce_locked.sh evaluates; it ends when no runner of the study is left.
#   scripts/evaluate_ahead.sh prereg_cpu_v3 &
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 STUDY [INTERVAL_S]" >&2; exit 2; }
name=$1
interval=${2:-600}
root=$(git rev-parse --show-toplevel)
cd "$root"
f="experiments/$name.yaml"
[ -f "$f" ] || { echo "$f does not exist" >&2; exit 1; }
here="$root/.venv/bin/moestack"
[ -x "$here" ] || { echo "$here does not exist: make setup first" >&2; exit 1; }
out="$root/runs/prereg/$name"
runners() { pgrep -f "prereg run $f --out $out" > /dev/null; }
while runners; do
  "$here" prereg evaluate "$f" --out "$out" --jobs 1 || echo "evaluate failed; trying again later" >&2
  "$here" prereg keep "$f" --out "$out" --kept "docs/$name/runs" || echo "keep failed" >&2
  for _ in $(seq "$interval"); do runners || break; sleep 1; done
done
echo "$name: no runner left; run scripts/reproduce_locked.sh $name again to finish"
