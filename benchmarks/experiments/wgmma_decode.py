"""Gluon wgmma decode kernel (mla_ops/wgmma_decode.py) against the Triton kernel, on the GPU.

First checks the new kernel's partials (out and lse) against the PyTorch implementation of
``mla::decode`` on random problems (odd heads, S_q > 1 causal, empty and 1-token sequences, short
last tiles, balanced splits, an invalid page id), then times decode + combine for both kernels on
the issue-3 cases under several split counts (CUDA-graph replays, rotated inputs), with the copy
and matmul ceilings measured in the same run.

    python benchmarks/experiments/wgmma_decode.py --cases a,d,e --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import reference
from mla_ops import triton_kernels as tk
from mla_ops import wgmma_decode as wd
from mla_ops.planner import MIN_CHUNK, SPLIT_GRANULE


def run_wgmma(
    q, kv_c, k_pe, seqlens, table, scale, causal, num_splits, total_splits, kv_scale=None, **cfg
):  # fmt: skip
    b, s_q, h, _ = q.shape
    out = torch.full((b, s_q, h, num_splits, kv_c.shape[-1]), float("nan"), device=q.device)
    lse = torch.full((b, s_q, h, num_splits), float("nan"), device=q.device)
    wd.launch(
        q, kv_c, k_pe, seqlens, table, out, lse, scale, kv_scale, causal, num_splits, total_splits,
        block_m=cfg.get("block_m", 16), num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 2), min_chunk=MIN_CHUNK, granule=SPLIT_GRANULE,
        lengths_per_step=128, gather=kv_c.shape[1] % wd.BLOCK_N != 0,
    )  # fmt: skip
    return out, lse


def check(
    seed: int, batch, heads, s_q, page, lengths, num_splits, total_splits, bad_page, fp8=False,
    **cfg,
):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    L, R = 512, 64
    pages_per_seq = max(1, -(-max(lengths) // page))
    num_pages = batch * pages_per_seq + 3
    cache = torch.randn(num_pages, page, L + R, generator=gen).to(dev, dt)
    cache[-3:] = float("nan")  # pages no sequence owns: stale memory
    table = (
        torch.randperm(batch * pages_per_seq, generator=gen).view(batch, -1).to(dev, torch.int32)
    )
    if bad_page:
        table[0, 0] = num_pages + 5
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    q = torch.randn(batch, s_q, heads, L + R, generator=gen).to(dev, dt)
    # Rows past each sequence's end, inside its last page, hold NaN (stale memory).
    for b_i, n in enumerate(lengths):
        for t in range(n, pages_per_seq * page):
            cache[table[b_i, t // page].long(), t % page] = float("nan")
    kv_c, kv_scale = cache[..., :L], None
    if fp8:  # float8 kv_c (scale from the live rows), k_pe in bf16; NaN poison stays NaN
        kv_scale = cache[..., :L].float().nan_to_num(0.0).abs().amax().item() / 448.0
        kv_c = (cache[..., :L].float() / kv_scale).to(torch.float8_e4m3fn)
    args = (q, kv_c, cache[..., L:], seqlens, table, 0.1, s_q > 1, num_splits)
    o, lse = run_wgmma(*args, total_splits, kv_scale=kv_scale, **cfg)
    ro, rlse = reference.decode(*args, kv_scale, None, total_splits)
    # The PyTorch implementation also leaves NaN in the other splits of a poisoned sequence (p = 0
    # times a NaN row); the combine makes the whole row NaN either way.
    ok_rows = ~torch.isnan(rlse) & ~torch.isnan(ro).any(-1)
    same_nan = torch.equal(torch.isnan(lse), torch.isnan(rlse))
    err_o = (o - ro)[ok_rows].abs().max().item() if ok_rows.any() else 0.0
    err_l = (lse - rlse)[ok_rows & torch.isfinite(rlse)].abs().max().item() if ok_rows.any() else 0
    inf_same = torch.equal(torch.isinf(lse), torch.isinf(rlse))
    good = same_nan and inf_same and err_o < 2e-2 and err_l < 2e-2
    return dict(
        seed=seed, batch=batch, heads=heads, s_q=s_q, page=page, lengths=lengths[:6],
        num_splits=num_splits, total_splits=total_splits, bad_page=bad_page, fp8=fp8, err_out=err_o,
        err_lse=err_l, nan_pattern_equal=same_nan, inf_pattern_equal=inf_same, ok=good, **cfg,
    )  # fmt: skip


PROBLEMS = [
    # batch, heads, s_q, page, lengths, num_splits, total_splits, bad_page
    (3, 16, 1, 64, [1000, 0, 65], 1, None, False),
    (3, 16, 1, 64, [1000, 1, 64], 3, None, False),
    (4, 5, 1, 128, [300, 2048, 63, 129], 4, 6, False),
    (2, 8, 2, 64, [700, 2], 2, None, False),
    (2, 7, 2, 64, [4096, 333], 5, None, False),
    (5, 16, 1, 64, [5000, 10, 1, 0, 777], 8, 10, False),
    (2, 16, 1, 64, [900, 300], 2, None, True),
    (1, 3, 5, 256, [2000], 1, None, False),
    # 32- and 64-row programs (two warpgroups): DeepSeek's 128 heads, S_q = 2, partial blocks.
    (2, 128, 1, 64, [1000, 65], 2, None, False),
    (3, 128, 2, 64, [700, 3, 0], 3, 8, False),
    (3, 21, 3, 128, [300, 0, 129], 2, None, False),
    (2, 32, 1, 64, [2000, 64], 4, None, False),
    (2, 128, 1, 64, [900, 300], 2, None, True),
    # Page sizes the copy engine cannot take: tiles gathered row by row (cp.async).
    (3, 16, 1, 1, [1000, 0, 65], 2, None, False),
    (4, 5, 1, 3, [300, 2048, 63, 129], 4, 6, False),
    (3, 128, 2, 16, [700, 3, 0], 3, 8, False),
    (2, 16, 1, 1, [900, 300], 2, None, True),
    (2, 32, 1, 16, [2000, 64], 4, None, True),
]
# The same problems over a float8 kv_c (checked at every ring depth that fits).
FP8_PROBLEMS = [p for i, p in enumerate(PROBLEMS) if i in (0, 2, 4, 5, 6, 9, 10, 13, 15, 16)]


def configs_for(query_rows: int, fp8: bool = False, explore: bool = False) -> list[dict]:
    """The kernel's own tiling (``wgmma_tiling``) with two ring slots (the fewest its pipeline
    takes; three do not fit in shared memory at 64 rows) and, over a float8 cache where they
    fit, three. ``explore``: also 8 warps at 16 rows."""
    block_m, warps = tk.wgmma_tiling(query_rows)
    stages = [2]
    if tk.wgmma_stages(block_m, 512, 64, fp8, tk.shared_memory_optin(torch.device("cuda"))) > 2:
        stages.append(3)
    warp_counts = sorted({warps, 8}) if explore else [warps]
    return [dict(block_m=block_m, num_warps=w, num_stages=n) for n in stages for w in warp_counts]


def correctness() -> list[dict]:
    rows = []
    for seed, p in enumerate(PROBLEMS):
        for cfg in configs_for(p[1] * p[2]):
            rows.append(check(seed, *p, **cfg))
    for seed, p in enumerate(FP8_PROBLEMS):
        for cfg in configs_for(p[1] * p[2], fp8=True):
            rows.append(check(100 + seed, *p, fp8=True, **cfg))
    return rows


def timing(case: bd.Case, l2_bytes: int, configs, split_counts) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    first = bd.Inputs(case, gen, with_contiguous=False)
    n_copies = min(8, math.ceil(4 * l2_bytes / (first.kv_cache.numel() * 2)))
    copies = [first] + [bd.Inputs(case, gen, False) for _ in range(n_copies - 1)]
    ref = bd.reference(first, case)
    results = []
    for num_splits, total_splits in split_counts:

        def triton_fn(inp, ns=num_splits, ts=total_splits):
            def fn():
                o, lse = torch.ops.mla.decode(*inp.op_args(ns, ts))
                return torch.ops.mla.combine(o, lse, torch.bfloat16)[0]

            return fn

        variants = [("triton", {}, triton_fn)]
        for cfg in configs:

            def wg_fn(inp, ns=num_splits, ts=total_splits, cfg=cfg):
                # fill_empty=True: this experiment predates mla_decode's fill_empty=False.
                return bd.wgmma_call(inp, ns, ts, fill_empty=True, **cfg)

            variants.append(("wgmma", cfg, wg_fn))
        for name, cfg, make in variants:
            fns = [make(inp) for inp in copies]
            # The op now dispatches to the wgmma kernel by itself: the baseline turns it off for
            # its launches (the path is chosen when the graph is captured).
            saved = tk.has_wgmma
            if name == "triton":
                tk.has_wgmma = lambda device: False
            try:
                err = bd.rel_err(fns[0](), ref)
                path = tk.LAST_LAUNCH["decode_path"]
                graphs = [bd.graphed(f) for f in fns]
            finally:
                tk.has_wgmma = saved
            t = bd.time_rotating(graphs, warmup=10, rep=100)
            results.append(
                dict(
                    case=case.name,
                    kernel=name,
                    **cfg,
                    num_splits=num_splits,
                    total_splits=total_splits,
                    us=t * 1e6,
                    rel_err=err,
                    path=path,
                )
            )
            print(results[-1], flush=True)
    return results


# (num_splits, total_splits) timed per case: one or two resident programs per SM, and the
# planner's balanced plans for the ragged batch (e).
SPLITS = {
    "a": [(1, None), (2, None), (4, 256)],
    "a8": [(1, None), (2, None)],
    "d": [(33, None), (66, None)],
    "e": [(2, 64), (4, 128), (8, 256)],
    "g": [(1, None), (2, None), (2, 128), (4, 256)],
    "b": [(1, None), (2, None), (4, 64)],
    "c": [(33, None), (66, None), (132, 66)],
    "f": [(1, None), (2, 64)],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,d,e")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--explore", action="store_true", help="time configs_for(explore=True)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    report = {"device": props.name, "torch": torch.__version__, "triton": bd.triton.__version__}
    if not args.skip_check:
        rows = correctness()
        report["check"] = rows
        bad = [r for r in rows if not r["ok"]]
        print(f"correctness: {len(rows) - len(bad)}/{len(rows)} ok", flush=True)
        for r in bad:
            print("FAILED", r, flush=True)
    ceil = bd.ceilings()
    report["ceilings"] = ceil
    print(ceil, flush=True)
    results = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        meta = dict(ceil)
        floor = bd.floor_seconds(case, meta)
        splits = SPLITS[name]
        configs = configs_for(case.s_q * case.heads, case.fp8, args.explore)
        rows = timing(case, props.L2_cache_size, configs, splits)
        for r in rows:
            r["roofline_fraction"] = floor / (r["us"] * 1e-6)
        results += rows
        torch.cuda.empty_cache()
    report["timing"] = results
    (out / "wgmma_decode.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{'case':4} {'kernel':14} {'splits':>10} {'us':>8} {'roofline':>8} {'err':>8}")
    for r in results:
        sp = f"{r['num_splits']}/{r['total_splits']}"
        kernel = r["kernel"]
        if "num_stages" in r:
            kernel += f" s{r['num_stages']}w{r['num_warps']}"
        print(
            f"{r['case']:4} {kernel:14} {sp:>10} {r['us']:8.1f} "
            f"{r['roofline_fraction']:8.3f} {r['rel_err']:8.1e}"
        )


if __name__ == "__main__":
    main()
