"""The in-kernel merge under a profiler: ``mla::attention`` merging in the wgmma kernel, shipped or
a ``merge_in_kernel`` diagnostic variant, called a few times for ``ncu`` to attach to (NOTES.md
item 45: what holds the partial reads of one-scorer programs to about 24 GB/s per multiprocessor).

    ncu --clock-control none -k regex:_mla_decode_wgmma -c 1 --metrics dram__bytes_read.sum \\
        python benchmarks/experiments/merge_profile.py --case br40 --variant no_part_reads
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
import merge_in_kernel as mk
import wgmma_bottleneck as wb

from mla_ops import triton_kernels as tk
from mla_ops import wgmma_decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="br40", help="a bench_decode case or br32 / br40")
    ap.add_argument("--splits", type=int, default=None, help="even splits (default: the plan)")
    ap.add_argument("--variant", default="shipped", choices=["shipped", *mk.DIAGNOSTIC])
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    case = bd.CASES.get(args.case) or mk.EXTRA_CASES[args.case]
    inp = bd.Inputs(case, torch.Generator().manual_seed(0), with_contiguous=False)
    plan = bd.planned(case, inp) if args.splits is None else (args.splits, None)
    if args.variant != "shipped":
        wb.VARIANTS[args.variant] = mk.DIAGNOSTIC[args.variant]
        wgmma_decode.launch = wb.build(args.variant, Path(tempfile.mkdtemp())).launch
    tk.MERGE_MAX_SPLITS = plan[0]
    for _ in range(args.calls):
        torch.ops.mla.attention(*inp.op_args(*plan))
    torch.cuda.synchronize()
    assert tk.LAST_LAUNCH["merge"].startswith("decode kernel"), tk.LAST_LAUNCH["merge"]
    print(f"{args.case} {args.variant} plan={tuple(plan)}: {tk.LAST_LAUNCH['merge']}")


if __name__ == "__main__":
    main()
