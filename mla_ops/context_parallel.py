"""Decode context parallelism (DCP): the latent cache sharded by token across a process group.

Every rank of the group holds a slice of every sequence's tokens: token ``t`` lives on rank
``(t // interleave) % world``, at local position ``(t // (interleave * world)) * interleave +
t % interleave``, so a growing sequence fills the ranks in turn and each rank's share stays
within ``interleave`` tokens of ``len / world``. A decode step gives every rank the same query
(all the group's heads); each rank attends over its own tokens (``mla_decode``), the ranks'
attention states (output and LSE) are gathered, and ``mla_combine`` merges them by LSE: the
result equals attention over the whole sequence. Cache bytes per rank are ``1 / world`` of the
whole; the exchange per step and layer is ``world x B x S_q x H x (L + 1)`` float32 values.

With tensor-parallel heads over the group (``heads_sharded``), each rank's query holds its own
heads: the group's queries are all-gathered, each rank attends all of them over its tokens, and
an all-to-all hands each rank its own heads' states to merge.

The gather is ``torch.distributed``'s functional collective (traceable: a compiled step keeps it
in its graph), so any backend works: NCCL on GPUs, gloo on CPU.

``ContextParallelCache`` is one rank's share as a cache: a ``PagedLatentCache`` of the tokens
the rank owns (pages for ``1 / world`` of ``max_length``), kept in step with the global lengths
through appends of any length (a prompt, a decode step, a verify block), crops, beam reorders
and batch regroups, each applied by every rank of the group alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from .ops import mla_combine, mla_decode
from .paged_cache import PagedLatentCache, capacity_for, cropped_lengths
from .reference import accumulation_dtype

# The traceable all-gather: ``all_gather_single`` where torch has it (``all_gather_tensor``, its
# older name, is deprecated there).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclass(frozen=True)
class ContextParallel:
    """Decode context parallelism for ``MLACache(..., static=True, context_parallel=...)``: the
    cache sharded by token across ``group`` (default: the world), ``interleave`` tokens a turn.
    Every rank runs the whole model on the same inputs; the rewrite (``backend="mla"``) reads
    each rank's pages and merges the ranks' attention states. Under tensor parallelism (a model
    loaded with ``DistributedConfig(tp_plan=...)``) the group lies inside the tensor-parallel
    group: the rewrite gathers the group's queries, and each rank keeps its own heads."""

    group: dist.ProcessGroup | None = None
    interleave: int = 1

    def ranks(self) -> tuple[int, int, str]:
        """``(rank, world, group name)`` of this process in the group."""
        group = self.group or dist.group.WORLD
        return dist.get_rank(group), dist.get_world_size(group), group.group_name


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


def local_capacity(max_length: int, world: int, interleave: int = 1) -> int:
    """The most tokens one rank holds of a sequence of ``max_length`` tokens."""
    span = interleave * world
    return -(-max_length // span) * interleave


def _check_group(world: int, rank: int, interleave: int) -> None:
    if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave < 1:
        raise ValueError(f"interleave must be a positive int, got {interleave!r}")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is not in a group of {world}")


def _check(q: torch.Tensor, world: int, rank: int, interleave: int) -> None:
    _check_group(world, rank, interleave)
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
    heads_sharded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode`` over a cache sharded by token across ``group`` (default: the world).

    Args:
        q: ``[B, S_q, H, L+R]``, the same on every rank of the group; with ``heads_sharded``
            (the ranks hold different heads: tensor parallelism over the group), this rank's
            heads, the same count on every rank.
        kv_cache: this rank's slice, in any form ``mla_decode`` takes (paged with
            ``block_table``, or ``[B, T_local, L+R]``); its local positions as ``local_position``
            says.
        cache_seqlens: ``[B]`` int32, the *global* token counts (the S_q new ones included);
            each rank derives its own (``local_lengths``).
        causal: query ``i`` sees the global keys ``[0, cache_seqlens - S_q + i]``.
        The rest as ``mla_decode``.

    Returns:
        ``out [B, S_q, H, L]`` in q's dtype and ``lse [B, S_q, H]`` float32, over all the group's
        tokens, on every rank (with ``heads_sharded``: of this rank's heads; every rank attends
        the group's heads over its tokens, and each gets its own heads' states back).
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
    heads_dim = 2 if heads_sharded else None
    if heads_sharded:
        q = gather_heads(q, group, world, heads_dim)  # [B, S_q, world * H, L+R]
    out, lse = mla_decode(
        q, kv_cache, lengths, block_table=block_table, head_dim_v=head_dim_v,
        softmax_scale=softmax_scale, causal=False, attn_mask=attn_mask,
    )  # fmt: skip
    return merge_across(out, lse, group, world, q.dtype, heads_dim)


