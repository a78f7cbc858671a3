"""What an all-visible ``attn_mask`` costs ``mla_decode``, by the mask's dtype.

``bench_decode``'s masked cases (``am``, ``bm``) pass bf16 zeros, Hugging Face's float form; the
rewritten Hugging Face step on transformers 5.17 passes a bool mask (NOTES.md item 65). This
times ``mla_decode`` (graph replays, clean L2, the planner's plan) on (a), (b) and a single
16-head sequence of 32k tokens with no mask, bf16 zeros and bool ones, and checks each output
against the unmasked float32 reference.

    python benchmarks/experiments/mask_dtypes.py --out $OUT --tag new
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import triton_kernels as tk

CASES = [bd.CASES["a"], bd.CASES["b"], bd.Case("1x16x32k", 1, 16, 32769)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    ceil = bd.ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for case in CASES:
        copies = bd.input_copies(case, l2)
        ref = bd.reference(copies[0], case)
        capacity = copies[0].block_table.shape[1] * case.page_size
        shape = (case.batch, case.s_q, capacity)
        for kind in ("none", "bf16", "bool"):
            for inp in copies:
                if kind == "none":
                    inp.attn_mask = None
                elif kind == "bf16":
                    inp.attn_mask = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
                else:
                    inp.attn_mask = torch.ones(shape, device="cuda", dtype=torch.bool)
            err = bd.rel_err(bd.decode_out(copies[0]), ref)
            fns = [bd.graphed(lambda i=inp: bd.decode_out(i)) for inp in copies]
            t = bd.time_rotating(fns, warmup=10, rep=100)
            rows.append(dict(
                case=case.name, mask=kind, us=t * 1e6, rel_err=err,
                one_scorer=tk.LAST_LAUNCH.get("wgmma_one_scorer"),
            ))  # fmt: skip
            print(rows[-1], flush=True)
        del copies, fns
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "mask_dtypes" + args.tag, ceil, rows)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}")
    base = {}
    for r in rows:
        base.setdefault(r["case"], r["us"])
        ratio = r["us"] / base[r["case"]]
        print(f"{r['case']:10} {r['mask']:>5} {r['us']:8.1f} us {ratio:6.2f}x  {r['rel_err']:.1e}")


if __name__ == "__main__":
    main()
