#!/usr/bin/env bash
# One check on a lent GPU in at most 6 minutes: bash benchmarks/gpu_check.sh [OUT_DIR] (benchmarks/README.md: gpu_check.sh).
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
OUT_DIR=${1:-${OUT_DIR:-benchmarks/results/gpu-$(date -u +%Y%m%d)}}
BENCH_SET=${GPU_CHECK_SET:-gpu}
if [ "$BENCH_SET" = smoke ]; then  # a CPU dry run, bounded by CI's own limit, not a GPU lease
    DEADLINE_S=${DEADLINE_S:-1800}; TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-900}; TRAINER_STEP_S=${TRAINER_STEP_S:-600}
    LONG_CONTEXT_S=${LONG_CONTEXT_S:-300}; export GRPO_LC_SET=${GRPO_LC_SET:-smoke}
    REPLAY_S=${REPLAY_S:-120}; REPLAY_VLLM_S=${REPLAY_VLLM_S:-300}
    STEP_ARGS=(--quick); LC_ARGS=(--smoke); REPLAY_ARGS=(--smoke); REPLAY_VLLM_ARGS=(--smoke --engine-mask)
else
    DEADLINE_S=${DEADLINE_S:-360}; TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-90}; TRAINER_STEP_S=${TRAINER_STEP_S:-75}
    LONG_CONTEXT_S=${LONG_CONTEXT_S:-60}; REPLAY_S=${REPLAY_S:-60}; REPLAY_VLLM_S=${REPLAY_VLLM_S:-120}
    STEP_ARGS=(--rounds 1 --one-process --sides ours trl trl+patch); LC_ARGS=(--device cuda --tokens 32768 --rounds 1 --variants base offload)
    REPLAY_ARGS=(--tokens 16384 --hidden 4096 --vocab 151936 --dtypes bf16 --backend triton --rounds 3)
    REPLAY_VLLM_ARGS=(--engine-mask --engine-dtype bfloat16)
