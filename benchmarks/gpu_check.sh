#!/usr/bin/env bash
# The GPU path on one machine with a GPU, in under 8 minutes:
#
#   1. the main job with --num_gpus=1 (the local workers share the GPU,
#      ps and chief stay on CPU), 3 epochs;
#   2. the same with --mixed_precision=mixed_float16 (tf2sync's loss
#      scaling on GPU workers);
#   3. w2 (a small conv net) with GPU workers: tf2sync through fit and its
#      custom loop, stock PSS and MultiWorkerMirroredStrategy, side by side
#      (benchmarks/harness.py --worker_gpus=1, 3 repeats).
#
# Writes OUT_DIR/gpu_check.md, a Markdown table (one row per part: exit
# code, seconds, what it printed), and prints it. On a machine without a
# GPU it says that it skipped the GPU parts, still writes the table (each
# row "skipped: no GPU") and exits 0, so CI runs it too.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # default: /tmp/gpu_check
#
# PYTHON selects the interpreter (default: .venv/bin/python, else python3).
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-/tmp/gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
TABLE="$OUT_DIR/gpu_check.md"
export TF_USE_LEGACY_KERAS=1

gpus=$(TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c \
  'import tensorflow as tf; print(len(tf.config.list_physical_devices("GPU")))' \
  2>/dev/null | tail -1)
case "$gpus" in '' | *[!0-9]*) gpus=0 ;; esac
device="no GPU"
if [ "$gpus" -gt 0 ]; then
  device=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
    2>/dev/null | head -1)
  device="${device:-$gpus GPU(s)}"
fi

{
  echo "# GPU check"
  echo
  echo "Machine: $(nproc) CPU cores, $device; $(date -u +%Y-%m-%dT%H:%MZ)."
  echo
  echo "| part | command | exit | seconds | result |"
  echo "|---|---|---|---|---|"
} >"$TABLE"

row() { # part, command, exit, seconds, result
  printf '| %s | `%s` | %s | %s | %s |\n' "$1" "$2" "$3" "$4" "$5" >>"$TABLE"
}

# part, limit in seconds, result-extracting regex, command...
run_part() {
  local part="$1" limit="$2" pattern="$3"
  shift 3
  local log="$OUT_DIR/$part.log" start end code result
  if [ "$gpus" -eq 0 ]; then
    row "$part" "$*" "-" "-" "skipped: no GPU"
    return
  fi
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  code=$?
  end=$(date +%s)
  result=$(grep -Eo "$pattern" "$log" | tail -1)
  if [ "$code" -ne 0 ]; then
    result="FAILED: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)"
  fi
  row "$part" "$*" "$code" "$((end - start))" "${result:-see $log}"
}

if [ "$gpus" -eq 0 ]; then
  echo "gpu_check: no GPU visible to TensorFlow: skipped the GPU parts."
fi
RESULT='accuracy=[0-9.]+ sync_steps_applied=[0-9]+ stale_gradients_dropped=[0-9]+'
run_part main_job_gpu 150 "$RESULT" \
  "$PY" -m tf2sync --num_gpus=1 --epochs=3
run_part main_job_mixed_float16 150 "$RESULT" \
  "$PY" -m tf2sync --num_gpus=1 --epochs=3 --mixed_precision=mixed_float16
run_part w2_gpu_workers 240 'tf2sync_fit[^|]*\|[^|]*\|[^|]*' \
  env TF2SYNC_BENCH_GPUS="$gpus" "$PY" benchmarks/harness.py --scenarios=main --workloads=w2 \
  --systems=tf2sync_fit,tf2sync_loop,pss_async,mwms --repeats=3 \
  --worker_gpus=1 --output_dir="$OUT_DIR/w2"
if [ "$gpus" -gt 0 ] && [ -f "$OUT_DIR/w2/benchmarks.md" ]; then
  {
    echo
    echo "## w2 with GPU workers (harness report)"
    echo
    cat "$OUT_DIR/w2/benchmarks.md"
  } >>"$TABLE"
fi
cat "$TABLE"
echo "gpu_check: table in $TABLE"
