"""How many math warps a 16-row float8 program should run, and how many ring slots
(benchmarks/NOTES.md item 51).

A 16-row program over a float8 cache runs one math warpgroup (convert 64 x 512 e4m3 to fp16,
scores, softmax, P.V) beside one producer warp. This times, on bench_decode's float8 cases (the
planner's plan, then ``mla::combine``, CUDA-graph replays of rotated inputs), after checking each
output against float64 attention over the dequantised cache:
  * ``op``: the op's tiling;
  * ``s3`` / ``s2``: one math warpgroup and a producer warp, three or two ring slots;
  * ``w8-*``: 8 math warps splitting each tile's conversion, rows and P.V columns (with or
    without a producer warp, three or two slots).
It also times the bf16 cache the float8 one was quantised from. The alternate-tile kernel of
item 51 (two warpgroups taking every other tile) and its timing-only variants are at commit
2572a88 (``benchmarks/experiments/fp8_alternate.py`` there).

    python benchmarks/experiments/fp8_warps.py --out $OUT [--cases a8,d8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from fp8_layout import case_inputs

# name -> wgmma_decode.launch keywords ({} is the op's own tiling): 8 math warps (w8), with or
# without a producer warp, 3 or 2 ring slots (s3, s2).
VARIANTS = {
    "op": {},
    "s3": dict(num_stages=3, producer_warps=1),
    "s2": dict(num_stages=2, producer_warps=1),
    "w8-s3": dict(num_warps=8, producer_warps=0, num_stages=3),
    "w8-producer-s3": dict(num_warps=8, producer_warps=1, num_stages=3),
    "w8-s2": dict(num_warps=8, producer_warps=0, num_stages=2),
    "w8-producer-s2": dict(num_warps=8, producer_warps=1, num_stages=2),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a8")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset of the names")
    args = ap.parse_args()
    names = args.variants.split(",")
    if unknown := set(names) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(unknown)}; expected some of {list(VARIANTS)}")
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for case_name in args.cases.split(","):
        case, copies, plan, ref, row = case_inputs(case_name, ceil)
        if case.fp8:
            # The bf16 cache the float8 one was quantised from: what "Nx of bf16" compares with.
            bf16 = bd.input_copies(replace(case, fp8=False), props.L2_cache_size)
            fns = [bd.wgmma_call(inp, *bd.planned(replace(case, fp8=False), inp)) for inp in bf16]
            seconds, _ = bd.time_call(fns)
            row["bf16_us"] = seconds * 1e6
            print(case_name, "bf16 cache", f"{seconds * 1e6:.1f} us", flush=True)
            del bf16, fns
        variants = {name: VARIANTS[name] for name in names}
        bd.time_rounds(row, case_name, copies, plan, ref, variants, args.rounds)
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "fp8_warps", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; {ceil}")
    for row in rows:
        base = row.get("bf16_us", float("nan"))
        print(f"{row['case']}: plan {row['num_splits']}/{row['total_splits']}, bf16 {base:.1f} us")
        for name in names:
            us = row[name]["us"]
            best = min(us)
            print(
                f"  {name:28} {', '.join(f'{u:.1f}' for u in us):>16} us  "
                f"{base / best:5.2f}x of bf16  {row['floor_us'] / best:.2f} of its roofline  "
                f"err {row[name]['rel_err']:.1e}"
            )


if __name__ == "__main__":
    main()
