"""The repair pass on a GPU: isolation on every kernel path, and its cost on finite data.

Part 1: for programs that mix query positions (S_q > 1, heads not a multiple of the block) under
a causal or masked problem, each sequence's last key set to NaN (seen by the last position
only): the other positions' rows must stay finite and close to the finite-key output, the last
position's rows NaN; with the pass turned off, how many earlier rows went NaN.
Part 2: CUDA-graph replays of ``runtime.attention`` with the pass on and off (finite data, L2
cleaned before each call, median), and with the pass triggered.

Usage (repo root, GPU): python benchmarks/experiments/repair_cost.py  (writes $OUT/repair.json)
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_decode import graphed, time_rotating

from mla_compile.mla_ops import runtime
from mla_compile.mla_ops.planner import DecodeOptions, default_splits

L, R = 512, 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter has no bf16
OFF = DecodeOptions(repair_non_finite=False)
TRITON = DecodeOptions(use_wgmma=False)


def make(batch, heads, s_q, tokens, page, fp8=False, mask=False, seed=0, ragged=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    lo = max(s_q, tokens // 2) if ragged else tokens
    lengths = torch.randint(lo, tokens + 1, (batch,), generator=g, device=DEV)
    per = math.ceil(tokens / page)
    num_pages = batch * per + 3
    bt = torch.randperm(num_pages, generator=g, device=DEV)[: batch * per]
    bt = bt.view(batch, per).int()
    kv = torch.randn(num_pages, page, L + R, generator=g, device=DEV).to(DTYPE)
    kv_c, k_pe = kv[..., :L], kv[..., L:]
    kv_scale = None
    if fp8:
        kv_c, kv_scale = kv[..., :L].to(torch.float8_e4m3fn), 1.0
    q = (0.05 * torch.randn(batch, s_q, heads, L + R, generator=g, device=DEV)).to(DTYPE)
    attn_mask = None
    if mask:
        attn_mask = torch.rand(batch, s_q, tokens, generator=g, device=DEV) > 0.2
        attn_mask[:, :, 0] = True
        attn_mask[torch.arange(batch), -1, lengths - 1] = True
    splits = default_splits(q, kv_c, k_pe, bt, attn_mask)
    args = [q, kv_c, k_pe, lengths.int(), bt, (L + R) ** -0.5, True, splits.num_splits, kv_scale,
            attn_mask, splits.total_splits]  # fmt: skip
    return args


def poison(args, value):
    kv_c, lengths, bt = args[1], args[3], args[4]
    page = kv_c.shape[1]
    for b, n in enumerate(lengths.tolist()):
        kv_c[bt[b, (n - 1) // page], (n - 1) % page, 5] = value


def correctness():
    rows = []
    heads = [16] if "--quick" in sys.argv else [3, 16, 40]
    combos = itertools.product(
        heads, [2, 4], [64, 16], [False, True], [False, True], [None, TRITON]
    )
    for heads, s_q, page, fp8, mask, opt in combos:
        if fp8 and mask:
            continue
        args = make(8, heads, s_q, 700, page, fp8, mask, seed=heads * 10 + s_q)
        options = opt or DecodeOptions()
        clean, _ = runtime.attention(*args, options=options)
        rec = {k: str(v) for k, v in runtime.LAST_LAUNCH.items()
               if k in ("kernel", "decode_path", "wgmma_one_scorer", "wgmma_rows_on_m",
                        "repair", "merge")}  # fmt: skip
        saved = args[1].clone()
        poison(args, float("nan"))
        out, _ = runtime.attention(*args, options=options)
        off, _ = runtime.attention(*args, options=replace_off(options))
        args[1].copy_(saved)
        early, ref = out[:, :-1].float(), clean[:, :-1].float()
        err = ((early - ref).abs().max() / ref.abs().max()).item()
        row = dict(
            heads=heads, s_q=s_q, page=page, fp8=fp8, mask=mask,
            forced_triton=opt is TRITON, **rec,
            early_finite=bool(torch.isfinite(early).all()), early_rel_err=err,
            late_nan=bool(torch.isnan(out[:, -1]).any(-1).all()),
            early_nan_rows_without_repair=int(torch.isnan(off[:, :-1]).any(-1).sum()),
        )  # fmt: skip
        row["ok"] = row["early_finite"] and err < 2e-2 and row["late_nan"]
        rows.append(row)
        print(row, flush=True)
    return rows


def replace_off(options):
    from dataclasses import replace

    return replace(options, repair_non_finite=False)


def timing():
    shapes = [  # batch, heads, s_q, tokens
        (32, 16, 2, 4096), (64, 16, 2, 8192), (32, 16, 4, 4096), (16, 3, 4, 8192),
        (64, 40, 2, 4096), (128, 16, 2, 2048), (32, 128, 2, 4096),
    ]  # fmt: skip
    rows = []
    for (batch, heads, s_q, tokens), opt in itertools.product(shapes, [None, TRITON]):
        args = make(batch, heads, s_q, tokens, 64, ragged=False)
        options = opt or DecodeOptions()
        res = {}
        for name, o in (("on", options), ("off", replace_off(options))):
            fn = graphed(lambda o=o, a=args: runtime.attention(*a, options=o))
            res[name] = time_rotating([fn]) * 1e6
            if name == "on":
                res["kernel"] = runtime.LAST_LAUNCH.get("kernel")
                res["repair"] = runtime.LAST_LAUNCH.get("repair")
        poison(args, float("nan"))
        fn = graphed(lambda o=options, a=args: runtime.attention(*a, options=o))
        res["triggered"] = time_rotating([fn]) * 1e6
        row = dict(batch=batch, heads=heads, s_q=s_q, tokens=tokens, forced_triton=opt is TRITON,
                   on_us=res["on"], off_us=res["off"], triggered_us=res["triggered"],
                   ratio=res["on"] / res["off"], kernel=res["kernel"],
                   repair=res["repair"])  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    import triton

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__}  # fmt: skip
    result["correctness"] = correctness()
    result["timing"] = timing()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "repair.json"), "w") as f:
        json.dump(result, f, indent=1)
    bad = [r for r in result["correctness"] if not r["ok"]]
    print(f"correctness: {len(result['correctness']) - len(bad)} ok, {len(bad)} failed")
    print("B H S_q T triton | on us | off us | ratio | triggered us | kernel")
    for r in result["timing"]:
        print(f"{r['batch']} {r['heads']} {r['s_q']} {r['tokens']} {r['forced_triton']} | "
              f"{r['on_us']:.1f} | {r['off_us']:.1f} | {r['ratio']:.3f} | "
              f"{r['triggered_us']:.1f} | {r['kernel']}")  # fmt: skip


if __name__ == "__main__":
    main()
