"""Experiment (issue 3): column block and warps of the combine kernel, timed alone.

Partials as ``mla::decode`` writes them for cases (c) and (d) of bench_decode.py: random float32
outputs and LSEs, every split non-empty. CUDA-graph replays, median; bytes = partials read +
output written.

``--in-call`` instead times whole ``mla_decode`` calls (bench_decode's clean-L2 graph replays,
the combine launched early behind the decode) with the base rule's column block (item 18's,
``triton_kernels.combine_tiling`` without a row count) scaled by 1/2, 1 and 2, and the op as it
is (``op``: the base rule, widened where the rows allow; NOTES.md item 50), rounds alternating
the order.

    python benchmarks/experiments/combine_tiling.py [--in-call --cases c,d,b,e --out $OUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mla_ops import triton_kernels as tk

SHAPES = {"c": (128, 64), "d": (64, 64), "a": (2048, 2), "f": (16384, 1)}  # rows, splits


def run(rows: int, splits: int, block_l: int, warps: int, o3, l2, out, lse) -> float:
    def fn():
        tk._mla_combine_kernel[(rows, triton.cdiv(512, block_l))](
            o3, l2, out, lse, *o3.stride(), *l2.stride(), *out.stride(), splits, 512,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_L=block_l, ACC=tl_f32,
            WAIT_PRIMARY=False, num_warps=warps,
        )  # fmt: skip

    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e-3


tl_f32 = triton.language.float32


def in_call(cases: str, rounds: int, out: str) -> None:
    """``mla_decode`` per case with the combine's column block scaled (1/2, 1, 2)."""
    import bench_decode as bd

    shipped = tk.combine_tiling

    def scaled(factor: float):
        def tiling(num_splits: int, kv_len: int, *_) -> tuple[int, int]:
            block_s, block_l = shipped(num_splits, kv_len)
            return block_s, max(16, min(512, int(block_l * factor)))

        return tiling

    def calls(ex, factor: float | None) -> list:
        def call(inp):
            if factor is None:  # the op's own tiling
                return bd.decode_out(inp)
            tk.combine_tiling = scaled(factor)
            try:
                return bd.decode_out(inp)
            finally:
                tk.combine_tiling = shipped

        return [lambda inp=inp: call(inp) for inp in ex.copies]

    ceil = bd.ceilings()
    rows = []
    for name in cases.split(","):
        ex = bd.experiment_case(name, ceil)
        for rnd in range(rounds):
            factors = (0.5, 1.0, None, 2.0) if rnd % 2 == 0 else (2.0, None, 1.0, 0.5)
            for factor in factors:
                t, err = bd.time_call(calls(ex, factor), ex.ref)
                block = tk.LAST_LAUNCH.get("combine_tiling") if factor is None else None
                block = block or scaled(factor or 1.0)(ex.plan.num_splits, 512)
                rows.append(dict(case=name, round=rnd, factor=factor, tiling=block, us=t * 1e6,
                                 roofline_fraction=ex.floor_s / t, rel_err=err))  # fmt: skip
                print(rows[-1], flush=True)
        del ex
        torch.cuda.empty_cache()
    bd.save_experiment(out, "combine_tiling_in_call", ceil, rows)
    print(f"\n{torch.cuda.get_device_name()}; {ceil}")
    for r in rows:
        factor = "op" if r["factor"] is None else f"x{r['factor']}"
        print(f"{r['case']} r{r['round']} {factor} {r['tiling']} {r['us']:.1f} us "
              f"{r['roofline_fraction']:.3f} {r['rel_err']:.1e}")  # fmt: skip


if __name__ == "__main__" and "--in-call" in sys.argv:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--in-call", action="store_true")
    ap.add_argument("--cases", default="c,d,b,e")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    in_call(args.cases, args.rounds, args.out)
elif __name__ == "__main__":
    print("case rows splits block_l warps us GB/s rel_err")
    for case, (rows, splits) in SHAPES.items():
        o3 = torch.randn(rows, splits, 512, device="cuda")
        l2 = torch.randn(rows, splits, device="cuda")
        out = torch.empty(rows, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(rows, device="cuda")
        ref = torch.einsum("rs,rsl->rl", l2.softmax(-1), o3)
        for block_l in (32, 64, 128, 256):
            for warps in (1, 2, 4, 8):
                t = run(rows, splits, block_l, warps, o3, l2, out, lse)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                gbps = (o3.numel() * 4 + out.numel() * 2) / t / 1e9
                us = t * 1e6
                print(f"{case} {rows} {splits} {block_l} {warps} {us:.1f} {gbps:.0f} {err:.1e}")
