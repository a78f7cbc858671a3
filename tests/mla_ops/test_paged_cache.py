"""PagedLatentCache: rows in, the same rows out, pages never shared, mla_decode reads it."""

from __future__ import annotations

import pytest
import torch

from mla_compile import mla_ops
from mla_compile.mla_ops.paged_cache import PagedLatentCache
from tests.mla_ops.reference64 import mla_attention

L, R, B = 32, 16, 3


def make(page_size: int, static: bool, max_length: int = 200, **kw) -> PagedLatentCache:
    return PagedLatentCache(
        num_layers=2, batch_size=B, kv_len=L, rope_len=R, max_length=max_length,
        page_size=page_size, static=static, dtype=torch.float32, **kw,
    )  # fmt: skip


def fill(cache: PagedLatentCache, steps: list[int], seed: int = 0):
    """Append ``steps`` chunks of new tokens to both layers; returns the rows written per layer."""
    gen = torch.Generator().manual_seed(seed)
    written = [[], []]
    for new in steps:
        for layer in range(2):
            kv_c, k_pe = (
                torch.randn(B, new, L, generator=gen),
                torch.randn(B, new, R, generator=gen),
            )
            cache.append(layer, kv_c, k_pe)
            written[layer].append(torch.cat([kv_c, k_pe], -1))
    return [torch.cat(w, dim=1) for w in written]  # [B, T, L+R] per layer


