"""The order in which the decode's programs take the batch's chunks, A/B on one machine.

The shipped kernel runs program ``pid`` on chunk ``(split, sequence) = divmod(pid // rows, B)``:
every sequence's first chunk, then every second one. On a ragged batch that can start a long
chunk after most multiprocessors are busy. This launches the wgmma kernel
(``bench_decode.wgmma_call``, the planner's plan, then ``mla::combine``) with ``order=`` tables
computed on the host from the lengths:

- ``split_major``: the kernel's split-major order (``longest_first=False``);
- ``longest_first``: the kernel's own longest-first order (``_longest_first``);
- ``identity``: the split-major order through the table (the table's own cost);
- ``lpt``: longest chunk first (ties in the shipped order), empty chunks last;
- ``lpt_seq``: longest first, ties sequence by sequence.

CUDA-graph replays of rotated inputs, the variants interleaved over ``--rounds``, each output
checked against ``bench_decode``'s float32 reference.

    python benchmarks/experiments/launch_order.py --cases e,d,a --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import planner
from mla_ops import wgmma_decode as wd


def order_table(lengths: torch.Tensor, num_splits: int, total_splits: int | None, kind: str):
    """``[B * num_splits]`` int32 of ``split * B + sequence`` in the order programs take them."""
    b = lengths.numel()
    start, end = planner.split_bounds(lengths.long(), num_splits, total_splits)
    tiles = ((end - start).clamp_min(0) + wd.BLOCK_N - 1) // wd.BLOCK_N  # [B, splits]
    seq = torch.arange(b).unsqueeze(1).expand(b, num_splits)
    split = torch.arange(num_splits).unsqueeze(0).expand(b, num_splits)
    lin = (split * b + seq).flatten()
    if kind == "identity":
        order = torch.arange(b * num_splits)
    else:
        tie = lin if kind == "lpt" else (seq * num_splits + split).flatten()
        key = -tiles.flatten() * (b * num_splits) + tie
        order = lin[torch.argsort(key)]
    return order.to(torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="e,d,a")
    ap.add_argument("--variants", default="split_major,longest_first,lpt_seq")
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
                fns = []
                for inp in copies:
                    kw = {"longest_first": variant == "longest_first"}
                    if variant not in ("split_major", "longest_first"):
                        table = order_table(
                            inp.lengths, plan.num_splits, plan.total_splits, variant
                        )
                        kw["order"] = table.cuda()
                    fns.append(bd.wgmma_call(inp, plan.num_splits, plan.total_splits, **kw))
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
