"""Splits merged inside the wgmma decode kernel (``mla::attention`` with
``triton_kernels.MERGE_MAX_SPLITS`` at least the call's ``num_splits``) against the decode writing
float32 partials for ``mla::combine`` (``MERGE_MAX_SPLITS = 0``), A/B on one machine.

Times ``mla::attention`` (CUDA-graph replays, rotated inputs) under the planner's plan and any
extra split counts given, and checks each variant's output against the float32 reference of
``bench_decode``.

    python benchmarks/experiments/merge_in_kernel.py --cases a,b,e,f,g --splits b:2 --out $OUT

``--row-lanes`` also times the in-kernel merge of a variant built from the kernel's source
(``ROW_LANES``, not shipped; NOTES.md item 44): in a program of 4 warps and 64 rows (a one-scorer
program), each thread of ``_merge_splits`` holds 16 rows of every split, and the shipped layout
spills 1,912 bytes there (offline sm_90 compile, Triton 3.6); four lanes per row and 32-column
blocks leave it 4 rows and no spill.
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
import wgmma_bottleneck as wb

from mla_ops import triton_kernels as tk
from mla_ops import wgmma_decode

ROW_LANES = [
    (
        "    CHUNK_L: gl.constexpr = 64 if L > 64 else L\n"
        "    parts_layout: gl.constexpr = gl.BlockedLayout(\n"
        "        [MAX_SPLITS, 2, 1], [1, 32, 1], [1, 1, num_warps], [1, 0, 2]\n"
        "    )\n",
        "    ROW_LANES: gl.constexpr = 4 if BLOCK_M // num_warps >= 16 else 1\n"
        "    CHUNK_L: gl.constexpr = 64 // ROW_LANES * 2 if L > 64 // ROW_LANES * 2 else L\n"
        "    parts_layout: gl.constexpr = gl.BlockedLayout(\n"
        "        [MAX_SPLITS, 2, 1], [1, 32 // ROW_LANES, ROW_LANES], [1, 1, num_warps], "
        "[1, 0, 2]\n"
        "    )\n",
    )
]


def attention_call(args: tuple):
    """A closure calling ``mla::attention`` on fixed arguments; returns the output."""
    return lambda: torch.ops.mla.attention(*args)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,b,e,f,g")
    ap.add_argument("--splits", default="", help="extra split counts (even plans), case:n,...")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--row-lanes", action="store_true", help="also the ROW_LANES merge variant")
    args = ap.parse_args()
    launches = {"kernel": wgmma_decode.launch}
    if args.row_lanes:
        wb.VARIANTS["row_lanes"] = ROW_LANES
        launches["kernel_row_lanes"] = wb.build("row_lanes", Path(tempfile.mkdtemp())).launch
    extra = bd.case_counts(args.splits)
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    shipped = tk.MERGE_MAX_SPLITS
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        ref = bd.reference(copies[0], case)
        floor = bd.floor_seconds(case, dict(ceil))
        plan = bd.planned(case, copies[0])
        plans = [(plan.num_splits, plan.total_splits)] + [(n, None) for n in extra.get(name, [])]
        for ns, ts in plans:
            for merger in ("combine", *launches):
                merge = merger != "combine"
                if merge and ns > 8:  # the in-kernel merge holds every split of a column block
                    continue
                tk.MERGE_MAX_SPLITS = ns if merge else 0
                # The op launches wgmma_decode.launch: the variant's for its rows.
                wgmma_decode.launch = launches.get(merger, launches["kernel"])
                fns = [attention_call(inp.op_args(ns, ts)) for inp in copies]
                t, err = bd.time_call(fns, ref)
                wgmma_decode.launch = launches["kernel"]
                assert tk.LAST_LAUNCH["merge"].startswith("decode" if merge else "mla::combine")
                row = dict(
                    case=name, merge=merge, merger=merger, num_splits=ns, total_splits=ts,
                    planner=(ns, ts) == plans[0], us=t * 1e6, roofline_fraction=floor / t,
                    rel_err=err,
                )  # fmt: skip
                rows.append(row)
                print(row, flush=True)
        del copies
        torch.cuda.empty_cache()
    tk.MERGE_MAX_SPLITS = shipped
    bd.save_experiment(args.out, "merge_in_kernel", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    print(f"{'case':5}{'merge':>17}{'splits':>9}{'us':>9}{'roofline':>9}  rel_err")
    for r in rows:
        sp = f"{r['num_splits']}/{r['total_splits']}{'*' if r['planner'] else ''}"
        print(
            f"{r['case']:5}{r['merger']:>17}{sp:>9}{r['us']:9.1f}"
            f"{r['roofline_fraction']:9.3f}  {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
