"""Case (b) in 32-row programs, unsplit: no combine at all (benchmarks/NOTES.md item 51).

(b) (B=32, H=128, T=4096) runs 64-row one-scorer programs in two or more chunks per sequence, and
``mla::combine`` then adds 5.9-6.6 % to the call (issue 3 allows 5 %). 32-row programs give 128
programs of whole sequences (one per multiprocessor, no partials to merge) at the cost of every
KV tile feeding 32 rows instead of 64. This times the op's plan against 32-row programs (the
transposed loop, 8 warps) at 1 and 2 splits, with and without the combine, on bench_decode's (b)
inputs (graph replays of rotated copies, clean L2), checking each combined output against the
reference.

    python benchmarks/experiments/rows_32_b.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    print(props.name, torch.__version__)
    case = bd.CASES["b"]
    copies = bd.input_copies(case, props.L2_cache_size)
    plan = bd.planned(case, copies[0])
    ref = bd.reference(copies[0], case)

    def timed(name: str, fns: list, check: bool = True) -> None:
        seconds, err = bd.time_call(fns, ref if check else None)
        print(f"{name:40} {seconds * 1e6:8.1f} us err {err:.1e}", flush=True)

    rows_32 = dict(block_m=32, num_warps=8, one_scorer=False)
    timed(f"op plan {plan}", [bd.wgmma_call(i, *plan) for i in copies])
    for splits in (1, 2):
        fns = [bd.wgmma_call(i, splits, None, **rows_32) for i in copies]
        timed(f"32 rows, 8 warps, {splits} split(s) + combine", fns)
    fns = [bd.wgmma_call(i, 1, None, with_combine=False, **rows_32) for i in copies]
    timed("32 rows, 1 split, no combine", fns, False)
    fns = [bd.wgmma_call(i, *plan, with_combine=False) for i in copies]
    timed("op plan, no combine", fns, False)


if __name__ == "__main__":
    main()