fi
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
START=$SECONDS
STATUS=0
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
fail() { local rc=$1; shift; log "FAILED ($rc): $*"; if [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi; }
run_step() {  # run_step SECONDS NAME LOGFILE COMMAND...: the command, killed at its limit
    local limit=$1 name=$2 file=$3 rc=0; shift 3
    log "$name, at most ${limit}s"
    timeout "$limit" "$@" > "$file" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then fail "$rc" "$name (124 = timed out; $file)"; fi  # 5: no test collected
}

# --- 0-1. a CUDA device, the carried comparators, the machine ----------------------------------------
if [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    log "no CUDA device visible to torch: nothing to check"; exit 3
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$OUT_DIR/nvidia-smi.csv" 2>/dev/null || true
shopt -s nullglob
WHEELS=("${WHEEL_DIR:-.whl}"/*.whl)
shopt -u nullglob
if [ "${#WHEELS[@]}" -gt 0 ]; then
    WHEEL_SITE="$(cd "${WHEEL_DIR:-.whl}" && pwd)/site"
    log "installing ${#WHEELS[@]} carried wheel(s) offline into $WHEEL_SITE: ${WHEELS[*]##*/}"
    if $PY -m pip install --no-index --no-deps --quiet --upgrade --target "$WHEEL_SITE" "${WHEELS[@]}" >> "$LOG" 2>&1; then
        export PYTHONPATH="$WHEEL_SITE:$PYTHONPATH"
    else
        fail 1 "offline install of ${WHEEL_DIR:-.whl}/*.whl (the comparators are skipped)"
    fi
fi
$PY -c "from benchmarks import kernels; print('implementations importable here:', ', '.join(kernels.implementations('cuda')))" \
    2>> "$LOG" | tee -a "$LOG" || true

# --- 2. GPU tests: the gpu-marked ones, then the kernel test files (time-capped together) --------------
TEST_END=$((SECONDS + TEST_TIMEOUT_S))
run_step "$TEST_TIMEOUT_S" "tests -m gpu" "$OUT_DIR/tests-gpu.log" $PY -m pytest tests -q -m gpu -p no:cacheprovider
LEFT=$((TEST_END - SECONDS))
if [ "${GPU_CHECK_KERNEL_TESTS:-1}" = 0 ] || [ "$LEFT" -le 10 ]; then
    log "kernel test files skipped (GPU_CHECK_KERNEL_TESTS=${GPU_CHECK_KERNEL_TESTS:-1}, ${LEFT}s left)"
else
    run_step "$LEFT" "kernel test files" "$OUT_DIR/tests-kernels.log" $PY -m pytest tests/test_functional.py tests/test_autograd.py \
        tests/test_triton_rows.py -q -m "not gpu and not slow" -p no:cacheprovider
fi
tail -q -n 1 "$OUT_DIR"/tests-*.log | tee -a "$LOG"

# --- 3. the benchmark set (the ceilings measured first on a GPU), time-budgeted so the JSON is always written --
HAS_CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
HAS_VLLM=$($PY -c "import importlib.util as u; print(int(u.find_spec('vllm') is not None))" 2>/dev/null || echo 0)
if [ "$HAS_CUDA" != 1 ] || [ "$HAS_VLLM" != 1 ]; then REPLAY_VLLM_S=0; fi  # (step 5b says why: not budgeted)
BUDGET=$((DEADLINE_S - (SECONDS - START) - 30 - 25 - TRAINER_STEP_S - LONG_CONTEXT_S - REPLAY_S - REPLAY_VLLM_S))
if [ "$BUDGET" -lt 30 ]; then BUDGET=30; fi
GRPO_BENCH_SET="$BENCH_SET" GRPO_BENCH_BUDGET_S="$BUDGET" \
    run_step $((BUDGET + 60)) "benchmarks ($BENCH_SET set, no case starts after ${BUDGET}s)" "$OUT_DIR/bench.log" \
    $PY -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider ${GPU_CHECK_BENCH_ARGS:-} \
    --benchmark-json "$OUT_DIR/gpu.json" --benchmark-columns=min,median,max,rounds
grep -A40 "fused-linear peak memory checks" "$OUT_DIR/bench.log" | tee -a "$LOG" || true
tail -n 2 "$OUT_DIR/bench.log" | tee -a "$LOG"

# --- 4-5. one GRPO step, ours vs TRL; one long-context step, offload off and on --------------------------
if [ "$TRAINER_STEP_S" -gt 0 ]; then
    run_step "$TRAINER_STEP_S" "trainer step (${STEP_ARGS[*]})" "$OUT_DIR/trainer_step.log" \
        $PY -m benchmarks.trainer_step "${STEP_ARGS[@]}" --timeout $((TRAINER_STEP_S - 10)) --out-dir "$OUT_DIR"
    grep "^\[trainer_step\]" "$OUT_DIR/trainer_step.log" | tee -a "$LOG" || true
fi
if [ "$LONG_CONTEXT_S" -gt 0 ]; then
    run_step "$LONG_CONTEXT_S" "long-context options (${LC_ARGS[*]})" "$OUT_DIR/long_context_options.log" \
        $PY -m benchmarks.long_context options "${LC_ARGS[@]}" --out "$OUT_DIR/long_context_options.md"
fi

# --- 5b. sampling-mask replay (issue 47): the head's time and peak at the headline shape (replay, full, recomputed
# top-p; triton on CUDA); a real vLLM CUDA engine's own kept sets (return_sampling_mask) replayed against its log-probs --
if [ "$REPLAY_S" -gt 0 ]; then
    run_step "$REPLAY_S" "replay timing (${REPLAY_ARGS[*]})" "$OUT_DIR/replay.log" \
        $PY -m benchmarks.replay timing "${REPLAY_ARGS[@]}" --out "$OUT_DIR/replay.md"
    grep "^| replay" "$OUT_DIR/replay.md" 2>/dev/null | tee -a "$LOG" || true
fi
if [ "$HAS_CUDA" != 1 ]; then
    log "replay vLLM: skipped (no CUDA device: the engine's sampling masks need vLLM's GPU model runner)"
elif [ "$HAS_VLLM" != 1 ]; then
    log "replay vLLM: skipped (vllm is not installed for $PY)"
elif [ "$REPLAY_VLLM_S" -gt 0 ]; then
    run_step "$REPLAY_VLLM_S" "replay vLLM (${REPLAY_VLLM_ARGS[*]})" "$OUT_DIR/replay_vllm.log" \
        $PY -m benchmarks.replay vllm "${REPLAY_VLLM_ARGS[@]}" --out "$OUT_DIR/replay_vllm.md"
    grep "^| replay" "$OUT_DIR/replay_vllm.md" 2>/dev/null | tee -a "$LOG" || true
fi

# --- 6. report -----------------------------------------------------------------------------------------
if [ -s "$OUT_DIR/gpu.json" ]; then
    log "report"
    $PY -m benchmarks.kernels report "$OUT_DIR/gpu.json" --title "grpo-kernels benchmarks: $BENCH_SET set" >> "$LOG" 2>&1 \
        || fail $? "benchmarks.kernels report"
    grep -m1 "^Measured ceilings" "$OUT_DIR/gpu.md" | tee -a "$LOG" || true
    for md in "$OUT_DIR"/trainer_step-*.md "$OUT_DIR/long_context_options.md" "$OUT_DIR/replay.md" "$OUT_DIR/replay_vllm.md"; do
        if [ -s "$md" ] && [ -s "$OUT_DIR/gpu.md" ]; then { echo; cat "$md"; } >> "$OUT_DIR/gpu.md"; fi
    done
else
    fail 1 "no gpu.json written"
fi
log "done in $((SECONDS - START))s, status $STATUS; results in $OUT_DIR"
exit "$STATUS"
