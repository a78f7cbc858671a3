"""How far apart a batch's cache pages lie: the same decode over the benchmark's page pool, over a
pool holding only the pages in use, and over one twice that size, A/B on one machine.

``bench_decode`` allocates every sequence the pages of the longest one and hands them out in a
random order, so the ragged (e) reads its 4145 used pages scattered over 8192 (604 MB), while (d)
uses all of its pool (302 MB). Each variant keeps the same lengths, queries and cache values (only
the page ids and the pool size change), times ``mla::attention`` under the planner's plan
(CUDA-graph replays, ``bench_decode``'s clean-L2 timer) and checks it against the float32
reference.

    python benchmarks/experiments/page_spread.py --cases e,d --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd


def repool(inp: bd.Inputs, factor: float | None, gen: torch.Generator) -> bd.Inputs:
    """``inp`` with its used pages moved to random ids in a pool of ``factor`` x the used pages
    (``None``: the benchmark's own pool, unchanged)."""
    if factor is None:
        return inp
    page_size = inp.kv_cache.shape[1]
    pages = (-(-inp.lengths // page_size)).tolist()  # pages in use per sequence
    used = sum(pages)
    pool = int(factor * used)
    ids = torch.randperm(pool, generator=gen)[:used].to("cuda", torch.int32)
    kv = torch.empty((pool, *inp.kv_cache.shape[1:]), dtype=inp.kv_cache.dtype, device="cuda")
    table = torch.zeros_like(inp.block_table)  # ids past a sequence's pages are never read
    offset = 0
    for b, n in enumerate(pages):
        new = ids[offset : offset + n]
        table[b, :n] = new
        kv[new.long()] = inp.kv_cache[inp.block_table[b, :n].long()]
        offset += n
    out = copy.copy(inp)
    out.kv_cache, out.block_table = kv, table
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="e,d")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        first = bd.input_copies(case, props.L2_cache_size)[0]
        ref = bd.reference(first, case)
        floor = bd.floor_seconds(case, dict(ceil))
        plan = bd.planned(case, first)
        gen = torch.Generator().manual_seed(1)
        for factor in (None, 1.0, 2.0):
            inp = repool(first, factor, gen)
            args_ = inp.op_args(*plan)
            t, err = bd.time_call([lambda a=args_: torch.ops.mla.attention(*a)[0]], ref)
            pool_mb = inp.kv_cache.numel() * inp.kv_cache.element_size() / 1e6
            row = dict(
                case=name, pool="benchmark" if factor is None else f"{factor:g}x used",
                pool_pages=inp.kv_cache.shape[0], pool_mb=pool_mb, us=t * 1e6,
                roofline_fraction=floor / t, rel_err=err,
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
            del inp
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "page_spread", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    print(f"{'case':5}{'pool':>12}{'pages':>7}{'MB':>7}{'us':>9}{'roofline':>9}  rel_err")
    for r in rows:
        print(
            f"{r['case']:5}{r['pool']:>12}{r['pool_pages']:7}{r['pool_mb']:7.0f}{r['us']:9.1f}"
            f"{r['roofline_fraction']:9.3f}  {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
