#!/usr/bin/env bash
# Every GPU check and measurement (issues 3, 7, 16, 17, 19, 29, 30, 31, 34, 53 and 56) on a
# lent machine, most valuable first, inside fixed time budgets. No network: nothing is
# installed; the package is staged the way pip would lay it out.
#
#   bash scripts/gpu_check.sh --dry-run        # the plan: phases, time caps, files; no GPU
#   bash scripts/gpu_check.sh                  # the first call; writes under $OUT (./gpu_out)
#   GPU_CHECK_PHASES=bench_serve,bench_lora,bench_stream bash scripts/gpu_check.sh   # the second
#   GPU_CHECK_PHASES=bench_moe,train bash scripts/gpu_check.sh   # some phases (names/prefixes)
#
# The caps are the times of the first H200 run (2026-11-30, BENCHMARKS.md) with headroom, or
# estimates where a phase has not run yet (each says so below). Each call is sized for one
# device call: the phases' caps plus staging fit GPU_CHECK_SECONDS (default 560), and the
# worst case adds one phase's SIGKILL grace and the summary (--dry-run prints the sums). Each
# phase's cap is also clipped to what is left of the budget, so a slow phase costs the phases
# after it, never the call. The phases the open issues need do not fit one call (750 s of
# caps; a call runs at most 600 s): the default plan is the first call (the bf16 kernels and
# every candidate tile config, issue 30's benchmark with the new paths retuned, the
# launch-by-launch profile of what it chose, the CUDA tests of the optimizer, the optimizer
# and training-step benchmark), and the phases of kind "second" (bench_serve, bench_lora,
# bench_stream) are the second call, sized to what the 15 minutes of a session's lent
# machine leave after the first call and the start-up. Optional phases run only when named
# (the 137M training runs among them: they ran on 2026-11-30, and the serving benchmark took
# their room).
#
# Output under $OUT, written as it goes: summary.txt (a line per phase as it ends, then a
# one-screen summary), log.txt (every phase's full output) and the files of each phase
# (--dry-run lists them). After a run, copy tuned_configs.json to kernels/ and commit it, and
# record the tables in BENCHMARKS.md with the date and the GPU.
set -u -o pipefail

CALL_S=580   # timeout_s of the device call the default plan is sized for
SECOND_CALL_S=230 # timeout_s of the second call (what the 15 minutes leave after the first)
SETUP_S=10   # staging the package and carried wheels, before the first phase
GRACE_S=10   # a phase past its cap gets SIGINT, then SIGKILL this many seconds later
SUMMARY_S=5  # the closing summary
PACK_S=5     # after the script, inside the device call: packing $OUT's files (docs/kernels.md)

