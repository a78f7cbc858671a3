"""What the state of L2 before a timed call costs. ``triton.testing.do_bench`` evicts L2 by zeroing
a 256 MB buffer before every timed call, which leaves the whole L2 full of dirty lines that the
timed kernel must write back to DRAM while it streams its own reads.

Times the same calls under the three modes of ``bench_decode.evict_l2``: ``dirty`` (do_bench's
zeroing), ``clean`` (reading that buffer: L2 full of clean lines, none of them inputs) and
``none`` (nothing between calls; the inputs are still rotated among copies covering 4x L2).
The calls: a 1 GiB copy (the copy ceiling's kernel), a 302 MB ``torch.sum`` (case d's bytes), and
``mla_decode`` on each case (the planner's plan, CUDA-graph replays, rotated inputs).

    python benchmarks/experiments/l2_state.py --cases a,b,c,d,e,f,g,a8 --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

MODES = ("dirty", "clean", "none")
STREAMS = ("copy_1GiB", "read_302MB")


def stream_rows() -> list[dict]:
    """The plain streams under each mode, in GB/s (bytes read + written)."""
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    r = torch.randn(4 * 65536 * 576, device="cuda", dtype=torch.bfloat16)
    s = torch.empty((), device="cuda", dtype=torch.float32)
    streams = {
        "copy_1GiB": (lambda: y.copy_(x), 2 * x.numel() * 2),
        "read_302MB": (lambda: torch.sum(r, 0, dtype=torch.float32, out=s), r.numel() * 2),
    }
    rows = []
    for name, (fn, nbytes) in streams.items():
        for mode in MODES:
            t = bd.time_rotating([fn], l2=mode)
            rows.append(dict(case=name, l2=mode, us=t * 1e6, gbps=nbytes / t / 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,b,c,d,e,f,g,a8")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = stream_rows()
    torch.cuda.empty_cache()
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        ref = bd.reference(copies[0], case)
        floor = bd.floor_seconds(case, dict(ceil))
        fns = [bd.impls(case)["mla_decode"](inp) for inp in copies]
        err = bd.rel_err(fns[0](), ref)
        graphs = [bd.graphed(f) for f in fns]
        for mode in MODES:
            t = bd.time_rotating(graphs, l2=mode)
            rows.append(dict(case=name, l2=mode, us=t * 1e6, roofline_fraction=floor / t, err=err))
        del copies, fns, graphs
        torch.cuda.empty_cache()

    bd.save_experiment(args.out, f"l2_state_{props.name.split()[1]}", ceil, rows)
    print(f"{'case':<11} " + " ".join(f"{m:>22}" for m in MODES))
    for name in [*STREAMS, *args.cases.split(",")]:
        cells = []
        for mode in MODES:
            row = next(r for r in rows if r["case"] == name and r["l2"] == mode)
            frac = row.get("roofline_fraction")
            tail = f"{frac:.3f}" if frac is not None else f"{row['gbps']:.0f} GB/s"
            cells.append(f"{row['us']:9.1f} us {tail:>9}")
        print(f"{name:<11} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
