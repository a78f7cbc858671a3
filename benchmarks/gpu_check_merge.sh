#!/usr/bin/env bash
# The in-kernel merge on a GPU (NOTES.md item 45): the wgmma kernel's tests, then the merge
# against mla::combine on 64- and 16-row plans. Usage (GPU machine, repo root):
#   bash benchmarks/gpu_check_merge.sh           # item 45's run
#   TESTS=... CASES=b,f SPLITS=b:2 FLAGS= DIAGNOSE= bash benchmarks/gpu_check_merge.sh
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider -n 8 ${TESTS:-tests/mla_ops/test_wgmma_decode.py} \
  2>&1 | tee "$OUT/gpu_tests_wgmma.log" | grep -v Warning | grep -v warner | tail -4
DIAGNOSE=${DIAGNOSE-lse_only,no_part_reads,c64}
python3 benchmarks/experiments/merge_in_kernel.py --cases ${CASES:-b,br32,br40,f,e} \
  --splits ${SPLITS:-b:2} ${FLAGS:---before} ${DIAGNOSE:+--diagnose $DIAGNOSE} \
  --out "$OUT" 2>&1 | tee "$OUT/merge_in_kernel.log" | tail -40