# name|cap in seconds|files under $OUT|default, second or optional|what it shows
# default: the first call; second: the second call (GPU_CHECK_PHASES=<the second phases>);
# optional: only when named.
PLAN=(
    "env|15|log.txt|default|GPU, driver, torch/triton/transformers/accelerate versions; the staged package imports; the host kernel OffloadAdamW will run (built here: compiler found or not)"
    "kernel_tests|215|kernel_tests.xml|default|bf16 kernels and every candidate tile vs float64; no host syncs (also on the persistent, torch-dW and fused-dSwiGLU paths); id asserts; >2^31 elements; LoRA's Triton path and training with streamed experts on CUDA"
    "bench_moe|130|bench_moe.json,tuned_configs.json|default|issue-3 and issue-30 tables and targets; mm, wgrad, mm_dswiglu retuned at every shape (persistent GEMM, torch dW, fused dSwiGLU timed vs classic tiles); outputs checked vs torch first; measured winners saved per shape"
    "profile_moe|40|profile_moe.json|default|the configs bench_moe chose in this run, launch by launch (fwd and bwd GEMMs, gathers, SwiGLU bwd, dW, the rest; the new paths labelled) at three shapes"
    "profile_moe_new|40|profile_moe_new.json|optional|the same with the persistent GEMM, torch's dW and the fused dSwiGLU forced (labelled per launch)"
    "optim_tests|30|optim_tests.xml|default|OffloadAdamW's overlap path, serial and pipelined, vs torch AdamW, also with every transfer stalled; per-layer waits on CUDA; optim=tiered's state offloaded to pinned host memory stepping the device bits"
    "bench_optim|120|bench_optim.json|default|optimizer step; training step of optim=tiered, after backward, in it and with its state offloaded (issue 53: peak memory <= 0.45x and step <= 1.05x device AdamW's) and OffloadAdamW pipelined, serial, in-backward and delayed vs device AdamW and torchao (when carried), each clipped and unclipped, with its parts and the compute stream's idle time (CUDA events); pinned copy GB/s each way and both at once; 200-step loss delayed vs exact (cut to 40 s, the steps run recorded); per contender whether it ran pipelined and its host kernel"
    "memory|15|bench_optim_memory.json|optional|device and host bytes per parameter, offload vs device AdamW"
    "bench_serve|80|bench_serve.json|second|serving from the expert cache vs every expert resident and accelerate's CPU offload (accelerate wheel); median (range) of 3 repeats, targets' rows first"
    "train_offload_adamw|40|train_offload_adamw.json,train_offload_adamw_metrics.jsonl|optional|20 steps of the 137M model with OffloadAdamW (hydra wheels)"
    "train_adamw|40|train_adamw.json,train_adamw_metrics.jsonl|optional|the same 20 steps with device AdamW"
    "bench_memory|60|bench_memory.json|optional|m137 step per model.checkpointing mode and compile=true: peak memory, step time (hydra wheels)"
    "tune|120|tuned_configs.json|optional|tune_kernels.py: every variant at 8k and 16k tokens, the plain grouped GEMM"
    "more_tests|60|more_tests.xml|optional|the interpreter's kernel tests and the MoE layer tests, on CUDA"
    "bench_lora|60|bench_lora.json|second|issue 34: m137 fine-tuned fully (device AdamW), router-only and LoRA r16 (fp32 and bf16 frozen base): peak memory, step time"
    "ep_check|60|ep_check.json|optional|the EP layer on NCCL (>= 2 GPUs) vs one process, max abs error per rank; else says it skipped"
    "bench_stream|60|bench_stream.json|second|issue 56: a Qwen3-30B-A3B MoE layer (128 experts of width 768 at d_model 2048, top-8; 2.4 GB of fp32 experts) LoRA-tuned with the experts resident and in pinned host memory through a cache of 16 slots: device memory (max_memory_allocated), step time, bytes moved (an estimate: not run on a GPU yet)"
)

second_only() { # whether GPU_CHECK_PHASES names phases of the second call and no others
    [[ -n ${GPU_CHECK_PHASES:-} ]] || return 1
    local entry found=1
    for entry in "${PLAN[@]}"; do
        selected "$(field "$entry" 0)" "$(field "$entry" 3)" || continue
        [[ $(field "$entry" 3) == second ]] || return 1
        found=0
    done
    return $found
}

field() { # field ENTRY INDEX: one |-separated field of a plan entry (0-based)
    local IFS='|'
    local -a parts
    read -r -a parts <<<"$1"
    echo "${parts[$2]}"
}

