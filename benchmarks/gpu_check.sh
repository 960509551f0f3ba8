#!/usr/bin/env bash
# The GPU path on one machine with a GPU, in under 8 minutes (its parts,
# table and exit codes: docs/benchmarks.md#gpu-check). PYTHON selects the
# interpreter (default: .venv/bin/python, else python3).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # default: /tmp/gpu_check
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

# A broken interpreter is not "no GPU": it stops the check.
if ! gpus=$(TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c \
  'import tensorflow as tf; print(len(tf.config.list_physical_devices("GPU")))' \
  2>"$OUT_DIR/detect.log"); then
  echo "gpu_check: $PY cannot import TensorFlow (see $OUT_DIR/detect.log)." >&2
  exit 2
fi
gpus=$(printf '%s\n' "$gpus" | tail -1)
case "$gpus" in '' | *[!0-9]*) gpus=0 ;; esac
# Nor is a GPU TensorFlow cannot use, unless CUDA_VISIBLE_DEVICES hides it.
listed=0
case "${CUDA_VISIBLE_DEVICES-unset}" in
  '' | -1) ;;
  *) listed=$(timeout 10 nvidia-smi -L 2>/dev/null | grep -c '^GPU [0-9]') ;;
esac
if [ "$gpus" -eq 0 ] && [ "${listed:-0}" -gt 0 ]; then
  version=$("$PY" -c 'import importlib.metadata as m
print(".".join(m.version("tensorflow").split(".")[:2]))' 2>/dev/null)
  echo "gpu_check: nvidia-smi lists $listed GPU(s) but TensorFlow sees none" \
    "(its log: $OUT_DIR/detect.log): install its CUDA libraries:" \
    "$PY -m pip install 'tensorflow[and-cuda]==${version:-2.21}.*'" >&2
  exit 2
fi
FAILED=0
device="no GPU"
if [ "$gpus" -gt 0 ]; then
  device=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
    2>/dev/null | head -1)
  device="${device:-$gpus GPU(s)}"
fi

printf '# GPU check\n\nMachine: %s CPU cores, %s; %s.\n\n%s\n%s\n' "$(nproc)" \
  "$device" "$(date -u +%Y-%m-%dT%H:%MZ)" "| part | command | exit | seconds | result |" \
  "|---|---|---|---|---|" >"$TABLE"

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
    FAILED=1
    result="FAILED: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)"
  fi
  row "$part" "$*" "$code" "$((end - start))" "${result:-see $log}"
}

if [ "$gpus" -eq 0 ]; then
  echo "gpu_check: no GPU visible to TensorFlow: skipped the GPU parts."
fi
RESULT='accuracy=[0-9.]+ sync_steps_applied=[0-9]+ stale_gradients_dropped=[0-9]+'
run_part main_job_gpu 120 "$RESULT" \
  "$PY" -m tf2sync --num_gpus=1 --epochs=3
run_part main_job_mixed_float16 120 "$RESULT" \
  "$PY" -m tf2sync --num_gpus=1 --epochs=3 --mixed_precision=mixed_float16
# Its result: each system's median examples/s, from the harness's report
# (the log has JSON records, not the table).
run_part w2_gpu_workers 210 'no line of the log' \
  env TF2SYNC_BENCH_GPUS="$gpus" "$PY" benchmarks/harness.py --scenarios=main --workloads=w2 \
  --systems=tf2sync_fit,tf2sync_loop,pss_async,mwms --repeats=3 \
  --worker_gpus=1 --output_dir="$OUT_DIR/w2"
if [ "$gpus" -gt 0 ] && [ -f "$OUT_DIR/w2/benchmarks.md" ]; then
  rates=$(grep -E '^\| `(tf2sync_fit|tf2sync_loop|pss_async|mwms)` \| [0-9,]+ \|' \
    "$OUT_DIR/w2/benchmarks.md" | head -4 |
    awk -F'|' '{gsub(/[ `]/, "", $2); gsub(/ /, "", $3); printf "%s%s %s ex/s", sep, $2, $3; sep="; "}')
  if [ -n "$rates" ]; then # the row's result cell: the medians
    sed -i "s#^\(| w2_gpu_workers | .* | 0 | [0-9]* | \)see [^|]* |\$#\1$rates |#" "$TABLE"
  fi
  printf '\n## w2 with GPU workers (harness report)\n\n' >>"$TABLE"
  cat "$OUT_DIR/w2/benchmarks.md" >>"$TABLE"
fi
cat "$TABLE"
echo "gpu_check: table in $TABLE"
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check: a part failed (see its row)." >&2
  exit 1
fi
