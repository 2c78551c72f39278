#!/usr/bin/env bash
# Every GPU check in one go, for a GPU machine lent for a few minutes: the CUDA tests, the
# GPU rows of the storage and sharded benchmarks, and the save_async stall of a GPU-resident
# state. Each step's output goes to $OUT (or ./gpu-out); a failing step does not stop the others.
# Run from the repository root, after `make install`: bash bench/gpu_checks.sh
set -u
out="${OUT:-gpu-out}"
mkdir -p "$out"
py=.venv/bin/python
status=0
step() {
  local name="$1"; shift
  echo "== $name: $*"
  if ! timeout "${STEP_TIMEOUT:-300}" "$@" >"$out/$name.log" 2>&1; then
    echo "   FAILED (see $out/$name.log)"; status=1
  fi
  tail -n 25 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv >"$out/gpu.txt" 2>&1
step cuda-tests "$py" -m pytest tests/cuda -q -p no:cacheprovider -n 0
step gpu-load "$py" bench/bench_storage.py --only gpu-load --size-mib 1024 --repeats 3 --markdown-out "$out/gpu-load.md"
step sharded-cuda "$py" bench/bench_sharded.py --device cuda --worlds 1 --repeats 3
step gpu-stall "$py" bench/bench_gpu_stall.py --params 1.2e9 --repeats 3 --markdown-out "$out/gpu-stall.md"
exit $status
