"""An independent float64 reference for MLA decode, written for clarity, not speed.

It shares no code with ``mla_ops``: it walks each sequence's tokens through the block table
itself and runs a plain softmax per query, in float64.
"""

from __future__ import annotations

import torch


def cache_rows(
    cache: torch.Tensor,
    block_table: torch.Tensor | None,
    batch_index: int,
    length: int,
    kv_scale: float | None = None,
) -> torch.Tensor:
    """Rows ``[length, D]`` of one sequence, in token order, as float64 (float8 dequantised)."""
    if block_table is None:
        rows = cache[batch_index, :length].cpu().double()
    else:
        page_size = cache.shape[1]
        tokens = torch.arange(length)
        pages = block_table[batch_index].long().cpu()[tokens // page_size]
        rows = cache.cpu()[pages, tokens % page_size].double()
    return rows * kv_scale if cache.dtype == torch.float8_e4m3fn else rows


def mla_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    token_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, S_q, H, L+R]`` over the cache: ``out [B, S_q, H, L], lse [B, S_q, H]``.

    token_range: optional per-sequence ``(start [B], end [B])``: only those keys are attended
    (one split's partial state). kv_scale dequantises a float8 cache. attn_mask ``[B, S_q, T_m]``:
    bool keeps the True keys, floating is added to the scaled scores (at or below -1e30: dropped);
    keys past T_m are dropped.
    Everything is computed in float64 on the CPU.
    """
    batch, s_q, heads, _ = q.shape
    kv_len = kv_c.shape[-1]
    out = torch.zeros(batch, s_q, heads, kv_len, dtype=torch.float64)
    lse = torch.full((batch, s_q, heads), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        length = int(cache_seqlens[b])
        keys = torch.cat(
            [
                cache_rows(kv_c, block_table, b, length, kv_scale),
                cache_rows(k_pe, block_table, b, length, kv_scale),
            ],
            dim=-1,
        )  # [length, L+R]
        for i in range(s_q):
            first, last = 0, length - 1  # inclusive
            if causal:
                last = length - s_q + i
            if token_range is not None:
                first = max(first, int(token_range[0][b]))
                last = min(last, int(token_range[1][b]) - 1)
            if last < first:
                continue
            keep = list(range(first, last + 1))
            bias = torch.zeros(len(keep), dtype=torch.float64)
            if attn_mask is not None:
                row = attn_mask[b, i].cpu()
                kept, values = [], []
                for j in keep:
                    if j >= row.shape[0]:
                        continue
                    if row.dtype == torch.bool:
                        if row[j]:
                            kept.append(j)
                            values.append(0.0)
                    elif float(row[j]) > -1e30:
                        kept.append(j)
                        values.append(float(row[j]))
                keep, bias = kept, torch.tensor(values, dtype=torch.float64)
                if not keep:
                    continue
            k = keys[keep]  # [n, L+R]: only the visible keys
            scores = q[b, i].cpu().double() @ k.T * softmax_scale + bias  # [H, n]
            lse[b, i] = torch.logsumexp(scores, dim=-1)
            out[b, i] = torch.softmax(scores, dim=-1) @ k[:, :kv_len]
    return out, lse
