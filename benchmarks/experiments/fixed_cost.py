"""(d)'s time as a straight line in its bytes: the steady read rate and the cost paid once per call.

(d) (B=4, H=16, T=65536) runs 128 programs of 32 tiles; the planner cuts other lengths of that
batch into as many programs (up to 64K tokens a sequence; 132 at 128K), which read other amounts
of cache in the same way. Timing each variant at several lengths of one batch
and head count and fitting ``time = bytes / rate + fixed`` separates what the loop pays per byte
(the slope) from what a call pays once (the intercept: launch, each program's start before its
first copy lands, its last tile and epilogue, the tail, the merge). The variants:

- ``copies``: the copies-only stand-in of ``ring_depth.py`` (two 72 KB slots, nothing held);
- ``decode``: the wgmma kernel writing float32 partials (the planner's plan);
- ``call``: that decode followed by ``mla::combine``, as ``mla_decode`` runs (d);
- ``op``: ``mla_decode`` itself, through the op.

Timing as the benchmark's: CUDA-graph replays of rotated input copies, L2 evicted by a read before
each, alternating rounds. Bytes are the roofline's (cache rows read + q + out).

    python benchmarks/experiments/fixed_cost.py --batch 4 --heads 16 \
        --contexts 16384,32768,65536,131072 --out $OUT
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from ring_depth import stream_call

from mla_ops import wgmma_decode as wd


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = slope * x + intercept``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


VARIANTS = ("copies", "decode", "call", "op")


def variant(name: str, inp: bd.Inputs, plan, chunk_tiles: int):
    """A closure launching variant ``name`` on one input copy."""
    if name == "copies":
        return stream_call(inp, chunk_tiles, 2, 0)
    if name == "op":
        return lambda: bd.decode_out(inp)
    return bd.wgmma_call(inp, *plan, with_combine=name == "call")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--contexts", default="16384,32768,65536,131072")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="fixed_cost")
    args = ap.parse_args()
    ceil = bd.ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        case = bd.Case(f"{args.batch}x{args.heads}x{context}", args.batch, args.heads, context)
        copies = bd.input_copies(case, l2)
        plan = bd.planned(case, copies[0])
        nbytes, _ = bd.case_cost(case, copies[0])
        chunk_tiles = math.ceil(
            case.batch * context / (plan[1] or plan[0] * case.batch) / wd.BLOCK_N
        )
        ref = bd.reference(copies[0], case)
        row = dict(
            case=case.name, context=context, plan=list(plan), chunk_tiles=chunk_tiles,
            bytes=nbytes, floor_us=bd.floor_seconds(case, ceil) * 1e6,
        )  # fmt: skip
        for r in range(args.rounds):
            for name in VARIANTS:
                fns = [variant(name, inp, plan, chunk_tiles) for inp in copies]
                if name in ("call", "op") and r == 0:
                    row[f"{name}_err"] = bd.rel_err(fns[0](), ref)
                us = bd.time_rotating([bd.graphed(f) for f in fns], warmup=10, rep=100) * 1e6
                row.setdefault(f"{name}_us", []).append(us)
                print(case.name, name, f"round {r}", f"{us:.1f} us", flush=True)
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    fits = {}
    for name in VARIANTS:
        slope, intercept = fit([r["bytes"] for r in rows], [min(r[f"{name}_us"]) for r in rows])
        fits[name] = dict(rate_GBps=1e-3 / slope, fixed_us=intercept)
    bd.save_experiment(args.out, args.name, ceil, rows, fits=fits)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
          f"{triton.__version__}; copy {ceil['copy_bw_Bps'] / 1e9:.0f} GB/s")  # fmt: skip
    for row in rows:
        cells = "  ".join(f"{n} {min(row[f'{n}_us']):7.1f}" for n in fits)
        call = row["floor_us"] / min(row["call_us"])
        print(f"{row['case']:>12} plan {row['plan']} {row['chunk_tiles']:3d} tiles  "
              f"floor {row['floor_us']:6.1f}  {cells} us  (call {call:.3f})")  # fmt: skip
    for name, f in fits.items():
        share = f["rate_GBps"] * 1e9 / ceil["copy_bw_Bps"]
        print(f"fit {name:7}: {f['rate_GBps']:7.0f} GB/s steady ({share:.3f} of the copy rate), "
              f"{f['fixed_us']:5.1f} us once per call")  # fmt: skip


if __name__ == "__main__":
    main()
