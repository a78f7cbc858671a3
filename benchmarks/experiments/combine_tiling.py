"""Experiment (issue 3): column block and warps of the combine kernel, timed alone.

Partials as ``mla::decode`` writes them for cases (c) and (d) of bench_decode.py: random float32
outputs and LSEs, every split non-empty. CUDA-graph replays, median; bytes = partials read +
output written.

    python benchmarks/experiments/combine_tiling.py
"""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench

from mla_ops import triton_kernels as tk

SHAPES = {"c": (128, 64), "d": (64, 64), "a": (2048, 2), "f": (16384, 1)}  # rows, splits


def run(rows: int, splits: int, block_l: int, warps: int, o3, l2, out, lse) -> float:
    def fn():
        tk._mla_combine_kernel[(rows, triton.cdiv(512, block_l))](
            o3, l2, out, lse, *o3.stride(), *l2.stride(), *out.stride(), splits, 512,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_L=block_l, ACC=tl_f32,
            num_warps=warps,
        )  # fmt: skip

    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e-3


tl_f32 = triton.language.float32

if __name__ == "__main__":
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