selected() { # selected NAME KIND: whether the phase runs (GPU_CHECK_PHASES: names or prefixes)
    if [[ -z ${GPU_CHECK_PHASES:-} ]]; then
        [[ $2 == default ]]
        return
    fi
    local item
    for item in ${GPU_CHECK_PHASES//,/ }; do
        [[ $1 == "$item"* ]] && return 0
    done
    return 1
}

cap_of() { # cap_of NAME: the phase's time cap from the plan
    local entry
    for entry in "${PLAN[@]}"; do
        [[ $(field "$entry" 0) == "$1" ]] && field "$entry" 1 && return
    done
    echo "gpu_check.sh: phase $1 is not in PLAN; add it there" >&2
    exit 2
}

# The device call this invocation is sized for, and its budget: what the call leaves after
# one phase's SIGKILL grace, the summary and the packing (GPU_CHECK_SECONDS where the call
# is shorter).
THIS_CALL_S=$CALL_S
second_only && THIS_CALL_S=$SECOND_CALL_S
BUDGET=${GPU_CHECK_SECONDS:-$((THIS_CALL_S - GRACE_S - SUMMARY_S - PACK_S))}

dry_run() { # the plan of this invocation: phases, caps, files, and the worst-case total
    local entry name cap total=0
    echo "gpu_check plan: budget ${BUDGET} s (GPU_CHECK_SECONDS), sized for one call of ${THIS_CALL_S} s"
    printf '  %-20s %5s  %-58s %s\n' phase cap "files under \$OUT" "what it shows"
    for entry in "${PLAN[@]}"; do
        name=$(field "$entry" 0)
        cap=$(field "$entry" 1)
        selected "$name" "$(field "$entry" 3)" || continue
        printf '  %-20s %4ss  %-58s %s\n' "$name" "$cap" "$(field "$entry" 2)" "$(field "$entry" 4)"
        total=$((total + cap))
    done
    echo "  always: summary.txt (a line per phase as it ends, then the summary), log.txt"
    [[ -z ${GPU_CHECK_PHASES:-} ]] &&
        echo "  optional (name them in GPU_CHECK_PHASES): $(names_of optional)"
    local worst=$((SETUP_S + total + GRACE_S + SUMMARY_S))
    echo "worst case: setup ${SETUP_S} + phases ${total} + grace ${GRACE_S} + summary ${SUMMARY_S} = ${worst} s of a ${THIS_CALL_S} s call"
    ((SETUP_S + total <= BUDGET)) ||
        echo "  over the budget by $((SETUP_S + total - BUDGET)) s: the last phases get less than their caps"
    [[ -z ${GPU_CHECK_PHASES:-} ]] && second_call_plan
    return 0
}

names_of() { # names_of KIND: the plan's phases of that kind, space-separated
    local entry out=()
    for entry in "${PLAN[@]}"; do
        [[ $(field "$entry" 3) == "$1" ]] && out+=("$(field "$entry" 0)")
    done
    echo "${out[*]}"
}

second_call_plan() { # the phases that do not fit the first call, and the call that runs them
    local entry name cap total=0 listed=""
    for entry in "${PLAN[@]}"; do
        [[ $(field "$entry" 3) == second ]] || continue
        name=$(field "$entry" 0)
        cap=$(field "$entry" 1)
        listed+="${listed:+, }$name (${cap} s)"
        total=$((total + cap))
    done
    local names
    names=$(names_of second)
    echo "second call (these phases do not fit the first with honest caps): GPU_CHECK_PHASES=${names// /,} bash scripts/gpu_check.sh"
    echo "  its phases: $listed"
    echo "  its worst case: setup ${SETUP_S} + phases ${total} + grace ${GRACE_S} + summary ${SUMMARY_S} = $((SETUP_S + total + GRACE_S + SUMMARY_S)) s of a ${SECOND_CALL_S} s call"
}

case "${1:-}" in
--dry-run)
    dry_run
    exit 0
    ;;
"") ;;
*)
    echo "gpu_check.sh: unknown argument ${1}; use --dry-run or no argument" >&2
    exit 2
    ;;
esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
LOG=$OUT/log.txt
: >"$SUMMARY"
: >"$LOG"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled

# Stage the package as installed (moestack.kernels <- kernels/, moestack.telemetry <-
# telemetry/, moestack.configs <- configs/; see pyproject.toml), with tests and scripts.
STAGE=$(mktemp -d)
mkdir -p "$STAGE/moestack"
cp -r "$REPO/moestack/." "$STAGE/moestack/"
cp -r "$REPO/kernels" "$STAGE/moestack/kernels"
cp -r "$REPO/telemetry" "$STAGE/moestack/telemetry"
cp -r "$REPO/configs" "$STAGE/moestack/configs"
cp -r "$REPO/tests" "$REPO/scripts" "$REPO/pyproject.toml" "$STAGE/"
cd "$STAGE" || exit 1
export PYTHONPATH=$STAGE
# Optional baselines carried as wheels in .whl/ (e.g. torchao, docs/kernels.md): no network,
# no dependencies, installed beside the staged package.
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$STAGE/site" "$REPO"/.whl/*.whl >>"$LOG" 2>&1 &&
        export PYTHONPATH=$STAGE:$STAGE/site
