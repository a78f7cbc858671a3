#!/usr/bin/env bash
# compute-sanitizer over every decode kernel path (benchmarks/sanitize_kernels.py), on a GPU
# machine, repository root. Usage: bash benchmarks/gpu_sanitize.sh [memcheck] [racecheck] [synccheck]
# memcheck runs every path in one process; racecheck and synccheck one process per path (a
# reported hazard or a failed launch then names its path). Logs go to $OUT (default: .).
set -uo pipefail
OUT=${OUT:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
TOOLS=${*:-memcheck racecheck synccheck}
LIMIT=${SANITIZE_LIMIT_S:-120}  # seconds a path may take under one tool
for tool in $TOOLS; do
  if [ "$tool" = memcheck ]; then
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_kernels.py \
      > "$OUT/sanitize_memcheck.log" 2>&1
    echo "memcheck: exit $? ($(grep -c 'ok (' "$OUT/sanitize_memcheck.log") paths ok)"
    grep "ERROR SUMMARY" "$OUT/sanitize_memcheck.log"
    continue
  fi
  for path in $(python3 benchmarks/sanitize_kernels.py --list); do
    timeout "$LIMIT" compute-sanitizer --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitize_kernels.py \
      --paths "$path" > "$OUT/sanitize_${tool}_${path}.log" 2>&1
    echo "$tool $path: exit $? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' \
      "$OUT/sanitize_${tool}_${path}.log" | tr '\n' ' ')"
  done
done
