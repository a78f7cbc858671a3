"""mla_decode at the latent shapes of the MLA families beyond DeepSeek's (NOTES.md item 75).

The issue's cases are all DeepSeek's row (L=512, R=64) at 16 or 128 heads. The other families
transformers has differ in latent width, RoPE part and head count; this times ``mla_decode`` (the
planner's defaults, bf16, page size 64, B=32, T=4096) at each, says which kernel took the call
and why (``LAST_LAUNCH``), checks it against a float32 einsum, and gives the roofline fraction
with the ceilings measured in the same run (bench_decode.py's method: CUDA-graph replays, L2
evicted by a read before each, inputs rotated).

    PYTHONPATH=$PWD python3 benchmarks/experiments/family_shapes.py --out $OUT
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd

import mla_ops
from mla_ops import triton_kernels as tk

# (name, families, L, R, heads)
SHAPES = [
    ("deepseek_128h", "DeepSeek-V2/V3, Kimi-K2, dots3_note full layers", 512, 64, 128),
    ("rope_64h", "Mistral Large 4, HY V4 (64 heads)", 512, 64, 64),
    ("nope_64h", "GLM-5 Next, Mistral Large 4 NoPE layers", 512, 0, 64),
    ("nope_32h", "Kimi Linear's MLA layers", 512, 0, 32),
    ("wide_64h", "dots3_note sliding-window layers (L=1024)", 1024, 64, 64),
    ("minicpm3_40h", "MiniCPM3 (L=256, R=32, 40 heads)", 256, 32, 40),
]
BATCH, CONTEXT, PAGE = 32, 4096, 64


def inputs(kv_len: int, rope_len: int, heads: int, gen: torch.Generator) -> dict:
    pages_per_seq = CONTEXT // PAGE
    num_pages = BATCH * pages_per_seq
    cache = torch.randn(num_pages, PAGE, kv_len + rope_len, generator=gen).to(
        "cuda", torch.bfloat16
    )
    table = torch.randperm(num_pages, generator=gen).view(BATCH, pages_per_seq)
    return dict(
        q=torch.randn(BATCH, 1, heads, kv_len + rope_len, generator=gen).to("cuda", torch.bfloat16),
        kv_cache=cache,  # [pages, page_size, L+R]
        block_table=table.to("cuda", torch.int32),  # [B, pages_per_seq]
        cache_seqlens=torch.full((BATCH,), CONTEXT, dtype=torch.int32, device="cuda"),
    )


def call(inp: dict, kv_len: int) -> torch.Tensor:
    out, _ = mla_ops.mla_decode(
        inp["q"], inp["kv_cache"], inp["cache_seqlens"], block_table=inp["block_table"],
        head_dim_v=kv_len, softmax_scale=bd.SCALE,
    )  # fmt: skip
    return out  # [B, 1, H, L]


def reference(inp: dict, kv_len: int, rows: int = 2) -> torch.Tensor:
    """Float32 einsum over the first ``rows`` sequences: ``[rows, 1, H, L]``."""
    outs = []
    for b in range(rows):
        kv = inp["kv_cache"][inp["block_table"][b].long()].flatten(0, 1).float()  # [T, L+R]
        scores = torch.einsum("shd,td->sht", inp["q"][b].float(), kv) * bd.SCALE
        outs.append(torch.einsum("sht,tl->shl", scores.softmax(-1), kv[:, :kv_len]))
    return torch.stack(outs)


# (block_m, block_n, num_warps, num_stages) of the Triton kernel tried at L=1024
WIDE_TILINGS = [(32, 16, 8, 2), (32, 16, 4, 2), (16, 16, 4, 2), (16, 32, 4, 2), (16, 32, 8, 2),
                (32, 32, 8, 2), (16, 64, 4, 1)]  # fmt: skip


def sweep_wide(ceil: dict, l2_bytes: int) -> list[dict]:
    """The wide shape (L=1024, R=64, 64 heads) under other tilings of the Triton kernel, with the
    planner's splits for it."""
    from mla_ops.planner import plan_splits

    _, _, kv_len, rope_len, heads = next(s for s in SHAPES if s[0] == "wide_64h")
    gen = torch.Generator().manual_seed(0)
    all_inputs = [inputs(kv_len, rope_len, heads, gen) for _ in range(4)]
    first = all_inputs[0]
    capacity = first["block_table"].shape[1] * PAGE
    plan = plan_splits(BATCH, heads, capacity, first["q"].device, False)
    ref = reference(first, kv_len)
    results = []
    for tiling in WIDE_TILINGS:
        cfg = tk.DecodeConfig(*tiling, use_tma=False)

        def fn(inp, cfg=cfg):
            kv_c, k_pe = inp["kv_cache"][..., :kv_len], inp["kv_cache"][..., kv_len:]
            o, lse = tk.decode(
                inp["q"], kv_c, k_pe, inp["cache_seqlens"], inp["block_table"], bd.SCALE, True,
                plan.num_splits, None, None, plan.total_splits, config=cfg,
            )  # fmt: skip
            return tk.combine(o, lse, torch.bfloat16)[0]

        try:
            err = bd.rel_err(fn(first)[:2], ref)
            seconds = bd.time_rotating([bd.graphed(lambda i=i, f=fn: f(i)) for i in all_inputs])
            results.append(dict(tiling=tiling, us=seconds * 1e6, rel_err=err))
        except Exception as exc:  # a tiling that does not fit: say so
            results.append(dict(tiling=tiling, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--sweep-wide", action="store_true", help="Triton tilings at L=1024")
    args = parser.parse_args()
    ceil = bd.ceilings()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for name, families, kv_len, rope_len, heads in SHAPES:
        gen = torch.Generator().manual_seed(0)
        first = inputs(kv_len, rope_len, heads, gen)
        copies = min(8, math.ceil(4 * l2_bytes / (first["kv_cache"].numel() * 2)))
        all_inputs = [first] + [inputs(kv_len, rope_len, heads, gen) for _ in range(copies - 1)]
        out = call(first, kv_len)
        launch = {k: v for k, v in tk.LAST_LAUNCH.items() if isinstance(v, (str, int, bool))}
        kv_c, k_pe = first["kv_cache"][..., :kv_len], first["kv_cache"][..., kv_len:]
        why = tk.wgmma_path(first["q"], kv_c, k_pe, first["block_table"], None)[1]
        err = bd.rel_err(out[:2], reference(first, kv_len))
        fns = [bd.graphed(lambda inp=inp, kv_len=kv_len: call(inp, kv_len)) for inp in all_inputs]
        seconds = bd.time_rotating(fns)
        tokens = BATCH * CONTEXT
        nbytes = tokens * (kv_len + rope_len) * 2 + BATCH * heads * (2 * kv_len + rope_len) * 2
        flops = 2 * heads * tokens * (2 * kv_len + rope_len)
        bytes_s, flops_s = nbytes / ceil["copy_bw_Bps"], flops / ceil["bf16_matmul_flops"]
        rows.append(
            dict(
                name=name, families=families, L=kv_len, R=rope_len, heads=heads, us=seconds * 1e6,
                roofline=max(bytes_s, flops_s) / seconds,
                bound="bytes" if bytes_s >= flops_s else "flops",
                matmul_fraction=flops / seconds / ceil["bf16_matmul_flops"], rel_err=err,
                kernel=launch.get("decode_path"), why=why, launch=launch,
            )
        )  # fmt: skip
    sweep = sweep_wide(ceil, l2_bytes) if args.sweep_wide else []
    bd.save_experiment(
        args.out, "family_shapes", ceil, rows, batch=BATCH, context=CONTEXT, sweep_wide=sweep
    )
    print(
        f"copy {ceil['copy_bw_Bps'] / 1e9:.0f} GB/s, matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} "
        f"TFLOP/s; B={BATCH}, T={CONTEXT}, bf16, page {PAGE}, S_q=1"
    )
    print(f"{'shape':14} {'L':>5} {'R':>3} {'H':>4} {'us':>8} {'roof':>5} {'bound':>6} err  kernel")
    for r in rows:
        print(
            f"{r['name']:14} {r['L']:5d} {r['R']:3d} {r['heads']:4d} {r['us']:8.1f} "
            f"{r['roofline']:5.2f} {r['bound']:>6} {r['rel_err']:.1e} {r['kernel']}"
        )
    for r in rows:
        print(f"{r['name']}: {r['why']}; {r['launch']}")
    for r in sweep:
        print("L=1024 Triton tiling", r)


if __name__ == "__main__":
    main()
