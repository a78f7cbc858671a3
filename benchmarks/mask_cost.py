"""What an attention mask costs mla_decode: the same problem without a mask, with an all-visible
bool mask and with an all-zero float mask (what the rewritten Hugging Face step passes).

    PYTHONPATH=. python3 benchmarks/mask_cost.py        # CUDA-graph replays, medians
"""

from __future__ import annotations

import torch
import triton

import mla_ops

L, R, H, PAGE = 512, 64, 16, 64


def case(batch: int, context: int) -> dict[str, float]:
    pages = -(-context // PAGE)
    q = torch.randn(batch, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(batch * pages, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    lengths = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    masks = {
        "none": None,
        "bool": torch.ones(batch, 1, pages * PAGE, device="cuda", dtype=torch.bool),
        "float": torch.zeros(batch, 1, pages * PAGE, device="cuda", dtype=torch.bfloat16),
    }
    times = {}
    for name, mask in masks.items():

        def call(mask=mask):
            return mla_ops.mla_decode(q, pool, lengths, block_table=table, head_dim_v=L,
                                      softmax_scale=0.1, causal=False, attn_mask=mask)  # fmt: skip

        times[name] = triton.testing.do_bench_cudagraph(call) * 1e3  # us
    return times


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, bf16, H={H}, L={L}, R={R}, page {PAGE}")
    for batch, context in [(32, 8192), (128, 4096), (1, 32768)]:
        t = case(batch, context)
        print(
            f"B={batch:<4} T={context:<6} no mask {t['none']:7.1f} us   bool mask "
            f"{t['bool']:7.1f} us ({t['bool'] / t['none']:.2f}x)   float mask "
            f"{t['float']:7.1f} us ({t['float'] / t['none']:.2f}x)"
        )
