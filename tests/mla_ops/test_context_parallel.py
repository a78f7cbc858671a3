"""Decode context parallelism (``mla_ops.context_parallel``): a cache sharded by token over 2 and
4 gloo processes gives, on every rank, single-process ``mla_decode``'s output and LSE (float64,
1e-10), for S_q 1 and 3 (causal), lengths 0, below the group size and ragged, dense and paged
slices, token interleaves 1 and 2 (every combination on 2 ranks, one on 4); and does under
``torch.compile(fullgraph=True)`` (2 ranks). ``ContextParallelCache``: each rank's share follows
a single-process cache through random appends, crops, beam reorders and batch regroups, holds
1 / world of its pages, and decodes (prefill, steps, a verify block) to the single process's
output. With tensor-parallel heads over the group, each rank gets its own heads' share of the
single process's output (decode and prefill)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla_compile.mla_ops import context_parallel as cp
from mla_compile.mla_ops import mla_decode
from mla_compile.mla_ops.paged_cache import PagedLatentCache

L, R, H = 32, 8, 5


def test_token_ownership_is_a_partition() -> None:
    """Every global position has one owner and one local position; the ranks' lengths add up to
    the sequence's and each local position maps back to its global one."""
    for world, interleave in itertools.product((1, 2, 3, 4), (1, 2, 3)):
        tokens = torch.arange(50)
        owners = cp.owner(tokens, world, interleave)
        local = cp.local_position(tokens, world, interleave)
        for rank in range(world):
            mine = tokens[owners == rank]
            assert torch.equal(local[owners == rank], torch.arange(len(mine)))
            back = cp.global_position(torch.arange(len(mine)), rank, world, interleave)
            assert torch.equal(back, mine)
        lengths = torch.arange(50, dtype=torch.int32)
        total = sum(cp.local_lengths(lengths, r, world, interleave) for r in range(world))
        assert torch.equal(total, lengths)


def problem(s_q: int):
    gen = torch.Generator().manual_seed(s_q)
    lengths = torch.tensor([0, s_q, 37, 12 + s_q], dtype=torch.int32)
    q = torch.randn(4, s_q, H, L + R, generator=gen, dtype=torch.float64)
    rows = torch.randn(4, 48, L + R, generator=gen, dtype=torch.float64)
    return q, rows, lengths


