"""Decode context parallelism (DCP): the latent cache sharded by token across a process group.

Every rank of the group holds a slice of every sequence's tokens: token ``t`` lives on rank
``(t // interleave) % world``, at local position ``(t // (interleave * world)) * interleave +
t % interleave``, so a growing sequence fills the ranks in turn and each rank's share stays
within ``interleave`` tokens of ``len / world``. A decode step gives every rank the same query
(all the group's heads); each rank attends over its own tokens (``mla_decode``), the ranks'
attention states (output and LSE) are gathered, and ``mla_combine`` merges them by LSE: the
result equals attention over the whole sequence. Cache bytes per rank are ``1 / world`` of the
whole; the exchange per step and layer is ``world x B x S_q x H x (L + 1)`` float32 values.

The gather is ``torch.distributed``'s functional collective (traceable: a compiled step keeps it
in its graph), so any backend works: NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from .ops import mla_combine, mla_decode
from .reference import accumulation_dtype

# The traceable all-gather: ``all_gather_single`` where torch has it (``all_gather_tensor``, its
# older name, is deprecated there).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def owner(token: torch.Tensor, world: int, interleave: int = 1) -> torch.Tensor:
    """The rank that holds each global token position (int64 tensor in, same shape out)."""
    return (token // interleave) % world


def local_position(token: torch.Tensor, world: int, interleave: int = 1) -> torch.Tensor:
    """Each global token position's position in its rank's slice."""
    return (token // (interleave * world)) * interleave + token % interleave


def local_lengths(cache_seqlens: torch.Tensor, rank: int, world: int, interleave: int = 1):
    """``[B]`` int32: how many of each sequence's ``cache_seqlens`` tokens rank ``rank`` holds."""
    n = cache_seqlens.long()
    span = interleave * world
    full, rest = n // span, n % span  # whole rounds, then the tokens of the last round
    mine = (rest - rank * interleave).clamp(min=0, max=interleave)
    return (full * interleave + mine).to(torch.int32)


def global_position(local: torch.Tensor, rank: int, world: int, interleave: int = 1):
    """Global token position of rank ``rank``'s local position ``local``."""
    return (local // interleave) * (interleave * world) + rank * interleave + local % interleave


def _check(q: torch.Tensor, world: int, rank: int, interleave: int) -> None:
    if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave < 1:
        raise ValueError(f"interleave must be a positive int, got {interleave!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S_q, H, L+R], got shape {tuple(q.shape)}")


def context_parallel_decode(
    q: torch.Tensor,
    kv_cache,
    cache_seqlens: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    block_table: torch.Tensor | None = None,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool = True,
    interleave: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode`` over a cache sharded by token across ``group`` (default: the world).

    Args:
        q: ``[B, S_q, H, L+R]``, the same on every rank of the group.
        kv_cache: this rank's slice, in any form ``mla_decode`` takes (paged with
            ``block_table``, or ``[B, T_local, L+R]``); its local positions as ``local_position``
            says.
        cache_seqlens: ``[B]`` int32, the *global* token counts (the S_q new ones included);
            each rank derives its own (``local_lengths``).
        causal: query ``i`` sees the global keys ``[0, cache_seqlens - S_q + i]``.
        The rest as ``mla_decode``.

    Returns:
        ``out [B, S_q, H, L]`` in q's dtype and ``lse [B, S_q, H]`` float32, over all the group's
        tokens, on every rank.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _check(q, world, rank, interleave)
    s_q = q.shape[1]
    lengths = local_lengths(cache_seqlens, rank, world, interleave)
    attn_mask = None
    if causal and s_q > 1:
        # Which local keys each query position sees: local j holds global g(j), visible to
        # query i when g(j) <= seqlen - S_q + i. The lengths bound it from above already.
        rows = kv_cache[0] if isinstance(kv_cache, tuple) else kv_cache
        capacity = (
            block_table.shape[1] * rows.shape[1] if block_table is not None else rows.shape[1]
        )
        local = torch.arange(capacity, device=q.device)
        last = cache_seqlens.long()[:, None] - s_q + torch.arange(s_q, device=q.device)  # [B, S_q]
        seen = global_position(local, rank, world, interleave)[None, None, :] <= last[..., None]
        attn_mask = seen  # [B, S_q, T_local]
    out, lse = mla_decode(
        q, kv_cache, lengths, block_table=block_table, head_dim_v=head_dim_v,
        softmax_scale=softmax_scale, causal=False, attn_mask=attn_mask,
    )  # fmt: skip
    # Every rank's state: [world * B, S_q, H, L] and [world * B, S_q, H], gathered on dim 0, in
    # the accumulation dtype (float32, or float64 for float64).
    acc = accumulation_dtype(q.dtype)
    group = group or dist.group.WORLD
    outs = _all_gather(out.to(acc).contiguous(), 0, group)
    lses = _all_gather(lse.to(acc).contiguous(), 0, group)
    outs = outs.view(world, *out.shape).permute(1, 2, 3, 0, 4)  # [B, S_q, H, world, L]
    lses = lses.view(world, *lse.shape).permute(1, 2, 3, 0)  # [B, S_q, H, world]
    return mla_combine(outs.contiguous(), lses.contiguous(), q.dtype)


def shard_rows(
    rows: torch.Tensor, cache_seqlens: torch.Tensor, rank: int, world: int, interleave: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s slice of a dense ``[B, T, D]`` cache (every sequence's tokens it holds, in
    local order, zero past its length): ``[B, ceil(T / world) rounded up to interleave, D]``."""
    capacity = rows.shape[1]
    span = interleave * world
    local_capacity = -(-capacity // span) * interleave
    local = torch.arange(local_capacity, device=rows.device)
    source = global_position(local, rank, world, interleave)  # [T_local]
    inside = source < capacity
    taken = rows[:, source.clamp(max=capacity - 1)]  # [B, T_local, D]
    lengths = local_lengths(cache_seqlens, rank, world, interleave).long()
    keep = inside[None, :] & (local[None, :] < lengths[:, None])
    return torch.where(keep[..., None], taken, torch.zeros((), dtype=rows.dtype))
