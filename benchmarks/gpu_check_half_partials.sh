#!/usr/bin/env bash
# NOTES.md item 79 on a GPU machine (repo root): fp16 partials against float32 ones in
# alternating rounds (experiments/half_partials.py), then the GPU tests of the one-scorer
# programs and their fp16 partials. Writes under $OUT (or benchmarks/results).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${AB_TIMEOUT:-330}" python3 benchmarks/experiments/half_partials.py \
  --cases "${CASES:-b,c,bm}" --rounds "${ROUNDS:-2}" --out "$OUT" 2>&1 | tail -16
timeout "${TEST_TIMEOUT:-220}" python3 -m pytest -q -p no:cacheprovider -n 8 \
  tests/mla_ops/test_wgmma_decode.py -k "${TESTS:-half_partials or one_scorer}" 2>&1 \
  | tee "$OUT/gpu_tests_half_partials.log" | tail -6
