#!/usr/bin/env bash
# Train and analyse pre-registered studies, training with the code their locks record,
# whatever this checkout holds now (docs/prereg.md, "The code in the lock"). For each STUDY: the
# commit that last changed experiments/STUDY.yaml.lock.json (its newest lock record, committed
# alone) is checked out in a worktree (.study/<commit>, with its own virtual environment:
# `make setup`, TORCH_SPEC passed on, e.g. TORCH_SPEC=torch for a GPU build), so moestack's
# sources match the newest lock's code hash without an amendment; a study whose file names
# corpus/stdlib.jsonl gets it copied from this checkout or packed by scripts/pack_corpus.py
# there (with this interpreter), and checked against the file's "corpus sha256: <hex>" line;
# a study on data=stdlib (the interpreter's own library) runs every piece under the Python
# version its first piece used (docs/STUDY/stdlib_python.txt).
# The runs live in this checkout's runs/prereg/STUDY (resumable: run the script again after a
# stop). A study trained in pieces on several machines carries its finished runs in
# docs/STUDY/runs (their records, "kept runs"): they are restored first, so only the rest
# trains. Then this checkout's moestack (`make setup` here) evaluates the finished runs
# (each evaluation names this checkout's code hash and commit), keeps their records in
# docs/STUDY/runs (their provenance.json included: the commit that trained them; commit
# them) and, once every run is done, writes the report into docs/STUDY/ (its "Code of the
# runs" flags runs whose records name no code).
#   scripts/reproduce_locked.sh prereg_cpu_v3 prereg_cpu_v3_e16
#   JOBS=1 TORCH_SPEC=torch scripts/reproduce_locked.sh prereg_137m   # one run at a time on a GPU
#   TRAIN=0 scripts/reproduce_locked.sh prereg_cpu_v3   # evaluate, keep and analyse only
#   AUDIT=1 scripts/reproduce_locked.sh prereg_cpu_v3   # and train 1 kept run per arm again
#     (picked at random, in runs/prereg/STUDY-audit): on the machine kind it was kept from its
#     weights must be the kept ones; elsewhere its metrics are compared (docs/STUDY/audit.txt,
#     which also names the code that trained each run again: its record's, or for a lock
#     commit older than code records the commit its provenance.json names with that commit's
#     code hash, against the lock's; and the code here that evaluated it)
set -euo pipefail
stoppable() {  # run "${@:2}" in folder $1 as a job of its own (set -m: its SIGINT is not ignored
  # and `timeout`'s SIGTERM to this script's process group does not reach it), stopped with
  # SIGINT, as Ctrl-C stops it, when this script gets SIGINT or SIGTERM (once): a lock
  # commit's `prereg run` older than its own SIGTERM handling would end at once on SIGTERM and
  # leave its runners training as orphans
  local dir=$1
  shift
  set -m
  (cd "$dir" && exec "$@") &
  job=$!
  set +m
  trap 'trap "" INT TERM; kill -INT "$job" 2>/dev/null || true; wait "$job" || true; exit 130' INT TERM
  local rc=0
  wait "$job" || rc=$?
  trap - INT TERM
  return "$rc"
}
[ $# -gt 0 ] || { echo "usage: $0 STUDY [STUDY ...] (experiments/STUDY.yaml, locked)" >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
cd "$root"
for name in "$@"; do
  f="experiments/$name.yaml"
  [ -f "$f" ] || { echo "$f does not exist" >&2; exit 1; }
  [ -f "$f.lock.json" ] || { echo "$f is not locked: its pilot, then its lock committed alone" >&2; exit 1; }
  commit=$(git log -n 1 --format=%H -- "$f.lock.json")
  [ -n "$commit" ] || { echo "$f.lock.json is not committed: commit it alone first" >&2; exit 1; }
  tree="$root/.study/${commit:0:12}"
  [ -d "$tree" ] || git worktree add --detach "$tree" "$commit"
  make -C "$tree" setup ${TORCH_SPEC:+TORCH_SPEC="$TORCH_SPEC"}
  if grep -q "corpus/stdlib.jsonl" "$tree/$f"; then
    want=$(grep -o "corpus sha256: [0-9a-f]\{64\}" "$tree/$f" | head -n 1 | cut -d' ' -f3) || true
    [ -n "$want" ] || { echo "$f names corpus/stdlib.jsonl but states no 'corpus sha256: <hex>'" >&2; exit 1; }
    if [ ! -f "$tree/corpus/stdlib.jsonl" ]; then
      if [ -f "$root/corpus/stdlib.jsonl" ]; then
        mkdir -p "$tree/corpus" && cp "$root/corpus/stdlib.jsonl" "$tree/corpus/"
      else
        (cd "$tree" && .venv/bin/python scripts/pack_corpus.py corpus/stdlib.jsonl)
      fi
    fi
    got=$(sha256sum "$tree/corpus/stdlib.jsonl" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "$tree/corpus/stdlib.jsonl has sha256 $got, not the $want $f states: delete it and bring the file the study names (pack it with the Python it names)" >&2; exit 1; }
  fi
  make -C "$root" setup ${TORCH_SPEC:+TORCH_SPEC="$TORCH_SPEC"}
  if grep -q "data=stdlib" "$tree/$f"; then  # the corpus is the interpreter's own library:
    # every piece of the study trains and evaluates under the Python its first piece used
    stamp="$root/docs/$name/stdlib_python.txt"
    for py in "$tree/.venv/bin/python" "$root/.venv/bin/python"; do
      got=$("$py" -c 'import platform; print(platform.python_version())')
      if [ ! -f "$stamp" ]; then mkdir -p "$(dirname "$stamp")" && echo "$got" > "$stamp"; fi
      [ "$got" = "$(cat "$stamp")" ] || { echo "$f trains on data=stdlib, the library of Python $(cat "$stamp") ($stamp); $py is Python $got, whose library is another corpus: use Python $(cat "$stamp")" >&2; exit 1; }
    done
  fi
  here="$root/.venv/bin/moestack"  # reads kept runs; the lock's code trains
  out="$root/runs/prereg/$name"
  kept="$root/docs/$name/runs"
  [ ! -d "$kept" ] || "$here" prereg restore "$f" --out "$out" --kept "$kept"
  [ "${TRAIN:-1}" = 0 ] || stoppable "$tree" "$tree/.venv/bin/moestack" prereg run "$f" --out "$out" --jobs "${JOBS:-2}"
  "$here" prereg evaluate "$f" --out "$out" --jobs "${JOBS:-2}"
  "$here" prereg keep "$f" --out "$out" --kept "$kept"
  if [ "${AUDIT:-0}" -gt 0 ] && [ -d "$kept" ]; then  # AUDIT kept runs per arm trained again
    scratch="$root/runs/prereg/$name-audit"
    [ -f "$scratch/audit_picks.json" ] || { rm -rf "$scratch"; "$here" prereg audit "$f" --out "$scratch" --kept "$kept" --recheck "$AUDIT"; }
    stoppable "$tree" "$tree/.venv/bin/moestack" prereg run "$f" --out "$scratch" --jobs "${JOBS:-2}"
    "$here" prereg evaluate "$f" --out "$scratch" --jobs "${JOBS:-2}"
    "$here" prereg audit "$f" --out "$scratch" --kept "$kept" | tee "$root/docs/$name/audit.txt"
  fi
  done_all='import sys; from moestack import prereg; s = prereg.status(sys.argv[1], out_dir=sys.argv[2]); sys.exit(s["total"]["finished"] != s["runs"])'
  if "$root/.venv/bin/python" -c "$done_all" "$f" "$out"; then
    "$here" prereg analyze "$f" --out "$out" --jobs "${JOBS:-2}" --report "$root/docs/$name"
  else
    echo "$name: not every run is finished; run this script again (here or on another machine, after committing $kept)"
  fi
done
