"""The order in which the decode's programs take the batch's chunks, A/B on one machine.

``split_major`` (``longest_first=False``): program ``pid`` takes chunk ``(split, sequence) =
divmod(pid // rows, B)``, every sequence's first chunk, then every second one. On a ragged batch
that can start a long chunk after every multiprocessor is busy. ``longest_first``: the kernel
ranks the chunks itself (``wgmma_decode._longest_first``, ``planner.longest_first_order``).
Launches the wgmma kernel on the planner's plan (``bench_decode.wgmma_call``), then
``mla::combine``; CUDA-graph replays of rotated inputs, the variants interleaved over
``--rounds``, each output checked against ``bench_decode``'s float32 reference.

(NOTES.md item 39's host-computed order tables, variants ``identity`` / ``lpt`` / ``lpt_seq``,
ran on commit e840008 of branch ``experiment/lpt-order``, whose kernel took an ``order=`` table.)

    python benchmarks/experiments/launch_order.py --cases e,d --out $OUT
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
    ap.add_argument("--cases", default="e,d,a")
    ap.add_argument("--variants", default="split_major,longest_first")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        ref = bd.reference(copies[0], case)
        floor = bd.floor_seconds(case, dict(ceil))
        plan = bd.planned(case, copies[0])
        for rnd in range(args.rounds):
            for variant in args.variants.split(","):
                kw = {"longest_first": variant == "longest_first"}
                fns = [
                    bd.wgmma_call(inp, plan.num_splits, plan.total_splits, **kw) for inp in copies
                ]
                t, err = bd.time_call(fns, ref)
                torch.cuda.synchronize()
                row = dict(
                    case=name, variant=variant, round=rnd, num_splits=plan.num_splits,
                    total_splits=plan.total_splits, copies=len(copies), us=t * 1e6,
                    roofline_fraction=floor / t, rel_err=err,
                )  # fmt: skip
                rows.append(row)
                print(row, flush=True)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "launch_order", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    print(f"{'case':5}{'variant':>10}{'round':>6}{'us':>9}{'roofline':>9}  rel_err")
    for r in rows:
        print(
            f"{r['case']:5}{r['variant']:>10}{r['round']:6}{r['us']:9.1f}"
            f"{r['roofline_fraction']:9.3f}  {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
