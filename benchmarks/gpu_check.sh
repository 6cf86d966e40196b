#!/usr/bin/env bash
# One check on a lent GPU (written for an H200), in at most ~6 minutes, with the machine's own
# torch/triton (no network; nothing installed into its environment):
#   0. optional comparators from wheels carried in .whl/ (see below)    -> .whl/site on PYTHONPATH
#   1. machine + versions + date, copy bandwidth and matmul rate, once  -> OUT_DIR/env.json
#   2. the GPU tests: `-m gpu` over tests/, then the kernel test files     -> OUT_DIR/tests*.log
#   3. the GPU benchmark set (headline cases first, time-budgeted)        -> OUT_DIR/gpu.json
#      side by side with Liger-Kernel (fused_selective_log_softmax, triton_grpo_loss,
#      LigerFusedLinearGRPOLoss) and TRL's fused log-prob head (trl/kernels/chunked_logprob.py)
#      whenever they are importable
#   3b. one full GRPO step, ours vs TRL (benchmarks/trainer_step.py; with the smoke set its --quick run)
#                                                                         -> OUT_DIR/trainer_step-*.{md,jsonl}
#   4. the report (the trainer step's table appended)                    -> OUT_DIR/gpu.md (+ PNGs)
#
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]      (or OUT_DIR=...; default benchmarks/results/gpu-<date>)
# Knobs (env): PYTHON (default python), DEADLINE_S (whole script, default 360), TEST_TIMEOUT_S
# (default 120), GRPO_BENCH_IMPLS (e.g. reference,triton), GRPO_BENCH_NOTE (free text in the report),
# GPU_CHECK_KERNEL_TESTS=0 (skip the kernel test files of step 2: CI has just run them),
# TRAINER_STEP_S (seconds kept for step 3b, default 90, 600 with the smoke set; 0 skips it),
# GPU_CHECK_BENCH_ARGS (extra pytest arguments for step 3, e.g. --ignore=benchmarks/bench_long_context.py).
# With the smoke set (a CPU dry run, bounded by no GPU lease; a loaded CPU imports slowly) DEADLINE_S
# defaults to 1800 and TEST_TIMEOUT_S to 300: CI's own time limit is the guard there.
# Dry run without a GPU (what CI runs, `make gpu-check-dry`):
#   GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_SET=smoke GPU_CHECK_KERNEL_TESTS=0 bash benchmarks/gpu_check.sh /tmp/x
# The smoke set also sets GRPO_LC_SET=smoke (bench_long_context.py's tiny lengths) unless given.
#
# Comparators without network: put their wheels in .whl/ (git-ignored; WHEEL_DIR overrides) on a
# machine that has network, before the run; the lent machine copies the working tree, ignored
# folders named in its carry list included:
#   pip download --no-deps -d .whl liger-kernel==0.8.5 trl==1.16.0
#   # only if the GPU image lacks them (TRL's head imports trl.trainer): transformers accelerate datasets
#   pip download --no-deps -d .whl transformers accelerate datasets
# Step 0 installs every wheel there with --no-deps into .whl/site (never touching the machine's own
# torch/triton) and puts it first on PYTHONPATH. No wheels: the comparators that are importable anyway run.
# Exit status: 0 when every step ran and the tests passed, else the first failing step's status;
# whatever was produced stays in OUT_DIR either way.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
OUT_DIR=${1:-${OUT_DIR:-benchmarks/results/gpu-$(date -u +%Y%m%d)}}
# (a dry run with the smoke set is not bounded by a GPU lease: a loaded CPU gets more time)
if [ "${GPU_CHECK_SET:-gpu}" = smoke ]; then DEADLINE_S=${DEADLINE_S:-1800}; else DEADLINE_S=${DEADLINE_S:-360}; fi
if [ "${GPU_CHECK_SET:-gpu}" = smoke ]; then TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-300}; else TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-120}; fi
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
START=$SECONDS
STATUS=0
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
fail() { local rc=$1; shift; log "FAILED ($rc): $*"; if [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi; }

# --- 0. a CUDA device, and what it is -------------------------------------------------------------
BENCH_SET=${GPU_CHECK_SET:-gpu}
if [ "$BENCH_SET" = smoke ]; then TRAINER_STEP_S=${TRAINER_STEP_S:-600}; else TRAINER_STEP_S=${TRAINER_STEP_S:-90}; fi
if [ "$BENCH_SET" = smoke ]; then export GRPO_LC_SET=${GRPO_LC_SET:-smoke}; fi
if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    log "no CUDA device visible to torch: nothing to check"
    exit 3
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$OUT_DIR/nvidia-smi.csv" 2>/dev/null || true

# --- 0b. comparators from carried wheels, offline ------------------------------------------------
WHEEL_DIR=${WHEEL_DIR:-.whl}
shopt -s nullglob
WHEELS=("$WHEEL_DIR"/*.whl)
shopt -u nullglob
if [ "${#WHEELS[@]}" -gt 0 ]; then
    WHEEL_SITE="$(cd "$WHEEL_DIR" && pwd)/site"
    log "installing ${#WHEELS[@]} carried wheel(s) offline into $WHEEL_SITE: ${WHEELS[*]##*/}"
    if $PY -m pip install --no-index --no-deps --quiet --upgrade --target "$WHEEL_SITE" "${WHEELS[@]}" >> "$LOG" 2>&1; then
        export PYTHONPATH="$WHEEL_SITE:$PYTHONPATH"
    else
        fail 1 "offline install of $WHEEL_DIR/*.whl (the comparators are skipped)"
    fi
fi
$PY -c "
from benchmarks._harness import liger_available, trl_available
print('comparators importable: liger_kernel', liger_available(), ', trl chunked_logprob', trl_available())
" 2>> "$LOG" | tee -a "$LOG" || true

# --- 1. environment and ceilings (copy bandwidth and matmul rate, measured once) --------------------
log "machine info, copy bandwidth and matmul rate"
CEILING_ARGS=()
# a CPU dry run measures no ceilings (the benchmarks report none on a CPU; a bf16 8192^3 matmul takes minutes)
if [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    CEILING_ARGS=(--no-ceilings)
fi
if ! $PY -m benchmarks.machine "${CEILING_ARGS[@]}" --out "$OUT_DIR/env.json" > /dev/null 2>> "$LOG"; then
    fail 1 "benchmarks.machine"
    $PY -m benchmarks.machine --no-ceilings --out "$OUT_DIR/env.json" > /dev/null 2>> "$LOG" || true
fi
read -r COPY_GBPS MATMUL_TFLOPS < <($PY -c "
import json; e = json.load(open('$OUT_DIR/env.json'))
print(e.get('copy_gbps') or '', e.get('matmul_tflops') or '')" 2>/dev/null || echo "")
log "copy ${COPY_GBPS:-?} GB/s, matmul ${MATMUL_TFLOPS:-?} TFLOP/s"
cat "$OUT_DIR/env.json" >> "$LOG" 2>/dev/null || true

# --- 2. GPU tests: the gpu-marked ones, then the kernel test files (time-capped) -------------------
TEST_END=$((SECONDS + TEST_TIMEOUT_S))
log "tests -m gpu"
rc=0
timeout "$TEST_TIMEOUT_S" $PY -m pytest tests -q -m gpu -p no:cacheprovider > "$OUT_DIR/tests-gpu.log" 2>&1 || rc=$?
tail -n 3 "$OUT_DIR/tests-gpu.log" | tee -a "$LOG"
# exit 5 = nothing collected (no gpu-marked test): not a failure
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then fail "$rc" "pytest -m gpu (124 = timed out)"; fi
shopt -s nullglob
KERNEL_TESTS=(tests/test_functional*.py tests/test_autograd*.py tests/test_triton_rows*.py tests/test_torch_rows*.py)
shopt -u nullglob
LEFT=$((TEST_END - SECONDS))
if [ "${GPU_CHECK_KERNEL_TESTS:-1}" = 0 ]; then
    log "kernel test files skipped (GPU_CHECK_KERNEL_TESTS=0)"
elif [ "${#KERNEL_TESTS[@]}" -gt 0 ] && [ "$LEFT" -gt 10 ]; then
    log "kernel test files (${KERNEL_TESTS[*]}), ${LEFT}s left for tests"
    rc=0
    timeout "$LEFT" $PY -m pytest "${KERNEL_TESTS[@]}" -q -m "not gpu and not slow" -p no:cacheprovider \
        > "$OUT_DIR/tests-kernels.log" 2>&1 || rc=$?
    tail -n 3 "$OUT_DIR/tests-kernels.log" | tee -a "$LOG"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then fail "$rc" "kernel test files (124 = timed out)"; fi
else
    log "kernel test files skipped (${#KERNEL_TESTS[@]} files, ${LEFT}s left)"
fi

# --- 3. the GPU benchmark set, time-budgeted so the JSON is always written ------------------------
REPORT_RESERVE=30
BUDGET=$((DEADLINE_S - (SECONDS - START) - REPORT_RESERVE - TRAINER_STEP_S - 45))  # 45 s: the last case's overrun + startup
if [ "$BUDGET" -lt 30 ]; then BUDGET=30; fi
log "benchmarks ($BENCH_SET set), budget ${BUDGET}s for starting cases"
rc=0
GRPO_BENCH_SET="$BENCH_SET" GRPO_BENCH_BUDGET_S="$BUDGET" GRPO_BENCH_COPY_GBPS="$COPY_GBPS" GRPO_BENCH_MATMUL_TFLOPS="$MATMUL_TFLOPS" \
    timeout $((BUDGET + 60)) $PY -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider ${GPU_CHECK_BENCH_ARGS:-} \
    --benchmark-json "$OUT_DIR/gpu.json" --benchmark-columns=min,median,max,rounds \
    > "$OUT_DIR/bench.log" 2>&1 || rc=$?
grep -A40 "fused-linear peak memory checks" "$OUT_DIR/bench.log" | tee -a "$LOG" || true
tail -n 2 "$OUT_DIR/bench.log" | tee -a "$LOG"
if [ "$rc" -ne 0 ]; then fail "$rc" "benchmarks (124 = timed out)"; fi

# --- 3b. one full GRPO step: ours (fused / reference loss) vs TRL (stock / patched) -----------------
# After the kernel cases (the headline numbers come first); the smoke set runs its CI-sized --quick.
TRAINER_MD=""
if [ "$TRAINER_STEP_S" -gt 0 ]; then
    # every side in one process (one start-up); the process's own timeout leaves time for the tables
    if [ "$BENCH_SET" = smoke ]; then STEP_ARGS=(--quick); else STEP_ARGS=(--rounds 1 --one-process); fi
    STEP_ARGS+=(--timeout $((TRAINER_STEP_S - 10)))
    log "trainer step (${STEP_ARGS[*]}), at most ${TRAINER_STEP_S}s"
    rc=0
    timeout $((TRAINER_STEP_S + 60)) $PY -m benchmarks.trainer_step "${STEP_ARGS[@]}" --out-dir "$OUT_DIR" \
        > "$OUT_DIR/trainer_step.log" 2>&1 || rc=$?
    grep "^\[trainer_step\]" "$OUT_DIR/trainer_step.log" | tee -a "$LOG" || true
    if [ "$rc" -ne 0 ]; then fail "$rc" "benchmarks.trainer_step (124 = timed out)"; fi
    shopt -s nullglob
    for f in "$OUT_DIR"/trainer_step-*.md; do TRAINER_MD="$f"; done
    shopt -u nullglob
fi

# --- 4. report ------------------------------------------------------------------------------------
if [ -s "$OUT_DIR/gpu.json" ]; then
    log "report"
    $PY -m benchmarks.report "$OUT_DIR/gpu.json" --env "$OUT_DIR/env.json" \
        --title "grpo-kernels benchmarks: GPU set" >> "$LOG" 2>&1 || fail $? "benchmarks.report"
    if [ -n "$TRAINER_MD" ] && [ -s "$OUT_DIR/gpu.md" ]; then
        { echo; cat "$TRAINER_MD"; } >> "$OUT_DIR/gpu.md"
    fi
else
    fail 1 "no gpu.json written"
fi
log "done in $((SECONDS - START))s, status $STATUS; results in $OUT_DIR"
exit "$STATUS"
