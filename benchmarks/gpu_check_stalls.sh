#!/usr/bin/env bash
# Per-instruction warp-state sampling (ncu SourceCounters) of the wgmma decode kernel on the
# planner's plan, for the cases given: SASS with stall reasons, to find instruction-fetch stalls
# (NOTES.md item 45). Usage (GPU machine, repo root): bash benchmarks/gpu_check_stalls.sh c d
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for case in "$@"; do
  "$NCU" --clock-control none -k regex:_mla_decode_wgmma -s 2 -c 1 --section SourceCounters \
    --section WarpStateStats -f -o "/tmp/stalls_$case" \
    python3 benchmarks/profile_decode.py --case "$case" 2>&1 | grep -v '^==' | tail -2
  "$NCU" -i "/tmp/stalls_$case.ncu-rep" --page source --csv --print-source sass \
    > "/tmp/sass_$case.csv" 2> /dev/null
  gzip -9 -c "/tmp/sass_$case.csv" > "$OUT/sass_$case.csv.gz"; ls -la "$OUT/sass_$case.csv.gz"
done
