"""The wgmma kernel with and without a producer partition (warp specialisation), A/B on one machine.

``producer_warps=0``: the math warps issue every copy themselves (the kernel before NOTES.md item
27); ``None``: the shipped default (``wgmma_decode.default_producer_warps``: one warp for TMA, a
warpgroup for gathers, none for 8 math warps); explicit counts where given (``--warps``).

Times decode + combine (CUDA-graph replays, rotated inputs) with the planner's plan, and the
decode alone; checks that every variant's partials are bit-identical to the no-producer kernel's
(the same math in the same order: only who issues the copies changes).

    python benchmarks/experiments/producer_warps.py --cases a,d,e,g,a8 --warps g:1,g:2 --out $OUT
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
from mla_ops import wgmma_decode as wd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,d,e,g,a8")
    ap.add_argument("--warps", default="", help="extra producer warp counts, case:n,...")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    extra = bd.case_counts(args.warps)
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        first = copies[0]
        ref = bd.reference(first, case)
        floor = bd.floor_seconds(case, dict(ceil))
        plan = bd.planned(case, first)
        ns, ts = plan.num_splits, plan.total_splits
        warps = tk.wgmma_tiling(case.heads * case.s_q)[1]
        gather = case.page_size % 64 != 0
        variants = [0, None, *extra.get(name, [])]
        baseline = None
        for producer in variants:
            for with_combine in (True, False):

                def make(inp, producer=producer, with_combine=with_combine, ns=ns, ts=ts):
                    return bd.wgmma_call(inp, ns, ts, with_combine, producer_warps=producer)

                fns = [make(inp) for inp in copies]
                same = None
                if with_combine:
                    err = bd.rel_err(fns[0](), ref)
                else:
                    err = float("nan")
                    o, lse = fns[0]()
                    live = torch.isfinite(lse)  # empty splits' out is never written
                    got = (o[live].clone(), lse[live].clone())
                    if baseline is None:
                        baseline = got
                    same = all(torch.equal(x, y) for x, y in zip(got, baseline, strict=True))
                t = bd.time_rotating([bd.graphed(f) for f in fns], warmup=10, rep=100)
                shown = wd.default_producer_warps(warps, gather) if producer is None else producer
                row = dict(
                    case=name, producer_warps=shown, default=producer is None,
                    combine=with_combine, num_splits=ns, total_splits=ts, us=t * 1e6,
                    roofline_fraction=floor / t, rel_err=err, bit_equal=same,
                )  # fmt: skip
                rows.append(row)
                print(row, flush=True)
        del copies, first
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "producer_warps", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    print(f"{'case':5}{'producer':>9}{'combine':>8}{'splits':>9}{'us':>9}{'roofline':>9}  check")
    for r in rows:
        sp = f"{r['num_splits']}/{r['total_splits']}"
        check = f"{r['rel_err']:.1e}" if r["combine"] else f"bit-equal {r['bit_equal']}"
        tag = f"{r['producer_warps']}{'*' if r['default'] else ''}"
        print(
            f"{r['case']:5}{tag:>9}{r['combine']!s:>8}{sp:>9}{r['us']:9.1f}"
            f"{r['roofline_fraction']:9.3f}  {check}"
        )


if __name__ == "__main__":
    main()