def _worker(rank: int, world: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        # Every combination on 2 ranks; on 4, S_q 3 with interleave 2 over pages.
        combinations = itertools.product((1, 3), (1, 2), (False, True))
        for s_q, interleave, paged in combinations if world == 2 else [(3, 2, True)]:
            q, rows, lengths = problem(s_q)
            want = mla_decode(q, rows, lengths, head_dim_v=L, softmax_scale=0.3, causal=True)
            local = cp.shard_rows(rows, lengths, rank, world, interleave)  # [B, T_local, D]
            kwargs = {}
            if paged:  # the slice in pages of 2 tokens, pages in reverse order
                batch, capacity, dim = local.shape
                local = torch.nn.functional.pad(local, (0, 0, 0, capacity % 2))
                pages = local.reshape(-1, 2, dim).flip(0)
                per = local.shape[1] // 2
                table = torch.arange(batch * per).view(batch, per)
                kwargs["block_table"] = (pages.shape[0] - 1 - table).int()
                local = pages
            got = cp.context_parallel_decode(
                q, local, lengths, head_dim_v=L, softmax_scale=0.3, interleave=interleave,
                **kwargs,
            )  # fmt: skip
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        _prefill_over_shares(rank, world)
        _heads_sharded(rank, world)
        _static_share_compiles(rank, world)
        _cp_rows_opcheck(rank, world)
        if world != 2:
            return
        # One graph under torch.compile (the gather is a functional collective).
        torch._dynamo.reset()
        q, rows, lengths = problem(3)
        step = torch.compile(cp.context_parallel_decode, backend="aot_eager", fullgraph=True)
        local = cp.shard_rows(rows, lengths, rank, world)
        got = step(q, local, lengths, head_dim_v=L, softmax_scale=0.3)
        want = mla_decode(q, rows, lengths, head_dim_v=L, softmax_scale=0.3, causal=True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        _cache_decodes(rank, world)
    finally:
        dist.destroy_process_group()


def _prefill_over_shares(rank: int, world: int) -> None:
    """``context_parallel_prefill``: a 9-token query (a second turn) over shares of a ragged
    cache, the model's mask over global positions, several chunks a rank: the single process's
    ``mla::prefill`` output and LSE."""
    gen = torch.Generator().manual_seed(11)
    nope, v_dim = 6, 5
    lengths = torch.tensor([0, 9, 37, 48], dtype=torch.int32)
    rows = torch.randn(4, 48, L + R, generator=gen, dtype=torch.float64)
    q = torch.randn(4, H, 9, nope + R, generator=gen, dtype=torch.float64)
    weight = torch.randn(H * (nope + v_dim), L, generator=gen, dtype=torch.float64) / 3
    mask = torch.rand(4, 1, 9, 45, generator=gen) > 0.3  # shorter than the cache: rest hidden
    want = torch.ops.mla.prefill(q, rows[..., :L], rows[..., L:], lengths, None, weight, mask,
                                 0.3, nope)  # fmt: skip
    local = cp.shard_rows(rows, lengths, rank, world, interleave=2)
    got = cp.context_parallel_prefill(
        q, local[..., :L], local[..., L:], lengths, weight, attn_mask=mask, softmax_scale=0.3,
        nope_dim=nope, interleave=2, chunk_tokens=16,
    )  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _heads_sharded(rank: int, world: int) -> None:
    """Tensor-parallel heads over the group (3 a rank): each rank passes its own heads' queries
    (and ``kv_b_proj`` rows, and a per-head mask, to the prefill) and gets its own heads'
    output and LSE over every rank's tokens, the single process's for those heads."""
    gen = torch.Generator().manual_seed(17)
    local_heads, nope, v_dim = 3, 6, 5
    heads = local_heads * world
    mine = slice(rank * local_heads, (rank + 1) * local_heads)
    lengths = torch.tensor([0, 3, 37, 48], dtype=torch.int32)
    rows = torch.randn(4, 48, L + R, generator=gen, dtype=torch.float64)
    q = torch.randn(4, 3, heads, L + R, generator=gen, dtype=torch.float64)
    want = mla_decode(q, rows, lengths, head_dim_v=L, softmax_scale=0.3, causal=True)
    local = cp.shard_rows(rows, lengths, rank, world, interleave=2)
    got = cp.context_parallel_decode(
        q[:, :, mine], local, lengths, head_dim_v=L, softmax_scale=0.3, interleave=2,
        heads_sharded=True,
    )  # fmt: skip
    torch.testing.assert_close(got[0], want[0][:, :, mine], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], want[1][:, :, mine], rtol=1e-10, atol=1e-10)

    q = torch.randn(4, heads, 9, nope + R, generator=gen, dtype=torch.float64)
    weight = torch.randn(heads, nope + v_dim, L, generator=gen, dtype=torch.float64) / 3
    mask = torch.rand(4, heads, 9, 45, generator=gen) > 0.3  # a mask per head
    want = torch.ops.mla.prefill(q, rows[..., :L], rows[..., L:], lengths, None,
                                 weight.flatten(0, 1), mask, 0.3, nope)  # fmt: skip
    got = cp.context_parallel_prefill(
        q[:, mine], local[..., :L], local[..., L:], lengths, weight[mine].flatten(0, 1),
        attn_mask=mask[:, mine], softmax_scale=0.3, nope_dim=nope, interleave=2,
        chunk_tokens=16, heads_sharded=True,
    )  # fmt: skip
    torch.testing.assert_close(got[0], want[0][:, mine], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], want[1][:, mine], rtol=1e-10, atol=1e-10)


