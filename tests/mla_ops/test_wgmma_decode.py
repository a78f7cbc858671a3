"""The Hopper decode kernel (``mla_ops/hopper``).

It has no interpreter mode, so its results are checked on a Hopper GPU only (against the float64
reference, output and LSE, empty sequences, S_q > 1, odd heads, balanced splits, a bad page id, a
float8 kv_c, page sizes that the copy engine takes (64, 128) and ones gathered row by row (1, 3,
16)).
On every machine: when ``mla::decode`` takes it and why not (``wgmma_plan_path``), how it would
fetch a cache's tiles (``wgmma_loads``), and that it compiles to wgmma and TMA (or cp.async)
instructions for sm_90 with the installed Triton (its wheel carries ptxas), without spilling.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mla_compile.mla_ops import device as device_facts
from mla_compile.mla_ops import planner, reference, runtime, splits, tiling, triton_kernels  # noqa: F401
from tests.conftest import HAS_CUDA, triton_available
from tests.mla_ops.cases import TRIGGER_AFTER_LOOP, assert_matches, make_case, offline_compile

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


try:
    from mla_compile.mla_ops import hopper
    from mla_compile.mla_ops.hopper import float8 as hopper_float8
    from mla_compile.mla_ops.hopper import host as hopper_host
    from mla_compile.mla_ops.hopper import layouts as hopper_layouts
except ImportError:  # a Triton without Gluon's Hopper module: the tests below skip
    hopper = hopper_float8 = hopper_host = hopper_layouts = None


def _gluon_available() -> bool:
    return hopper is not None


def _on_hopper() -> bool:
    if not HAS_CUDA:
        return False
    return device_facts.has_wgmma(torch.device("cuda", 0))


requires_hopper = pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU (sm_90)")


def run(kernels, case, options=planner.DEFAULT_OPTIONS):
    out_p, lse_p = runtime.decode(*case.op_args(), options=options)
    assert runtime.LAST_LAUNCH["decode_path"] == "wgmma", case.describe()
    loads = "tma" if case.kv_c.shape[1] % 64 == 0 else "gather"
    assert runtime.LAST_LAUNCH["wgmma_loads"] == loads, case.describe()
    return runtime.combine(out_p, lse_p, case.q.dtype)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", range(12))
def test_random_problems(kernels, seed: int, dtype: torch.dtype) -> None:
    """Random lengths (0, S_q, long), 1-256 query rows (16-, 32- and 64-row programs, partial
    ones), splits, widths, page sizes 64/128 (copy engine) and 1/3/16 (gathered by cp.async)."""
    import random

    rng = random.Random(seed)
    s_q = rng.choice([1, 1, 2, 3])
    heads = rng.choice([1, 3, 5, 16 // s_q, 21, 128 // s_q])
    case = make_case(
        300 + seed,
        dtype=dtype,
        device="cuda",
        s_q=s_q,
        heads=heads,
        dims=rng.choice([(512, 64), (64, 16), (128, 0), (256, 32)]),
        page_size=rng.choice([64, 128, 1, 3, 16]),
        max_len=rng.choice([70, 700, 3000]),
        total_splits=rng.choice([None, 3, 8]),
    )
    out, lse = run(kernels, case)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


FP8 = torch.float8_e4m3fn


# A float8 cache multiplied in float8 (``tiling.default_float8_products``: the query as
# two e4m3 terms, P in e4m3) against float64 attention over the dequantised cache: P's rounding
# (e4m3 keeps 4 significant bits) moves each output by up to a few hundredths; the scores keep
# about bf16's precision, so the LSE stays close.
FLOAT8_PRODUCTS_TOLERANCE = (5e-2, 5e-2)
FLOAT8_PRODUCTS_LSE_TOLERANCE = 2e-3


def assert_fp8_matches(kernels, out, lse, ref_out, ref_lse, dtype, context: str) -> None:
    """``assert_matches`` against the dequantised cache's reference, at the float8 products'
    tolerance where the last launch multiplied in float8."""
    products = runtime.LAST_LAUNCH.get("wgmma_float8_products", False)
    assert_matches(
        out, lse, ref_out, ref_lse, dtype, f"{context} float8_products={products}",
        FLOAT8_PRODUCTS_TOLERANCE if products else None,
        FLOAT8_PRODUCTS_LSE_TOLERANCE if products else None,
    )  # fmt: skip


def _fp8_pair_case(seed: int, dtype: torch.dtype, **kw):
    """A float8 kv_c with k_pe in q's dtype (the layout the kernel takes; FlashMLA's fp8 one)."""
    case = make_case(seed, dtype=dtype, device="cuda", cache_dtype=FP8, pair=True, **kw)
    if case.k_pe.dtype == FP8:
        case.k_pe = (case.k_pe.float() * case.kv_scale).to(dtype)
        case.kv_cache = (case.kv_c, case.k_pe)
    return case


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_fp8_cache(kernels, seed: int, dtype: torch.dtype) -> None:
    """A float8 kv_c against the float64 reference of the dequantised cache, at 16-, 32- and
    64-row programs (three ring slots at 32 rows, two at 16 and 64), S_q > 1, empty sequences,
    partial last tiles: exact where it is converted to fp16 in shared memory (scale folded into
    the query), within ``FLOAT8_PRODUCTS_TOLERANCE`` where 16-row programs of width 512 multiply
    it in float8."""
    import random

    rng = random.Random(seed)
    s_q = rng.choice([1, 1, 2])
    case = _fp8_pair_case(
        800 + seed,
        dtype,
        s_q=s_q,
        heads=rng.choice([3, 16 // s_q, 21, 128 // s_q]),
        dims=rng.choice([(512, 64), (64, 16), (128, 0)]),
        page_size=rng.choice([64, 128, 1, 16]),
        max_len=rng.choice([70, 700, 3000]),
        total_splits=rng.choice([None, 8]),
    )
    out, lse = run(kernels, case)
    ref_out, ref_lse = case.reference()
    assert_fp8_matches(kernels, out, lse, ref_out, ref_lse, dtype, case.describe())


def _fp8_whole_case(seed: int, dtype: torch.dtype, **kw):
    """The whole cache in float8 under one scale (kv_c and k_pe views of one ``[..., L+R]``
    e4m3 tensor: vLLM's fp8 MLA cache), with rows of whole 16-byte units as the copy engine
    needs (``make_case`` may pad them by 8 bytes)."""
    case = make_case(seed, dtype=dtype, device="cuda", cache_dtype=FP8, pair=False, **kw)
    cache = case.kv_cache.contiguous()
    kv_len = case.kv_c.shape[-1]
    return replace(case, kv_cache=cache, kv_c=cache[..., :kv_len], k_pe=cache[..., kv_len:])


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_fp8_whole_cache(kernels, seed: int, dtype: torch.dtype) -> None:
    """kv_c and k_pe both in float8 (one tensor, one scale) against the float64 reference of
    the dequantised cache: the wgmma kernel reads it at a RoPE width of 64, 16-row programs of width
    512 over whole 64-token pages with both parts' scores float8 products, every other program (32
    and 64 rows, another kv_c width, gathered pages) converting both parts to fp16; another RoPE
    width runs the Triton kernel. The draws cover all three (splits, empty sequences, partial last
    tiles, stale rows); S_q = 2 and 64-token pages are in
    ``test_fp8_cache_query_outside_fp16_range`` and
    ``test_float8_products_error_against_bf16_is_the_caches``."""
    import random

    rng = random.Random(seed)
    s_q = rng.choice([1, 1, 2])
    heads = rng.choice([3, 5, 16 // s_q, 16 // s_q, 128 // s_q])
    dims = rng.choice([(512, 64), (512, 64), (512, 32), (64, 16)])
    page_size = rng.choice([64, 64, 128, 1, 16])
    case = _fp8_whole_case(
        870 + seed, dtype, s_q=s_q, heads=heads, dims=dims, page_size=page_size,
        max_len=rng.choice([70, 700, 3000]), total_splits=rng.choice([None, 8]),
    )  # fmt: skip
    runtime.LAST_LAUNCH.clear()
    out_p, lse_p = runtime.decode(*case.op_args())
    out, lse = runtime.combine(out_p, lse_p, dtype)
    takes = dims[1] == 64
    products = takes and heads * s_q <= 16 and dims[0] == 512 and page_size % 64 == 0
    assert (runtime.LAST_LAUNCH["decode_path"] == "wgmma") == takes, case.describe()
    assert runtime.LAST_LAUNCH.get("wgmma_float8_products", False) == products, case.describe()
    ref_out, ref_lse = case.reference()
    assert_fp8_matches(kernels, out, lse, ref_out, ref_lse, dtype, case.describe())


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("heads", "s_q", "dims", "page_size"),
    [
        (16, 2, (512, 64), 64),  # 32 rows (MTP): three ring slots
        (21, 1, (512, 64), 128),  # 32-row programs, 11 rows masked
        (128, 1, (512, 64), 64),  # two 64-row programs a chunk
        (40, 3, (512, 64), 64),  # 120 rows: a partial second row block
        (16, 1, (256, 64), 64),  # 16 rows of another width: converted, with a producer warp
        (5, 3, (128, 64), 128),
        (16, 1, (512, 64), 1),  # gathered rows: a producer warpgroup
        (128, 1, (512, 64), 16),  # gathered, 64-row programs
        (12, 2, (512, 64), 3),
    ],
)
def test_fp8_whole_cache_converted(
    kernels, heads: int, s_q: int, dims: tuple, page_size: int, dtype: torch.dtype
) -> None:
    """The whole row in float8 where it is not multiplied in float8 (more than 16 query rows,
    another kv_c width, pages gathered row by row): k_pe converted to fp16 like kv_c, the RoPE
    query in fp16 under the nope part's power of two. Exact conversions, so
    the 16-bit tolerance against float64 attention over the dequantised cache; causal S_q > 1,
    splits, an empty sequence, partial last tiles and stale (NaN) rows."""
    case = _fp8_whole_case(
        880 + heads + s_q, dtype, s_q=s_q, heads=heads, dims=dims, page_size=page_size,
        lengths=[1000, 0, 70, 130], causal=s_q > 1, total_splits=6, num_splits=3,
    )  # fmt: skip
    out, lse = run(kernels, case)
    assert runtime.LAST_LAUNCH["decode_path"] == "wgmma", case.describe()
    assert not runtime.LAST_LAUNCH["wgmma_float8_products"], case.describe()
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


def _poison_hidden_paged(case) -> None:
    """NaN into every cached row (``kv_c`` and ``k_pe``) of a paged cache that ``case.attn_mask``
    hides from all query positions: Hugging Face's eager float64 prefill leaves NaN at left-pad
    positions, and they must not leak (``cases.poison_hidden_keys`` for a dense cache)."""
    mask = case.attn_mask
    hidden = ~mask.bool().any(dim=1) if mask.dtype == torch.bool else (mask <= -1e30).all(dim=1)
    page_size = case.kv_c.shape[1]
    for b, length in enumerate(case.cache_seqlens.tolist()):
        for t in range(min(length, hidden.shape[1])):
            if hidden[b, t]:
                page, row = int(case.block_table[b, t // page_size]), t % page_size
                for part in (case.kv_c, case.k_pe):
                    if part.shape[-1] and part.dtype == FP8:
                        part.view(torch.uint8)[page, row] = 0x7F  # e4m3fn's NaN
                    elif part.shape[-1]:
                        part[page, row] = float("nan")


MASKED_SHAPES = {
    "16 rows": dict(heads=16, s_q=1, page_size=64),
    "16 rows gathered": dict(heads=16, s_q=1, page_size=1),
    "32 rows": dict(heads=16, s_q=2, page_size=64),
    "64 rows, one scorer": dict(heads=128, s_q=1, page_size=64),
    "64 rows, one scorer, 40 heads": dict(heads=40, s_q=1, page_size=64),
    # One chunk a sequence: warpgroup 1 prepares the mask terms of all but the first two tiles.
    "64 rows, one scorer, long chunks": dict(
        heads=128,
        s_q=1,
        page_size=64,
        lengths=[1500, 0, 640, 70],
        num_splits=1,
        total_splits=None,
    ),
    "64 rows, one scorer, S_q = 3": dict(heads=20, s_q=3, page_size=64),
    "64 rows gathered": dict(heads=40, s_q=2, page_size=16),
    "float8 products": dict(heads=16, s_q=1, page_size=64, fp8="pair"),
    "float8 products, whole row": dict(heads=8, s_q=2, page_size=64, fp8="whole"),
    "float8 converted, 64 rows": dict(heads=128, s_q=1, page_size=64, fp8="whole"),
    "float8 converted, gathered": dict(heads=16, s_q=2, page_size=3, fp8="pair"),
}


@requires_hopper
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", list(MASKED_SHAPES))
def test_attention_mask_in_the_wgmma_kernel(kernels, shape: str, kind: str) -> None:
    """An ``attn_mask`` (left padding, random holes, a fully hidden query row, a mask shorter or
    longer than the cache; Hugging Face's ``finfo.min`` fill) read by the wgmma kernel's
    transposed loop in every tiling it runs and by the one-scorer loop (item
    64): 16-, 32- and 64-row programs, copy-engine and gathered tiles, float8 products and
    conversions; against the float64 reference, with NaN written at every key the mask hides
    from all queries (they must not leak: the kernel zeroes their value rows)."""
    kw = dict(MASKED_SHAPES[shape])
    fp8 = kw.pop("fp8", None)
    args = dict(
        dims=(512, 64), lengths=[700, 0, 300, 70], causal=True, num_splits=3, total_splits=8,
        mask=kind,
    ) | kw  # fmt: skip
    seed = 1300 + len(shape) + (kind == "float")
    if fp8 == "pair":
        case = _fp8_pair_case(seed, torch.bfloat16, **args)
    elif fp8 == "whole":
        case = _fp8_whole_case(seed, torch.bfloat16, **args)
    else:
        case = make_case(seed, dtype=torch.bfloat16, device="cuda", pair=False, **args)
    ref_out, ref_lse = case.reference()
    _poison_hidden_paged(case)
    out, lse = run(kernels, case)
    assert runtime.LAST_LAUNCH["wgmma_one_scorer"] == ("one scorer" in shape), shape
    assert not runtime.LAST_LAUNCH["wgmma_rows_on_m"]
    products = runtime.LAST_LAUNCH["wgmma_float8_products"]
    assert products == shape.startswith("float8 products"), shape
    assert_fp8_matches(kernels, out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


@requires_hopper
@pytest.mark.parametrize(("dims", "heads"), [((256, 32), 40), ((128, 64), 64), ((256, 0), 128)])
def test_one_scorer_on_narrow_rows(kernels, dims: tuple[int, int], heads: int) -> None:
    """64-row programs over rows narrower than DeepSeek's (MiniCPM3: L=256, R=32, 40 heads), where
    a third ring slot would fit: the one-scorer loop keeps its two (it was handed three and
    refused)."""
    case = make_case(
        1340 + heads, dtype=torch.bfloat16, device="cuda", page_size=64, dims=dims, heads=heads,
        s_q=1, lengths=[900, 0, 64, 333], causal=True, pair=False,
    )  # fmt: skip
    out, lse = run(kernels, case)
    assert runtime.LAST_LAUNCH["wgmma_one_scorer"] is True
    # The query stays in shared memory: its register split is DeepSeek's row's (L = 512).
    assert runtime.LAST_LAUNCH["wgmma_query_in_registers"] is False
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


@requires_hopper
@pytest.mark.parametrize("heads", [16, 128])
def test_attention_mask_merged_in_the_kernel(kernels, heads: int) -> None:
    """``mla::attention`` with a mask and at most ``tiling.MERGE_MAX_SPLITS`` splits: the wgmma
    kernel masks and writes the output itself (one chunk, or merged by the last to arrive), as the
    float64 reference says."""
    case = make_case(
        1320 + heads, dtype=torch.bfloat16, device="cuda", page_size=64, dims=(512, 64),
        heads=heads, s_q=1, lengths=[900, 64, 0], causal=True, mask="float", pair=False,
        num_splits=tiling.MERGE_MAX_SPLITS, total_splits=4,
    )  # fmt: skip
    ref_out, ref_lse = case.reference()
    _poison_hidden_paged(case)
    out, lse = runtime.attention(*case.op_args())
    assert runtime.LAST_LAUNCH["merge"].startswith("decode kernel"), runtime.LAST_LAUNCH["merge"]
    assert runtime.LAST_LAUNCH["decode_path"] == "wgmma"
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


def test_mask_hidden_threshold_matches_the_reference() -> None:
    """The wgmma kernel's ``MASK_HIDDEN`` is the reference's (the module keeps its own copy)."""
    if not _gluon_available():
        pytest.skip("Triton without Gluon's Hopper module")

    assert hopper.MASK_HIDDEN.value == reference.MASK_HIDDEN


@requires_hopper
@pytest.mark.parametrize("layout", ["pair", "whole", "whole converted"])
@pytest.mark.parametrize("query_max", [1e-6, 1.0, 6e4, 1e9])
def test_fp8_cache_query_outside_fp16_range(kernels, query_max: float, layout: str) -> None:
    """The fp16 nope query is moved into fp16's range by a power of two: a bf16 query from 1e-6
    to 1e9 neither overflows nor rounds away. ``whole``: k_pe in float8 too, in 16-row programs
    both query parts' e4m3 terms under one power of two; ``whole converted``: in 32-row programs,
    both query parts in fp16 under one power of two."""
    make = _fp8_pair_case if layout == "pair" else _fp8_whole_case
    heads = dict(pair=16, whole=8).get(layout, 16)  # x S_q = 2: 32, 16 and 32 query rows
    case = make(
        850, torch.bfloat16, page_size=64, dims=(512, 64), heads=heads, s_q=2, causal=True,
        lengths=[130, 64, 0],
    )  # fmt: skip
    case.q = case.q * (query_max / case.q.abs().max().item())
    case.softmax_scale /= query_max  # keep the scores' spread
    out, lse = run(kernels, case)
    assert runtime.LAST_LAUNCH["decode_path"] == "wgmma"
    assert runtime.LAST_LAUNCH["wgmma_float8_products"] == (layout == "whole")
    ref_out, ref_lse = case.reference()
    assert torch.isfinite(out[:2]).all()
    assert_fp8_matches(kernels, out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


@requires_hopper
@pytest.mark.parametrize(("heads", "s_q"), [(16, 1), (3, 2), (8, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_float8_products_error_against_bf16_is_the_caches(
    kernels, monkeypatch, seed: int, heads: int, s_q: int
) -> None:
    """The float8 cache's error as the benchmark reports it: its output against float64 attention
    over the bf16 cache it was quantised from. Multiplied in float8 (16-row programs, width 512: the
    query as two e4m3 terms, P in e4m3) the error stays within e4m3's precision (under 5 %, as
    ``test_decode``'s bound) and within a quarter more than the fp16 products' (the cache's own
    rounding dominates both: +1 % on bench_decode's h16_b128_4k_fp8; +15 % on this file's 6 query
    rows and a 2-token sequence, where P's rounding weighs more; with the query as one e4m3 term
    h16_b128_4k_fp8's error was a third larger). Odd heads, S_q = 2 (causal), splits, partial last
    tiles, stale rows (NaN)."""

    case = make_case(
        910 + seed, dtype=torch.bfloat16, device="cuda", page_size=64, dims=(512, 64),
        heads=heads, s_q=s_q, pair=True, causal=s_q > 1, max_len=3000, total_splits=8,
    )  # fmt: skip
    ref_out, _ = case.reference()
    live = case.kv_c.float().nan_to_num(0.0)
    scale = max(float(live.abs().amax()), 1.0) / 448.0
    kv_c8 = (case.kv_c.float() / scale).to(FP8)  # stale rows stay NaN
    case8 = replace(case, kv_c=kv_c8, kv_cache=(kv_c8, case.k_pe), kv_scale=scale)

    def rel_err(out: torch.Tensor) -> float:
        out64 = out.double().cpu()
        return float((out64 - ref_out).norm() / ref_out.norm())

    out_products, _ = run(kernels, case8)
    assert runtime.LAST_LAUNCH["wgmma_float8_products"], case.describe()
    # The whole row in float8 under one scale (k_pe quantised too).
    row8 = (torch.cat([case.kv_c, case.k_pe], -1).float() / scale).to(FP8)
    kv_c8e, k_pe8e = row8[..., :512], row8[..., 512:]
    case8e = replace(case, kv_c=kv_c8e, k_pe=k_pe8e, kv_cache=row8, kv_scale=scale)
    out_whole, _ = run(kernels, case8e)
    assert runtime.LAST_LAUNCH["wgmma_float8_products"], case.describe()
    out_f16, _ = run(kernels, case8, planner.DecodeOptions(float8_products=False))
    assert not runtime.LAST_LAUNCH["wgmma_float8_products"]
    err_products, err_f16 = rel_err(out_products), rel_err(out_f16)
    err_whole = rel_err(out_whole)
    assert err_products < 0.05 and err_products <= 1.25 * err_f16, (
        err_products, err_f16, case.describe()
    )  # fmt: skip
    # k_pe's own e4m3 rounding adds to the scores' error, not to V's.
    assert err_whole < 0.05 and err_whole <= 1.5 * err_f16, (err_whole, err_f16, case.describe())


@requires_hopper
@pytest.mark.parametrize(("heads", "s_q"), [(16, 1), (128, 2)])
@pytest.mark.parametrize("lengths", [[0, 0], [2, 64], [65, 4097], [128, 2]])
def test_tile_edges_and_empty(kernels, lengths: list[int], heads: int, s_q: int) -> None:
    """Lengths at and around the 64-token tile; empty sequences give zeros and -inf. 16-row
    programs and DeepSeek's 128 heads with S_q = 2 (four 64-row programs per sequence, causal)."""
    case = make_case(
        17, dtype=torch.bfloat16, device="cuda", page_size=64, dims=(512, 64), heads=heads,
        s_q=s_q, lengths=lengths, num_splits=3, causal=s_q > 1,
    )  # fmt: skip
    out, lse = run(kernels, case)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


@requires_hopper
@pytest.mark.parametrize("page_size", [64, 1, 16])
def test_bad_page_poisons_only_its_sequence(kernels, page_size: int) -> None:
    """A page id past the cache: its sequence's rows are NaN (nothing read out of bounds), the
    other sequence is untouched; copy-engine and gathered tiles alike (``make_case`` also puts
    junk ids past each sequence's pages, which must not be read)."""
    case = make_case(
        12, dtype=torch.bfloat16, device="cuda", page_size=page_size, dims=(512, 64), heads=16,
        s_q=1, lengths=[200, 200], num_splits=1,
    )  # fmt: skip
    ref_out, ref_lse = case.reference()
    case.block_table[0, 130 // page_size] = case.kv_c.shape[0] + 1
    out, lse = run(kernels, case)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert not torch.isnan(out[1]).any()
    assert_matches(out[1:], lse[1:], ref_out[1:], ref_lse[1:], torch.bfloat16, case.describe())


@requires_hopper
@pytest.mark.parametrize("page_size", [64, 1])
def test_fill_empty_off_leaves_empty_splits_unwritten(kernels, page_size: int) -> None:
    """``fill_empty=False`` (what ``mla_decode`` passes): an empty split's ``out`` keeps the
    poisoned allocation's NaN, its ``lse`` is ``-inf``, every other partial is bit-equal to
    ``fill_empty=True``'s and so is the combined output."""
    case = make_case(
        43, dtype=torch.bfloat16, device="cuda", page_size=page_size, dims=(512, 64),
        heads=16, s_q=1, lengths=[1000, 0, 300], num_splits=4, total_splits=4,
    )  # fmt: skip
    out_fill, lse_fill = runtime.decode(*case.op_args(), fill_empty=True)
    out_p, lse_p = runtime.decode(*case.op_args(), fill_empty=False)
    assert runtime.LAST_LAUNCH["decode_path"] == "wgmma"
    assert torch.equal(lse_p, lse_fill)
    empty = torch.isneginf(lse_fill).all(dim=(1, 2))  # [B, splits]
    assert empty.any() and (~empty).any()
    by_split_p, by_split_fill = out_p.permute(0, 3, 1, 2, 4), out_fill.permute(0, 3, 1, 2, 4)
    assert torch.isnan(by_split_p[empty]).all() and (by_split_fill[empty] == 0).all()
    assert torch.equal(by_split_p[~empty], by_split_fill[~empty])
    out, lse = runtime.combine(out_p, lse_p, torch.bfloat16)
    out_ref, lse_ref = runtime.combine(out_fill, lse_fill, torch.bfloat16)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


@requires_hopper
@pytest.mark.parametrize(("page_size", "float8"), [(64, False), (1, False), (64, True), (3, True)])
def test_producer_partition_matches_math_warps_copying(
    kernels, monkeypatch, page_size: int, float8: bool
) -> None:
    """16-row programs copy through a producer partition (one warp for TMA, a warpgroup for
    gathers): the partials, a bad page's NaN included, are bit-equal to those of the kernel whose
    math warps issue the copies themselves (``producer_warps=0``)."""

    kw = dict(
        page_size=page_size, dims=(512, 64), heads=16, s_q=1, lengths=[1000, 0, 300, 64, 130],
        num_splits=3, total_splits=4,
    )  # fmt: skip
    if float8:
        case = _fp8_pair_case(71, torch.bfloat16, **kw)
    else:
        case = make_case(71, dtype=torch.bfloat16, device="cuda", **kw)
    case.block_table[3, 0] = 10**6  # a bad page id in one sequence
    out_ws, lse_ws = runtime.decode(*case.op_args())
    assert runtime.LAST_LAUNCH["wgmma_producer_warps"] == (1 if page_size % 64 == 0 else 4)
    out_0, lse_0 = runtime.decode(*case.op_args(), options=planner.DecodeOptions(producer_warps=0))
    assert runtime.LAST_LAUNCH["wgmma_producer_warps"] == 0
    # [B, S_q, H, splits]: the bad page's split only, in its sequence only.
    assert torch.isnan(lse_ws[3, ..., 0]).all() and torch.isnan(lse_ws).sum() == 16
    assert torch.equal(lse_ws.nan_to_num(), lse_0.nan_to_num())
    assert torch.equal(out_ws.nan_to_num(), out_0.nan_to_num())


def _assert_bad_page_poisons_only_sequence_1(
    kernels, case, out, lse, options=planner.DEFAULT_OPTIONS
) -> None:
    """With a bad page id in the second sequence (``case`` is changed): its partials' lse is
    NaN at every row of its first split and nowhere else, and every other sequence's combined
    output and lse equal ``out``/``lse``, the good cache's."""
    _, s_q, heads, _ = case.q.shape
    case.block_table[1, 0] = 10**6
    out_p, lse_p = runtime.decode(*case.op_args(), options=options)
    assert torch.isnan(lse_p[1, ..., 0]).all()
    assert torch.isnan(lse_p).sum() == s_q * heads
    out_bad, lse_bad = runtime.combine(out_p, lse_p, torch.bfloat16)
    keep = [b for b in range(case.q.shape[0]) if b != 1]
    assert torch.equal(out_bad[keep], out[keep]) and torch.equal(lse_bad[keep], lse[keep])


@requires_hopper
@pytest.mark.parametrize("rows_on_m", [False, True])
@pytest.mark.parametrize(
    ("heads", "s_q", "page_size", "lengths"),
    [(128, 1, 64, [0, 1, 64, 65, 700]), (128, 2, 1, [2, 130, 0]), (43, 3, 16, [3, 200, 64]),
     (64, 1, 128, [4097, 63])],
)  # fmt: skip
def test_64_row_programs_either_orientation(
    kernels, monkeypatch, rows_on_m: bool, heads: int, s_q: int, page_size: int, lengths: list[int]
) -> None:
    """64-row programs of two warpgroups that split the scores, with the query rows on the MMA's
    M side (``S = Q K^T``, the default for a gathered 16-bit cache) or transposed
    (``S^T = K Q^T``), match the float64 reference: empty, 1-token and tile-edge lengths, causal
    S_q > 1, a partial last row block (43 heads x 3), copy-engine and gathered tiles, several
    splits; a bad page id makes only its split's rows NaN. (Copy-engine tiles of a 16-bit cache
    otherwise take one-scorer programs: ``test_one_scorer_programs``.)"""

    options = planner.DecodeOptions(one_scorer=False, rows_on_m=rows_on_m)
    case = make_case(
        29, dtype=torch.bfloat16, device="cuda", page_size=page_size, dims=(512, 64),
        heads=heads, s_q=s_q, lengths=lengths, num_splits=3, causal=s_q > 1,
    )  # fmt: skip
    out, lse = run(kernels, case, options)
    assert runtime.LAST_LAUNCH["wgmma_rows_on_m"] is rows_on_m
    assert runtime.LAST_LAUNCH["wgmma_one_scorer"] is False
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())
    _assert_bad_page_poisons_only_sequence_1(kernels, case, out, lse, options)


@requires_hopper
@pytest.mark.parametrize(
    ("heads", "s_q", "page_size", "lengths"),
    [(128, 1, 64, [0, 1, 64, 65, 700]), (128, 2, 64, [2, 130, 0]), (43, 3, 64, [3, 200, 64]),
     (64, 1, 128, [4097, 63])],
)  # fmt: skip
@pytest.mark.parametrize("query_in_registers", [False, True])
def test_one_scorer_programs(
    kernels, monkeypatch, heads: int, s_q: int, page_size: int, lengths: list[int],
    query_in_registers: bool,
) -> None:  # fmt: skip
    """64-row programs of a 16-bit cache with copy-engine tiles are one-scorer programs (the op's
    default: warpgroup 0 scores whole tiles and hands P to warpgroup 1, ``launch(one_scorer=True)``)
    and match the float64 reference: empty, 1-token and tile-edge lengths, causal S_q > 1, a
    partial last row block (43 heads x 3), several splits, pages of two tiles; a bad page id makes
    only its split's rows NaN; the same bits on a second call. Also with the nope query in
    warpgroup 0's registers and a ring of three (``DecodeOptions.query_in_registers``)."""

    options = planner.DecodeOptions(query_in_registers=query_in_registers)
    case = make_case(
        29, dtype=torch.bfloat16, device="cuda", page_size=page_size, dims=(512, 64),
        heads=heads, s_q=s_q, lengths=lengths, num_splits=3, causal=s_q > 1,
    )  # fmt: skip
    out, lse = run(kernels, case, options)
    assert runtime.LAST_LAUNCH["wgmma_one_scorer"] is True
    assert runtime.LAST_LAUNCH["wgmma_producer_warps"] == 0
    assert runtime.LAST_LAUNCH["wgmma_query_in_registers"] is query_in_registers
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())
    again = run(kernels, case, options)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    _assert_bad_page_poisons_only_sequence_1(kernels, case, out, lse, options)


@requires_hopper
@pytest.mark.parametrize("query_in_registers", [False, True])
def test_one_scorer_merges_in_the_kernel(kernels, monkeypatch, query_in_registers: bool) -> None:
    """``mla::attention`` over one-scorer programs with the in-kernel merge: both output halves
    (warpgroup 1's through shared memory) reach the final rows and the merge's partials; also
    with the query in registers (every output part, the one-chunk rows staged in a ring slot)."""

    options = planner.DecodeOptions(query_in_registers=query_in_registers, merge_max_splits=4)
    case = make_case(
        61, dtype=torch.bfloat16, device="cuda", dims=(512, 64), heads=128, s_q=2, page_size=64,
        lengths=[130, 0, 900, 64], num_splits=4, causal=True,
    )  # fmt: skip
    out, lse = runtime.attention(*case.op_args(), options=options)
    assert runtime.LAST_LAUNCH["merge"].startswith("decode kernel"), runtime.LAST_LAUNCH["merge"]
    assert runtime.LAST_LAUNCH["wgmma_one_scorer"] is True
    assert runtime.LAST_LAUNCH["wgmma_query_in_registers"] is query_in_registers
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


def _launch_args(kernels, case) -> tuple:
    """``hopper.launch``'s positional arguments for ``case`` with the op's tiling."""
    from mla_compile.mla_ops.splits import MIN_CHUNK, SPLIT_GRANULE

    block_m, warps = tiling.wgmma_tiling(case.q.shape[1] * case.q.shape[2])
    b, s_q, h, _ = case.q.shape
    out = torch.empty((b, s_q, h, case.num_splits, 512), device="cuda")
    lse = torch.empty((b, s_q, h, case.num_splits), device="cuda")
    return (
        case.q, case.kv_c, case.k_pe, case.cache_seqlens, case.block_table, out, lse,
        case.softmax_scale, None, case.causal, case.num_splits, None, block_m, warps, 2,
        MIN_CHUNK, SPLIT_GRANULE, tiling.LENGTHS_PER_STEP,
    )  # fmt: skip


LONGEST_FIRST_CASES = [
    # 16-row programs: TMA tiles, gathered ones (page size 1), a float8 cache.
    dict(heads=16, s_q=1, page_size=64),
    dict(heads=16, s_q=1, page_size=1),
    dict(heads=16, s_q=1, page_size=64, float8=True),
    # 5 heads x S_q 3 = 15 rows, causal, page size 16 (gathered).
    dict(heads=5, s_q=3, page_size=16, causal=True),
    # 32-row programs; 64-row programs over a float8 cache, two row blocks per sequence.
    dict(heads=32, s_q=1, page_size=64),
    dict(heads=128, s_q=1, page_size=64, float8=True),
]  # fmt: skip


def _ragged_case(seed: int, heads: int, s_q: int, page_size: int, float8: bool = False, **kw):
    """40 sequences of ragged lengths (empty ones, tile edges, whole chunks) on a balanced plan
    whose chunks are 320 tokens: 44-51 full chunks and 22-29 partial ones (seeds 61 and 62)."""
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 63, 64, 65, 320, 640, 700, 1000, 1919]) for _ in range(40)]
    kw = dict(
        page_size=page_size, dims=(512, 64), heads=heads, s_q=s_q, lengths=lengths,
        num_splits=6, total_splits=60, **kw,
    )  # fmt: skip
    if float8:
        return _fp8_pair_case(seed, torch.bfloat16, **kw)
    return make_case(seed, dtype=torch.bfloat16, device="cuda", **kw)


