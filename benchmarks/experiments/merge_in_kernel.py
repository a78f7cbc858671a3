"""Splits merged inside the wgmma decode kernel (``mla::attention`` with
``triton_kernels.MERGE_MAX_SPLITS`` at least the call's ``num_splits``) against the decode writing
float32 partials for ``mla::combine`` (``MERGE_MAX_SPLITS = 0``), A/B on one machine.

Times ``mla::attention`` (CUDA-graph replays, rotated inputs) under the planner's plan and any
extra split counts given, and checks each variant's output against the float32 reference of
``bench_decode``.

    python benchmarks/experiments/merge_in_kernel.py --cases a,b,e,f,g --splits b:2 --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import triton_kernels as tk


def attention_call(args: tuple):
    """A closure calling ``mla::attention`` on fixed arguments; returns the output."""
    return lambda: torch.ops.mla.attention(*args)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,b,e,f,g")
    ap.add_argument("--splits", default="", help="extra split counts (even plans), case:n,...")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
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
            for merge in (False, True):
                if merge and ns > 8:  # the in-kernel merge holds every split of a column block
                    continue
                tk.MERGE_MAX_SPLITS = ns if merge else 0
                fns = [attention_call(inp.op_args(ns, ts)) for inp in copies]
                t, err = bd.time_call(fns, ref)
                assert tk.LAST_LAUNCH["merge"].startswith("decode" if merge else "mla::combine")
                row = dict(
                    case=name, merge=merge, num_splits=ns, total_splits=ts,
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
    print(f"{'case':5}{'merge':>7}{'splits':>9}{'us':>9}{'roofline':>9}  rel_err")
    for r in rows:
        sp = f"{r['num_splits']}/{r['total_splits']}{'*' if r['planner'] else ''}"
        print(
            f"{r['case']:5}{'kernel' if r['merge'] else 'comb.':>7}{sp:>9}{r['us']:9.1f}"
            f"{r['roofline_fraction']:9.3f}  {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