def merge_across(
    out: torch.Tensor,
    lse: torch.Tensor,
    group,
    world: int,
    dtype: torch.dtype,
    heads_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's attention state ``out [..., D]``, ``lse [...]`` (in the accumulation dtype:
    float32, or float64 for float64) merged by LSE.

    ``heads_dim=None``: the ranks attended the same heads; every state is gathered (on dim 0)
    and every rank gets the merged whole. ``heads_dim=d``: the ranks hold different heads
    (tensor parallelism over the group), and ``out`` / ``lse`` hold the whole group's heads on
    dim ``d`` in rank order (``gather_heads``); each rank is sent the states of its own heads
    (an all-to-all, ``1 / world`` of the gather's bytes) and returns those heads merged."""
    acc = accumulation_dtype(dtype)
    group = group or dist.group.WORLD
    if heads_dim is None:
        outs = _all_gather(out.to(acc).contiguous(), 0, group).view(world, *out.shape)
        lses = _all_gather(lse.to(acc).contiguous(), 0, group).view(world, *lse.shape)
    else:  # [world (whose heads), ...] sent, [world (whose tokens), ...] received
        outs = out.to(acc).unflatten(heads_dim, (world, -1)).movedim(heads_dim, 0)
        lses = lse.to(acc).unflatten(heads_dim, (world, -1)).movedim(heads_dim, 0)
        outs = funcol.all_to_all_single(outs.contiguous(), None, None, group)
        lses = funcol.all_to_all_single(lses.contiguous(), None, None, group)
    dims = outs.dim() - 1
    outs = outs.permute(*range(1, dims), 0, dims)  # [B, ..., world, D]
    lses = lses.permute(*range(1, dims), 0)  # [B, ..., world]
    return mla_combine(outs.contiguous(), lses.contiguous(), dtype)


def gather_heads(x: torch.Tensor, group, world: int, dim: int) -> torch.Tensor:
    """Every rank's heads of ``x`` (its own on dim ``dim``) side by side in rank order: the
    group's heads, for ranks that hold different heads (tensor parallelism over the group).
    ``[..., H, ...]`` in, ``[..., world * H, ...]`` out."""
    gathered = _all_gather(x.contiguous(), 0, group or dist.group.WORLD)  # [world * d0, ...]
    return gathered.view(world, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def context_parallel_prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    block_table: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    softmax_scale: float,
    nope_dim: int,
    interleave: int = 1,
    chunk_tokens: int = 0,
    heads_sharded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla::prefill`` (the un-absorbed attention of a long query) over a cache sharded by token
    across ``group``: a prompt pass or a second turn over a cached prefix.

    Args:
        q: ``[B, H, S, P+R]``, the same on every rank.
        kv_c, k_pe, block_table: this rank's slice (local positions as ``local_position`` says),
            in the forms ``mla::prefill`` takes.
        cache_seqlens: ``[B]`` int32, the *global* token counts.
        attn_mask: ``[B|1, H|1, S|1, T_m]`` over *global* positions, as the model made it; each
            rank reads the columns of the tokens it holds.
        heads_sharded: the ranks hold different heads (tensor parallelism over the group): ``q``,
            ``kv_b_weight`` (``[H * (P+V), L]``) and a per-head mask are this rank's heads; the
            group's are gathered (queries and ``kv_b_proj`` rows), each rank attends them over its
            tokens and gets its own heads' states back.

    Returns:
        ``out [B, H, S, V]`` in q's dtype and ``lse [B, H, S]``, over all the group's tokens, on
        every rank.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _check_group(world, rank, interleave)
    lengths = local_lengths(cache_seqlens, rank, world, interleave)
    heads_dim = 1 if heads_sharded else None
    if heads_sharded:  # before the mask is cut: every rank's mask is over global positions
        q, kv_b_weight, attn_mask = group_heads(q, kv_b_weight, attn_mask, group, world)
    if attn_mask is not None:
        capacity = (
            block_table.shape[1] * kv_c.shape[1] if block_table is not None else kv_c.shape[1]
        )
        attn_mask = local_mask_columns(attn_mask, capacity, rank, world, interleave)
    out, lse = torch.ops.mla.prefill(q, kv_c, k_pe, lengths, block_table, kv_b_weight,
                                     attn_mask, softmax_scale, nope_dim, chunk_tokens)  # fmt: skip
    return merge_across(out, lse, group, world, q.dtype, heads_dim)


def group_heads(
    q: torch.Tensor,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    group,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What ``mla::prefill`` needs to attend the group's heads when each rank holds its own
    (tensor parallelism over the group): ``q [B, H, S, P+R]``, the rows of ``kv_b_proj``
    (``[H * (P+V), L]``, head-major) and a per-head mask, each gathered across the group in
    rank order (``world * H`` heads)."""
    q = gather_heads(q, group, world, 1)
    kv_b_weight = gather_heads(kv_b_weight, group, world, 0)
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] > 1:
        attn_mask = gather_heads(attn_mask, group, world, 1)
    return q, kv_b_weight, attn_mask


def local_mask_columns(
    attn_mask: torch.Tensor, capacity: int, rank: int, world: int, interleave: int = 1
) -> torch.Tensor:
    """The columns of a mask over *global* key positions ``[..., T_m]`` that rank ``rank``'s
    local positions ``0 .. capacity - 1`` hold: ``[..., capacity]``; positions past ``T_m``
    hidden (False, or -inf for a float mask)."""
    local = torch.arange(capacity, device=attn_mask.device)
    source = global_position(local, rank, world, interleave)  # [capacity] global positions
    inside = source < attn_mask.shape[-1]
    columns = attn_mask[..., source.clamp(max=attn_mask.shape[-1] - 1)]
    hidden = False if attn_mask.dtype == torch.bool else float("-inf")
    return torch.where(inside, columns, hidden)


@torch.library.custom_op("mla::cp_rows", mutates_args=())
def cp_rows(
    pool: torch.Tensor,
    block_table: torch.Tensor,
    local_seqlens: torch.Tensor,
    group_name: str,
    world: int,
    rank: int,
    interleave: int,
    capacity: int,
    heads_sharded: bool = False,
) -> torch.Tensor:
    """Every rank's rows of a sharded cache in global token order: ``[B, capacity, D]``, zero
    past each sequence's length. What an unrewritten attention reads from a context-parallel
    ``MLACache``: an all-gather of the whole cache (correct, without the memory saving). The
    rewrite replaces it, reading this rank's ``pool`` pages in place; ``heads_sharded`` (the
    group's ranks hold different heads) is for the rewrite, which then gathers the group's
    queries, and does not change the rows."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    local = torch.ops.mla.paged_rows(pool, block_table, local_seqlens)  # [B, T_local, D]
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local.contiguous(), group=_resolve_process_group(group_name))
    out = local.new_zeros((local.shape[0], capacity, local.shape[2]))
    position = torch.arange(local.shape[1], device=local.device)
    for source, rows in enumerate(gathered):
        target = global_position(position, source, world, interleave)
        inside = target < capacity
        out[:, target[inside]] = rows[:, inside]
    return out


@cp_rows.register_fake
def _cp_rows_fake(
    pool: torch.Tensor,
    block_table: torch.Tensor,
    local_seqlens: torch.Tensor,
    group_name: str,
    world: int,
    rank: int,
    interleave: int,
    capacity: int,
    heads_sharded: bool = False,
) -> torch.Tensor:
    return pool.new_empty((block_table.shape[0], capacity, pool.shape[2]))


def shard_rows(
    rows: torch.Tensor, cache_seqlens: torch.Tensor, rank: int, world: int, interleave: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s slice of a dense ``[B, T, D]`` cache (every sequence's tokens it holds, in
    local order, zero past its length): ``[B, ceil(T / world) rounded up to interleave, D]``."""
    capacity = rows.shape[1]
    local = torch.arange(local_capacity(capacity, world, interleave), device=rows.device)
    source = global_position(local, rank, world, interleave)  # [T_local]
    inside = source < capacity
    taken = rows[:, source.clamp(max=capacity - 1)]  # [B, T_local, D]
    lengths = local_lengths(cache_seqlens, rank, world, interleave).long()
    keep = inside[None, :] & (local[None, :] < lengths[:, None])
    return torch.where(keep[..., None], taken, torch.zeros((), dtype=rows.dtype))


class ContextParallelCache:
    """One rank's share of a latent cache sharded by token across a group.

    Args:
        rank, world: this rank and the group's size (``for_group`` reads them from a process
            group); interleave: tokens per turn (see the module docstring).
        static: every page allocated up front and the lengths on the device (global and local):
            ``append`` and ``decode`` read nothing on the host, so a step compiles into one
            graph and can be captured in a CUDA graph. The pools hold one scratch page more,
            where ``mla::paged_write`` puts the rows of tokens other ranks own.
        heads_sharded: the group's ranks hold different heads of the attention (a model under
            tensor parallelism over this group): ``decode`` and the rewrite gather the group's
            queries and hand each rank its own heads' output.
        The rest as ``PagedLatentCache``'s; ``max_length`` is the global most tokens per
        sequence, and the pages are allocated for this rank's share of it.

    Every rank calls every method with the same arguments (the whole new rows on ``append``),
    as the layers of a model replicated over the group do; each keeps the rows it owns.
    """

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        num_layers: int,
        batch_size: int,
        kv_len: int,
        rope_len: int,
        max_length: int,
        interleave: int = 1,
        page_size: int = 64,
        num_pages: int | None = None,
        static: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        group_name: str | None = None,
        heads_sharded: bool = False,
    ) -> None:
        _check_group(world, rank, interleave)
        self.group_name = group_name  # the group's name (None: the world), for mla::cp_rows
        self.heads_sharded = heads_sharded
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        self.rank, self.world, self.interleave = rank, world, interleave
        self.max_length, self.static = max_length, static
        share = local_capacity(max_length, world, interleave)
        if static and num_pages is None:  # every sequence's pages, and the scratch page
            num_pages = batch_size * -(-share // page_size) + 1
        self.local = PagedLatentCache(
            num_layers=num_layers, batch_size=batch_size, kv_len=kv_len, rope_len=rope_len,
            max_length=share, page_size=page_size, num_pages=num_pages, static=static,
            dtype=dtype, device=device,
        )  # fmt: skip
        self._lengths = [0] * num_layers  # global tokens per sequence, by layer (growing mode)
        # [num_layers, B] int32 global tokens per sequence (static mode's device lengths)
        self.global_seqlens = torch.zeros_like(self.local.seqlens)

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None = None, **kwargs) -> ContextParallelCache:
        """The calling rank's share, for ``group`` (default: the world)."""
        group = group or dist.group.WORLD
        return cls(
            rank=dist.get_rank(group), world=dist.get_world_size(group),
            group_name=group.group_name, **kwargs,
        )  # fmt: skip

    def get_seq_length(self, layer: int = 0) -> int:
        """Global tokens stored per sequence in ``layer`` (static mode: a host read)."""
        return int(self.global_seqlens[layer, 0]) if self.static else self._lengths[layer]

    def cache_seqlens(self, layer: int) -> torch.Tensor:
        """``[B]`` int32 global lengths of ``layer`` (``context_parallel_decode``'s argument)."""
        if self.static:
            return self.global_seqlens[layer]
        batch = self.local.batch_size
        return torch.full((batch,), self._lengths[layer], dtype=torch.int32, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.local.device

    def cache_bytes(self) -> int:
        """Bytes of this rank's pools (every layer)."""
        return sum(p.numel() * p.element_size() for p in self.local.all_pools)

    # What MLACache reads of its storage (a PagedLatentCache's names).
    @property
    def batch_size(self) -> int:
        return self.local.batch_size

    @property
    def pools(self) -> list[torch.Tensor]:
        return self.local.pools

    @property
    def all_pools(self) -> list[torch.Tensor]:
        return self.local.all_pools

    @property
    def block_table(self) -> torch.Tensor:
        return self.local.block_table

    @property
    def seqlens(self) -> torch.Tensor:
        """``[num_layers, B]`` int32 global lengths (static mode)."""
        return self.global_seqlens

    def fixed_tensors(self) -> list[torch.Tensor]:
        """The tensors a compiled step reads in place (static mode)."""
        return [*self.local.fixed_tensors(), self.global_seqlens]

    def bytes_per_token_per_layer(self) -> int:
        return self.local.bytes_per_token_per_layer()

    def index_bytes_per_token(self) -> int:
        return 0

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's rows of ``layer`` in global order (``mla::cp_rows``, static mode):
        ``kv_c [B, capacity, L]``, ``k_pe [B, capacity, R]``."""
        if not self.static:
            raise RuntimeError("ContextParallelCache.rows needs a static share (static=True)")
        name = self.group_name or dist.group.WORLD.group_name
        capacity = capacity_for(self.max_length, self.local.page_size)
        rows = torch.ops.mla.cp_rows(
            self.local.pools[layer], self.local.block_table, self.local.seqlens[layer], name,
            self.world, self.rank, self.interleave, capacity, self.heads_sharded,
        )  # fmt: skip
        return rows[..., : self.local.kv_len], rows[..., self.local.kv_len :]

    def append(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store the ``S`` new tokens of every sequence (``kv_c [B, S, L]``, ``k_pe [B, S, R]``,
        the same on every rank): this rank keeps those it owns."""
        self.local._check_rows(kv_c, k_pe)
        if self.static:
            self._append_at_device_lengths(layer, kv_c, k_pe)
            return
        start, new = self._lengths[layer], kv_c.shape[1]
        if start + new > self.max_length:
            raise ValueError(
                f"cache capacity exceeded: {start} + {new} tokens > max_length={self.max_length}"
            )
        position = torch.arange(start, start + new, device=kv_c.device)
        mine = (owner(position, self.world, self.interleave) == self.rank).nonzero()[:, 0]
        if mine.numel():
            self.local.append(layer, kv_c[:, mine], k_pe[:, mine])
        self._lengths[layer] = start + new

    def _append_at_device_lengths(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Static mode: the new tokens' global positions from the device lengths; this rank's
        rows written at their local positions (``mla::paged_write``), the others to scratch."""
        lengths, new = self.global_seqlens[layer], kv_c.shape[1]
        if not torch.compiler.is_compiling() and (layer == 0 or self.device.type != "cuda"):
            end = int(lengths.max()) + new  # a host read: once a step, never under compile
            if end > self.max_length:
                raise ValueError(
                    f"cache capacity exceeded: {end - new} + {new} tokens > "
                    f"max_length={self.max_length} (static share)"
                )
        position = lengths.long()[:, None] + torch.arange(new, device=kv_c.device)  # [B, S]
        mine = owner(position, self.world, self.interleave) == self.rank
        local = torch.where(mine, local_position(position, self.world, self.interleave), -1)
        rows = torch.cat([kv_c, k_pe], dim=-1)  # [B, S, L+R]
        torch.ops.mla.paged_write(self.local.pools[layer], self.local.block_table, local, rows)
        self.local.seqlens[layer].add_(mine.sum(dim=1).to(torch.int32))
        lengths.add_(new)

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        *,
        group: dist.ProcessGroup | None = None,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``context_parallel_decode`` of ``q [B, S_q, H, L+R]`` (this rank's heads when they are
        sharded) over ``layer`` across ``group`` (its ranks and size must be this cache's)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if (world, rank) != (self.world, self.rank):
            raise ValueError(
                f"group is rank {rank} of {world}; this cache holds rank {self.rank} of "
                f"{self.world}'s tokens"
            )
        return context_parallel_decode(
            q, self.local.pools[layer], self.cache_seqlens(layer), group=group,
            block_table=self.local.block_table, head_dim_v=self.local.kv_len,
            softmax_scale=softmax_scale, causal=causal, interleave=self.interleave,
            heads_sharded=self.heads_sharded,
        )  # fmt: skip

    def crop(self, max_length: int, layer: int | None = None) -> None:
        """Keep the first ``max_length`` global tokens (negative: drop that many)."""
        layers = range(self.local.num_layers) if layer is None else [layer]
        lengths = {index: self.get_seq_length(index) for index in layers}
        for index, keep in cropped_lengths(lengths, max_length).items():
            mine = local_lengths(torch.tensor([keep]), self.rank, self.world, self.interleave)
            self.local.crop(int(mine[0]), layer=index)
            self._lengths[index] = keep
            self.global_seqlens[index].fill_(keep)

    def reorder(self, beam_idx: torch.Tensor, layer: int | None = None) -> None:
        """Sequence ``i`` becomes a copy of sequence ``beam_idx[i]`` (``PagedLatentCache``)."""
        self.local.reorder(beam_idx, layer)

    def regroup(self, sources: torch.Tensor) -> None:
        """A new batch of copies of ``sources`` (``PagedLatentCache.regroup``)."""
        self.local.regroup(sources)
        sources = torch.as_tensor(sources, dtype=torch.long).reshape(-1).to(self.device)
        self.global_seqlens = self.global_seqlens[:, sources].clone()

    def reset(self) -> None:
        """Empty every sequence."""
        self.crop(0)