def stored_rows(cache: PagedLatentCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.rows(layer)`` cut to the stored length; a static cache returns the whole capacity,
    zero past the length, which is checked here."""
    kv_c, k_pe = cache.rows(layer)
    length = cache.get_seq_length(layer)
    if cache.static:
        assert kv_c.shape[1] == k_pe.shape[1] == cache.capacity
        assert not kv_c[:, length:].any() and not k_pe[:, length:].any()
    return kv_c[:, :length], k_pe[:, :length]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_rows_round_trip_across_pages(page_size: int, static: bool) -> None:
    cache = make(page_size, static)
    expected = fill(cache, [7, 1, 1, 64, 2])
    for layer in range(2):
        kv_c, k_pe = stored_rows(cache, layer)
        torch.testing.assert_close(torch.cat([kv_c, k_pe], -1), expected[layer], rtol=0, atol=0)
        assert cache.get_seq_length(layer) == 75
        assert cache.seqlens[layer].tolist() == [75] * B


@pytest.mark.parametrize("static", [False, True])
def test_pages_are_never_shared(static: bool) -> None:
    cache = make(3, static)
    fill(cache, [50])
    used = cache.block_table[cache.block_table >= 0].tolist()
    assert len(used) == len(set(used)), "a page id appears twice in the block table"
    cache.reset()
    fill(cache, [20, 5], seed=1)  # pages are reused after a reset, still one owner each
    used = cache.block_table[cache.block_table >= 0].tolist()
    assert len(used) == len(set(used))


@pytest.mark.parametrize("static", [False, True])
def test_mla_decode_reads_the_cache(static: bool) -> None:
    """Decode over the paged rows equals the float64 reference over the rows as written."""
    cache = make(4, static)
    expected = fill(cache, [30, 1])
    q = torch.randn(B, 1, 4, L + R)
    for layer in range(2):
        out, lse = mla_ops.mla_decode(
            q, head_dim_v=L, softmax_scale=0.2, **cache.decode_args(layer)
        )
        rows = expected[layer]
        lengths = torch.full((B,), rows.shape[1], dtype=torch.int32)
        ref_out, ref_lse = mla_attention(q, rows[..., :L], rows[..., L:], lengths, None, 0.2, True)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_stale_rows_after_reset_are_not_read() -> None:
    cache = make(8, static=True)
    fill(cache, [40])
    for pool in cache.pools:
        pool.fill_(float("nan"))  # whatever the pages held before must not leak
    cache.reset()
    expected = fill(cache, [5], seed=2)
    q = torch.randn(B, 1, 2, L + R)
    out, _ = mla_ops.mla_decode(q, head_dim_v=L, softmax_scale=0.2, **cache.decode_args(0))
    assert not torch.isnan(out).any()
    kv_c, k_pe = stored_rows(cache, 0)
    torch.testing.assert_close(torch.cat([kv_c, k_pe], -1), expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("static", [False, True])
def test_reorder_is_a_batch_gather(static: bool) -> None:
    cache = make(5, static)
    expected = fill(cache, [23])
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder(beam_idx)
    for layer in range(2):
        kv_c, k_pe = stored_rows(cache, layer)
        torch.testing.assert_close(torch.cat([kv_c, k_pe], -1), expected[layer][beam_idx])
    used = cache.block_table[cache.block_table >= 0].tolist()
    assert len(used) == len(set(used)), "reorder must copy rows, not share pages"


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("sources", [[2, 0], [0, 0, 1, 1, 2, 2], [1]])
def test_regroup_selects_and_repeats(static: bool, sources: list[int]) -> None:
    """Batch selection and repeat_interleave: new sequence i holds sequence sources[i]'s rows in
    pages of its own; appending afterwards touches only the new sequence."""
    cache = make(5, static, num_pages=6 * 40)
    expected = fill(cache, [23])
    cache.regroup(torch.tensor(sources))
    assert cache.batch_size == len(sources) and cache.seqlens.shape == (2, len(sources))
    for layer in range(2):
        kv_c, k_pe = stored_rows(cache, layer)
        assert torch.equal(torch.cat([kv_c, k_pe], -1), expected[layer][sources])
    used = cache.block_table[cache.block_table >= 0].tolist()
    assert len(used) == len(set(used)), "regroup must copy rows, not share pages"
    for layer in range(2):
        new = torch.randn(len(sources), 2, L), torch.randn(len(sources), 2, R)
        cache.append(layer, *new)
        kv_c, _ = stored_rows(cache, layer)
        assert torch.equal(kv_c[:, :23], expected[layer][sources][..., :L])
        assert torch.equal(kv_c[:, 23:], new[0])


def test_regroup_errors() -> None:
    cache = make(5, True)
    fill(cache, [4])
    with pytest.raises(ValueError, match=r"sources must be indices in \[0, 3\)"):
        cache.regroup(torch.tensor([3]))
    with pytest.raises(ValueError, match="needs 240 pages, the pools hold 120"):
        cache.regroup(torch.arange(3).repeat_interleave(2))


@pytest.mark.parametrize("static", [False, True])
def test_crop(static: bool) -> None:
    cache = make(4, static)
    expected = fill(cache, [30])
    cache.crop(9)
    assert cache.get_seq_length() == 9
    kv_c, _ = stored_rows(cache, 0)
    torch.testing.assert_close(kv_c, expected[0][:, :9, :L])
    cache.crop(-4)
    assert cache.get_seq_length() == 5 and cache.seqlens[1].tolist() == [5] * B
    if not static:
        assert cache.block_table[:, 2:].eq(-1).all()  # pages past the kept tokens were freed
    more = fill(cache, [3], seed=3)
    kv_c, _ = stored_rows(cache, 0)
    torch.testing.assert_close(kv_c[:, 5:], more[0][..., :L])


def test_static_cache_never_moves() -> None:
    cache = make(16, static=True)
    addresses = [p.data_ptr() for p in cache.pools] + [
        cache.block_table.data_ptr(),
        cache.seqlens.data_ptr(),
    ]
    table = cache.block_table.clone()
    fill(cache, [10, 1, 1, 100])
    cache.reorder(torch.tensor([1, 1, 0]))
    cache.crop(3)
    assert addresses == [p.data_ptr() for p in cache.pools] + [
        cache.block_table.data_ptr(),
        cache.seqlens.data_ptr(),
    ]
    assert torch.equal(table, cache.block_table)


def test_bytes_per_token() -> None:
    cache = PagedLatentCache(
        num_layers=1, batch_size=1, kv_len=512, rope_len=64, max_length=64, dtype=torch.bfloat16
    )
    assert cache.bytes_per_token_per_layer() == 1152  # DeepSeek-V3: 576 values x 2 bytes


def test_errors() -> None:
    cache = make(4, static=True, max_length=10)
    with pytest.raises(
        ValueError, match=r"cache capacity exceeded: 0 \+ 11 tokens > max_length=10"
    ):
        cache.append(0, torch.randn(B, 11, L), torch.randn(B, 11, R))
    with pytest.raises(TypeError, match=r"kv_c is torch\.float16, the cache stores torch\.float32"):
        cache.append(0, torch.randn(B, 1, L).half(), torch.randn(B, 1, R))
    with pytest.raises(ValueError, match=r"k_pe must be \[batch=3, S, 16\]"):
        cache.append(0, torch.randn(B, 1, L), torch.randn(B, 1, R + 1))
    with pytest.raises(ValueError, match="kv_c is on meta"):
        cache.append(0, torch.randn(B, 1, L, device="meta"), torch.randn(B, 1, R))
    with pytest.raises(ValueError, match="static cache needs 9 pages"):
        make(4, static=True, max_length=10, num_pages=8)
    small = make(4, static=False, max_length=100, num_pages=6)
    small.append(0, torch.randn(B, 8, L), torch.randn(B, 8, R))
    with pytest.raises(RuntimeError, match="page pool exhausted"):
        small.append(0, torch.randn(B, 1, L), torch.randn(B, 1, R))
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        make(0, static=False)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_indexer_keys_beside_the_latents(page_size: int, static: bool) -> None:
    """A sparse-attention indexer's keys (one layer of two keeps them) land at the positions of
    the tokens appended last, read back in token order (static: capacity-long, zero past the
    length), and follow beam reordering, batch regrouping and cropping with the latents."""
    cache = make(page_size, static, index_len=8, index_layers=[1])
    gen = torch.Generator().manual_seed(3)
    keys = []
    for new in (5, 1, 1, 70):
        for layer in range(2):
            cache.append(layer, torch.randn(B, new, L, generator=gen), torch.randn(B, new, R))
        keys.append(torch.randn(B, new, 8, generator=gen))
        cache.append_index(1, keys[-1])
    expected = torch.cat(keys, dim=1)  # [B, 77, 8]

    def stored_keys() -> torch.Tensor:
        got, length = cache.index_rows(1), cache.get_seq_length(1)
        if static:
            assert got.shape[1] == cache.capacity and not got[:, length:].any()
        return got[:, :length]

    torch.testing.assert_close(stored_keys(), expected, rtol=0, atol=0)
    assert cache.index_pools[0] is None and cache.index_bytes_per_token() == 8 * 4
    with pytest.raises(ValueError, match="layer 0 keeps no indexer keys"):
        cache.index_rows(0)
    with pytest.raises(ValueError, match=r"indexer keys must be \[batch=3, S, 8\]"):
        cache.append_index(1, torch.randn(B, 1, 4))
    latents = torch.cat(stored_rows(cache, 1), -1)
    cache.reorder(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(stored_keys(), expected[[2, 2, 0]], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(stored_rows(cache, 1), -1), latents[[2, 2, 0]])
    cache.regroup(torch.tensor([1, 0]))  # [2, 2, 0] -> [2, 2]
    torch.testing.assert_close(stored_keys(), expected[[2, 2]], rtol=0, atol=0)
    cache.crop(6)
    torch.testing.assert_close(stored_keys(), expected[[2, 2], :6], rtol=0, atol=0)


def test_reorder_refuses_indices_outside_the_batch() -> None:
    """A negative or too large beam index would copy another sequence's rows (or fail deep in
    the gather): refused by name, the cache unchanged; bool and float indices too."""
    cache = make(5, True)
    expected = fill(cache, [9])
    for bad in ([0, -1, 1], [0, 1, 3]):
        with pytest.raises(ValueError, match=r"beam_idx must be sequence indices in \[0, 3\)"):
            cache.reorder(torch.tensor(bad))
    for bad in (torch.tensor([True, False, True]), torch.tensor([0.0, 1.0, 2.0])):
        with pytest.raises(TypeError, match="beam_idx must hold integer sequence indices"):
            cache.reorder(bad)
    kv_c, k_pe = stored_rows(cache, 0)
    assert torch.equal(torch.cat([kv_c, k_pe], -1), expected[0])


def test_crop_that_fails_changes_nothing() -> None:
    """Cropping more tokens than a layer holds raises before any layer is cropped."""
    cache = make(4, False)
    fill(cache, [6])
    cache.append(0, torch.randn(B, 4, L), torch.randn(B, 4, R))  # layer 0: 10 tokens, layer 1: 6
    with pytest.raises(ValueError, match="cannot crop 8 tokens from layer 1's 6-token cache"):
        cache.crop(-8)
    assert cache.get_seq_length(0) == 10 and cache.get_seq_length(1) == 6
    assert cache.seqlens[0].tolist() == [10] * B and cache.seqlens[1].tolist() == [6] * B
