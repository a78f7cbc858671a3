"""Splits merged inside the wgmma decode kernel (``mla::attention`` with
``triton_kernels.MERGE_MAX_SPLITS`` at least the call's ``num_splits``) against the decode writing
float32 partials for ``mla::combine`` (``MERGE_MAX_SPLITS = 0``), A/B on one machine.

Times ``mla::attention`` (CUDA-graph replays, rotated inputs) under the planner's plan and any
extra split counts given, and checks each variant's output against the float32 reference of
``bench_decode``.

    python benchmarks/experiments/merge_in_kernel.py --cases a,b,e,f,g --splits b:2 --out $OUT
    python benchmarks/experiments/merge_in_kernel.py --cases b,br32,br40,f,e --splits b:2 --before \
        --diagnose lse_only,no_part_reads,c64

``--before`` also times the in-kernel merge of the layout shipped before NOTES.md item 45
(``BEFORE_ROW_LANES``, built from the kernel's source): in a program of 4 warps and 64 rows (a
one-scorer program) each thread of ``_merge_splits`` held 16 rows of every split and spilled 1,912
bytes (offline sm_90, Triton 3.6); the shipped layout gives a warp's lanes 4 rows and no spill.

``--diagnose lse_only,no_part_reads,...`` times variants of the shipped kernel (``DIAGNOSTIC``):
``lse_only`` runs the arrival protocol and the lse merge alone and ``no_part_reads`` stores every
output row without reading a partial (their outputs are garbage); ``c64`` / ``c128`` merge 64- /
128-column blocks; ``unrolled`` unrolls one-scorer programs' column loop and ``rolled_all`` rolls
every program's.

Besides the issue's cases, two ragged 64-row batches of this experiment's own (lengths uniform in
[1, 8192], 128 heads): ``br32`` (32 sequences, the planner's 4 splits, as (b)) and ``br40`` (40
sequences, 2 splits: a batch the op merges in the kernel).
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

# One-scorer programs' column loop unrolled, as before item 45 (its code then ran from a cold
# instruction cache): every program takes the unrolled branch.
UNROLLED = [("    if ROW_LANES > 1:\n        for c in range(NUM_BLOCKS):\n",
             "    if False:\n        for c in range(NUM_BLOCKS):\n")]  # fmt: skip
BEFORE_ROW_LANES = [
    *UNROLLED,
    (
        "    ROW_LANES: gl.constexpr = 4 if BLOCK_M // num_warps >= 16 else 1\n",
        "    ROW_LANES: gl.constexpr = 1\n",
    ),
    (
        "    VEC: gl.constexpr = 4 if ROW_LANES > 1 else 2\n",
        "    VEC: gl.constexpr = 2\n",
    ),
    (
        "    CHUNK_L: gl.constexpr = min(32 if ROW_LANES > 1 else 64, L)\n",
        "    CHUNK_L: gl.constexpr = min(64, L)\n",
    ),
]

# Diagnostic variants (results garbage, times only): where the merging program's time goes.
NO_READ = "read & (n_real < 0)"
FIRST_LOAD = "    part = _merge_block_load(part_rows, offs_c, stride_od, read, 0, CHUNK_L)\n"
ROLLED_LOAD = (
    "                part_rows, offs_c, stride_od, read & (c + 1 < NUM_BLOCKS), c + 1, CHUNK_L\n"
)
STATIC_LOAD = "_merge_block_load(part_rows, offs_c, stride_od, read, c + 1, CHUNK_L)"
ROLLED_LOOP = "        for c in range(NUM_BLOCKS):\n"
STATIC_LOOP = "        for c in gl.static_range(NUM_BLOCKS):\n"
CHUNK_32 = "    CHUNK_L: gl.constexpr = min(32 if ROW_LANES > 1 else 64, L)\n"
DIAGNOSTIC = {
    # The arrival protocol and the lse merge only: no partial read, no output row stored.
    "lse_only": [
        (FIRST_LOAD, FIRST_LOAD.replace("read, 0", f"{NO_READ}, 0")),
        (ROLLED_LOOP, ROLLED_LOOP.replace("NUM_BLOCKS", "0")),
        (STATIC_LOOP, STATIC_LOOP.replace("NUM_BLOCKS", "0")),
    ],
    # Every output row stored, no partial read (masked off: the loads issue, no bytes move).
    "no_part_reads": [
        (FIRST_LOAD, FIRST_LOAD.replace("read, 0", f"{NO_READ}, 0")),
        (ROLLED_LOAD, ROLLED_LOAD.replace("read &", f"{NO_READ} &")),
        (STATIC_LOAD, STATIC_LOAD.replace("read, c", f"{NO_READ}, c")),
    ],
    # More bytes in flight: 64- and 128-column blocks in one-scorer programs (the next block is
    # loaded while this one is merged, so two blocks are in flight).
    "c64": [(CHUNK_32, CHUNK_32.replace("32 if", "64 if"))],
    "c128": [(CHUNK_32, CHUNK_32.replace("32 if", "128 if"))],
    # The shipped layout with the column loop unrolled (the first half of item 45).
    "unrolled": UNROLLED,
    # Every program's column loop rolled, 16- and 32-row programs too.
    "rolled_all": [(UNROLLED[0][0], UNROLLED[0][0].replace("ROW_LANES > 1", "True"))],
}

EXTRA_CASES = {
    "br32": bd.Case("br32", 32, 128, 8192, ragged=True),
    "br40": bd.Case("br40", 40, 128, 8192, ragged=True),
}


def attention_call(args: tuple):
    """A closure calling ``mla::attention`` on fixed arguments; returns the output."""
    return lambda: torch.ops.mla.attention(*args)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,b,e,f,g")
    ap.add_argument("--splits", default="", help="extra split counts (even plans), case:n,...")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--before", action="store_true", help="also the merge layout before item 45")
    ap.add_argument("--diagnose", default="", help="diagnostic variants: " + ",".join(DIAGNOSTIC))
    args = ap.parse_args()
    launches = {"kernel": wgmma_decode.launch}
    if args.before:
        wb.VARIANTS["before_row_lanes"] = BEFORE_ROW_LANES
        launches["kernel_before"] = wb.build("before_row_lanes", Path(tempfile.mkdtemp())).launch
    for name in filter(None, args.diagnose.split(",")):
        wb.VARIANTS[name] = DIAGNOSTIC[name]
        launches[f"kernel_{name}"] = wb.build(name, Path(tempfile.mkdtemp())).launch
    extra = bd.case_counts(args.splits)
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    shipped = tk.MERGE_MAX_SPLITS
    for name in args.cases.split(","):
        case = bd.CASES.get(name) or EXTRA_CASES[name]
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
