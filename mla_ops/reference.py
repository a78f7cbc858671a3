"""PyTorch implementation of ``mla::decode`` and ``mla::combine`` for CPU (and any device).

It computes exactly what the Triton kernels compute (same split boundaries, same empty-split
convention) with plain tensor ops, in float32 (float64 for float64 inputs). It gathers the whole
cache capacity per sequence, so it is meant for correctness and small problems, not speed.
"""

from __future__ import annotations

import torch

from .splits import split_bounds


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of partial outputs and LSEs for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_rows(
    cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """The cache rows of every sequence in token order: ``[B, end - start, D]`` for the token
    positions ``start .. end - 1`` (default: the whole capacity).

    cache: ``[num_pages, page_size, D]`` with ``block_table [B, max_pages]``, else ``[B, T, D]``.
    Table entries past a sequence's last page are never used, so they are clamped, not trusted.
    """
    if block_table is None:
        return cache[:, start:end]
    num_pages, page_size, dim = cache.shape
    end = block_table.shape[1] * page_size if end is None else end
    first, last = start // page_size, -(-end // page_size)  # the pages holding the range
    pages_used = (cache_seqlens.long() + page_size - 1) // page_size  # [B]
    page_pos = torch.arange(first, last, device=block_table.device)
    in_use = page_pos[None, :] < pages_used[:, None]  # [B, last - first]
    pages = torch.where(in_use, block_table[:, first:last].long(), 0)
    pages = pages.clamp(0, max(num_pages - 1, 0))
    batch = block_table.shape[0]
    rows = cache[pages].reshape(batch, (last - first) * page_size, dim)
    offset = first * page_size
    return rows[:, start - offset : end - offset]


# A float mask value at or below this hides its key. Hugging Face fills hidden positions with the
# dtype's most negative value (-3.4e38 in float32/bfloat16): added to a score it would absorb the
# score and the log(n) of a split's LSE, so such rows must be dropped, not averaged uniformly.
MASK_HIDDEN = -1e30


def mask_hidden_threshold(dtype: torch.dtype) -> float:
    """The float mask value at or below which a key is hidden: ``MASK_HIDDEN``, or the dtype's
    most negative finite value where that is larger (float16's -65504, which Hugging Face fills
    float16 masks with and which could never reach -1e30)."""
    return max(MASK_HIDDEN, float(torch.finfo(dtype).min))


def mask_over_capacity(
    attn_mask: torch.Tensor, capacity: int, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn_mask [B, S_q, T_m]`` as a visibility mask and an additive bias over ``capacity`` keys.

    Keys at ``T_m`` and past, and float values at or below ``mask_hidden_threshold``, are hidden;
    a bool mask has a zero bias.
    """
    keep = min(attn_mask.shape[-1], capacity)
    past = (0, capacity - keep)  # keys past the mask: hidden, no bias (padded on the last dim)
    if attn_mask.dtype == torch.bool:
        visible = torch.nn.functional.pad(attn_mask[..., :keep], past, value=False)
        return visible, torch.zeros(visible.shape, dtype=acc, device=attn_mask.device)
    values = attn_mask[..., :keep].to(acc)
    shown = values > mask_hidden_threshold(attn_mask.dtype)
    visible = torch.nn.functional.pad(shown, past, value=False)
    bias = torch.nn.functional.pad(torch.where(shown, values, 0.0), past, value=0.0)
    return visible, bias


def decode(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials: ``o [B, S_q, H, num_splits, L]`` and ``lse [B, S_q, H, num_splits]``.

    A float8 cache part is dequantised with ``kv_scale``. ``attn_mask [B, S_q, T_m]``: bool
    (True = visible) or floating (added to the scaled scores; at or below ``MASK_HIDDEN``:
    hidden); keys at ``T_m`` and past are hidden.
    """
    batch, s_q, heads, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    kv_len = kv_c.shape[-1]

    def dequantised(part: torch.Tensor) -> torch.Tensor:
        rows = gather_rows(part, cache_seqlens, block_table).to(acc)
        return rows * kv_scale if part.dtype == torch.float8_e4m3fn else rows

    rows = torch.cat([dequantised(kv_c), dequantised(k_pe)], dim=-1)  # [B, T, L+R]
    capacity = rows.shape[1]
    if capacity == 0:  # a zero-length cache or block table: every sequence is empty
        out = q.new_zeros((batch, s_q, heads, num_splits, kv_len), dtype=acc)
        return out, q.new_full((batch, s_q, heads, num_splits), float("-inf"), dtype=acc)
    seqlen = cache_seqlens.long()
    token = torch.arange(capacity, device=q.device)
    # Rows past a sequence's end are stale memory (maybe NaN): 0 * NaN would leak into P @ V.
    rows = rows.masked_fill((token[None, :] >= seqlen[:, None])[..., None], 0.0)
    scores = torch.einsum("bshd,btd->bsht", q.to(acc), rows) * softmax_scale  # [B, S_q, H, T]

    visible = token[None, None, :] < seqlen[:, None, None]  # [B, 1, T]
    if causal:
        # query i of S_q sees keys [0, seqlen - S_q + i]
        last_key = seqlen[:, None] - s_q + torch.arange(s_q, device=q.device)[None, :]  # [B, S_q]
        visible = visible & (token[None, None, :] <= last_key[:, :, None])  # [B, S_q, T]
    if attn_mask is not None:
        mask, bias = mask_over_capacity(attn_mask, capacity, acc)  # [B, S_q, T] each
        visible = visible & mask
        scores = scores + bias[:, :, None, :]
    # Each query position reads only the values of the keys it sees: a key hidden from it (left
    # padding, or causal: seen by a later position only) may hold NaN or inf, and 0 * inf would
    # leak into its P @ V.
    values = rows[:, None, :, :kv_len].masked_fill(~visible[..., None], 0.0)  # [B, S_q|1, T, L]
    values = values.expand(batch, s_q, capacity, kv_len)
    start, end = split_bounds(seqlen, num_splits, total_splits)  # [B, num_splits]

    outs, lses = [], []
    for split in range(num_splits):
        in_split = (token[None, :] >= start[:, split : split + 1]) & (
            token[None, :] < end[:, split : split + 1]
        )  # [B, T]
        mask = (visible & in_split[:, None, :])[:, :, None, :]  # [B, S_q, 1, T]
        masked = scores.masked_fill(~mask, float("-inf"))
        # Shift by the row maximum before exp: with a bias near -3.4e38 (finfo.min masks) the
        # lse itself cannot hold log(n), so normalising by exp(scores - lse) would be wrong.
        row_max = masked.amax(dim=-1, keepdim=True)  # [B, S_q, H, 1]
        probs = torch.exp(masked - torch.where(torch.isneginf(row_max), 0.0, row_max))
        total = probs.sum(dim=-1)  # [B, S_q, H]
        probs = probs / torch.where(total == 0, 1.0, total)[..., None]
        outs.append(torch.einsum("bsht,bstl->bshl", probs, values))
        lses.append(row_max.squeeze(-1) + torch.log(total))
    # Functional (no in-place writes): the same code is the ops' decomposition in exported
    # programs (export.aoti's Python-free packages).
    out = torch.stack(outs, dim=3)  # [B, S_q, H, num_splits, L]
    lse = torch.stack(lses, dim=3)  # [B, S_q, H, num_splits]
    return out, lse


def combine(
    out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE-weighted merge over the split axis: ``[..., S, L], [..., S] -> [..., L], [...]``."""
    acc = accumulation_dtype(out_partial.dtype)
    lse_partial = lse_partial.to(acc)
    lse_max = lse_partial.amax(dim=-1, keepdim=True)
    # All splits empty: shift by 0 so the weights are exactly 0 and the output is 0, not NaN.
    shift = torch.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = torch.exp(lse_partial - shift)  # [..., S]
    total = weight.sum(dim=-1)
    lse = torch.log(total) + shift.squeeze(-1)
    # An empty split's output is never read, whatever it holds.
    parts = torch.where(weight[..., None] > 0, out_partial.to(acc), 0.0)
    out = (weight[..., None] * parts).sum(dim=-2) / torch.where(total == 0, 1.0, total)[..., None]
    # NaN in a partial LSE (the kernels' poison for unreadable cache locations) must survive.
    poisoned = torch.isnan(lse_partial).any(dim=-1)
    out = torch.where(poisoned[..., None], float("nan"), out)
    return out.to(out_dtype or out_partial.dtype), lse
