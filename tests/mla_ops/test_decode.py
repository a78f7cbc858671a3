"""mla_decode (decode + combine through the public wrapper) against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from mla_compile import mla_ops
from mla_compile.mla_ops import splits
from mla_compile.mla_ops.splits import MIN_CHUNK, SPLIT_GRANULE, split_bounds, split_len
from tests.conftest import HAS_CUDA, requires_cuda
from tests.mla_ops.cases import assert_matches, make_case, poison_hidden_keys

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def run_and_check(case, dtype, planner: bool = False) -> None:
    """mla_decode on ``case`` (the planner's num_splits if ``planner``) against float64."""
    out, lse = mla_ops.mla_decode(
        case.q,
        case.kv_cache,
        case.cache_seqlens,
        block_table=case.block_table,
        head_dim_v=case.head_dim_v,
        softmax_scale=case.softmax_scale,
        causal=case.causal,
        num_splits=None if planner else case.num_splits,
        kv_scale=case.kv_scale,
        attn_mask=case.attn_mask,
        total_splits=None if planner else case.total_splits,
    )
    b, s, h, _ = case.q.shape
    assert out.shape == (b, s, h, case.head_dim_v) and out.dtype == case.q.dtype
    assert lse.shape == (b, s, h)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(24))
def test_random_problems(seed: int, dtype: torch.dtype, device: str) -> None:
    run_and_check(make_case(seed, dtype=dtype, device=device), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 3, 64, None])
@pytest.mark.parametrize("s_q", [1, 2, 8])
def test_mixed_lengths_with_empty_sequences(s_q: int, page_size: int | None, device: str) -> None:
    lengths = [0, s_q, 700, 0, 257, s_q + 1]
    case = make_case(
        1, device=device, s_q=s_q, page_size=page_size, lengths=lengths, num_splits=4, causal=True
    )
    run_and_check(case, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [1, 3, 16, 20, 128])
