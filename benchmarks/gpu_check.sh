#!/usr/bin/env bash
# One check on a lent GPU (an H200) in at most ~6 minutes, with the machine's own torch/triton, no network
# (docs/benchmarks.md):
#   0. comparators from wheels carried in .whl/ (below)                      -> .whl/site first on PYTHONPATH
#   1. machine, versions, copy bandwidth and matmul rate, once               -> OUT_DIR/env.json
#   2. the GPU tests (-m gpu), then the kernel test files (time-capped)       -> OUT_DIR/tests*.log
#   3. the GPU benchmark set, headline cases first, time-budgeted: ours beside Liger-Kernel, TRL's head,
#      quack's cross-entropy, Cut Cross-Entropy and verl's linear_cross_entropy where they import
#                                                                             -> OUT_DIR/gpu.json
#   3b. one full GRPO step, ours vs TRL (trainer_step; --quick with the smoke set) -> OUT_DIR/trainer_step-*
#   4. the report, the trainer step's tables appended                        -> OUT_DIR/gpu.md (+ PNGs)
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   (default benchmarks/results/gpu-<date>)
# Knobs: PYTHON (default python), DEADLINE_S (default 360; 1800 with the smoke set), TEST_TIMEOUT_S (120;
# 900: the kernel test files on a CPU), GRPO_BENCH_IMPLS, GRPO_BENCH_NOTE, GPU_CHECK_KERNEL_TESTS=0, TRAINER_STEP_S (90; 600; 0 skips it),
# GPU_CHECK_BENCH_ARGS (extra pytest arguments for step 3). Dry run without a GPU (CI's `make bench-ci`):
#   GPU_CHECK_ALLOW_CPU=1 GPU_CHECK_SET=smoke GPU_CHECK_KERNEL_TESTS=0 bash benchmarks/gpu_check.sh /tmp/x
#
# Comparators without network: download their wheels into .whl/ (git-ignored; WHEEL_DIR overrides) where
# there is network, for the GPU machine's Python (3.12; its image has torch, triton, einops), and carry
# .whl with the working tree (64 MiB at most in all):
#   pip download --no-deps -d .whl liger-kernel==0.8.5 trl==1.16.0 cut-cross-entropy==25.1.1 verl==0.9.1
#   # quack's cross-entropy: ~100 MB with nvidia-cutlass-dsl's libraries, over the carry limit (run it where allowed):
#   pip download --no-deps -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
#       quack-kernels nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext
# Step 0 installs every wheel there with --no-deps into .whl/site (never the machine's torch/triton); verl's
# kernel is imported without verl's package __init__ (which needs Ray). A comparator that does not import
# is skipped with the reason, in the report's table. Exit status: 0 when every step ran and the tests
# passed, else the first failing step's; whatever was produced stays in OUT_DIR.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
OUT_DIR=${1:-${OUT_DIR:-benchmarks/results/gpu-$(date -u +%Y%m%d)}}
BENCH_SET=${GPU_CHECK_SET:-gpu}
if [ "$BENCH_SET" = smoke ]; then  # a CPU dry run, bounded by CI's own limit, not a GPU lease
    DEADLINE_S=${DEADLINE_S:-1800}; TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-900}; TRAINER_STEP_S=${TRAINER_STEP_S:-600}
    export GRPO_LC_SET=${GRPO_LC_SET:-smoke}
else
    DEADLINE_S=${DEADLINE_S:-360}; TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-120}; TRAINER_STEP_S=${TRAINER_STEP_S:-90}
fi
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
START=$SECONDS
STATUS=0
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
fail() { local rc=$1; shift; log "FAILED ($rc): $*"; if [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi; }
has_cuda() { $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; }

# --- 0. a CUDA device, and the carried comparators --------------------------------------------------
if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ] && ! has_cuda; then log "no CUDA device visible to torch: nothing to check"; exit 3; fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$OUT_DIR/nvidia-smi.csv" 2>/dev/null || true
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
$PY -c "from benchmarks import kernels; print('implementations importable here:', ', '.join(kernels.implementations('cuda')))" \
    2>> "$LOG" | tee -a "$LOG" || true

