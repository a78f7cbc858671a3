"""What ``mla::combine`` adds to a call, taken apart: the decode alone, then the decode followed by
stand-ins for the combine that stop at successive points of its chain, then the real combine.

Each stand-in is launched exactly as the combine is (same grid and warps, programmatic dependent
launch, ``griddepcontrol.wait`` first) and writes the same output tensors:
- ``wait``: waits, then stores zeros (the grid's completion, the wait and the stores);
- ``lse``: waits, loads the row's split lse, stores their largest and zeros (one L2 round trip);
- the real combine also loads the partials of the splits with weight (a second round trip).
Timing only: the stand-ins' outputs are not attention. CUDA-graph replays of rotated inputs,
``bench_decode``'s clean-L2 timer, the planner's plan.

    python benchmarks/experiments/combine_chain.py --cases d,b,c,e --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import triton_kernels as tk


@triton.jit
def _stand_in(LSE_PART, OUT, LSE, NUM_SPLITS, L, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
              READ_LSE: tl.constexpr):  # fmt: skip
    gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    l_block = tl.program_id(1)
    lse = 0.0
    if READ_LSE:
        offs_s = tl.arange(0, BLOCK_S)
        lse_s = tl.load(
            LSE_PART + row * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf")
        )
        lse = tl.max(lse_s, 0)
    if l_block == 0:
        tl.store(LSE + row, lse)
    offs_l = l_block * BLOCK_L + tl.arange(0, BLOCK_L)
    tl.store(OUT + row * L + offs_l, tl.zeros([BLOCK_L], tl.float32).to(OUT.dtype.element_ty),
             mask=offs_l < L)  # fmt: skip


def stand_in_call(args: tuple, read_lse: bool):
    """The decode (``fill_empty=False``) then a combine stand-in, on fixed op arguments."""
    q = args[0]
    b, s_q, h, _ = q.shape
    kv_len = args[1].shape[-1]

    def fn():
        _, lse_p = torch.ops.mla.decode(*args, fill_empty=False)
        splits = lse_p.shape[-1]
        out = torch.empty((b, s_q, h, kv_len), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, s_q, h), dtype=torch.float32, device=q.device)
        block_s, block_l = tk.combine_tiling(splits, kv_len)
        _stand_in[(b * s_q * h, triton.cdiv(kv_len, block_l))](
            lse_p, out, lse, splits, kv_len, BLOCK_S=block_s, BLOCK_L=block_l,
            READ_LSE=read_lse, num_warps=2, launch_pdl=True,
        )  # fmt: skip
        return out

    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="d,b,c,e")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        plan = bd.planned(case, copies[0])
        op_args = [inp.op_args(*plan) for inp in copies]
        variants = {
            "decode alone": [
                lambda a=a: torch.ops.mla.decode(*a, fill_empty=False) for a in op_args
            ],
            "+ wait, stores": [stand_in_call(a, False) for a in op_args],
            "+ wait, lse, stores": [stand_in_call(a, True) for a in op_args],
            "+ mla::combine": [lambda a=a: torch.ops.mla.attention(*a)[0] for a in op_args],
        }
        row = dict(case=name, num_splits=plan[0], total_splits=plan[1])
        for label, fns in variants.items():
            row[label] = bd.time_call(fns)[0] * 1e6
        assert tk.LAST_LAUNCH["merge"].startswith("mla::combine"), tk.LAST_LAUNCH["merge"]
        rows.append(row)
        print(row, flush=True)
        del copies, op_args, variants
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "combine_chain", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; {ceil}")
    labels = [k for k in rows[0] if k not in ("case", "num_splits", "total_splits")]
    print(f"{'case':5}{'splits':>7}" + "".join(f"{k:>22}" for k in labels))
    for r in rows:
        print(f"{r['case']:5}{r['num_splits']:7}" + "".join(f"{r[k]:22.1f}" for k in labels))


if __name__ == "__main__":
    main()
