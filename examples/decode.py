"""MLA decode, three ways, on one random DeepSeek-V3-shaped attention layer (no download).

1. naive: expand K = [kv_c W_UK^T, k_pe] and V = kv_c W_UV^T per head, then ordinary MHA
   (what Hugging Face transformers <= 5.14 caches: H*(P+R+V) values per token);
2. absorbed: q_lat = q_nope W_UK, MQA over the 576-wide latent cache with ``mla_ops.mla_decode``,
   o = o_lat W_UV^T (what DeepSeek's inference code and FlashMLA do: L+R values per token);
3. the same under ``torch.compile(fullgraph=True)``.

It prints the largest difference between them, their times and the cache bytes per token.

    python examples/decode.py                      # CPU, float32, small batch
    python examples/decode.py --device cuda --dtype bfloat16 --batch 64 --context 4096
"""

from __future__ import annotations

import argparse
import time

import torch

from mla_compile import mla_ops


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    p.add_argument("--heads", type=int, default=16, help="H (DeepSeek-V3: 128)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def timed(fn, repeats: int, device: torch.device) -> tuple[object, float]:
    result = fn()  # warm-up (and compilation)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    # DeepSeek-V3 attention dims: latent L, rope R, per-head nope P and value V.
    L, R, P, V, H = 512, 64, 128, 128, args.heads
    B, T, page = args.batch, args.context, args.page_size
    scale = 0.1352337788608801  # (P+R)**-0.5 * mscale**2 with V3's YaRN settings

    w_kv_b = torch.randn(H * (P + V), L, device=device, dtype=dtype) / L**0.5  # kv_b_proj.weight
    w_uk, w_uv = w_kv_b.view(H, P + V, L).split([P, V], dim=1)  # [H, P, L], [H, V, L]
    q_nope = torch.randn(B, 1, H, P, device=device, dtype=dtype)
    q_pe = torch.randn(B, 1, H, R, device=device, dtype=dtype)

    # Paged latent cache: one [kv_c | k_pe] row per token, pages of sequences interleaved.
    pages_per_seq = -(-T // page)
    kv_cache = torch.randn(B * pages_per_seq, page, L + R, device=device, dtype=dtype)
    block_table = (
        torch.randperm(B * pages_per_seq, device=device).view(B, pages_per_seq).to(torch.int32)
    )
    cache_seqlens = torch.full((B,), T, dtype=torch.int32, device=device)

    def naive() -> torch.Tensor:
        rows = kv_cache[block_table.long()].view(B, -1, L + R)[:, :T]  # [B, T, L+R]
        kv_c, k_pe = rows.split([L, R], dim=-1)
        k = torch.cat(
            [torch.einsum("btl,hpl->bhtp", kv_c, w_uk), k_pe[:, None].expand(B, H, T, R)], dim=-1
        )  # [B, H, T, P+R]
        v = torch.einsum("btl,hvl->bhtv", kv_c, w_uv)  # [B, H, T, V]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, 1, P+R]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return o.transpose(1, 2)  # [B, 1, H, V]

    def absorbed() -> torch.Tensor:
        q_lat = torch.einsum("bshp,hpl->bshl", q_nope, w_uk)  # [B, 1, H, L]
        q = torch.cat([q_lat, q_pe], dim=-1)  # [B, 1, H, L+R]
        o_lat, _ = mla_ops.mla_decode(
            q, kv_cache, cache_seqlens, block_table=block_table, head_dim_v=L, softmax_scale=scale
        )  # [B, 1, H, L]
        return torch.einsum("bshl,hvl->bshv", o_lat, w_uv)  # [B, 1, H, V]

    compiled = torch.compile(absorbed, fullgraph=True)

    ref, t_naive = timed(naive, args.repeats, device)
    out, t_abs = timed(absorbed, args.repeats, device)
    out_c, t_comp = timed(compiled, args.repeats, device)
    elt = torch.finfo(dtype).bits // 8
    print(f"device={device} dtype={dtype} B={B} T={T} H={H} L={L} R={R} page_size={page}")
    print(f"{'form':<22}{'ms/step':>10}{'max |diff| vs naive':>22}{'cache B/token/layer':>22}")
    print(f"{'naive (expanded K/V)':<22}{t_naive:>10.2f}{0.0:>22.2e}{H * (P + R + V) * elt:>22,}")
    for name, o, t in (("absorbed mla_decode", out, t_abs), ("absorbed + compile", out_c, t_comp)):
        diff = (o.float() - ref.float()).abs().max().item()
        print(f"{name:<22}{t:>10.2f}{diff:>22.2e}{(L + R) * elt:>22,}")


if __name__ == "__main__":
    main()
