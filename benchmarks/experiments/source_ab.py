"""A/B of a change to the wgmma kernel: the package's ``mla_ops/wgmma_decode.py`` against other
copies of it, on bench_decode's cases, alternating in rounds on one machine (benchmarks/NOTES.md
item 53 on).

Each variant's output is checked against float64 attention (over the dequantised cache for a
float8 case; such a case's error against the bf16 cache it was quantised from is reported too,
``rel_err_bf16``) before it is timed; timing is bench_decode's: the planner's plan, the wgmma kernel
launched directly with the op's tiling, then ``mla::combine``; CUDA-graph replays of rotated
input copies (clean L2), median.

    git show HEAD:mla_ops/wgmma_decode.py > /tmp/base.py
    python benchmarks/experiments/source_ab.py --sources base=/tmp/base.py --cases a8,d8,e8 \
        --out $OUT

Cases are bench_decode's (``a`` ... ``g``) or ``X8``: case ``X`` over a float8 cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from fp8_layout import case_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--sources", required=True,
        help="name=path[+key=int...],...: the copies to compare, each with optional launch "
        "keywords (e.g. +num_stages=3); the path 'package' is the package's own file",
    )  # fmt: skip
    ap.add_argument("--cases", default="a8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="source_ab", help="the JSON's file name under --out")
    args = ap.parse_args()
    try:
        extra_modules, extra_kw = bd.parse_sources(args.sources)
    except ValueError as e:
        ap.error(str(e))
    modules = {"package": None, **extra_modules}
    launch_kw = {"package": {}, **extra_kw}
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for case_name in args.cases.split(","):
        case, copies, plan, ref, row = case_inputs(case_name, ceil, float64_reference=True)
        variants = {
            name: dict(module=module, **launch_kw[name]) for name, module in modules.items()
        }
        bd.time_rounds(row, case_name, copies, plan, ref, variants, args.rounds)
        if case.fp8:
            # Also against the bf16 cache the float8 one was quantised from (the issue's "within
            # fp8 tolerance of the bf16 result"; bench_decode's a8 error).
            ref_bf16 = bd.reference(copies[0], case)
            for name, kw in variants.items():
                row[name]["rel_err_bf16"] = bd.rel_err(
                    bd.wgmma_call(copies[0], *plan, **kw)(), ref_bf16
                )
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, args.name, ceil, rows, sources=args.sources)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; {ceil}")
    for row in rows:
        print(f"{row['case']}: plan {row['num_splits']}/{row['total_splits']}")
        for name in modules:
            us = row[name]["us"]
            print(
                f"  {name:12} {', '.join(f'{u:.1f}' for u in us):>16} us  "
                f"{row['floor_us'] / min(us):.2f} of its roofline  err {row[name]['rel_err']:.1e}"
                + (
                    f", vs bf16 {row[name]['rel_err_bf16']:.2e}"
                    if "rel_err_bf16" in row[name]
                    else ""
                )
            )


if __name__ == "__main__":
    main()
