"""Repeated launches of the wgmma kernel over a float8 cache whose unused rows hold NaN (the
tests' poison): NaN counts per sequence and, over the same cache without NaN, each launch's
largest difference from a three-slot launch (NOTES.md item 57: a ring slot handed back while
loads from it were still queued gave both; the three-slot launch has the variant's other
settings). Variants: the op's launch, no producer partition,
three ring slots, the fp16 conversion. ``--whole``: ``k_pe`` in float8 too, under the same
scale (NOTES.md item 58; no fp16 conversion then).

    python benchmarks/experiments/float8_race_check.py [--launches 4] [--whole]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mla_ops import wgmma_decode as wd
from tests.mla_ops.cases import make_case

FP8 = torch.float8_e4m3fn
VARIANTS = {
    "op's launch": {},
    "no producer": dict(producer_warps=0),
    "3 slots": dict(num_stages=3),
    "fp16 conversion": dict(float8_products=False),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--whole", action="store_true", help="k_pe in float8 too")
    args = ap.parse_args()
    # test_float8_products_error_against_bf16_is_the_caches[2-16-1]'s case: three sequences, two
    # of them ending in a partial tile.
    case = make_case(
        912, dtype=torch.bfloat16, device="cuda", page_size=64, dims=(512, 64), heads=16, s_q=1,
        pair=True, causal=False, max_len=3000, total_splits=8,
    )  # fmt: skip
    scale = max(float(case.kv_c.float().nan_to_num(0.0).abs().amax()), 1.0) / 448.0
    kv_c = (case.kv_c.float() / scale).to(FP8)  # unused rows stay NaN
    k_pe = (case.k_pe.float() / scale).to(FP8) if args.whole else case.k_pe
    case = replace(case, kv_c=kv_c, k_pe=k_pe, kv_cache=(kv_c, k_pe), kv_scale=scale)
    batch = case.q.shape[0]

    def launch(kv_c: torch.Tensor, k_pe: torch.Tensor, **kw) -> torch.Tensor:
        out = torch.zeros(batch, 1, 16, 1, 512, device="cuda")
        lse = torch.zeros(batch, 1, 16, 1, device="cuda")
        wd.launch(
            case.q, kv_c, k_pe, case.cache_seqlens, case.block_table, out, lse,
            case.softmax_scale, scale, False, 1, 8, **{
                "block_m": 16, "num_warps": 4, "num_stages": 2, "min_chunk": 256, "granule": 64,
                "lengths_per_step": 128, **kw,
            },
        )  # fmt: skip
        torch.cuda.synchronize()
        return out

    print(torch.cuda.get_device_name(), "lengths", case.cache_seqlens.tolist())
    clean_kv = kv_c.float().nan_to_num(0.0).to(FP8)
    clean_pe = case.k_pe.float().nan_to_num(0.0).to(case.k_pe.dtype)
    for name, kw in VARIANTS.items():
        if args.whole and kw.get("float8_products") is False:
            continue
        ref = launch(clean_kv, clean_pe, **{**kw, "num_stages": 3})
        nan = [torch.isnan(launch(kv_c, case.k_pe, **kw)).sum((1, 2, 3, 4)).tolist()
               for _ in range(args.launches)]  # fmt: skip
        diff = [(launch(clean_kv, clean_pe, **kw) - ref).abs().max().item()
                for _ in range(args.launches)]  # fmt: skip
        print(f"{name:16} NaN per sequence {nan}  max |diff| without NaN {diff}")


if __name__ == "__main__":
    main()
