"""The combine's expected splits loaded together with their LSEs, A/B on one machine (NOTES.md
item 61).

``mla_decode`` calls (graph replays, clean L2, the planner's plans) with
``triton_kernels.COMBINE_EARLY_SPLITS`` off (every partial loaded after the LSEs, one more L2
round trip) and on, in alternating rounds; the decode alone once per round for the combine's
share. The two variants' outputs must be the same bits.

    python benchmarks/experiments/combine_early.py --cases b,c,d,e --out $OUT
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
    ap.add_argument("--cases", default="b,c,d,e")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        ex = bd.experiment_case(name, ceil)
        outs = {}
        for early in (False, True):
            tk.COMBINE_EARLY_SPLITS = early
            outs[early] = bd.decode_out(ex.copies[0])
        same = torch.equal(outs[False], outs[True])
        err = bd.rel_err(outs[True], ex.ref)
        early_splits = tk.LAST_LAUNCH.get("combine_early_splits")
        decode_args = [inp.op_args(*ex.plan) for inp in ex.copies]
        for rnd in range(args.rounds):
            order = (False, True) if rnd % 2 == 0 else (True, False)
            for early in order:
                tk.COMBINE_EARLY_SPLITS = early
                fns = [bd.graphed(lambda i=inp: bd.decode_out(i)) for inp in ex.copies]
                t = bd.time_rotating(fns, warmup=10, rep=100)
                rows.append(dict(case=name, early=early, round=rnd, us=t * 1e6,
                                 roofline=ex.floor_s / t))  # fmt: skip
                print(rows[-1], flush=True)
            fns = [
                bd.graphed(lambda a=a: torch.ops.mla.decode(*a, fill_empty=False))
                for a in decode_args
            ]
            t = bd.time_rotating(fns, warmup=10, rep=100)
            rows.append(dict(case=name, early="decode alone", round=rnd, us=t * 1e6))
            print(rows[-1], flush=True)
        rows.append(dict(case=name, same_bits=same, rel_err=err, early_splits=early_splits,
                         plan=list(ex.plan)))  # fmt: skip
        print(rows[-1], flush=True)
        del ex
        torch.cuda.empty_cache()
    tk.COMBINE_EARLY_SPLITS = True
    bd.save_experiment(args.out, "combine_early", ceil, rows)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"triton {bd.triton.__version__}; {ceil}")  # fmt: skip
    print(f"{'case':5}{'after LSEs':>22}{'with LSEs':>22}{'decode alone':>22}  same bits, err")
    for name in args.cases.split(","):

        def us(early, name=name):
            return " ".join(
                f"{r['us']:.1f}" for r in rows if r["case"] == name and r.get("early") == early
            )

        info = next(r for r in rows if r["case"] == name and "same_bits" in r)
        print(
            f"{name:5}{us(False):>22}{us(True):>22}{us('decode alone'):>22}  "
            f"{info['same_bits']}, {info['rel_err']:.1e} (early {info['early_splits']})"
        )


if __name__ == "__main__":
    main()
