"""A uniform batch's chunk length rounded up or down, A/B on one machine.

The planner gives a balanced batch one chunk length, ``sum(lengths) / total_splits`` rounded *up*
to a 64-token tile (``planner.split_len``). On (d) (4 x 65536 tokens, 132 multiprocessors) that
is 32 tiles: 128 programs, 4 multiprocessors idle, every program 32 tiles. Rounded *down* (31
tiles), 132 programs of 31 tiles fill the machine and each sequence keeps a one-tile leftover
(4 more programs), which start when the first multiprocessor frees: the fast tier of NOTES.md
item 38 finishes about 10 % early. This times both (and other leftovers) on a few uniform shapes:
the same kernel, only ``total_splits`` differs (``ceil(tokens / (tiles * 64))`` gives a chunk of
``tiles``). One stamped launch per variant records where the leftovers ran and when every
multiprocessor finished.

    python benchmarks/experiments/chunk_rounding.py --out $OUT
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import planner
from mla_ops import wgmma_decode as wd

FIELD = {name: i for i, name in enumerate(wd.STAMP_FIELDS)}


def stamp_launch(inp, num_splits: int, total_splits: int | None) -> torch.Tensor:
    """The stamps ``[programs, STAMP_SLOTS]`` (CPU) of one clean-L2 launch of the 16-row wgmma
    kernel on ``inp`` (one row block per sequence), after a warm-up launch."""
    programs = inp.q.shape[0] * num_splits
    stamps = torch.zeros(programs, wd.STAMP_SLOTS.value, dtype=torch.int64, device="cuda")
    fn = bd.wgmma_call(inp, num_splits, total_splits, with_combine=False, stamps=stamps)
    fn()
    stamps.zero_()
    bd.evict_l2("clean")
    fn()
    torch.cuda.synchronize()
    return stamps.cpu()


def stamped(inp, num_splits: int, total_splits: int) -> dict:
    """One clean-L2 stamped launch: span, per-multiprocessor last exits, the leftovers."""
    s = stamp_launch(inp, num_splits, total_splits)
    tiles = s[:, FIELD["tiles"]]
    real = tiles > 0
    t0 = s[real, FIELD["entry"]].min()
    exit_us = (s[:, FIELD["exit"]] - t0).double() / 1e3
    entry_us = (s[:, FIELD["entry"]] - t0).double() / 1e3
    sm = s[:, FIELD["sm"]]
    last = {}
    for i in real.nonzero().flatten().tolist():
        last[int(sm[i])] = max(last.get(int(sm[i]), 0.0), float(exit_us[i]))
    full = int(tiles.max())
    leftovers = [
        dict(sm=int(sm[i]), tiles=int(tiles[i]), entry=float(entry_us[i]), exit=float(exit_us[i]))
        for i in (real & (tiles < full)).nonzero().flatten().tolist()
    ]
    exits = sorted(last.values())
    return dict(
        span_us=float(exit_us[real].max()), sms_used=len(last),
        sm_exit_p10=exits[len(exits) // 10], sm_exit_p50=exits[len(exits) // 2],
        leftovers=leftovers, sm_last_exit=last,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x65536,4x61440,4x63488,4x131072")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        case = bd.Case(f"{batch}x{context}", batch, 16, context)
        copies = bd.input_copies(case, props.L2_cache_size)
        ref = bd.reference(copies[0], case)
        floor = bd.floor_seconds(case, dict(ceil))
        plan = bd.planned(case, copies[0])
        tokens = int(copies[0].lengths.sum())
        up = int(planner.split_len(copies[0].lengths, *plan)[0]) // planner.SPLIT_GRANULE
        # total_splits giving a chunk of `tiles` tiles: ceil(tokens / total) <= tiles * 64.
        variants = {
            f"{tiles} tiles": math.ceil(tokens / (tiles * planner.SPLIT_GRANULE))
            for tiles in (up, up - 1, up - 2)
        }
        info = {}
        for label, total in variants.items():
            start, end = planner.split_bounds(copies[0].lengths, plan.num_splits, total)
            tiles = ((end - start).clamp_min(0) + 63) // 64
            info[label] = dict(
                total_splits=total, programs=int((tiles > 0).sum()),
                chunk_tiles=int(tiles.max()), leftover_tiles=int(tiles[0][tiles[0] > 0][-1]),
                stamps=stamped(copies[0], plan.num_splits, total),
            )  # fmt: skip
        for rnd in range(args.rounds):
            for label, total in variants.items():
                fns = [bd.wgmma_call(inp, plan.num_splits, total) for inp in copies]
                t, err = bd.time_call(fns, ref)
                row = dict(
                    case=case.name, variant=label, round=rnd, num_splits=plan.num_splits,
                    us=t * 1e6, roofline_fraction=floor / t, rel_err=err,
                    **{k: v for k, v in info[label].items() if k != "stamps"},
                )  # fmt: skip
                rows.append(row)
                print(row, flush=True)
        for label in variants:
            rows.append(dict(case=case.name, variant=label, stamps=info[label]["stamps"]))
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "chunk_rounding", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    print(f"{'shape':10}{'variant':>10}{'programs':>9}{'left':>5}{'us':>9}{'roofline':>9}  err")
    for r in rows:
        if "us" in r:
            print(
                f"{r['case']:10}{r['variant']:>10}{r['programs']:9}{r['leftover_tiles']:5}"
                f"{r['us']:9.1f}{r['roofline_fraction']:9.3f}  {r['rel_err']:.1e}"
            )
    print("stamped launches: span, multiprocessor exits p10/p50, leftovers (sm, tiles, entry-exit)")
    for r in rows:
        if "stamps" in r:
            st = r["stamps"]
            lo = " ".join(
                f"({x['sm']},{x['tiles']},{x['entry']:.0f}-{x['exit']:.0f})"
                for x in st["leftovers"][:8]
            )
            print(
                f"{r['case']:10}{r['variant']:>10} span {st['span_us']:6.1f} sms {st['sms_used']}"
                f" exits {st['sm_exit_p10']:.1f}/{st['sm_exit_p50']:.1f}  {lo}"
            )


if __name__ == "__main__":
    main()
