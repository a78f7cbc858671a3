"""64-row wgmma programs with the query rows on the MMA's N side (transposed, ``S^T = K Q^T``)
or on its M side (``S = Q K^T``, ``wgmma_decode._consume_rows_on_m``), A/B on one machine.

Times decode + combine and the decode alone (CUDA-graph replays, rotated inputs) under the
planner's plan and any extra split counts given, and checks each variant's combined output
against the float32 reference of ``bench_decode``.

    python benchmarks/experiments/rows_on_m.py --cases b,c,f --splits b:1,b:2,f:2 --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="b,c,f")
    ap.add_argument("--splits", default="", help="extra split counts (even plans), case:n,...")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    extra = bd.case_counts(args.splits)
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
        plans = [(plan.num_splits, plan.total_splits)] + [(n, None) for n in extra.get(name, [])]
        for ns, ts in plans:
            for rows_on_m in (False, True):
                for with_combine in (True, False):
                    fns = [
                        bd.wgmma_call(
                            inp, ns, ts, with_combine, rows_on_m=rows_on_m, one_scorer=False
                        )
                        for inp in copies
                    ]
                    t, err = bd.time_call(fns, ref if with_combine else None)
                    row = dict(
                        case=name, rows_on_m=rows_on_m, combine=with_combine, num_splits=ns,
                        total_splits=ts, planner=(ns, ts) == plans[0], us=t * 1e6,
                        roofline_fraction=floor / t, rel_err=err,
                    )  # fmt: skip
                    rows.append(row)
                    print(row, flush=True)
        del copies, first
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "rows_on_m", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    print(f"{'case':5}{'rows on':>8}{'combine':>8}{'splits':>9}{'us':>9}{'roofline':>9}  rel_err")
    for r in rows:
        sp = f"{r['num_splits']}/{r['total_splits']}{'*' if r['planner'] else ''}"
        print(
            f"{r['case']:5}{'M' if r['rows_on_m'] else 'N':>8}{r['combine']!s:>8}{sp:>9}"
            f"{r['us']:9.1f}{r['roofline_fraction']:9.3f}  {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