def _cp_rows_opcheck(rank: int, world: int) -> None:
    """``mla::cp_rows`` (every rank's rows in global order, as an unrewritten attention reads a
    sharded MLACache): ``torch.library.opcheck`` on every rank, and the rows themselves."""
    gen = torch.Generator().manual_seed(13)
    lengths = torch.tensor([0, 9, 30], dtype=torch.int32)
    rows = torch.randn(3, 32, L + R, generator=gen, dtype=torch.float64)
    local = cp.shard_rows(rows, lengths, rank, world, interleave=2)  # [3, T_local, D]
    pages = local.reshape(-1, 4, L + R)  # pages of 4, in order
    table = torch.arange(pages.shape[0], dtype=torch.int32).view(3, -1)
    mine = cp.local_lengths(lengths, rank, world, interleave=2)
    args = (pages, table, mine, dist.group.WORLD.group_name, world, rank, 2, 32)
    torch.library.opcheck(torch.ops.mla.cp_rows.default, args)
    got = torch.ops.mla.cp_rows(*args)
    position = torch.arange(32)
    want = torch.where((position[None, :] < lengths[:, None].long())[..., None], rows, 0.0)
    assert torch.equal(got, want)


def _static_share_compiles(rank: int, world: int) -> None:
    """A static share (device lengths, a scratch page): the append and the decode of a step
    compile into one graph each (``fullgraph=True``: no host read, the gather a functional
    collective); a prompt of 37, steps of 1, a verify block of 3 and a crop decode to a single
    static cache's output (1e-10), in 1/world of its pages plus one."""
    gen = torch.Generator().manual_seed(9)
    kwargs = dict(num_layers=1, batch_size=3, kv_len=L, rope_len=R, max_length=64, page_size=4,
                  static=True, dtype=torch.float64)  # fmt: skip
    full = PagedLatentCache(**kwargs)
    share = cp.ContextParallelCache(rank=rank, world=world, interleave=2, **kwargs)

    def step(rows: torch.Tensor, q: torch.Tensor):
        share.append(0, rows[..., :L], rows[..., L:])
        return share.decode(0, q, softmax_scale=0.3)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for new in (37, 1, 1, 3, -2, 1):
        if new < 0:
            full.crop(new)
            share.crop(new)
            continue
        rows = torch.randn(3, new, L + R, generator=gen, dtype=torch.float64)
        q = torch.randn(3, min(new, 3), H, L + R, generator=gen, dtype=torch.float64)
        full.append(0, rows[..., :L], rows[..., L:])
        want = mla_decode(q, full.pools[0], full.seqlens[0], block_table=full.block_table,
                          head_dim_v=L, softmax_scale=0.3)  # fmt: skip
        got = compiled(rows, q)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert share.get_seq_length() == full.get_seq_length() == 41
    full_pages = full.pools[0].shape[0]
    assert share.local.pools[0].shape[0] <= full_pages // world + 3 + 1  # a page a sequence


def _caches(rank: int, world: int, interleave: int, batch: int = 3, layers: int = 2):
    kwargs = dict(num_layers=layers, batch_size=batch, kv_len=L, rope_len=R, max_length=90,
                  page_size=4, dtype=torch.float64)  # fmt: skip
    full = PagedLatentCache(**kwargs)
    share = cp.ContextParallelCache(rank=rank, world=world, interleave=interleave, **kwargs)
    return full, share


