"""Property-based tests (hypothesis): ``mla_decode`` over its argument space against the
independent float64 reference, and the paged latent cache's operations against a shadow model
(plain per-sequence lists of rows). Bounded to a few seconds each in CI."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_compile import mla_ops
from mla_compile.mla_ops.paged_cache import PagedLatentCache
from tests.mla_ops.cases import assert_matches, make_case

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@SETTINGS
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 3),
    s_q=st.integers(1, 3),
    heads=st.integers(1, 5),
    dims=st.sampled_from([(16, 8), (32, 0), (8, 16)]),
    page_size=st.sampled_from([None, 1, 3, 4, 16]),
    causal=st.booleans(),
    num_splits=st.integers(1, 5),
    balanced=st.booleans(),
    mask=st.sampled_from([None, "bool", "float"]),
    pair=st.booleans(),
    planned=st.booleans(),
)
def test_mla_decode_matches_the_reference(
    seed, batch, s_q, heads, dims, page_size, causal, num_splits, balanced, mask, pair, planned
) -> None:
    """Any batch, query length, head count, widths (R = 0 included), page size (contiguous and
    page size 1 included), causal or not, split plan (the planner's, or explicit, balanced or
    not), mask form and cache form: float64 within 1e-10 of the reference; empty sequences give
    zeros and -inf."""
    case = make_case(
        seed, dtype=torch.float64, batch=batch, s_q=s_q, heads=heads, dims=dims,
        page_size=page_size, causal=causal, num_splits=num_splits, pair=pair, max_len=40,
        mask=mask, total_splits=(num_splits * batch + 1) if balanced else None,
    )  # fmt: skip
    out, lse = mla_ops.mla_decode(
        case.q, case.kv_cache, case.cache_seqlens, block_table=case.block_table,
        head_dim_v=case.head_dim_v, softmax_scale=case.softmax_scale, causal=case.causal,
        num_splits=None if planned else case.num_splits,
        total_splits=None if planned else case.total_splits, attn_mask=case.attn_mask,
    )  # fmt: skip
    assert_matches(out, lse, *case.reference(), torch.float64, case.describe())


L, R = 8, 4


class Shadow:
    """What a cache should hold: each layer's rows per sequence, as plain lists."""

    def __init__(self, layers: int, batch: int) -> None:
        self.rows = [[[] for _ in range(batch)] for _ in range(layers)]

    def append(self, layer: int, new: torch.Tensor) -> None:
        for b, seq in enumerate(self.rows[layer]):
            seq.extend(new[b].unbind(0))

    def regroup(self, sources: list[int]) -> None:
        self.rows = [[list(layer[s]) for s in sources] for layer in self.rows]

    def crop(self, keep: int) -> None:
        self.rows = [[seq[:keep] for seq in layer] for layer in self.rows]


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 5)),
        st.tuples(st.just("reorder"), st.integers(0, 10**6)),
        st.tuples(st.just("regroup"), st.integers(0, 10**6)),
        st.tuples(st.just("crop"), st.integers(-6, 8)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


@SETTINGS
@given(
    ops=operations,
    page_size=st.sampled_from([1, 3, 4]),
    static=st.booleans(),
    batch=st.integers(1, 3),
)
def test_paged_cache_matches_a_shadow_model(ops, page_size, static, batch) -> None:
    """Any sequence of appends, beam reorders, batch regroups (selection and repetition),
    crops and resets: the cache returns exactly the rows the shadow model holds, a refused
    operation changes nothing, and no two sequences ever share a page."""
    layers, max_length = 2, 24
    cache = PagedLatentCache(
        num_layers=layers, batch_size=batch, kv_len=L, rope_len=R, max_length=max_length,
        page_size=page_size, static=static, dtype=torch.float64, num_pages=64 * 8,
    )  # fmt: skip
    shadow = Shadow(layers, batch)
    gen = torch.Generator().manual_seed(len(ops))
    for op, value in ops:
        length = cache.get_seq_length(0)
        length = int(length) if isinstance(length, torch.Tensor) else length
        if op == "append":
            if length + value > max_length:
                continue
            for layer in range(layers):
                new = torch.randn(
                    cache.batch_size, value, L + R, generator=gen, dtype=torch.float64
                )
                cache.append(layer, new[..., :L], new[..., L:])
                shadow.append(layer, new)
        elif op == "reorder":
            index = torch.randint(0, cache.batch_size, (cache.batch_size,), generator=gen)
            cache.reorder(index)
            shadow.regroup(index.tolist())
        elif op == "regroup":
            count = 1 + value % 3
            sources = torch.randint(0, cache.batch_size, (count,), generator=gen)
            cache.regroup(sources)
            shadow.regroup(sources.tolist())
        elif op == "crop":
            keep = length + value if value < 0 else min(length, value)
            if keep < 0:
                try:
                    cache.crop(value)
                except ValueError:
                    pass  # refused: nothing may change (checked below)
                else:
                    raise AssertionError(f"crop({value}) of {length} tokens was not refused")
            else:
                cache.crop(value)
                shadow.crop(keep)
        else:
            cache.reset()
            shadow.crop(0)
        for layer in range(layers):
            kv_c, k_pe = cache.rows(layer)
            stored = torch.cat([kv_c, k_pe], -1)
            for b, seq in enumerate(shadow.rows[layer]):
                expected = torch.stack(seq) if seq else stored.new_zeros(0, L + R)
                assert torch.equal(stored[b, : len(seq)], expected), (op, value, layer, b)
                assert not stored[b, len(seq) :].any() or not static
        used = cache.block_table[cache.block_table >= 0].tolist()
        assert len(used) == len(set(used)), "pages shared between sequences"
