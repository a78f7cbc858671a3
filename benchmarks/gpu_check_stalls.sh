#!/usr/bin/env bash
# Per-instruction warp-state sampling (ncu SourceCounters) of the wgmma decode kernel: SASS with
# stall reasons, gzipped under $OUT, e.g. to find instruction-fetch stalls (NOTES.md item 45).
# Usage (GPU machine, repo root):
#   bash benchmarks/gpu_check_stalls.sh c d          # the op on each case's planned split
#   MERGE=1 bash benchmarks/gpu_check_stalls.sh shipped no_part_reads
#                                                    # (b) at 2 splits merged in the kernel, by
#                                                    # merge_in_kernel variant (merge_profile.py)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --version | tail -1
for name in "$@"; do
  if [ "${MERGE:-0}" = 1 ]; then
    program=(benchmarks/experiments/merge_profile.py --case b --splits 2 --variant "$name")
    name="merge_$name"
  else
    program=(benchmarks/profile_decode.py --case "$name")
  fi
  "$NCU" --clock-control none -k regex:_mla_decode_wgmma -s 2 -c 1 --section SourceCounters \
    --section WarpStateStats -f -o "/tmp/stalls_$name" python3 "${program[@]}" 2>&1 \
    | grep -v '^==' | tail -2
  "$NCU" -i "/tmp/stalls_$name.ncu-rep" --page source --csv --print-source sass \
    > "/tmp/sass_$name.csv" 2> /dev/null
  gzip -9 -c "/tmp/sass_$name.csv" > "$OUT/sass_$name.csv.gz"; ls -la "$OUT/sass_$name.csv.gz"
done