def _cache_decodes(rank: int, world: int) -> None:
    """A prompt of 37 tokens, two one-token steps and a verify block of 3, then a crop back to
    a rejected draft: every decode on the shares equals the single process's."""
    gen = torch.Generator().manual_seed(5)
    full, share = _caches(rank, world, interleave=2)
    for new in (37, 1, 1, 3, -2, 1):
        if new < 0:
            full.crop(new, layer=1)
            share.crop(new, layer=1)
            continue
        rows = torch.randn(3, new, L + R, generator=gen, dtype=torch.float64)
        q = torch.randn(3, new if new <= 3 else 1, H, L + R, generator=gen, dtype=torch.float64)
        for cache in (full, share):
            cache.append(1, rows[..., :L], rows[..., L:])
        want = mla_decode(q, full.pools[1], full.seqlens[1], block_table=full.block_table,
                          head_dim_v=L, softmax_scale=0.3)  # fmt: skip
        got = share.decode(1, q, softmax_scale=0.3)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    other = _caches(rank, world + 1, interleave=2)[1]  # made for another group
    with pytest.raises(ValueError, match=f"this cache holds rank {rank} of {world + 1}"):
        other.decode(1, q, softmax_scale=0.3)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_cache_equals_one_process(tmp_path, world: int) -> None:
    """A failing rank's exception and traceback come back through ``mp.spawn``."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(world, init), nprocs=world)


@pytest.mark.parametrize("world,interleave", [(2, 1), (3, 2), (4, 1)])
def test_each_share_follows_the_whole_cache(world: int, interleave: int) -> None:
    """Random appends (a prompt, steps, verify blocks), crops, beam reorders and regroups,
    applied alike to a single-process cache and to every rank's share: after each, each share
    holds exactly ``shard_rows`` of the whole cache's rows, and the shares' pools hold
    ``1 / world`` of the whole's pages (to a page)."""
    gen = torch.Generator().manual_seed(world * 10 + interleave)
    full, _ = _caches(0, world, interleave)
    shares = [_caches(rank, world, interleave)[1] for rank in range(world)]
    page_bytes = 2 * 4 * (L + R) * 8  # a page of every layer
    for share in shares:  # 1 / world of the pages, give or take one per sequence
        assert (
            share.cache_bytes() * world
            <= sum(p.numel() * 8 for p in full.pools) + world * 3 * page_bytes
        )
    for _ in range(40):
        op = int(torch.randint(0, 5, (), generator=gen))
        length = full.get_seq_length(0)
        batch = full.batch_size
        if op <= 1:
            new = int(torch.randint(1, 12 if op else 4, (), generator=gen))
            new = min(new, 90 - length)
            if new == 0:
                continue
            rows = torch.randn(batch, new, L + R, generator=gen, dtype=torch.float64)
            for cache in (full, *shares):
                for layer in (0, 1):
                    cache.append(layer, rows[..., :L] + layer, rows[..., L:])
        elif op == 2:
            keep = int(torch.randint(0, length + 1, (), generator=gen))
            for cache in (full, *shares):
                cache.crop(keep)
        elif op == 3:
            beams = torch.randint(0, batch, (batch,), generator=gen)
            for cache in (full, *shares):
                cache.reorder(beams)
        else:
            sources = torch.randint(0, batch, (int(torch.randint(1, 4, (), generator=gen)),),
                                    generator=gen)  # fmt: skip
            for cache in (full, *shares):
                cache.regroup(sources)
        lengths = full.seqlens[0]
        for layer in (0, 1):
            whole = torch.cat(full.rows(layer), dim=-1)  # [B, T, L+R]
            for rank, share in enumerate(shares):
                assert share.get_seq_length(layer) == full.get_seq_length(layer)
                want = cp.shard_rows(whole, lengths, rank, world, interleave)
                got = torch.cat(share.local.rows(layer), dim=-1)
                assert torch.equal(got, want[:, : got.shape[1]])
                assert not want[:, got.shape[1] :].any()


def test_a_share_refuses_another_group() -> None:
    """A share decodes only across the group it was made for, and an overflowing append is an
    error on every rank."""
    _, share = _caches(0, 2, 1)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        cp.ContextParallelCache(rank=2, world=2, num_layers=1, batch_size=1, kv_len=L,
                                rope_len=R, max_length=8)  # fmt: skip
    rows = torch.zeros(3, 91, L + R, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_length=90"):
        share.append(0, rows[..., :L], rows[..., L:])
