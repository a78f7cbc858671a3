"""What a uniform batch's empty headroom splits cost, and its balanced plan (NOTES.md item 85).

The planner asks for ``RAGGED_HEADROOM`` (2) times a batch's even share of chunks, so that a
ragged batch's long sequences can be cut as short as everyone else's (``planner.plan_splits``).
A uniform batch uses only half: (d) (4 x 65536 tokens, 16 heads) launches 4 x 64 programs, of
which 128 take 32 tiles each and 128 find their split empty, store their rows' ``-inf`` and
exit. This times the same batch and the same 128 real chunks under plans that differ only in
how many empty programs follow them and whether they are balanced: ``n/t`` is ``num_splits``
and ``total_splits`` (``-``: none; 128 or 132 give the same 2048-token chunk), and ``n/t/sm``
the same with the longest-first ranking off (split-major). The decode alone, then with
``mla::combine`` (which reads ``num_splits`` LSEs a row), against item 60's virtual batch of 128
one-chunk sequences (no empty split, one shared query) as a second control.

    python benchmarks/experiments/empty_splits.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from tapered_chunks import stamped, virtual_batch, waves


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", default="64/132,32/-,32/128,33/132,48/132,128/132")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ceil = bd.ceilings()
    gen = torch.Generator().manual_seed(0)
    case = bd.CASES["d"]
    d_inp = bd.Inputs(case, gen, False)
    print("planned:", tuple(bd.planned(case, d_inp)), flush=True)
    floor = bd.floor_seconds(case, dict(ceil))
    variants = {}
    launch_kw = {}
    for p in args.plans.split(","):
        n, t, *split_major = p.split("/")  # "n/t/sm": longest_first off
        variants[f"d {p}"] = (d_inp, (int(n), None if t == "-" else int(t)))
        launch_kw[f"d {p}"] = dict(longest_first=False) if split_major else {}
    variants["virtual 128x32"] = (virtual_batch(waves("128x32"), gen), (1, None))
    launch_kw["virtual 128x32"] = {}
    errs = {}
    for name, (inp, p) in variants.items():
        ref = bd.reference(inp, SimpleNamespace(batch=inp.q.shape[0], s_q=1))
        errs[name] = bd.rel_err(bd.wgmma_call(inp, *p, **launch_kw[name])(), ref)
    stamps = {name: stamped(inp, *p) for name, (inp, p) in variants.items() if not launch_kw[name]}
    calls = {
        name: tuple(
            bd.wgmma_call(inp, *p, with_combine=c, **launch_kw[name]) for c in (False, True)
        )
        for name, (inp, p) in variants.items()
    }
    rows = bd.time_decode_rounds(calls, args.rounds)
    bd.save_experiment(args.out, "empty_splits", ceil, rows, errors=errs, stamps=stamps)
    print("\n" + bd.versions_line(ceil))
    print(f"{'variant':18}{'decode us':>22}{'+combine us':>22}{'span':>7}{'p50':>7}  err")
    for name in variants:
        dec, com = bd.decode_round_text(rows, name)
        st = stamps.get(name, dict(span_us=float("nan"), exit_p50=float("nan")))
        print(
            f"{name:18}{dec:>22}{com:>22}{st['span_us']:7.1f}{st['exit_p50']:7.1f}"
            f"  {errs[name]:.1e}   floor {floor * 1e6:.1f}"
        )


if __name__ == "__main__":
    main()
