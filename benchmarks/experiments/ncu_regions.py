"""Where a decode loop's time goes, from an ncu source-level SASS export: the warp-stall samples
of the loop's instructions, summed between its synchronising instructions (benchmarks/NOTES.md
item 55).

    ncu --clock-control none -k regex:_mla_decode_wgmma -s 2 -c 1 --section SourceCounters \\
        -o a8 python benchmarks/experiments/fp8_profile.py
    ncu --import a8.ncu-rep --page source --print-source sass --csv > a8.csv
    python benchmarks/experiments/ncu_regions.py a8.csv --executed 32768,32256 --us 128.2

The loop is the instructions executed ``--executed`` times (warp-level counts: the math warps
times the tiles; a second count for the instructions skipped on the last tile). A new segment
starts at each ``WARPGROUP.ARRIVE`` (a wgmma group's issue), ``WARPGROUP.DEPBAR`` (a wait for
one) and ``SYNCS`` operation (an mbarrier wait for a ring slot's tile, or its hand-back).
``--us``: the kernel's duration, to turn samples into microseconds per tile (one math warp's
samples taken to cover the whole run).
"""

from __future__ import annotations

import argparse
import csv
import gzip
from collections import Counter

MARKERS = ("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "SYNCS.")
REASONS = (
    "barrier", "long_sb", "short_sb", "wait", "mio", "selected", "no_inst", "branch_resolving",
    "math",
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output (.gz too)")
    ap.add_argument("--executed", default="32768", help="comma-separated warp-level counts")
    ap.add_argument("--us", type=float, default=None, help="the kernel's duration (us)")
    ap.add_argument("--warps", type=int, default=4, help="math warps per program")
    ap.add_argument("--tiles", type=int, default=64, help="tiles per program")
    args = ap.parse_args()
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        rows = list(csv.reader(f))
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    counts = set(args.executed.split(","))
    segments: list[tuple[str, Counter]] = []
    for row in rows[2:]:
        if row[col["Instructions Executed"]] not in counts:
            continue
        source = row[col["Source"]].strip()
        if not segments or any(m in source for m in MARKERS):
            segments.append((source[:48], Counter()))
        stalls = segments[-1][1]
        stalls["samples"] += int(row[col["# Samples"]] or 0)
        for reason in REASONS:
            stalls[reason] += int(row[col[f"stall_{reason}"]] or 0)
    total = sum(s["samples"] for _, s in segments)
    # Samples of one math warp cover the run: total / warps samples <-> the duration.
    us_per_sample = args.us / (total / args.warps) if args.us else None
    print(f"loop samples {total} in {len(segments)} segments")
    for first, stalls in segments:
        top = ", ".join(f"{r} {stalls[r]}" for r in sorted(REASONS, key=lambda r: -stalls[r])[:3])
        per_tile = ""
        if us_per_sample:
            per_tile = f"{stalls['samples'] / args.warps / args.tiles * us_per_sample:6.3f} us/tile"
        print(f"{stalls['samples']:6d} {per_tile}  {first:48s}  {top}")


if __name__ == "__main__":
    main()
