"""A float8 cache at more than 16 query rows: what ``mla_decode`` runs and how fast, against the
bf16 cache (NOTES.md item 62).

The float8 products (items 57-59) serve 16-row programs only. More rows (128 heads: (b), or 16
heads with S_q = 2 for MTP: 32 rows) convert a float8 ``kv_c`` to fp16 in the wgmma kernel, and a
float8 ``k_pe`` (the whole row in e4m3, vLLM's fp8 MLA cache) is refused by the wgmma kernel, so
the Triton kernel takes the call. This times ``mla_decode`` (graph replays, clean L2, the
planner's plans) over the bf16 cache, a float8 ``kv_c`` with a bf16 ``k_pe`` (``8``) and the whole
row in float8 (``8e``), and says which kernel ran; each float8 output is checked against float64
attention over the dequantised cache.

    python benchmarks/experiments/fp8_rows.py --cases b,a2,f --out $OUT

``--mask``: every call also passes an all-visible bf16 ``attn_mask`` (zeros), what a rewritten
Hugging Face decode step passes (``bench_decode``'s case ``am``; NOTES.md item 63).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from fp8_layout import dequantised_reference

from mla_ops import triton_kernels as tk

# (a) with S_q = 2 (MTP): 32 query rows of 16 heads.
EXTRA = {"a2": bd.Case("a2", 128, 16, 4096, s_q=2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="b,a2")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--mask", action="store_true", help="an all-visible bf16 attn_mask too")
    args = ap.parse_args()
    ceil = bd.ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for name in args.cases.split(","):
        base = bd.CASES.get(name) or EXTRA[name]
        for suffix, kw in (("", {}), ("8", dict(fp8=True)), ("8e", dict(fp8=True, fp8_rope=True))):
            case = replace(base, name=name + suffix, mask=args.mask, **kw)
            copies = bd.input_copies(case, l2)
            if case.fp8:
                ref = dequantised_reference(copies[0], case).float()
            else:
                ref = bd.reference(copies[0], case)
            err = bd.rel_err(bd.decode_out(copies[0]), ref)
            path = tk.LAST_LAUNCH.get("decode_path")
            fns = [bd.graphed(lambda i=inp: bd.decode_out(i)) for inp in copies]
            t = bd.time_rotating(fns, warmup=10, rep=100)
            rows.append(dict(case=case.name, us=t * 1e6, rel_err=err, decode_path=path,
                             floor_us=bd.floor_seconds(case, dict(ceil)) * 1e6))  # fmt: skip
            print(rows[-1], flush=True)
            del copies, fns
            torch.cuda.empty_cache()
    bd.save_experiment(args.out, "fp8_rows" + ("_mask" if args.mask else ""), ceil, rows)
    print(f"\n{'with' if args.mask else 'without'} an all-visible attn_mask")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"triton {bd.triton.__version__}; {ceil}")  # fmt: skip
    print(f"{'case':8}{'us':>9}{'vs bf16':>9}{'kernel':>10}  err")
    base_us = {}
    for r in rows:
        key = r["case"].removesuffix("8e").removesuffix("8")
        base_us.setdefault(key, r["us"])
        ratio = base_us[key] / r["us"]
        print(f"{r['case']:8}{r['us']:9.1f}{ratio:8.2f}x{r['decode_path']:>10}  {r['rel_err']:.1e}")


if __name__ == "__main__":
    main()