# --- 1. environment and ceilings (none on a CPU: they are noise there) --------------------------------
log "machine info, copy bandwidth and matmul rate"
CEILING_ARGS=()
if ! has_cuda; then CEILING_ARGS=(--no-ceilings); fi
$PY -m benchmarks.harness machine "${CEILING_ARGS[@]}" --out "$OUT_DIR/env.json" > /dev/null 2>> "$LOG" || fail 1 "harness machine"
read -r COPY_GBPS MATMUL_TFLOPS < <($PY -c "
import json; e = json.load(open('$OUT_DIR/env.json')); print(e.get('copy_gbps') or '', e.get('matmul_tflops') or '')" 2>/dev/null || echo "")
log "copy ${COPY_GBPS:-?} GB/s, matmul ${MATMUL_TFLOPS:-?} TFLOP/s"

# --- 2. GPU tests: the gpu-marked ones, then the kernel test files (time-capped) ----------------------
TEST_END=$((SECONDS + TEST_TIMEOUT_S))
log "tests -m gpu"
rc=0
timeout "$TEST_TIMEOUT_S" $PY -m pytest tests -q -m gpu -p no:cacheprovider > "$OUT_DIR/tests-gpu.log" 2>&1 || rc=$?
tail -n 3 "$OUT_DIR/tests-gpu.log" | tee -a "$LOG"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then fail "$rc" "pytest -m gpu (124 = timed out)"; fi  # 5: none collected
LEFT=$((TEST_END - SECONDS))
if [ "${GPU_CHECK_KERNEL_TESTS:-1}" = 0 ] || [ "$LEFT" -le 10 ]; then
    log "kernel test files skipped (GPU_CHECK_KERNEL_TESTS=${GPU_CHECK_KERNEL_TESTS:-1}, ${LEFT}s left)"
else
    rc=0
    timeout "$LEFT" $PY -m pytest tests/test_functional.py tests/test_autograd.py tests/test_triton_rows.py -q \
        -m "not gpu and not slow" -p no:cacheprovider > "$OUT_DIR/tests-kernels.log" 2>&1 || rc=$?
    tail -n 3 "$OUT_DIR/tests-kernels.log" | tee -a "$LOG"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then fail "$rc" "kernel test files (124 = timed out)"; fi
fi

# --- 3. the benchmark set, time-budgeted so the JSON is always written --------------------------------
BUDGET=$((DEADLINE_S - (SECONDS - START) - 30 - TRAINER_STEP_S - 45))  # 30 s: the report; 45: the last case's overrun
if [ "$BUDGET" -lt 30 ]; then BUDGET=30; fi
log "benchmarks ($BENCH_SET set), budget ${BUDGET}s for starting cases"
rc=0
GRPO_BENCH_SET="$BENCH_SET" GRPO_BENCH_BUDGET_S="$BUDGET" GRPO_BENCH_COPY_GBPS="$COPY_GBPS" GRPO_BENCH_MATMUL_TFLOPS="$MATMUL_TFLOPS" \
    timeout $((BUDGET + 60)) $PY -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider ${GPU_CHECK_BENCH_ARGS:-} \
    --benchmark-json "$OUT_DIR/gpu.json" --benchmark-columns=min,median,max,rounds > "$OUT_DIR/bench.log" 2>&1 || rc=$?
grep -A40 "fused-linear peak memory checks" "$OUT_DIR/bench.log" | tee -a "$LOG" || true
tail -n 2 "$OUT_DIR/bench.log" | tee -a "$LOG"
if [ "$rc" -ne 0 ]; then fail "$rc" "benchmarks (124 = timed out)"; fi

# --- 3b. one full GRPO step, after the kernel cases (the headline numbers come first) -----------------
TRAINER_MD=""
if [ "$TRAINER_STEP_S" -gt 0 ]; then
    if [ "$BENCH_SET" = smoke ]; then STEP_ARGS=(--quick); else STEP_ARGS=(--rounds 1 --one-process); fi
    STEP_ARGS+=(--timeout $((TRAINER_STEP_S - 10)))
    log "trainer step (${STEP_ARGS[*]}), at most ${TRAINER_STEP_S}s"
    rc=0
    timeout $((TRAINER_STEP_S + 60)) $PY -m benchmarks.trainer_step "${STEP_ARGS[@]}" --out-dir "$OUT_DIR" \
        > "$OUT_DIR/trainer_step.log" 2>&1 || rc=$?
    grep "^\[trainer_step\]" "$OUT_DIR/trainer_step.log" | tee -a "$LOG" || true
    if [ "$rc" -ne 0 ]; then fail "$rc" "benchmarks.trainer_step (124 = timed out)"; fi
    TRAINER_MD=$(ls "$OUT_DIR"/trainer_step-*.md 2>/dev/null | tail -n 1 || true)
fi

# --- 4. report -----------------------------------------------------------------------------------------
if [ -s "$OUT_DIR/gpu.json" ]; then
    log "report"
    $PY -m benchmarks.kernels report "$OUT_DIR/gpu.json" --env "$OUT_DIR/env.json" \
        --title "grpo-kernels benchmarks: $BENCH_SET set" >> "$LOG" 2>&1 || fail $? "benchmarks.kernels report"
    if [ -n "$TRAINER_MD" ] && [ -s "$OUT_DIR/gpu.md" ]; then { echo; cat "$TRAINER_MD"; } >> "$OUT_DIR/gpu.md"; fi
else
    fail 1 "no gpu.json written"
fi
log "done in $((SECONDS - START))s, status $STATUS; results in $OUT_DIR"
exit "$STATUS"
