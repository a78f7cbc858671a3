"""mla::paged_rows and mla::paged_append against per-sequence loops written independently, and
the mla::expanded_kv_update marker."""

from __future__ import annotations

import pytest
import torch

from mla_compile import mla_ops  # noqa: F401  (registers the ops)
from tests.conftest import HAS_CUDA
from tests.mla_ops.cases import make_case
from tests.mla_ops.reference64 import cache_rows

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_paged_rows(seed: int, device: str) -> None:
    """Each sequence's rows in token order, zeros past its length; junk table entries past the
    used pages and NaN in unused pages are never read."""
    case = make_case(seed, device=device, page_size=[1, 3, 16][seed % 3], dims=(16, 8))
    pool = case.kv_c.contiguous()
    rows = torch.ops.mla.paged_rows(pool, case.block_table, case.cache_seqlens)
    batch, capacity = case.block_table.shape[0], case.block_table.shape[1] * pool.shape[1]
    assert rows.shape == (batch, capacity, pool.shape[2])
    for b, length in enumerate(case.cache_seqlens.tolist()):
        want = cache_rows(pool, case.block_table, b, length)
        assert torch.equal(rows[b, :length].cpu().double(), want)
        assert not rows[b, length:].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 3, 8])
def test_paged_append(page_size: int, device: str) -> None:
    """Rows land at each sequence's own positions (different lengths per sequence), lengths
    advance, no other row of the pool changes."""
    gen = torch.Generator().manual_seed(page_size)
    batch, max_pages, width = 3, 4, 6
    pool = torch.randn(batch * max_pages + 2, page_size, width, generator=gen).to(device)
    block_table = torch.randperm(pool.shape[0], generator=gen)[: batch * max_pages]
    block_table = block_table.reshape(batch, max_pages).to(torch.int32).to(device)
    lengths = torch.tensor([0, 1, page_size * 2 - 1], dtype=torch.int32, device=device)
    new = torch.randn(batch, 2, width, generator=gen).to(device)
    before, start = pool.clone(), lengths.clone()
    torch.ops.mla.paged_append(pool, block_table, lengths, new)
    assert lengths.tolist() == (start + 2).tolist()
    expected = before.clone()
    for b in range(batch):
        for i in range(2):
            position = int(start[b]) + i
            page = int(block_table[b, position // page_size])
            expected[page, position % page_size] = new[b, i]
    assert torch.equal(pool, expected)


def test_paged_append_past_capacity_stays_in_own_pages() -> None:
    pool = torch.zeros(4, 2, 3)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([4, 1], dtype=torch.int32)  # sequence 0 is full
    torch.ops.mla.paged_append(pool, block_table, lengths, torch.ones(2, 1, 3))
    assert lengths.tolist() == [5, 2]  # overlong: mla_decode's value checks report it
    assert pool[1, 1].eq(1).all()  # the last row of sequence 0, not a page of sequence 1
    assert pool[2, 1].eq(1).all() and pool[3].eq(0).all() and pool[0].eq(0).all()


def test_expanded_kv_update_is_only_a_marker() -> None:
    keys, values = torch.randn(2, 4, 1, 24), torch.randn(2, 4, 1, 16)
    pool, table = torch.zeros(6, 4, 40), torch.zeros(2, 3, dtype=torch.int32)
    lengths = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"ran un-rewritten.*backend='mla'"):
        torch.ops.mla.expanded_kv_update(keys, values, pool, table, lengths)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (keys, values, pool, table, lengths)]
        full_keys, full_values = torch.ops.mla.expanded_kv_update(*fake)
    assert full_keys.shape == (2, 4, 12, 24) and full_values.shape == (2, 4, 12, 16)


def test_paged_op_errors() -> None:
    pool, table = torch.zeros(6, 4, 40), torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="block_table must be int32"):
        torch.ops.mla.paged_rows(pool, table.long(), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens must be \[batch=2\]"):
        torch.ops.mla.paged_rows(pool, table, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rows must be \[batch=2, S, 40\]"):
        torch.ops.mla.paged_append(
            pool, table, torch.zeros(2, dtype=torch.int32), torch.zeros(2, 1, 39)
        )


def test_page_ids_in_use_are_checked() -> None:
    """A page id outside the pool for a page in use is an error naming it, for both ops (it was
    clamped to another page, or failed inside index_copy_); ids past a sequence's pages are free."""
    pool = torch.randn(4, 2, 3)
    lengths = torch.tensor([3, 1], dtype=torch.int32)  # pages in use: 2 and 1
    free_tail = torch.tensor([[0, 1, -1], [2, 99, 99]], dtype=torch.int32)
    torch.ops.mla.paged_rows(pool, free_tail, lengths)  # the -1 and 99s are never read
    bad = torch.tensor([[0, 7, -1], [2, -1, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"page ids outside \[0, 4\) for pages in use: \[7\]"):
        torch.ops.mla.paged_rows(pool, bad, lengths)
    # two more rows take sequence 1 (1 token) onto its second page, which is -1
    unallocated = torch.tensor([[0, 1, 3], [2, -1, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"page ids outside \[0, 4\) for pages in use: \[-1\]"):
        torch.ops.mla.paged_append(pool, unallocated, lengths.clone(), torch.ones(2, 2, 3))
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 6\]"):
        torch.ops.mla.paged_rows(pool, free_tail, torch.tensor([7, 0], dtype=torch.int32))


def test_an_overlong_sequence_reads_as_nan(monkeypatch) -> None:
    """Without value checks (CUDA's default: they would sync the host), a sequence appended past
    the block table's capacity reads back as NaN rows, never as silently wrong values; the other
    sequences are untouched."""
    from mla_compile.mla_ops import ops

    monkeypatch.setattr(ops, "_values_checked_on", lambda device: False)
    pool = torch.randn(4, 2, 3)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([4, 1], dtype=torch.int32)
    torch.ops.mla.paged_append(pool, block_table, lengths, torch.ones(2, 1, 3))  # 5 > 4
    rows = torch.ops.mla.paged_rows(pool, block_table, lengths)
    assert torch.isnan(rows[0]).all()
    assert torch.equal(rows[1, :2], pool[2]) and not rows[1, 2:].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_write(page_size: int, device: str) -> None:
    """Each row lands at its position in its sequence's pages (a per-row loop says where);
    a negative position writes only the scratch page; every other row is untouched."""
    gen = torch.Generator().manual_seed(page_size)
    pool = torch.randn(2 * 4 + 1, page_size, 6, generator=gen, dtype=torch.float64).to(device)
    table = torch.randperm(8, generator=gen).reshape(2, 4).to(torch.int32).to(device)
    positions = torch.tensor([[0, 3, -1], [2, -1, 1]], dtype=torch.int64, device=device)
    rows = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64).to(device)
    want = pool.clone()
    for b in range(2):
        for s, position in enumerate(positions[b].tolist()):
            if position >= 0:
                page = int(table[b, position // page_size])
                want[page, position % page_size] = rows[b, s]
    torch.ops.mla.paged_write(pool, table, positions, rows)
    assert torch.equal(pool[:-1], want[:-1])  # the scratch page (last) may hold anything
    with pytest.raises(ValueError, match="the pool's last page"):
        torch.ops.mla.paged_write(pool, torch.full_like(table, 8), positions, rows)
    with pytest.raises(ValueError, match="positions must be int64"):
        torch.ops.mla.paged_write(pool, table, positions.int(), rows)
