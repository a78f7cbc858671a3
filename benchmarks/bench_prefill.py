"""Prefill attention of one DeepSeek-V2-Lite layer over a latent cache: the original form against
``mla::prefill``, time and peak memory, on one GPU.

* ``original``: what Hugging Face's attention does with a cache that holds latents: every cached
  token up-projected by ``kv_b_proj`` at once (``[B, H, T, P+R]`` keys, ``[B, H, T, V]`` values),
  then ``scaled_dot_product_attention`` with the bool mask ``[B, 1, S, T]``.
* ``chunked``: ``mla::prefill`` over the same latents in pages (the rewrite's prefill), its chunk
  chosen by ``plan_prefill`` (``auto``) or fixed (``--chunks``).
* ``absorbed``: ``mla_decode`` in the absorbed form (the decode rewrite), for short queries only.

Cases ``B x S x T``: S query tokens (the last S of T cached tokens, causal, the first sequence
left-padded by 7 tokens), over a cache of capacity T. Times are the median of CUDA-event timings
after a warm-up; peak memory is the most allocated during one call above what its inputs hold.
Results: JSON under ``--out`` with the device and versions; a table on stdout.

    python benchmarks/bench_prefill.py --out results
    python benchmarks/bench_prefill.py --cases 16x8192x8192 --chunks 1024,4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os

import torch

from mla_compile.fx_passes.absorb import absorbed_mla_attention_paged
from mla_compile.mla_ops import prefill as prefill_op

H, L, R, P, V = 16, 512, 64, 128, 128  # V2-Lite's attention
PAGE = 64
CASES = (
    "1x1024x1024", "1x8192x8192", "1x32768x32768", "16x1024x1024", "16x8192x8192",
    "16x4096x32768", "16x16x8192", "16x64x8192", "16x256x8192",
)  # fmt: skip


def make_case(batch: int, q_len: int, cache_len: int, device: str, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(batch * 131 + q_len)
    pages = cache_len // PAGE
    pool = torch.randn(batch * pages, PAGE, L + R, device=device, dtype=dtype, generator=gen)
    block_table = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
    lengths = torch.full((batch,), cache_len, device=device, dtype=torch.int32)
    weight = torch.randn(H * (P + V), L, device=device, dtype=dtype, generator=gen) / math.sqrt(L)
    q = torch.randn(batch, H, q_len, P + R, device=device, dtype=dtype, generator=gen)
    key = torch.arange(cache_len, device=device)
    query_pos = torch.arange(cache_len - q_len, cache_len, device=device)
    mask = (key[None, :] <= query_pos[:, None])[None, None].repeat(batch, 1, 1, 1)  # [B,1,S,T]
    mask[0, :, :, :7] = False  # left padding of the first sequence
    return q, pool, block_table, lengths, weight, mask


def original(q, pool, block_table, lengths, weight, mask, scale):
    batch, cache_len = block_table.shape[0], block_table.shape[1] * PAGE
    rows = pool[block_table.long()].view(batch, cache_len, L + R)  # the cache's rows, in order
    kv = torch.nn.functional.linear(rows[..., :L], weight).view(batch, cache_len, H, P + V)
    kv = kv.transpose(1, 2)
    k_pe = rows[..., L:][:, None].expand(batch, H, cache_len, R)
    keys = torch.cat([kv[..., :P], k_pe], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, keys, kv[..., P:], attn_mask=mask, scale=scale
    )


def chunked(chunk_tokens: int, kernel: str = "", need_lse: bool = False):
    """``mla::prefill`` as the rewrite calls it (no LSE wanted), or with a kernel forced."""

    def run(q, pool, block_table, lengths, weight, mask, scale):
        out, _ = torch.ops.mla.prefill(q, pool[..., :L], pool[..., L:], lengths, block_table,
                                       weight, mask, scale, P, chunk_tokens, need_lse,
                                       kernel)  # fmt: skip
        return out

    return run


def absorbed(q, pool, block_table, lengths, weight, mask, scale):
    return absorbed_mla_attention_paged(q, pool, block_table, lengths, weight, mask, scale, P, V)


def measure(fn, inputs, scale, reps: int) -> dict:
    torch.cuda.synchronize()
    try:
        out = fn(*inputs, scale)  # warm-up (and compile)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(*inputs, scale)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*inputs, scale)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return dict(ms=times[len(times) // 2], peak_bytes=peak, out=out)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return dict(error="out of memory")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="B x S x T")
    p.add_argument("--chunks", default="", help="fixed chunk sizes to time beside auto")
    p.add_argument("--kernels", default="", help="mla::prefill kernels to force beside auto")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    dtype, scale = torch.bfloat16, 1 / math.sqrt(P + R)
    rows = []
    for case in args.cases.split(","):
        batch, q_len, cache_len = (int(x) for x in case.split("x"))
        inputs = make_case(batch, q_len, cache_len, "cuda", dtype)
        variants = {"original": original, "chunked_auto": chunked(0)}
        variants.update({f"chunked_{c}": chunked(int(c)) for c in args.chunks.split(",") if c})
        variants.update({f"chunked_{k}": chunked(0, k) for k in args.kernels.split(",") if k})
        if q_len <= 256:
            variants["absorbed"] = absorbed
        reference = None
        for name, fn in variants.items():
            result = measure(fn, inputs, scale, args.reps)
            out = result.pop("out", None)
            if out is not None and reference is None:
                reference = out.float()
            elif out is not None:  # against the first variant that ran (bf16 agreement)
                result["max_rel_diff"] = float(
                    (out.float() - reference).abs().max() / reference.abs().max()
                )
            if name.startswith("chunked") and "error" not in result:
                plan = prefill_op.LAST_PLAN["prefill"]
                result.update(
                    chunk_tokens=plan.chunk_tokens, num_chunks=plan.num_chunks, kernel=plan.kernel
                )
            rows.append(dict(case=case, variant=name, **result))
            del out
        del inputs
        torch.cuda.empty_cache()
    facts = dict(
        date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
        torch=torch.__version__, dtype=str(dtype), heads=H, kv_lora_rank=L, rope=R, nope=P, v=V,
        page_size=PAGE, reps=args.reps,
    )  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill.json"), "w") as f:
        json.dump(dict(facts=facts, rows=rows), f, indent=1)
    print(f"{'case':>14} {'variant':>17} {'ms':>8} {'peak MiB':>8} {'chunk':>6} {'kernel':>9} "
          f"{'rel diff':>8}")  # fmt: skip
    for row in rows:
        if "error" in row:
            print(f"{row['case']:>14} {row['variant']:>17} {row['error']}")
            continue
        print(
            f"{row['case']:>14} {row['variant']:>17} {row['ms']:8.3f} "
            f"{row['peak_bytes'] / 2**20:8.0f} {row.get('chunk_tokens', ''):>6} "
            f"{row.get('kernel', ''):>9} {row.get('max_rel_diff', float('nan')):8.2e}"
        )


if __name__ == "__main__":
    main()
