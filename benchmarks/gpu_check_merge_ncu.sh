#!/usr/bin/env bash
# What holds the in-kernel merge's partial reads (NOTES.md item 45): ncu metrics of the merging
# wgmma kernel, shipped against the variant without partial reads, on (b) at 2 splits and br40.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,\
lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,\
smsp__inst_executed.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,\
l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,\
smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct
for spec in "b 2" "br40 0"; do
  set -- $spec
  for variant in shipped no_part_reads lse_only; do
    extra=$([ "$2" != 0 ] && echo "--splits $2")
    "$NCU" --clock-control none -k regex:_mla_decode_wgmma -s 2 -c 1 --metrics "$METRICS" --csv \
      python3 benchmarks/experiments/merge_profile.py --case "$1" $extra --variant "$variant" \
      > /tmp/ncu.csv 2> /tmp/ncu.err
    { echo "## $1 $variant"; cat /tmp/ncu.csv; } >> "$OUT/ncu_merge.csv"
    { echo "## $1 $variant"; cat /tmp/ncu.err; } >> "$OUT/ncu_merge.err"
    echo "== $1 $variant"; grep -v '^==PROF==' /tmp/ncu.csv | python3 -c "
import csv, sys
for r in csv.DictReader(l for l in sys.stdin if l.startswith('\"')):
    print(f\"  {r['Metric Name']:70} {r['Metric Unit']:8} {r['Metric Value']}\")"
    tail -2 /tmp/ncu.err
  done
done
