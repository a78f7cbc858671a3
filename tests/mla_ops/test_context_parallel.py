"""Decode context parallelism (``mla_ops.context_parallel``): a cache sharded by token over 2 and
4 gloo processes gives, on every rank, single-process ``mla_decode``'s output and LSE (float64,
1e-10), for S_q 1 and 3 (causal), lengths 0, below the group size and ragged, dense and paged
slices, token interleaves 1 and 2 (every combination on 2 ranks, one on 4); and does under
``torch.compile(fullgraph=True)`` (2 ranks)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla_compile.mla_ops import context_parallel as cp
from mla_compile.mla_ops import mla_decode

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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_cache_equals_one_process(tmp_path, world: int) -> None:
    """A failing rank's exception and traceback come back through ``mp.spawn``."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(world, init), nprocs=world)