def test_head_counts(heads: int, device: str) -> None:
    case = make_case(2, device=device, heads=heads, s_q=2, dims=(32, 16), max_len=300)
    run_and_check(case, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rope_part(device: str) -> None:
    for pair in (False, True):
        case = make_case(3, device=device, dims=(64, 0), pair=pair, page_size=16)
        assert case.k_pe.shape[-1] == 0
        run_and_check(case, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dims", "heads", "s_q", "page_size"),
    [
        ((1024, 64), 3, 1, 64),  # Dots 3 Note's sliding-window layers' latent width
        ((1024, 64), 64, 2, 1),
        ((512, 0), 64, 1, 64),  # GLM-5 Next, Mistral Large 4's NoPE layers: no RoPE part
        ((512, 0), 5, 3, 16),
        ((512, 64), 64, 1, 64),  # HY V4, Mistral Large 4: 64 heads
        ((256, 32), 40, 1, 64),  # MiniCPM3
        ((256, 32), 40, 2, 1),
    ],
)
def test_latent_shapes_of_other_families(
    dims: tuple[int, int], heads: int, s_q: int, page_size: int, device: str
) -> None:
    """Latent widths and head counts of the MLA families beyond DeepSeek's (L=512, R=64, H=16 or
    128), in bf16 as they run, with empty and odd-length sequences."""
    case = make_case(
        11, dtype=torch.bfloat16, device=device, dims=dims, heads=heads, s_q=s_q,
        page_size=page_size, causal=s_q > 1, lengths=[0, 1100, s_q, 333],
    )  # fmt: skip
    run_and_check(case, torch.bfloat16, planner=True)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device: str) -> None:
    q = torch.randn(0, 1, 4, 48, device=device)
    cache = torch.randn(0, 10, 48, device=device)
    seqlens = torch.zeros(0, dtype=torch.int32, device=device)
    out, lse = mla_ops.mla_decode(q, cache, seqlens, head_dim_v=32, softmax_scale=0.1)
    assert out.shape == (0, 1, 4, 32) and lse.shape == (0, 1, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_planner_default_is_correct(device: str) -> None:
    case = make_case(4, device=device, num_splits=1, max_len=2000, page_size=64)
    run_and_check(case, torch.float32, planner=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("total_splits", [None, 2])
@pytest.mark.parametrize("seed", range(8))
def test_partials_are_per_split_attention(seed: int, total_splits: int | None, device: str) -> None:
    """Each split's partial state is attention over exactly that split's tokens."""
    case = make_case(seed, device=device, max_len=900, num_splits=3, total_splits=total_splits)
    out_p, lse_p = torch.ops.mla.decode(*case.op_args())
    start, end = split_bounds(case.cache_seqlens.cpu(), case.num_splits, case.total_splits)
    for split in range(case.num_splits):
        ref_out, ref_lse = case.reference(token_range=(start[:, split], end[:, split]))
        assert_matches(
            out_p[:, :, :, split],
            lse_p[:, :, :, split],
            ref_out,
            ref_lse,
            torch.float32,
            f"split {split}: {case.describe()}",
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("total_splits", [1, 3, 8])
@pytest.mark.parametrize("seed", range(6))
def test_balanced_splits(seed: int, total_splits: int, device: str) -> None:
    """Ragged batches (empty sequences, S_q > 1, masks) cut into chunks of one batch-wide length."""
    case = make_case(
        seed + 40, device=device, max_len=2000, num_splits=6, total_splits=total_splits
    )
    run_and_check(case, torch.float32)


LENGTHS = torch.tensor([0, 1, 255, 256, 257, 1000, 4096, 65536], dtype=torch.int32)


@pytest.mark.parametrize("total_splits", [None, 1, 3, 16, 1000])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_split_bounds_cover_each_sequence(num_splits: int, total_splits: int | None) -> None:
    start, end = split_bounds(LENGTHS, num_splits, total_splits)
    for b, length in enumerate(LENGTHS.tolist()):
        covered = []
        for s in range(num_splits):
            if end[b, s] > start[b, s]:
                covered.extend(range(int(start[b, s]), int(end[b, s])))
                assert start[b, s] % SPLIT_GRANULE == 0
        assert covered == list(range(length))
        nonempty = int((end[b] > start[b]).sum())
        assert nonempty <= max(1, -(-length // MIN_CHUNK))


@pytest.mark.parametrize("seed", range(6))
def test_longest_first_order(seed: int) -> None:
    """The wgmma kernel's longest-first order (``splits.longest_first_order``): every (sequence,
    split) once; full chunks first, sequence by sequence; then partial chunks by tiles, most
    first; then the empty ones. Equal lengths keep the split-major order."""
    from mla_compile.mla_ops.splits import longest_first_order

    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(2, 129, (1,), generator=gen))
    lengths = torch.randint(0, 9000, (batch,), generator=gen)
    lengths[: batch // 4] = 0 if seed % 2 else 2048  # empty sequences, or ties in length
    num_splits, total_splits = 4, max(1, batch * 2 - 7)
    order = longest_first_order(lengths, num_splits, total_splits)
    assert order.shape == (batch * num_splits, 2)
    flat = order[:, 0] * num_splits + order[:, 1]
    assert torch.equal(flat.sort().values, torch.arange(batch * num_splits))
    start, end = split_bounds(lengths, num_splits, total_splits)
    tokens = (end - start).clamp_min(0)[order[:, 0], order[:, 1]]
    chunk = split_len(lengths, num_splits, total_splits)[order[:, 0]]
    tiles = (tokens + SPLIT_GRANULE - 1) // SPLIT_GRANULE
    n_full = int((tokens == chunk).sum())
    assert (tokens[:n_full] == chunk[:n_full]).all()
    assert (order[:n_full].diff(dim=0)[:, 0] >= 0).all()  # sequence by sequence
    rest = tiles[n_full:]
    assert (rest.diff() <= 0).all()  # then most tiles first, empty ones last
    same = torch.full((batch,), 3000)
    split_major = torch.stack(
        [torch.arange(batch).repeat(num_splits), torch.arange(num_splits).repeat_interleave(batch)],
        1,
    )
    assert torch.equal(longest_first_order(same, num_splits, total_splits), split_major)


def test_balanced_split_bounds_share_one_chunk_length() -> None:
    """With total_splits every sequence is cut at one batch-wide length (unless that would need
    more than num_splits chunks), so a long sequence no longer sets the wave's time alone."""
    lengths = torch.tensor([8192, 1000, 300, 0, 5000, 4096], dtype=torch.int32)
    total = int(lengths.sum())  # 18588 tokens
    start, end = split_bounds(lengths, 16, 24)
    chunk = math.ceil(math.ceil(total / 24) / SPLIT_GRANULE) * SPLIT_GRANULE
    assert chunk == 832
    for b, length in enumerate(lengths.tolist()):
        sizes = [int(e - s) for s, e in zip(start[b], end[b]) if e > s]
        assert all(size == chunk for size in sizes[:-1]), sizes
        assert len(sizes) == -(-length // chunk)
    # Even per-sequence splits of 4: the longest sequence's chunks are 2.5x the balanced ones.
    even_start, even_end = split_bounds(lengths, 4)
    assert int((even_end - even_start).max()) == 2048
    # num_splits caps the chunks of one sequence: 8192 tokens in at most 4 chunks of 2048.
    start, end = split_bounds(lengths, 4, 24)
    assert int((end[0] - start[0]).max()) == 2048 and int((end[1] - start[1]).max()) == 832


@pytest.mark.parametrize("length", [64, 1000, 4096, 65536])
@pytest.mark.parametrize("chunks", [1, 2, 3, 64])
def test_balanced_bounds_of_a_uniform_batch_are_the_even_ones(length: int, chunks: int) -> None:
    """A uniform batch planned with headroom gets exactly the even per-sequence split."""
    lengths = torch.full((5,), length, dtype=torch.int32)
    even = split_bounds(lengths, chunks)
    balanced = split_bounds(lengths, 2 * chunks, 5 * chunks)
    for e, bal in zip(even, balanced):
        assert torch.equal(bal[:, :chunks], e) and bool((bal[:, chunks:] >= lengths[:, None]).all())


@requires_cuda
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_deepseek_v3_shapes_gpu(heads: int, s_q: int, dtype: torch.dtype) -> None:
    """DeepSeek-V3: L=512, R=64, page size 64, mixed lengths up to 4096, planner's splits."""
    lengths = [4096, 1, 0, 1000, 3333, 64, 65, 2048][: 8 if heads == 16 else 4]
    lengths = [max(x, s_q) if x else 0 for x in lengths]
    case = make_case(
        5,
        dtype=dtype,
        device="cuda",
        heads=heads,
        s_q=s_q,
        dims=(512, 64),
        page_size=64,
        lengths=lengths,
        causal=True,
        pair=False,
    )
    case.softmax_scale = 0.1352337788608801  # DeepSeek-V3's (P+R)**-0.5 * mscale**2
    out, lse = mla_ops.mla_decode(
        case.q,
        case.kv_cache,
        case.cache_seqlens,
        block_table=case.block_table,
        head_dim_v=512,
        softmax_scale=case.softmax_scale,
    )
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


@pytest.mark.parametrize(
    ("batch", "rows", "capacity", "expected"),
    [
        # h16_b128_4k: 2 resident programs x 132 SMs = 264 slots, 128 sequences: 2 chunks each
        (128, 16, 4096, (4, 256)),
        (32, 128, 4096, (4, 64)),  # h128_b32_4k: 1 resident 64-row program, 2 row blocks each
        (1, 128, 32768, (64, 66)),  # h128_b1_32k: long context, capped at MAX_SPLITS
        (1, 16, 300, (2, 264)),  # capped by capacity / MIN_CHUNK
        (512, 128, 4096, (2, 512)),  # more programs than slots: one chunk each on average
    ],
)
def test_planner_fills_one_wave(monkeypatch, batch, rows, capacity, expected) -> None:

    monkeypatch.setattr(splits, "multiprocessor_count", lambda device: 132)
    device = torch.device("cuda", 0)
    assert splits.plan_splits(batch, rows, capacity, device) == expected
    assert splits.plan_splits(batch, rows, capacity, torch.device("cpu")) == (1, None)


@pytest.mark.parametrize(
    ("batch", "capacity", "expected"),
    [
        (128, 4096, (2, 128)),  # h16_b128_4k: 132 slots, one chunk per sequence (uniform)
        (4, 65536, (64, 132)),  # h16_b4_64k: 33 chunks each, headroom capped at MAX_SPLITS
        (64, 8192, (4, 128)),  # h16_b64_8k_ragged: 2 chunks each on average
    ],
)
def test_planner_one_wgmma_program_per_sm(monkeypatch, batch, capacity, expected) -> None:
    """The Gluon wgmma kernel keeps one program per multiprocessor: half the Triton kernel's."""

    monkeypatch.setattr(splits, "multiprocessor_count", lambda device: 132)
    device = torch.device("cuda", 0)
    assert splits.plan_splits(batch, 16, capacity, device, wgmma=True) == expected


@pytest.mark.parametrize(
    ("rows", "capacity", "wgmma", "expected"),
    [
        (16, 32832, True, (128, 132)),  # one wave's chunks, up to SINGLE_SEQUENCE_MAX_SPLITS
        (32, 32832, True, (128, 132)),  # 16 heads x S_q 2
        (16, 16448, True, (65, 132)),  # capped by capacity / MIN_CHUNK
        (16, 8192, True, (32, 132)),
        (64, 32768, True, (64, 132)),  # 64-row programs keep MAX_SPLITS
        (128, 32768, True, (64, 66)),  # h128_b1_32k: 64 chunks of 512 tokens fill the wave
        (16, 131072, False, (64, 264)),  # the Triton kernel keeps MAX_SPLITS
        (16, None, True, (64, 132)),  # so does an unknown capacity
    ],
)
def test_planner_single_sequence(monkeypatch, rows, capacity, wgmma, expected) -> None:
    """A batch of one sequence has no raggedness to leave headroom for: its wgmma programs of at
    most 32 rows take as many chunks as one wave cuts its capacity into, and
    every chunk of a full cache then has a program of its own."""

    monkeypatch.setattr(splits, "multiprocessor_count", lambda device: 132)
    device = torch.device("cuda", 0)
    plan = splits.plan_splits(1, rows, capacity, device, wgmma=wgmma)
    assert plan == expected
    if capacity is None:
        return
    full = torch.tensor([capacity], dtype=torch.int32)
    start, end = splits.split_bounds(full, plan.num_splits, plan.total_splits)
    chunks = int((end > start).sum())
    assert chunks <= plan.num_splits
    if wgmma and rows <= 32 and capacity >= 32 * 1024:
        assert chunks > splits.MAX_SPLITS, (chunks, plan)


def test_planner_symbolic_batch_splits_evenly(monkeypatch) -> None:
    """A symbolic batch has no total to balance against: even splits for the assumed batch."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setattr(splits, "multiprocessor_count", lambda device: 132)
    batch = ShapeEnv().create_unbacked_symint()
    plan = splits.plan_splits(batch, 16, None, torch.device("cuda", 0))
    assert plan == (264 // splits.SYMBOLIC_BATCH_ASSUMPTION, None)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_fp8_cache(seed: int, dtype: torch.dtype, device: str) -> None:
    """A float8 e4m3 cache with a per-tensor scale, single tensor or pair (RoPE part fp8 or in
    q's dtype): exact against the float64 reference of the dequantised cache."""
    run_and_check(make_case(400 + seed, dtype=dtype, device=device, cache_dtype=FP8), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache_within_fp8_tolerance_of_bf16(device: str) -> None:
    """quantize_kv_fp8 + mla_decode stays within e4m3's precision of the bf16-cache result."""
    case = make_case(
        500,
        dtype=torch.bfloat16,
        device=device,
        page_size=64,
        dims=(512, 64),
        heads=16,
        lengths=[1000, 3000, 64],
        pair=False,
    )
    kw = dict(block_table=case.block_table, head_dim_v=512, softmax_scale=case.softmax_scale)
    cache = case.kv_cache.nan_to_num(0.0)  # unused rows hold NaN poison; amax needs numbers
    out_bf16, lse_bf16 = mla_ops.mla_decode(case.q, cache, case.cache_seqlens, **kw)
    cache_fp8, kv_scale = mla_ops.quantize_kv_fp8(cache)
    out_fp8, lse_fp8 = mla_ops.mla_decode(
        case.q, cache_fp8, case.cache_seqlens, kv_scale=kv_scale, **kw
    )
    # e4m3 keeps 3 mantissa bits (about 6 % per value); attention averages it to 4.3 % here.
    rel = ((out_fp8.float() - out_bf16.float()).norm() / out_bf16.float().norm()).item()
    assert rel < 0.05, rel
    assert (lse_fp8 - lse_bf16).abs().max().item() < 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("seed", range(8))
def test_attention_mask(seed: int, kind: str, dtype: torch.dtype, device: str) -> None:
    """Left padding, holes, fully hidden rows, masks shorter or longer than the cache."""
    run_and_check(make_case(300 + seed, dtype=dtype, device=device, mask=kind), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_mask_and_hugging_face_fill(device: str) -> None:
    """A [B, 1, T] mask broadcasts over S_q; finfo.min (Hugging Face's fill) hides like -inf."""
    case = make_case(
        31, device=device, s_q=2, lengths=[40, 0, 17], causal=True, page_size=3, mask="bool"
    )
    visible = torch.rand(3, 1, 41, generator=torch.Generator().manual_seed(0)) > 0.3
    visible[:, :, 30:] = True  # the newest keys stay visible, as in decoding
    args = dict(
        block_table=case.block_table,
        head_dim_v=case.head_dim_v,
        softmax_scale=case.softmax_scale,
        causal=True,
        num_splits=2,
    )
    fill = torch.finfo(torch.float32).min
    float_mask = torch.where(visible, 0.0, fill).to(device)
    out_b, lse_b = mla_ops.mla_decode(
        case.q, case.kv_cache, case.cache_seqlens, attn_mask=visible.to(device), **args
    )
    out_f, lse_f = mla_ops.mla_decode(
        case.q, case.kv_cache, case.cache_seqlens, attn_mask=float_mask, **args
    )
    case.attn_mask = visible.expand(3, 2, 41)
    ref_out, ref_lse = case.reference()
    assert_matches(out_b, lse_b, ref_out, ref_lse, torch.float32, "bool [B, 1, T]")
    assert_matches(out_f, lse_f, ref_out, ref_lse, torch.float32, "finfo.min [B, 1, T]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_hidden_keys_holding_nan_do_not_leak(kind: str, device: str) -> None:
    case = make_case(
        51, device=device, s_q=1, page_size=None, pair=False, mask=kind, lengths=[30, 64, 9]
    )
    poison_hidden_keys(case)
    run_and_check(case, torch.float32)


@pytest.mark.parametrize("layout", ["empty block table", "zero-length cache", "no pages"])
def test_an_all_empty_batch_over_an_empty_cache(layout: str) -> None:
    """Every sequence empty over a cache with no tokens at all: zeros and -inf, not an error
    from inside the reference."""
    batch, heads, kv_len, rope_len = 2, 3, 32, 16
    q = torch.randn(batch, 1, heads, kv_len + rope_len)
    block_table = torch.zeros(batch, 0, dtype=torch.int32)
    kv_cache = {
        "empty block table": torch.randn(6, 16, kv_len + rope_len),
        "zero-length cache": torch.randn(batch, 0, kv_len + rope_len),
        "no pages": torch.randn(0, 16, kv_len + rope_len),
    }[layout]
    out, lse = mla_ops.mla_decode(
        q, kv_cache, torch.zeros(batch, dtype=torch.int32),
        block_table=None if layout == "zero-length cache" else block_table,
        head_dim_v=kv_len, softmax_scale=0.1,
    )  # fmt: skip
    assert out.shape == (batch, 1, heads, kv_len) and not out.any()
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_key_stays_with_the_queries_that_see_it(bad: float) -> None:
    """S_q = 2, causal: the last key is seen by the second query only. A non-finite value there
    leaves the first query's output exactly what it is with any other value in that row."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 3, 48, dtype=torch.float64, generator=gen)
    kv = torch.randn(2, 12, 48, dtype=torch.float64, generator=gen)
    lengths = torch.tensor([12, 7], dtype=torch.int32)
    clean, _ = mla_ops.mla_decode(q, kv, lengths, head_dim_v=32, softmax_scale=0.2)
    poisoned = kv.clone()
    poisoned[0, 11], poisoned[1, 6] = bad, bad  # each sequence's last key
    out, lse = mla_ops.mla_decode(q, poisoned, lengths, head_dim_v=32, softmax_scale=0.2)
    assert torch.equal(out[:, 0], clean[:, 0]) and torch.isfinite(lse[:, 0]).all()
    assert not torch.isfinite(out[:, 1]).all()


def test_a_float16_mask_hides_at_its_minimum() -> None:
    """Hugging Face fills a float16 mask's hidden keys with float16's minimum (-65504), which
    never reaches -1e30: it hides them all the same, so a row that sees nothing gives zeros and
    -inf (it averaged over the hidden keys), and partly hidden rows equal the bool mask's."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 3, 48, dtype=torch.float16, generator=gen)
    kv = torch.randn(2, 10, 48, dtype=torch.float16, generator=gen)
    lengths = torch.tensor([10, 6], dtype=torch.int32)
    visible = torch.ones(2, 2, 10, dtype=torch.bool)
    visible[0, 0] = False  # a row that sees no key
    visible[1, :, :3] = False  # left padding
    additive = torch.zeros(2, 2, 10, dtype=torch.float16).masked_fill(
        ~visible, torch.finfo(torch.float16).min
    )
    kw = dict(head_dim_v=32, softmax_scale=0.2, causal=False)
    out, lse = mla_ops.mla_decode(q, kv, lengths, attn_mask=additive, **kw)
    expected, expected_lse = mla_ops.mla_decode(q, kv, lengths, attn_mask=visible, **kw)
    assert not out[0, 0].any() and torch.isneginf(lse[0, 0]).all()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
