#!/usr/bin/env bash
# Where the in-kernel merge's warps stall (NOTES.md item 45): ncu's per-instruction warp-state
# sampling of the merging wgmma kernel, (b) at 2 splits, as SASS with its stall reasons.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --version | tail -1
for variant in shipped no_part_reads; do
  "$NCU" --clock-control none -k regex:_mla_decode_wgmma -s 2 -c 1 --section SourceCounters \
    --section WarpStateStats -f -o "/tmp/merge_$variant" \
    python3 benchmarks/experiments/merge_profile.py --case b --splits 2 --variant "$variant" \
    2>&1 | grep -v '^==PROF==' | tail -2
  "$NCU" -i "/tmp/merge_$variant.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/sass_$variant.csv" 2> "$OUT/sass_$variant.err"
  wc -c "$OUT/sass_$variant.csv"; head -c 400 "$OUT/sass_$variant.err"
  head -2 "$OUT/sass_$variant.csv" | cut -c1-1500
done
