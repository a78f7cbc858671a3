"""One long sequence (batch 1): ``mla_decode`` with the planner's split plan, timed.

A batch of one sequence has no raggedness to balance, yet the planner capped its splits at
``MAX_SPLITS`` (64), so a 16-head sequence of 32k tokens ran 57 programs on an H100's 132
multiprocessors (NOTES.md item 65). This times ``mla_decode`` (graph replays, clean L2, the
planner's plan, the combine included) on batch-1 shapes with 16, 32 (16 heads x S_q 2), 64 and
128 query rows, checks each output against the float32 reference, and prints the plan it ran.
Run it from two checkouts to compare planners.

``--sweep``: instead, short single sequences (16 heads, 1k-8k tokens) under every split count in
``SWEEP_SPLITS`` (chunks of ``ceil(T / splits)`` tokens; at most 2 splits the kernel merges them
itself, more go through ``mla::combine``), to see what the planner's choice costs at batch 1.

    python benchmarks/experiments/single_sequence.py --out $OUT --tag new
    python benchmarks/experiments/single_sequence.py --sweep --out $OUT
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

CASES = [
    bd.Case("1x16x16k", 1, 16, 16385),
    bd.Case("1x16x32k", 1, 16, 32769),  # bench_e2e's 1 x 32768 after one step
    bd.Case("1x16x32k_mask", 1, 16, 32769, mask=True),
    bd.Case("1x16x128k", 1, 16, 131072),
    bd.Case("1x16x32k_sq2", 1, 16, 32769, s_q=2),
    bd.Case("1x64x32k", 1, 64, 32768),
    bd.Case("c", 1, 128, 32768),
]
SWEEP_CONTEXTS = (1025, 2049, 4097, 8193)
SWEEP_SPLITS = (1, 2, 3, 4, 5, 8, 16)


def sweep(ceil: dict, l2: int) -> list[dict]:
    """``mla_decode`` on one 16-head sequence per context and split count (``num_splits`` given,
    no ``total_splits``), against the planner's own choice."""
    import mla_ops

    rows = []
    for context in SWEEP_CONTEXTS:
        case = bd.Case(f"1x16x{context}", 1, 16, context)
        copies = bd.input_copies(case, l2)
        plan = bd.planned(case, copies[0])
        ref = bd.reference(copies[0], case)
        for splits in (None, *SWEEP_SPLITS):

            def call(inp, splits=splits):
                return mla_ops.mla_decode(
                    inp.q, inp.decode_cache(), inp.cache_seqlens, block_table=inp.block_table,
                    head_dim_v=bd.L, softmax_scale=bd.SCALE, num_splits=splits,
                )[0]  # fmt: skip

            err = bd.rel_err(call(copies[0]), ref)
            fns = [bd.graphed(lambda i=inp: call(i)) for inp in copies]
            t = bd.time_rotating(fns, warmup=10, rep=100)
            rows.append(dict(
                case=case.name, splits=splits or f"planner {plan.num_splits}/{plan.total_splits}",
                us=t * 1e6, rel_err=err, merge=tk.LAST_LAUNCH.get("merge"),
            ))  # fmt: skip
            print(rows[-1], flush=True)
        del copies
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--sweep", action="store_true", help="short sequences x split counts")
    args = ap.parse_args()
    ceil = bd.ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    if args.sweep:
        rows = sweep(ceil, l2)
        bd.save_experiment(args.out, "single_sequence_splits" + args.tag, ceil, rows)
        print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}")
        for r in rows:
            print(f"{r['case']:12} {r['splits']!s:>16} {r['us']:8.1f} us  {r['rel_err']:.1e}")
        return
    rows = []
    for case in CASES:
        copies = bd.input_copies(case, l2)
        plan = bd.planned(case, copies[0])
        err = bd.rel_err(bd.decode_out(copies[0]), bd.reference(copies[0], case))
        fns = [bd.graphed(lambda i=inp: bd.decode_out(i)) for inp in copies]
        t = bd.time_rotating(fns, warmup=10, rep=100)
        floor = bd.floor_seconds(case, dict(ceil))
        rows.append(dict(
            case=case.name, us=t * 1e6, roofline=floor / t, rel_err=err,
            num_splits=plan.num_splits, total_splits=plan.total_splits,
            decode_path=tk.LAST_LAUNCH.get("decode_path"), merge=tk.LAST_LAUNCH.get("merge"),
        ))  # fmt: skip
        print(rows[-1], flush=True)
        del copies, fns
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "single_sequence" + args.tag, ceil, rows)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"triton {bd.triton.__version__}; {ceil}")  # fmt: skip
    print(f"{'case':16}{'us':>9}{'roofline':>10}{'splits':>12}  err")
    for r in rows:
        plan = f"{r['num_splits']}/{r['total_splits']}"
        print(f"{r['case']:16}{r['us']:9.1f}{r['roofline']:10.2f}{plan:>12}  {r['rel_err']:.1e}")


if __name__ == "__main__":
    main()