@requires_hopper
@pytest.mark.parametrize("kw", LONGEST_FIRST_CASES, ids=lambda kw: str(sorted(kw.items())))
def test_longest_first_matches_split_major(kernels, monkeypatch, kw: dict) -> None:
    """A ragged batch on a balanced plan: programs take the chunks longest first
    (``LAST_LAUNCH["wgmma_order"]``), and every partial, the empty splits' zeros and -inf
    included, is bit-equal to the split-major launch's (each chunk computed once, by whichever
    program); output and LSE match the float64 reference."""

    case = _ragged_case(61, **kw)
    out_lf, lse_lf = runtime.decode(*case.op_args())
    assert runtime.LAST_LAUNCH["wgmma_order"] == "longest-first"
    out_sm, lse_sm = runtime.decode(
        *case.op_args(), options=planner.DecodeOptions(longest_first=False)
    )
    assert runtime.LAST_LAUNCH["wgmma_order"] == "split-major"
    assert not torch.isnan(lse_lf).any() and not torch.isnan(out_lf).any()
    assert torch.equal(lse_lf, lse_sm) and torch.equal(out_lf, out_sm)
    out, lse = runtime.combine(out_lf, lse_lf, case.q.dtype)
    ref_out, ref_lse = case.reference()
    assert_fp8_matches(kernels, out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


def test_longest_first_default() -> None:
    """Longest first for a balanced plan of at most ``LENGTHS_PER_STEP`` sequences and
    ``LONGEST_FIRST_MAX_SPLITS`` splits (the kernel packs a split in 7 bits), except in programs
    with the rows on M; ``launch`` refuses it where the kernel cannot rank."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

    step = tiling.LENGTHS_PER_STEP
    most = hopper.LONGEST_FIRST_MAX_SPLITS.value
    assert tiling.default_longest_first(64, 4, 128, step, rows_on_m=False)
    assert tiling.default_longest_first(step, most, 1, step, rows_on_m=False)
    assert not tiling.default_longest_first(step + 1, 4, 128, step, rows_on_m=False)
    assert not tiling.default_longest_first(64, most + 1, 128, step, rows_on_m=False)
    assert not tiling.default_longest_first(64, 4, None, step, rows_on_m=False)
    assert not tiling.default_longest_first(64, 4, 128, step, rows_on_m=True)
    q = torch.zeros(2, 1, 16, 576)
    args = (q, q[..., :512], q[..., 512:], torch.ones(2, dtype=torch.int32), None, None, None)
    for num_splits, total_splits in [(2, None), (most + 1, 4)]:
        with pytest.raises(ValueError, match="longest_first needs a balanced plan"):
            hopper.launch(
                *args, 1.0, None, False, num_splits, total_splits, 16, 4, 2, 256, 64, step,
                longest_first=True,
            )  # fmt: skip


MERGE_CASES = [
    # 16-row programs: sequences in 0, 1, 2, 3 and 4 chunks (chunks of >= 256 tokens).
    dict(heads=16, s_q=1, page_size=64, lengths=[0, 1, 300, 700, 2000], num_splits=4),
    # 64-row programs (rows on M), causal S_q = 2 over page size 1 (gathered).
    dict(heads=128, s_q=2, page_size=1, lengths=[130, 0, 900], num_splits=4, causal=True),
    # 43 heads x S_q 3 = 129 rows: three 64-row programs per sequence, the last with one row.
    dict(heads=43, s_q=3, page_size=16, lengths=[3, 600, 1500], num_splits=3, causal=True),
    # Balanced chunks across a ragged batch (total_splits).
    dict(heads=16, s_q=1, page_size=64, lengths=[1000, 0, 300, 64, 130], num_splits=3,
         total_splits=4),
    # 32-row programs, two chunks at most.
    dict(heads=32, s_q=1, page_size=128, lengths=[257, 4097], num_splits=2),
]  # fmt: skip


@requires_hopper
@pytest.mark.parametrize("float8", [False, True])
@pytest.mark.parametrize("kw", MERGE_CASES, ids=lambda kw: f"h{kw['heads']}xs{kw['s_q']}")
def test_attention_merges_in_the_kernel(kernels, monkeypatch, kw: dict, float8: bool) -> None:
    """``mla::attention`` with at most ``DecodeOptions.merge_max_splits`` splits (raised to 4
    here, so that sequences in up to four chunks are merged): the wgmma kernel writes the output
    itself (no
    combine kernel) into a NaN-poisoned allocation, matching the float64 reference; sequences in
    one chunk (or none) bit-equal to decode + combine, the others within rounding of it; the same
    bits on a second call."""
    options = planner.DecodeOptions(merge_max_splits=4)
    if float8:
        case = _fp8_pair_case(61, torch.bfloat16, dims=(512, 64), **kw)
    else:
        case = make_case(61, dtype=torch.bfloat16, device="cuda", dims=(512, 64), **kw)
    out, lse = runtime.attention(*case.op_args(), options=options)
    assert runtime.LAST_LAUNCH["merge"].startswith("decode kernel"), runtime.LAST_LAUNCH["merge"]
    assert runtime.LAST_LAUNCH["decode_path"] == "wgmma"
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = case.reference()
    assert_fp8_matches(kernels, out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())
    out_p, lse_p = runtime.decode(*case.op_args())
    out_c, lse_c = runtime.combine(out_p, lse_p, torch.bfloat16)
    chunks = (~torch.isneginf(lse_p)).any(dim=(1, 2)).sum(dim=-1)  # [B] chunks per sequence
    assert (chunks > 1).any(), "the case must exercise the merge"
    whole = chunks <= 1
    assert torch.equal(out[whole], out_c[whole]) and torch.equal(lse[whole], lse_c[whole])
    torch.testing.assert_close(out, out_c, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_c, atol=1e-5, rtol=1e-5)
    again = runtime.attention(*case.op_args(), options=options)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@requires_hopper
@pytest.mark.parametrize("page_size", [64, 1])
def test_attention_bad_page_poisons_only_its_sequence(kernels, page_size: int) -> None:
    """A page id past the cache in a sequence of one chunk and in one of two chunks: their rows
    are NaN in the merged output, the other sequences are untouched."""
    case = make_case(
        62, dtype=torch.bfloat16, device="cuda", page_size=page_size, dims=(512, 64), heads=16,
        s_q=1, lengths=[200, 700, 500, 0], num_splits=tiling.MERGE_MAX_SPLITS,
    )  # fmt: skip
    ref_out, ref_lse = case.reference()
    case.block_table[0, 130 // page_size] = case.kv_c.shape[0] + 1
    case.block_table[1, 600 // page_size] = case.kv_c.shape[0] + 5
    out, lse = runtime.attention(*case.op_args())
    assert runtime.LAST_LAUNCH["merge"].startswith("decode kernel")
    assert torch.isnan(out[:2]).all() and torch.isnan(lse[:2]).all()
    assert not torch.isnan(out[2:]).any()
    assert_matches(out[2:], lse[2:], ref_out[2:], ref_lse[2:], torch.bfloat16, case.describe())


@requires_hopper
def test_attention_over_merge_max_splits_uses_the_combine(kernels) -> None:
    """More splits than ``tiling.MERGE_MAX_SPLITS``: decode partials and the combine kernel, and
    ``LAST_LAUNCH["merge"]`` says why."""
    case = make_case(
        63, dtype=torch.bfloat16, device="cuda", page_size=64, dims=(512, 64), heads=16, s_q=1,
        lengths=[3000, 5], num_splits=tiling.MERGE_MAX_SPLITS + 1,
    )  # fmt: skip
    out, lse = runtime.attention(*case.op_args())
    most = tiling.MERGE_MAX_SPLITS
    assert runtime.LAST_LAUNCH["merge"].startswith(f"mla::combine: num_splits={most + 1} > {most}")
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, case.describe())


@requires_hopper
def test_merged_attention_in_a_cuda_graph_matches_eager() -> None:
    """``mla_decode`` with a merging plan captured in a CUDA graph (its arrival counters zeroed by
    a memset in the graph): replays on new inputs equal eager calls bit for bit."""
    from mla_compile import mla_ops

    case = make_case(
        64, dtype=torch.bfloat16, device="cuda", page_size=64, dims=(512, 64), heads=128, s_q=1,
        lengths=[3000, 1, 700, 0],
    )  # fmt: skip
    q, kv_c, k_pe = case.q.clone(), case.kv_c.clone(), case.k_pe.clone()

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return mla_ops.mla_decode(
            q, (kv_c, k_pe), case.cache_seqlens, block_table=case.block_table, head_dim_v=512,
            softmax_scale=0.1, num_splits=2,
        )  # fmt: skip

    call()  # compile outside the capture
    assert runtime.LAST_LAUNCH["merge"].startswith("decode kernel")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph, lse_graph = call()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        kv_c.copy_(torch.randn(kv_c.shape, generator=gen, device="cuda"))
        graph.replay()
        out, lse = call()
        assert torch.equal(out_graph, out) and torch.equal(lse_graph, lse), seed


def test_rows_on_m_default() -> None:
    """The rows go on the MMA's M side exactly for 64-row programs of two warpgroups over a 16-bit
    cache (a float8 cache keeps the transposed loop and its single conversion per tile)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

    assert tiling.default_rows_on_m(64, 8, float8=False)
    assert not tiling.default_rows_on_m(64, 8, float8=True)
    assert not tiling.default_rows_on_m(32, 8, float8=False)
    assert not tiling.default_rows_on_m(16, 4, float8=False)


def test_one_scorer_default() -> None:
    """One-scorer programs exactly for 64 rows over a 16-bit cache whose tiles arrive by TMA:
    gathered tiles keep the rows-on-M loop, a float8 cache the transposed one, fewer rows their
    own tiling."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

    assert tiling.default_one_scorer(64, float8=False, gather=False)
    assert not tiling.default_one_scorer(64, float8=False, gather=True)
    assert not tiling.default_one_scorer(64, float8=True, gather=False)
    assert not tiling.default_one_scorer(32, float8=False, gather=False)
    assert not tiling.default_one_scorer(16, float8=False, gather=False)


@requires_hopper
def test_config_can_turn_wgmma_off(kernels) -> None:
    case = make_case(
        5, dtype=torch.bfloat16, device="cuda", page_size=64, dims=(512, 64), heads=16, s_q=1
    )
    config = tiling.triton_tiling(16, 512)
    runtime.decode(
        *case.op_args(), options=planner.DecodeOptions(triton_tiling=config, use_wgmma=False)
    )
    assert runtime.LAST_LAUNCH["decode_path"] in ("tma", "gather")


@requires_hopper
def test_fp8_in_f16_off_runs_the_triton_kernel(kernels) -> None:
    """``DecodeConfig(fp8_in_f16=False)`` asks for bf16 dots, which the wgmma kernel does not do:
    the Triton kernel runs, and ``use_wgmma=True`` with it is an error that says why."""
    case = _fp8_pair_case(851, torch.bfloat16, page_size=64, dims=(512, 64), heads=16, s_q=1)
    config = replace(tiling.triton_tiling(16, 512, float8_cache=True), fp8_in_f16=False)
    runtime.decode(*case.op_args(), options=planner.DecodeOptions(triton_tiling=config))
    assert runtime.LAST_LAUNCH["decode_path"] in ("tma", "gather")
    with pytest.raises(ValueError, match="fp8_in_f16=False"):
        runtime.decode(
            *case.op_args(), options=planner.DecodeOptions(triton_tiling=config, use_wgmma=True)
        )


def _meta_call(
    dtype=torch.bfloat16, heads=16, s_q=1, page=64, widths=(512, 64), cache=None, pe_cache=None
):  # fmt: skip
    q = torch.empty(2, s_q, heads, sum(widths), dtype=dtype, device="meta")
    kv_c = torch.empty(10, page, widths[0], dtype=cache or dtype, device="meta")
    k_pe = torch.empty(10, page, widths[1], dtype=pe_cache or dtype, device="meta")
    table = torch.empty(2, 5, dtype=torch.int32, device="meta")
    return q, kv_c, k_pe, table


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        (dict(dtype=torch.float32), "takes bf16/fp16"),
        (dict(cache=FP8), None),
        (dict(cache=FP8, heads=128), None),
        (dict(cache=FP8, pe_cache=FP8), None),
        (dict(cache=FP8, pe_cache=FP8, widths=(512, 32)), "k_pe width 32"),
        (dict(pe_cache=FP8), "neither q's (torch.bfloat16) nor a float8_e4m3fn kv_c"),
        (dict(cache=FP8, pe_cache=FP8, heads=128), None),
        (dict(cache=FP8, pe_cache=FP8, heads=8, s_q=4), None),
        (dict(cache=FP8, pe_cache=FP8, widths=(256, 64)), None),
        (dict(cache=FP8, pe_cache=FP8, widths=(512, 16)), "k_pe width 16"),
        (dict(cache=torch.float16), "neither q's"),
        (dict(heads=128), None),
        (dict(heads=8, s_q=3), None),
        (dict(page=1), None),
        (dict(page=3, cache=FP8, heads=128), None),
        (dict(widths=(512, 48)), "k_pe width 48 is not a power of two"),
        (dict(widths=(32, 16)), "kv_c width 32 is not a power of two in [64, 512]"),
        (dict(widths=(1024, 64)), "kv_c width 1024 is not a power of two in [64, 512]"),
        (dict(widths=(512, 128)), "k_pe width 128 is not a power of two in [16, 64]"),
    ],
)
def test_plan_path_says_why(monkeypatch, change, reason) -> None:

    monkeypatch.setattr(device_facts, "has_wgmma", lambda device: True)
    q, kv_c, k_pe, table = _meta_call(**change)
    ok, why = tiling.wgmma_support(q, kv_c, k_pe, table, None)
    assert ok == (reason is None), why
    if reason is not None:
        assert reason in why
    if reason is None:
        ok, why = tiling.wgmma_support(q, kv_c, k_pe, None, None)
        assert not ok and "not paged" in why
        # An attn_mask is read by the transposed and one-scorer loops.
        mask = torch.empty(2, 1, 320, device="meta")
        ok, why = tiling.wgmma_support(q, kv_c, k_pe, table, mask)
        assert ok and why.endswith("a torch.float32 attn_mask"), why


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
def test_plan_path_checks_shared_memory(monkeypatch) -> None:
    """64-row programs need about 226 KB: a GPU that allows less runs the Triton kernel."""

    monkeypatch.setattr(device_facts, "has_wgmma", lambda device: True)
    monkeypatch.setattr(device_facts, "shared_memory_optin", lambda device: 200_000)
    ok, why = tiling.wgmma_support(*_meta_call(heads=128), None)
    assert not ok and "64-row programs need 231424 bytes of shared memory" in why, why
    assert tiling.wgmma_support(*_meta_call(heads=16), None)[0]


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
def test_loads_say_how_and_why(monkeypatch) -> None:
    """Pages of whole 64-token tiles go to the copy engine; other page sizes are gathered by
    cp.async when their rows are contiguous 16-byte units; otherwise neither, with the reasons."""

    monkeypatch.setattr(device_facts, "has_copy_engine", lambda device: True)
    table = torch.zeros(2, 4, dtype=torch.int32)

    def loads(page: int, row: int = 576, dtype=torch.bfloat16):
        cache = torch.zeros(8, page, row, dtype=dtype)
        return tiling.wgmma_loads(cache[..., :512], cache[..., 512:576], table)

    assert loads(64)[0] == "tma"
    assert loads(1)[0] == "gather" and "page_size 1 is not a multiple" in loads(1)[1]
    assert loads(48, row=584)[0] == "gather"  # 1168-byte rows: 16-byte units
    how, why = loads(16, row=580)  # 1160-byte rows
    assert how is None and "kv_c rows are not contiguous 16-byte units" in why, why
    assert loads(3, dtype=torch.float8_e4m3fn)[0] == "gather"


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
def test_float8_k_pe_takes_the_wgmma_kernel_at_width_64(monkeypatch) -> None:
    """A whole-float8 cache takes the wgmma kernel in whole 64-token pages (copy-engine tiles) and
    gathered row by row (page size 1) alike; at a RoPE width of 32 it does
    not, and ``wgmma_path`` says why."""

    monkeypatch.setattr(device_facts, "has_wgmma", lambda device: True)
    monkeypatch.setattr(device_facts, "has_copy_engine", lambda device: True)
    table = torch.zeros(2, 4, dtype=torch.int32)
    for rope, page, how in ((64, 64, "tma"), (64, 1, "gather"), (32, 64, None)):
        q = torch.zeros(2, 1, 16, 512 + rope, dtype=torch.bfloat16)
        cache = torch.zeros(8, page, 512 + rope, dtype=FP8)
        loads, why = tiling.wgmma_path(q, cache[..., :512], cache[..., 512:], table, None)
        assert loads == how, why
    assert "k_pe is read by the wgmma kernel at a width of 64; got k_pe width 32" in why, why
    assert tiling.wgmma_loads(*[torch.zeros(8, 1, 64)] * 2, None)[0] is None


def test_no_wgmma_off_hopper() -> None:

    assert not device_facts.has_wgmma(torch.device("cpu"))


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize(
    ("rows", "stages", "kv_dtype", "page_size", "rows_on_m", "merge", "pe_dtype"),
    [(16, 2, None, 64, None, False, None), (64, 2, None, 64, None, False, None),
     (64, 2, None, 64, False, False, None), (64, 2, None, 1, None, False, None),
     (16, 2, "fp8e4nv", 64, None, False, None), (32, 3, "fp8e4nv", 64, None, False, None),
     (16, 2, None, 1, None, False, None),
     (64, 2, "fp8e4nv", 16, None, False, None), (16, 2, None, 64, None, True, None),
     (64, 2, None, 64, None, True, None),
     # The whole row in float8, converted.
     (64, 2, "fp8e4nv", 64, None, False, "fp8e4nv"), (32, 3, "fp8e4nv", 64, None, False, "fp8e4nv"),
     (64, 2, "fp8e4nv", 16, None, False, "fp8e4nv"), (16, 2, "fp8e4nv", 1, None, False, "fp8e4nv")],
)  # fmt: skip
def test_compiles_to_wgmma_for_sm90(
    rows: int,
    stages: int,
    kv_dtype: str | None,
    page_size: int,
    rows_on_m: bool | None,
    merge: bool,
    pe_dtype: str | None,
) -> None:
    """The installed Triton compiles the kernel for sm_90 (no GPU needed): wgmma and TMA copies
    (16-byte cp.async for page sizes the copy engine cannot take) in the PTX, no mma.sync, at most a
    few spilled scalars, and shared memory within ``wgmma_shared_memory``'s bound and one SM; 64
    rows with the query rows on either MMA side. Over a float8 cache, the ring slots
    ``wgmma_stages`` picks (two at 16 rows, three at 32), and, where it is not multiplied in float8,
    the conversion by ``cvt.rn.f16x2.e4m3x2`` in two branches (with and without the stale-row
    select), a float8 k_pe's too. Merging (``mla::attention``): exactly one release-acquire arrival,
    partials read past L1. One ``griddepcontrol.launch_dependents``, after the loop's last product
    (the combine launched at the programs' entries made the benchmark's calls that run it 0.5-1.2
    us slower on an H200)."""

    block_m, warps = tiling.wgmma_tiling(rows)
    gather = page_size % 64 != 0
    res = offline_compile(
        f"k = oc.compile_wgmma({block_m}, {stages}, warps={warps}, kv_dtype={kv_dtype!r}, "
        f"page_size={page_size}, gather={gather}, rows_on_m={rows_on_m}, merge={merge}, "
        f"pe_dtype={pe_dtype!r}); "
        "r = oc.resources(k); ptx = k.asm['ptx']; "
        "r['cvt_e4m3'] = ptx.count('cvt.rn.f16x2.e4m3x2'); r['m64n256'] = ptx.count('m64n256k16'); "
        "r['arrive'] = ptx.count('atom.global.gpu.acq_rel.add'); "
        "r['cg'] = ptx.count('ld.global.cg'); " + TRIGGER_AFTER_LOOP + "print(r)"
    )
    assert res["wgmma"] > 0 and res["mma.sync"] == 0, res
    assert res["trigger"] == [1, True, True], res
    if gather:  # every row copy 16 bytes wide
        assert res["tma"] == 0 and res["cp.async"] > 0, res
        assert res["cp.async_16B"] == res["cp.async"], res
    else:
        assert res["tma"] > 0 and res["cp.async"] == 0, res
    # Triton 3.6 (the GPU machine) spills nothing; Triton 3.9 puts 72 bytes per thread on the
    # stack at 16 rows (cuobjdump's STACK, which the old LOCAL-only check missed). Less than the
    # O^T accumulator (256 bytes per thread at 16 rows), which must stay in registers.
    assert res["spill_bytes"] < 256, res
    assert res["shared_bytes"] <= 232448, res
    float8 = kv_dtype is not None
    bound = tiling.wgmma_shared_memory(block_m, 512, 64, stages, float8)
    assert res["shared_bytes"] <= bound, res
    # 16-row programs of width 512 multiply a float8 tile in float8: nothing converted.
    products = tiling.default_float8_products(block_m, 512, float8, gather)
    assert (res["cvt_e4m3"] > 0) == (float8 and not products), res
    # Rows on M (64 rows, 16-bit cache, unless turned off): P.V is one m64n256k16 chain per
    # warpgroup; the transposed loop's P.V has N = BLOCK_M.
    on_m = rows == 64 and not float8 and rows_on_m is not False
    assert (res["m64n256"] > 0) == on_m, res
    if float8:
        assert tiling.wgmma_stages(block_m, 512, 64, True, 232448) == stages
    if float8 and not products:
        # The tile converted in two branches: a split's last tile zeroes its
        # stale rows with a select, every other tile converts without one (a select shared by
        # both would unpack every converted pair). Each branch converts the 64 x 512 tile (and
        # a float8 k_pe's 64 x 64) two values per cvt, spread over all the math threads.
        width = 512 + (64 if pe_dtype else 0)
        assert res["cvt_e4m3"] == 2 * 64 * width // 2 // (warps * 32), res
    assert res["arrive"] == int(merge) and (res["cg"] > 0) == merge, res


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize(
    ("rows", "warps", "kv_dtype", "page_size", "mask", "one_scorer", "s_q"),
    [(16, 4, None, 64, "bf16", False, 1), (16, 4, None, 1, "bool", False, 1),
     (16, 4, "fp8e4nv", 64, "bf16", False, 1), (64, 8, None, 1, "bool", False, 1),
     (32, 8, None, 64, "bf16", False, 2), (64, 4, None, 64, "bf16", True, 1),
     (64, 4, None, 64, "bool", True, 1), (64, 4, None, 64, "bf16", True, 2)],
)  # fmt: skip
def test_masked_builds_compile(
    rows: int, warps: int, kv_dtype, page_size: int, mask: str, one_scorer: bool, s_q: int
) -> None:
    """With an attention mask the transposed and one-scorer loops compile
    for sm_90 in the tilings the op gives masked calls (a gathered 64-row program takes the
    transposed loop instead of the rows-on-M one; the one-scorer loop adds the mask terms
    warpgroup 1 prepares at S_q = 1, reads a row per query position otherwise): wgmma, no
    mma.sync, at most a few spilled
    scalars, shared memory within an SM and within ``wgmma_shared_memory``'s bound."""

    gather = page_size % 64 != 0
    res = offline_compile(
        f"k = oc.compile_wgmma({rows}, 2, warps={warps}, kv_dtype={kv_dtype!r}, "
        f"page_size={page_size}, gather={gather}, rows_on_m=False, mask={mask!r}, "
        f"one_scorer={one_scorer}, s_q={s_q}); print(oc.resources(k))"
    )
    assert res["wgmma"] > 0 and res["mma.sync"] == 0, res
    assert res["spill_bytes"] < 256, res
    bound = tiling.wgmma_shared_memory(rows, 512, 64, 2, kv_dtype is not None)
    assert res["shared_bytes"] <= min(bound, 232448), res


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize("merge", [False, True])
def test_float8_products_compile_to_float8_wgmma(merge: bool) -> None:
    """A 16-row float8 program of width 512 multiplies in float8: 16
    ``m64n32k32`` e4m3 products for the nope scores (both query terms, K = 512) and 16
    ``m64n16k32`` for P.V (8 row blocks of 512, K = 64), the RoPE scores in 16 bits; nothing
    converted to fp16; ``V^T`` read from the ring slot as 16-bit pairs by 16 ``ldmatrix.trans``
    (x4) a thread and tile, then one byte permute per operand register (64);
    P.V left in flight (no ``wgmma.wait_group`` between its last product and the loop's branch);
    no spill; no fp16 staging tile (64 KB less shared memory than the same build with
    ``float8_products=False``, which keeps its conversions)."""
    products, staged = offline_compile(
        "import re; r = []\n"
        "for fp in (True, False):\n"
        f"    k = oc.compile_wgmma(16, 2, kv_dtype='fp8e4nv', merge={merge}, float8_products=fp)\n"
        "    ptx = k.asm['ptx']; x = oc.resources(k)\n"
        "    x['n32'] = len(re.findall(r'm64n32k32\\.f32\\.e4m3\\.e4m3', ptx))\n"
        "    x['n16'] = len(re.findall(r'm64n16k32\\.f32\\.e4m3\\.e4m3', ptx))\n"
        "    x['cvt'] = ptx.count('cvt.rn.f16x2.e4m3x2'); x['prmt'] = ptx.count('prmt.b32')\n"
        "    x['ldsm'] = len(re.findall(r'ldmatrix\\.sync\\.aligned\\.m8n8\\.x4\\.trans', ptx))\n"
        "    pv = [m.end() for m in re.finditer(r'm64n16k32\\.f32\\.e4m3', ptx)]\n"
        "    after = ptx[pv[-1]:] if pv else ''\n"
        "    x['pv_in_flight'] = 'bra' in after[: after.find('wgmma.wait_group')]\n"
        "    r.append(x)\n"
        "print(r)"
    )
    assert products["n32"] == 16 and products["n16"] == 16, products
    assert products["wgmma"] == 36 and products["cvt"] == 0, products
    assert products["ldsm"] == 16 and products["prmt"] == 64, products
    assert products["pv_in_flight"], products
    assert products["spill_bytes"] == 0, products
    assert staged["n32"] == staged["n16"] == 0 and staged["cvt"] > 0, staged
    assert staged["shared_bytes"] - products["shared_bytes"] >= 64 * 512 * 2, (products, staged)


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
def test_float8_k_pe_compiles_to_float8_rope_scores() -> None:
    """With ``k_pe`` in float8 too the RoPE scores are two more ``m64n32k32``
    e4m3 products (K = 64) into the nope scores' accumulator, and no 16-bit wgmma is left; no
    spill, and a ring slot 4 KB smaller (64 x 64 bytes of k_pe instead of 128)."""
    whole, pair = offline_compile(
        "import re; r = []\n"
        "for pe in ('fp8e4nv', None):\n"
        "    k = oc.compile_wgmma(16, 2, kv_dtype='fp8e4nv', pe_dtype=pe)\n"
        "    ptx = k.asm['ptx']; x = oc.resources(k)\n"
        "    x['n32'] = len(re.findall(r'm64n32k32\\.f32\\.e4m3\\.e4m3', ptx))\n"
        "    x['n16'] = len(re.findall(r'm64n16k32\\.f32\\.e4m3\\.e4m3', ptx))\n"
        "    x['bf16'] = len(re.findall(r'k16\\.f32\\.bf16\\.bf16', ptx))\n"
        "    r.append(x)\n"
        "print(r)"
    )
    assert whole["n32"] == 18 and whole["n16"] == 16 and whole["bf16"] == 0, whole
    assert whole["wgmma"] == 34 and whole["spill_bytes"] == 0, whole
    assert pair["bf16"] == 4, pair
    assert pair["shared_bytes"] - whole["shared_bytes"] >= 2 * 64 * 64, (whole, pair)


def test_float8_products_choice_and_its_checks() -> None:
    """``default_float8_products``: float8 16-row programs of width 512 over copy-engine tiles
    only; ``launch(float8_products=True)`` elsewhere is refused, naming what it expected."""
    if not _gluon_available():
        pytest.skip("Triton without Gluon's Hopper module")

    assert tiling.default_float8_products(16, 512, True, False)
    assert not tiling.default_float8_products(16, 512, False, False)  # 16-bit cache
    assert not tiling.default_float8_products(32, 512, True, False)  # two warpgroups
    assert not tiling.default_float8_products(16, 256, True, False)  # another width
    assert not tiling.default_float8_products(16, 512, True, True)  # gathered tiles
    case = make_case(5, dtype=torch.bfloat16, page_size=64, dims=(256, 64), heads=16, s_q=1,
                     pair=True, lengths=[64])  # fmt: skip
    kv_c = case.kv_c.to(FP8)
    out = torch.empty(1, 1, 16, 1, 256)
    lse = torch.empty(1, 1, 16, 1)
    with pytest.raises(ValueError, match="float8_products: expected a float8_e4m3fn kv_c of width"):
        hopper.launch(
            case.q, kv_c, case.k_pe, case.cache_seqlens, case.block_table, out, lse, 0.1, 1.0,
            False, 1, None, block_m=16, num_warps=4, num_stages=2, min_chunk=256, granule=64,
            lengths_per_step=128, float8_products=True,
        )  # fmt: skip
    # A float8 k_pe is read with a float8 kv_c only (multiplied in float8 or converted).
    case = make_case(5, dtype=torch.bfloat16, page_size=64, dims=(512, 64), heads=16, s_q=1,
                     pair=True, lengths=[64])  # fmt: skip
    out = torch.empty(1, 1, 16, 1, 512)
    with pytest.raises(ValueError, match="a float8_e4m3fn k_pe is read with a float8_e4m3fn kv_c"):
        hopper.launch(
            case.q, case.kv_c, case.k_pe.to(FP8), case.cache_seqlens, case.block_table, out,
            lse, 0.1, 1.0, False, 1, None, block_m=16, num_warps=4, num_stages=2,
            min_chunk=256, granule=64, lengths_per_step=128, float8_products=False,
        )  # fmt: skip


def test_query_in_registers_choice_and_its_checks() -> None:
    """``default_query_in_registers``: one-scorer programs over DeepSeek's row (L = 512, R = 64)
    without a mask only; ``launch(query_in_registers=True)`` elsewhere is refused, naming what it
    expected; ``DecodeOptions(query_in_registers=False)`` turns the choice off."""
    if not _gluon_available():
        pytest.skip("Triton without Gluon's Hopper module")

    choice = tiling.default_query_in_registers
    assert choice(True, 512, 64, False)
    assert not choice(False, 512, 64, False)  # not a one-scorer program
    assert not choice(True, 256, 64, False)  # the 64 + 448 column split is L = 512's
    assert not choice(True, 512, 32, False)  # P fits a k_pe slot of 64 columns only
    assert not choice(True, 512, 64, True)  # masked calls keep the two-slot loop
    assert not choice(True, 512, 64, False, allowed=False)
    case = make_case(5, dtype=torch.bfloat16, page_size=64, dims=(256, 64), heads=64, s_q=1,
                     pair=True, lengths=[64])  # fmt: skip
    out = torch.empty(1, 1, 64, 1, 256)
    lse = torch.empty(1, 1, 64, 1)
    with pytest.raises(ValueError, match="query_in_registers: expected one_scorer over a kv_c"):
        hopper.launch(
            case.q, case.kv_c, case.k_pe, case.cache_seqlens, case.block_table, out, lse, 0.1,
            None, False, 1, None, block_m=64, num_warps=4, num_stages=2, min_chunk=256,
            granule=64, lengths_per_step=128, one_scorer=True, query_in_registers=True,
        )  # fmt: skip


def test_float8_products_view_of_the_ring_slot() -> None:
    """``_VT_OFFSET_BASES`` reads a copy-engine float8 slot (``[64, 512]``, 128-byte swizzle: four
    ``[64, 128-byte]`` slabs, each row's 16-byte units XOR its low 3 bits) as 16-bit pairs
    ``[256 (mp), 64 (k)]``: every 2-byte offset maps to token ``k`` and a pair ``mp = 32 b + 8 w
    + g`` whose bytes ``h = 0, 1`` are rows ``m = 64 b + 16 w + 8 h + g`` of ``V^T``, each row's
    latent column (``_latent_column``, the output's permutation) that byte's column; every row
    and column once."""
    if not _gluon_available():
        pytest.skip("Triton without Gluon's Hopper module")
    from mla_compile.mla_ops.hopper import float8 as hopper_float8
    from mla_compile.mla_ops.hopper import layouts as hopper_layouts

    bases = hopper_layouts._VT_OFFSET_BASES.value
    column_of = hopper_float8._latent_column.fn
    seen = set()
    for pair_offset in range(64 * 256):
        mp = k = 0
        for bit, (bm, bk) in enumerate(bases):
            if pair_offset >> bit & 1:
                mp, k = mp ^ bm, k ^ bk
        for h in (0, 1):
            offset = 2 * pair_offset + h
            slab, rest = divmod(offset, 64 * 128)
            token, within = divmod(rest, 128)
            unit = (within >> 4) ^ (token & 7)
            column = slab * 128 + unit * 16 + (within & 15)
            m = 64 * (mp >> 5) + 16 * ((mp >> 3) & 3) + 8 * h + (mp & 7)
            assert k == token and column_of(m) == column, (offset, m, k, token, column)
            seen.add((m, k))
    assert len(seen) == 64 * 512
    assert sorted(column_of(m) for m in range(512)) == list(range(512))


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
def test_rows_on_m_loads_the_query_before_the_first_copies() -> None:
    """A 64-row program with the rows on M issues its query's loads (18 16-byte loads per
    thread: 64 x 576 bf16 over 256 threads) before the ring's first copies, so that they do not
    queue behind every program's first tiles."""
    res = offline_compile(
        "import re; k = oc.compile_wgmma(64, 2, warps=8); ptx = k.asm['ptx']; "
        "first_copy = ptx.index('cp.async.bulk.tensor'); "
        "loads = [m.start() for m in re.finditer(r'ld\\.global\\.v4', ptx)]; "
        "print([len(loads), sum(i < first_copy for i in loads)])"
    )
    assert res[0] >= 18 and res[1] == 18, res


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize("merge", [False, True])
def test_one_scorer_compiles_to_one_warpgroup_scores(merge: bool) -> None:
    """``one_scorer``: the scores are 36 ``m64n64k16`` (one warpgroup, the whole tile: 32 for
    the nope part, 4 for RoPE) and P.V two chains of 4 ``m64n256k16`` (one per warpgroup), within
    one SM's shared memory and ``wgmma_shared_memory``'s bound for the ring of two. Without the
    merge or with it, less spill than the output half a thread holds (512 bytes; none under
    Triton 3.6). The merge reads the partials in 16-byte loads, 4 rows of 4 columns a thread, in
    a rolled loop (before it held 16 rows, unrolled, and spilled 1,912 bytes under
    Triton 3.6). Each warpgroup stores its float32 half from its accumulator, 8 bytes a store
    (no hand-over through shared memory, no 16-byte stores from one warpgroup); only
    final 16-bit rows, staged, go out 16 bytes a store."""

    res = offline_compile(
        f"k = oc.compile_wgmma(64, 2, warps=4, one_scorer=True, merge={merge}); "
        "r = oc.resources(k); ptx = k.asm['ptx']; "
        "r['m64n64'] = ptx.count('m64n64k16'); r['m64n256'] = ptx.count('m64n256k16'); "
        "r['cg_v4'] = ptx.count('ld.global.cg.v4'); r['cg'] = ptx.count('ld.global.cg'); "
        "r['st_v2'] = ptx.count('st.global.v2.b32'); r['st_v4'] = ptx.count('st.global.v4.b32'); "
        "print(r)"
    )
    assert res["m64n64"] == 36 and res["m64n256"] == 8 and res["mma.sync"] == 0, res
    assert res["shared_bytes"] <= 232448, res
    assert res["shared_bytes"] <= tiling.wgmma_shared_memory(64, 512, 64, 2, False), res
    assert res["spill_bytes"] < 256, res
    # The merge's partial reads (every ld.global.cg but the lse's) are 16 bytes wide, in a rolled
    # loop over the column blocks: the first block and the loop's next one, 4 splits each
    # (unrolled, 256 loads in the code stalled the merge on instruction fetch).
    assert (res["cg_v4"] > 0) == merge and res["cg"] - res["cg_v4"] <= (16 if merge else 0), res
    assert res["cg_v4"] <= 64, res
    # 2 warpgroups x 64 rows x 256 columns of float32, 2 values a store: 128 stores in the code.
    assert res["st_v2"] >= 128 and (res["st_v4"] > 0) == merge, res


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize("merge", [False, True])
def test_query_in_registers_compiles_to_unserialised_products(merge: bool) -> None:
    """``query_in_registers``: the nope scores are 32 ``m64n64k16`` with the
    query as the A operand in registers (plus 4 for RoPE from shared memory); P.V is warpgroup
    0's 64 columns (4 ``m64n64k16``) and warpgroup 1's 448 (4 each of ``m64n256k16``,
    ``m64n128k16``, ``m64n64k16``). A ring of three 72 KB slots fits one SM's shared memory only
    without the query there. ptxas keeps the products in flight: a handful of ``WARPGROUP.DEPBAR``
    waits in the whole kernel, as the two-slot one-scorer build has, where a build short of
    registers (three warpgroups of 168) had one after each of its 52 products and spilled the
    query. The combine's launch trigger comes after the last product, as in the other loops."""
    res = offline_compile(
        f"k = oc.compile_wgmma(64, 3, warps=4, one_scorer=True, query_in_registers=True, "
        f"merge={merge}); r = oc.resources(k); ptx = k.asm['ptx']; import re; "
        "r['rs'] = len(re.findall(r'm64n64k16\\.f32\\.bf16\\.bf16\\s+\\{[^}]*\\},\\s*\\{', ptx)); "
        "r['m64n64'] = ptx.count('m64n64k16'); r['m64n128'] = ptx.count('m64n128k16'); "
        "r['m64n256'] = ptx.count('m64n256k16'); " + TRIGGER_AFTER_LOOP + "print(r)"
    )
    assert res["rs"] == 32 and res["m64n64"] == 44, res
    assert res["trigger"] == [1, True, True], res
    assert res["m64n128"] == 4 and res["m64n256"] == 4 and res["mma.sync"] == 0, res
    assert res["hgmma"] == 52 and res["wgmma_waits"] <= 8, res
    assert res["shared_bytes"] <= 232448, res
    assert res["spill_bytes"] < 256, res


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
def test_fp8_conversion_has_no_bank_conflicts() -> None:
    """The float8 tile's conversion layout reads its float8 bytes and writes their fp16 values
    without a bank-conflict replay, for 4 and 8 warps and every kv_c width the kernel takes
    (Triton's own count from the layouts). The same count sees the 16-bit
    ``io`` layout's loads replay two-way on a float8 tile's 128-byte rows (ncu: 2.1 of 4.6
    million load wavefronts on (h16_b128_4k_fp8)), so the check can fail."""
    widths = (64, 128, 256, 512)
    res = offline_compile(
        f"print([oc.conversion_bank_conflicts(w, L) for w in (4, 8) for L in {widths}])"
    )
    for (warps, kv_len), counts in zip([(w, L) for w in (4, 8) for L in widths], res, strict=True):
        assert counts["conv_load"] == 0 and counts["conv_store"] == 0, (warps, kv_len, counts)
        assert counts["io_load"] == (kv_len >= 128), (warps, kv_len, counts)


@pytest.mark.skipif(not _gluon_available(), reason="Triton without Gluon's Hopper module")
@pytest.mark.parametrize(("stages", "kv_dtype"), [(2, None), (3, "fp8e4nv")])
def test_longest_first_compiles_and_keeps_its_registers(stages: int, kv_dtype: str | None) -> None:
    """The 16-row kernel of a balanced plan, built longest first: the ranking's shared memory
    adds nothing to the kernel's, and it spills at most 8 scalars more than the split-major build
    (Triton 3.6: none either way; Triton 3.9 over a float8 cache: 24 and 56 bytes)."""
    split_major, longest = offline_compile(
        f"print([oc.resources(oc.compile_wgmma(16, {stages}, kv_dtype={kv_dtype!r}, "
        "balanced=True, longest_first=lf)) for lf in (False, True)])"
    )
    assert longest["wgmma"] == split_major["wgmma"] > 0, (split_major, longest)
    assert longest["shared_bytes"] == split_major["shared_bytes"], (split_major, longest)
    assert longest["spill_bytes"] <= split_major["spill_bytes"] + 32, (split_major, longest)


def test_merge_path_says_why() -> None:
    """Which ``mla::attention`` calls merge splits inside the wgmma kernel, and why not."""

    most = tiling.MERGE_MAX_SPLITS
    assert tiling.merge_path("tma", 1)[0] and tiling.merge_path("gather", most)[0]
    ok, why = tiling.merge_path("tma", most + 1)
    assert not ok and f"num_splits={most + 1} > {most}" in why
    ok, why = tiling.merge_path(None, 1)
    assert not ok and "Triton decode kernel" in why


@pytest.mark.parametrize(
    ("heads", "page_size", "cache_dtype", "mask", "loop"),
    [
        (128, 64, None, None, "one-scorer"),  # DeepSeek's row: the query in registers
        (128, 64, None, "bool", "one-scorer"),  # masked: the two-slot one-scorer loop
        (128, 16, None, None, "rows-on-m"),  # gathered tiles
        (128, 16, None, "bool", "transposed"),  # gathered and masked
        (16, 64, None, None, "transposed"),
        (16, 64, torch.float8_e4m3fn, None, "transposed"),  # float8 products
        (32, 1, torch.float8_e4m3fn, None, "transposed"),  # float8, gathered, ring of three
    ],
)  # fmt: skip
def test_every_plan_prepares(monkeypatch, heads, page_size, cache_dtype, mask, loop) -> None:
    """On an emulated Hopper device, each loop the planner can choose is one that
    ``hopper.prepare`` accepts as planned (tiling, ring depth, loop, producer and order): a plan
    never names a configuration the kernel refuses. No GPU needed (nothing is launched)."""
    if not _gluon_available():
        pytest.skip("Triton without Gluon's Hopper module")
    monkeypatch.setattr(device_facts, "has_wgmma", lambda device: True)
    monkeypatch.setattr(device_facts, "has_copy_engine", lambda device: True)
    case = make_case(
        7, dtype=torch.bfloat16, page_size=page_size, dims=(512, 64), heads=heads, s_q=1,
        lengths=[300, 64], num_splits=2, cache_dtype=cache_dtype, mask=mask, pair=True,
        device="cuda" if HAS_CUDA else "cpu",
    )  # fmt: skip
    q, kv_c, k_pe, _, block_table = case.op_args()[:5]
    for merge in (False, True):
        plan = planner.plan_decode(
            q, kv_c, k_pe, block_table, case.attn_mask, causal=True, num_splits=2,
            total_splits=None, merge=merge,
        )  # fmt: skip
        assert plan.kernel == "wgmma" and plan.wgmma.loop == loop, plan.describe()
        out = q.new_empty((*q.shape[:3], 2, kv_c.shape[-1]), dtype=torch.float32)
        lse = q.new_empty((*q.shape[:3], 2), dtype=torch.float32)
        merge_into = None
        if plan.merge_in_kernel:
            merge_into = (q.new_empty((*q.shape[:3], kv_c.shape[-1])),
                          q.new_empty(q.shape[:3], dtype=torch.float32),
                          q.new_zeros(8, dtype=torch.int32))  # fmt: skip
        prepared = hopper.prepare(
            q, kv_c, k_pe, block_table, out, lse, True, 2, None, fill_empty=False,
            merge_into=merge_into, attn_mask=case.attn_mask, **plan.wgmma.prepare_kwargs(),
        )  # fmt: skip
        stages = prepared.kwargs["NUM_STAGES"]
        assert stages == plan.wgmma.num_stages, (stages, plan.describe())
