"""The combine launched early (programmatic dependent launch) or after the decode, A/B.

``mla_decode`` as shipped (decode + combine, planner plans, CUDA-graph replays, rotated inputs)
with ``triton_kernels.has_pdl`` answering True (the shipped behaviour on Hopper: the decode
kernels trigger their dependents, the combine is launched with ``launch_pdl`` and waits on the
device) and False (an ordinary launch after the decode). Also the decode alone, so the combine's
cost in the call is ``total - decode`` (the decode without zeros for empty splits, as
``mla_decode`` runs it), beside the combine timed alone in its own graph (what
``bench_decode.py`` reported as the combine's share before NOTES.md item 27). The two launches'
outputs are compared (the ``equal`` column).

    python benchmarks/experiments/combine_pdl.py --cases a,b,c,d,e,f,g --out $OUT
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,b,c,d,e,f,g")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    shipped = tk.has_pdl
    # What a graph of one trivial kernel takes here: the floor under any kernel timed alone.
    x = torch.zeros(1, device="cuda")
    lone_graph_us = bd.time_rotating([bd.graphed(lambda: x.add_(1))]) * 1e6
    print(f"graph of one trivial kernel: {lone_graph_us:.1f} us", flush=True)
    rows = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        first = copies[0]
        floor = bd.floor_seconds(case, dict(ceil))
        plan = bd.planned(case, first)
        outs = {}
        for pdl in (False, True):
            tk.has_pdl = shipped if pdl else (lambda device: False)
            try:
                t_total = bd.time_rotating(
                    [bd.graphed(lambda i=i: bd.decode_out(i)) for i in copies]
                )
                outs[pdl] = bd.decode_out(first).clone()
                o_p, l_p = torch.ops.mla.decode(*first.op_args(*plan))
                call_args = [i.op_args(*plan) for i in copies]
                t_decode = bd.time_rotating(
                    [
                        bd.graphed(lambda a=a: torch.ops.mla.decode(*a, fill_empty=False))
                        for a in call_args
                    ]
                )
                t_alone = bd.time_rotating(
                    [
                        bd.graphed(
                            lambda o=o_p, lse=l_p: torch.ops.mla.combine(o, lse, torch.bfloat16)
                        )
                    ]
                )
            finally:
                tk.has_pdl = shipped
            row = dict(
                case=name, pdl=pdl, num_splits=plan.num_splits, total_splits=plan.total_splits,
                us=t_total * 1e6, decode_us=t_decode * 1e6,
                combine_in_call_us=(t_total - t_decode) * 1e6,
                combine_alone_us=t_alone * 1e6, roofline_fraction=floor / t_total,
                kernel=tk.LAST_LAUNCH["decode_path"],
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
        same = torch.equal(outs[False], outs[True])
        rows[-1]["equal_to_no_pdl"] = rows[-2]["equal_to_no_pdl"] = same
        del copies, first
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "combine_pdl", ceil, rows, lone_graph_us=lone_graph_us)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    print(f"graph of one trivial kernel: {lone_graph_us:.1f} us")
    print(
        f"{'case':5}{'pdl':>6}{'us':>9}{'roofline':>9}{'decode':>9}{'comb in call':>13}"
        f"{'comb alone':>11}{'share':>7}  equal"
    )
    for r in rows:
        share = r["combine_in_call_us"] / r["us"]
        print(
            f"{r['case']:5}{r['pdl']!s:>6}{r['us']:9.1f}{r['roofline_fraction']:9.3f}"
            f"{r['decode_us']:9.1f}{r['combine_in_call_us']:13.1f}{r['combine_alone_us']:11.1f}"
            f"{100 * share:6.1f}%  {r['equal_to_no_pdl']}"
        )


if __name__ == "__main__":
    main()
