#!/usr/bin/env bash
# One device session: environment facts, the GPU test subset, then the decode benchmark.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_run.sh [bench args...]
# Writes logs and results under $OUT (or benchmarks/results when OUT is unset).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/mla_ops 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/bench_decode.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^cases'
fi