fi
# Tuning merges into a copy of the checked-in table; every later phase reads that copy.
cp "$REPO/kernels/tuned_configs.json" "$OUT/tuned_configs.json"
export MOESTACK_TUNED_CONFIGS=$OUT/tuned_configs.json
# One triton cache for every phase and for a second call on the same machine: bench_moe's
# autotuning and profile_moe load the candidate kernels kernel_tests compiled (the tests'
# conftest keeps a TRITON_CACHE_DIR that is set, and makes a temporary one only where none
# is). Outside $OUT, so that it does not come back with the results.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/moestack-gpu-check-triton}
mkdir -p "$TRITON_CACHE_DIR"

phase() { # phase NAME COMMAND...: run under the plan's cap, log, record the outcome
    local name=$1 kind=default entry
    shift
    for entry in "${PLAN[@]}"; do
        [[ $(field "$entry" 0) == "$name" ]] && kind=$(field "$entry" 3)
    done
    selected "$name" "$kind" || return 0
    local limit
    limit=$(cap_of "$name")
    local left=$((BUDGET - SECONDS))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        echo "$name: skipped (time budget spent)" | tee -a "$SUMMARY"
        return
    fi
    echo "===== $name (limit ${limit}s): $*" >>"$LOG"
    local t0=$SECONDS
    timeout --signal=INT --kill-after="$GRACE_S" "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local verdict=ok
    ((rc == 124 || rc == 137)) && verdict="TIMED OUT"
    ((rc != 0 && rc != 124 && rc != 137)) && verdict="FAILED (rc $rc)"
    echo "$name: $verdict in $((SECONDS - t0))s" | tee -a "$SUMMARY"
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra")
# Kernel compilation, not GPU time, dominates the tests: with pytest-xdist the workers
# compile in parallel; triton's on-disk cache (above) is shared between them and the later
# phases. The kernel tests compile every candidate tile config (60-90 s a test on the H200
# machine's 16 cores, 2026-11-30): they get a worker per core, up to 16; the other phases 4.
# xdist's default hand-out gives each worker two tests at once in collection order, then one
# at a time as they finish: test_kernels_gpu.py puts its slowest tests first, so that they
# start together and the short ones fill in around them. Its work stealing (--dist
# worksteal) hands out contiguous chunks and steals by count, not time: simulated with the
# durations below it ends later (median 196 s against 167 s), so it is not used.
KERNEL_PYTEST=("${PYTEST[@]}")
if "$PY" -c "import xdist" 2>/dev/null; then
    cores=$(nproc 2>/dev/null || echo 4)
    KERNEL_PYTEST+=(-n $((cores < 16 ? cores : 16)))
    PYTEST+=(-n 4)
fi

phase env bash -c "nvidia-smi; $PY -c 'import sys, torch, triton; print(sys.version); \
print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda); \
print(torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA device\"); \
import moestack.kernels, moestack.optim; print(\"moestack staged at\", moestack.__file__); \
from moestack.optim import fused; print(fused.host_kernel_report()); \
import importlib.util as u; print(\"torchao:\", bool(u.find_spec(\"torchao\"))); \
import importlib.metadata as m; v = lambda n: m.version(n) if u.find_spec(n) else None; \
print(\"transformers:\", v(\"transformers\"), \"accelerate:\", v(\"accelerate\"))'"
# 92 tests: 28 candidate-config tests (60-85 s each on 2026-11-30, when there were 20), the
# device-side id checks (92 + 32 s), the persistent GEMM only trimmed (its default candidate
# and its large tile, both load paths: 12 tests of one compile each; the layer with it
# forced; the tile table's no-sync check), the no-sync checks of the persistent, torch-dW and
# fused-dSwiGLU paths. Estimate (2026-11-30's durations, the new tests guessed, each +-15%):
# about 2400 s of test time, 150 s on 16 workers if perfectly spread; xdist's hand-out
# simulated: 193 s median (p90 208) in the old file order, where most workers got two
# candidate tests back to back and the 92 s test waited behind one, 167 s (p90 175) with the
# slowest first, 184 s (p90 192) if every test runs 10% slower on 16 workers than on 12; plus
# 10-15 s to start the workers: 180-210 s of the 215 s cap. Not yet measured. Then 17 short
# tests, handed out as workers free up: LoRA on the experts (14, both paths, fp32, fp16 and
# bf16: a few new kernel compiles) and training with streamed experts (3, a tiny model).
MOESTACK_AUTOTUNE=0 phase kernel_tests "${KERNEL_PYTEST[@]}" --junitxml="$OUT/kernel_tests.xml" \
    tests/kernels/test_kernels_gpu.py tests/model/test_no_host_sync_gpu.py tests/cache/test_cache_gpu.py \
    tests/kernels/test_persistent.py::test_gpu_default_and_large_tile_bf16 \
    tests/kernels/test_persistent.py::test_gpu_layer_bf16 \
    tests/kernels/test_persistent.py::test_tile_table_never_syncs \
    tests/model/test_lora_gpu.py tests/cache/test_streaming_gpu.py
# Autotunes on first use, checks every contender against the torch path, saves the checked
# winners into the table after every shape. The checked-in table's entries of the kinds with
# candidates it was never timed against (mm: the persistent GEMM; wgrad: torch's dW, 256x128,
# block_k 128; mm_dswiglu: no entry) are not read: those keys autotune at every shape, and
# only configs measured here are saved (with their provenance). Estimate: 59-67 s measured on
# 2026-11-30 with 42 keys autotuned, now 36 keys (mm_swiglu's 12 read from the table) and 61
# timings a shape instead of 47, and the persistent candidates' compiles at these shapes (9,
# 3-6 s each) not in the cache the tests filled: 100-115 s of the 130 s cap. Not yet measured.
phase bench_moe "$PY" scripts/bench_moe.py --json "$OUT/bench_moe.json" \
    --save-tuned "$OUT/tuned_configs.json" --retune mm,wgrad,mm_dswiglu
# Which launch of the Triton layer takes the time (the backward lost to torch on 2026-11-30):
# the configs bench_moe measured and chose in this run (the table it saved; the checked-in
# one where it did not run), each launch labelled by role, with " [persistent]",
# " [torch._grouped_mm]" or "+SwiGLU'" where the tuner chose issue 30's paths: where the time
# of what ships goes, for a target bench_moe missed. Optional: the same with every new path
# forced (profile_moe_new). No autotuning: every kernel they launch was compiled by bench_moe
# (estimate 20-30 s, not yet measured).
MOESTACK_AUTOTUNE=0 phase profile_moe "$PY" scripts/profile_moe.py \
    --shapes mixtral-8k,qwen3_30b-8k,olmoe-8k --json "$OUT/profile_moe.json"
MOESTACK_AUTOTUNE=0 phase profile_moe_new "$PY" scripts/profile_moe.py \
    --shapes mixtral-8k,qwen3_30b-8k,olmoe-8k --persistent --fused-dswiglu --torch-wgrad \
    --json "$OUT/profile_moe_new.json"
MOESTACK_AUTOTUNE=0 phase optim_tests "${PYTEST[@]}" --junitxml="$OUT/optim_tests.xml" \
    tests/optim/test_offload_devices.py tests/optim/test_offload_pipeline.py \
    tests/optim/test_tiered_offload.py
phase bench_optim "$PY" scripts/bench_optim.py --only gpu,train_step,delay_loss --reps 5 \
    --delay-loss-budget-s 40 --json "$OUT/bench_optim.json"
phase memory "$PY" scripts/bench_optim.py --only memory --json "$OUT/bench_optim_memory.json"
# Issue 31: a random Qwen3-30B-A3B-like model served from the expert cache (LRU and static at
# k, 2k, 25% and 50% of a layer's experts, prefetch off and on, and over the disk tier),
# against every expert on the GPU and against accelerate's CPU offload (the accelerate
# wheel, docs/kernels.md); each phase the median (range) of 3 repeats. The rows the targets
# judge run first (the ceiling, LRU at 2k and 25% without and with prefetch, accelerate);
# a later row is skipped, with the reason, when the slowest row of its kind so far would end
# past --budget-s (the first cache row always runs). The JSON is written after every row
# and an interrupt still prints the table, so it ends inside its cap with what it measured.
phase bench_serve "$PY" scripts/bench_serve.py --budget-s 55 --json "$OUT/bench_serve.json"
# Issue 34's targets: LoRA's peak device memory against a full fine-tune with device AdamW
# (<= 0.5x) and its step against a router-only one (<= 1.3x), on the 137M model, 16k tokens.
# Its runs are composed as moestack-train composes them: it needs the hydra wheels.
if "$PY" -c "import hydra" 2>/dev/null; then
    MOESTACK_AUTOTUNE=0 phase bench_lora "$PY" scripts/bench_lora.py --moestack-model m137 \
        --device cuda --batch-size 16 --seq-len 1024 --steps 8 --warmup 3 --max-bytes 4000000 \
        --json "$OUT/bench_lora.json"
elif selected bench_lora second; then
    echo "bench_lora: skipped (hydra is not importable; carry its wheels)" | tee -a "$SUMMARY"
fi
# Issue 56: frozen experts streamed through the expert cache in training, each mode in a fresh
# process (the JSON's rows, written after each: device_peak_bytes, step_s, the cache's traffic
# per step). Building the model and its store takes most of the cap: on 2 CPU cores (the same
# command on the CPU, 2026-12-08) 8 s resident, 27 s host (the store written and read back);
# the disk mode (22 s more) and a second layer do not fit.
phase bench_stream "$PY" scripts/bench_stream.py --device cuda --experts-mb 2400 --experts 128 \
    --d-model 2048 --d-ff 768 --top-k 8 --capacity 16 --batch 4 --seq 512 --steps 5 \
    --threads 8 --modes resident,host --json "$OUT/bench_stream.json"
# End-to-end training of the 137M model (bf16 autocast, triton experts, the table's configs):
# the training CLI needs hydra-core, omegaconf and antlr4 carried as wheels (docs/kernels.md).
if "$PY" -c "import hydra" 2>/dev/null; then
    for optim in offload_adamw adamw; do
        MOESTACK_AUTOTUNE=0 phase "train_$optim" "$PY" -m moestack.train model=m137 \
            optim="$optim" telemetry=off steps=20 batch_size=8 data.seq_len=512 eval_every=0 \
            eval_batches=2 ckpt_every=0 log_every=5 wandb_mode=disabled progress=false \
            out_dir="$STAGE/run_$optim"
        [[ -f $STAGE/run_$optim/summary.json ]] && cp "$STAGE/run_$optim/summary.json" "$OUT/train_$optim.json"
        [[ -f $STAGE/run_$optim/metrics.jsonl ]] && cp "$STAGE/run_$optim/metrics.jsonl" "$OUT/train_${optim}_metrics.jsonl"
    done
elif selected train_offload_adamw optional; then
    echo "train: skipped (hydra is not importable; carry its wheels)" | tee -a "$SUMMARY"
fi
# Issue 17's GPU rows: peak memory (torch.cuda.max_memory_allocated) and step time of m137 in
# each checkpointing mode and compiled; compose_config needs the hydra wheels too.
if "$PY" -c "import hydra" 2>/dev/null; then
    MOESTACK_AUTOTUNE=0 phase bench_memory "$PY" scripts/bench_memory.py --device cuda \
        --steps 5 --json "$OUT/bench_memory.json"
elif selected bench_memory optional; then
    echo "bench_memory: skipped (hydra is not importable; carry its wheels)" | tee -a "$SUMMARY"
fi
phase tune "$PY" scripts/tune_kernels.py --tokens 8192 16384 --out "$OUT/tuned_configs.json"
MOESTACK_AUTOTUNE=0 phase more_tests "${PYTEST[@]}" --junitxml="$OUT/more_tests.xml" \
    tests/kernels/test_grouped_gemm.py tests/kernels/test_moe_experts.py tests/model/test_moe.py
# Issue 16: the expert-parallel layer over NCCL, one process per GPU, against one process
# (outputs and gradients, torch and triton experts); with fewer than 2 GPUs it writes and
# prints that it skipped, and why.
MOESTACK_AUTOTUNE=0 phase ep_check "$PY" scripts/ep_check.py --json "$OUT/ep_check.json"
if ! selected ep_check optional; then # not in the plan: say so, and why it matters
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    if ((gpus < 2)); then
        echo "ep_check: skipped, needs >= 2 GPUs, found $gpus" | tee -a "$SUMMARY"
    else
        echo "ep_check: not run; GPU_CHECK_PHASES=ep_check runs it on these $gpus GPUs" | tee -a "$SUMMARY"
    fi
fi

ran() { grep -q "^===== $1" "$LOG"; } # ran NAME: whether a phase (or prefix) started

{ # One screen: what passed, what failed, the figures that matter; the rest is in log.txt.
    echo
    echo "--- tests (per phase; failures listed)"
    awk '/^===== /{ph=$2} /^(FAILED|ERROR) /{print ph": "$0}
         / (passed|failed|errors?|skipped)/ && / in [0-9.]+s/{print ph": "$0}' "$LOG" | head -16
    if ran bench_moe; then
        echo "--- bench_moe (output checks against the torch path, then issue 3's and issue 30's targets)"
        grep -E "OUTPUT CHECK FAILED|: failed: |output check FAILED|not saving" "$LOG" | head -6
        echo "contenders checked ok: $(grep -cE " vs moestack-torch: .*: ok$" "$LOG")"
        grep -E "^(retuning |issue-(3|30) targets |  (met   |MISSED) |tuned configs this run: )" \
            "$LOG" | head -40
    fi
    for pass in profile_moe profile_moe_new; do
        ran "$pass " || continue
        echo "--- $pass (the Triton layer launch by launch; the configs it ran first)"
        sed -n "/^===== $pass /,/^=====/p" "$LOG" | grep -vE "^(=====|$)" | head -40
    done
    if ran bench_optim; then
        echo "--- bench_optim (GPU optimizer step, training step and its parts)"
        sed -n '/^===== bench_optim/,/^=====/p' "$LOG" |
            grep -E "step_ms|_part_|vs_adamw|_pipelined|_host_step|_error|serial_reason|host_kernel|cut_by_budget|delayed_vs_exact" | head -40
    fi
    if ran bench_serve; then
        echo "--- bench_serve (serving from the expert cache: tokens/s, memory, bytes, hit rate)"
        sed -n '/^===== bench_serve/,/^=====/p' "$LOG" |
            grep -E "^(bench_serve: |setup: |\| |serve (target|check): )" | head -50
    fi
    if ran bench_lora; then
        echo "--- bench_lora (m137: full fine-tune, router-only, LoRA; issue 34's targets)"
        sed -n '/^===== bench_lora/,/^=====/p' "$LOG" |
            grep -E "^(model=|contender |all |routers |lora|target )" | head -10
    fi
    if ran bench_stream; then
        echo "--- bench_stream (training with streamed experts: a JSON row per mode)"
        sed -n '/^===== bench_stream/,/^=====/p' "$LOG" | grep -E '^\{"mode"' | head -6
    fi
    if ran bench_memory; then
        echo "--- bench_memory (m137 per checkpointing mode and compiled: MiB, step s)"
        grep -E "^\[cuda\] " "$LOG" | head -9
    fi
    if ran train_; then
        echo "--- training (offload_adamw, then adamw)"
        grep -E "^(train loss|val loss|tokens/s) " "$LOG"
    fi
    if ran ep_check; then
        echo "--- ep_check (expert parallelism on NCCL vs one process)"
        grep -E "^(ep_check: |  beyond atol)" "$LOG" | head -6
    fi
    echo "--- tuned configs in the table: $(grep -c '"block_m"' "$OUT/tuned_configs.json")"
    if [[ -z ${GPU_CHECK_PHASES:-} ]]; then
        names=$(names_of second)
        echo "--- not in this call (no room with honest caps): $names; next, on the same machine:"
        echo "GPU_CHECK_PHASES=${names// /,} bash scripts/gpu_check.sh   # device call timeout_s ${SECOND_CALL_S}"
        echo "(send it at once: a machine idle 30 s goes back; with less than ${SECOND_CALL_S} s of device time left: timeout_s = what is left - 10, GPU_CHECK_SECONDS 20 s under it)"
    fi
} | tee -a "$SUMMARY"
rm -rf "$STAGE"
# The exit status says whether every phase that ran passed.
! grep -qE ": (FAILED|TIMED OUT)" "$SUMMARY"
