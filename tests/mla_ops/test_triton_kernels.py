"""The Triton kernels themselves: on CUDA when present, else on CPU through TRITON_INTERPRET=1.

Outputs are allocated poisoned (NaN) to prove that the kernels write every element. The
interpreter gets float32/float16 only: its bf16 tl.dot is unsupported (triton issue #11584).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from mla_compile.mla_ops import device as device_facts
from mla_compile.mla_ops import planner, reference, runtime, splits, tiling, triton_kernels  # noqa: F401
from tests.conftest import HAS_CUDA, triton_available
from tests.mla_ops.cases import (
    TRIGGER_AFTER_LOOP,
    assert_matches,
    make_case,
    offline_compile,
    poison_hidden_keys,
)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


@pytest.fixture
def kernels(kernels, monkeypatch):
    # These tests are about the Triton kernel: on a Hopper GPU the op would otherwise take the
    # Gluon wgmma kernel where it applies (tested in test_wgmma_decode.py).
    monkeypatch.setattr(device_facts, "has_wgmma", lambda device: False)
    return kernels


@pytest.fixture(params=["gather", "tma"])
def path_kernels(request, kernels, monkeypatch):
    """The kernels with KV tiles loaded by per-token address, or by the copy engine (TMA).

    Without a Hopper GPU the TMA path runs in the interpreter, which emulates descriptors.
    """
    if request.param == "tma":
        monkeypatch.setattr(device_facts, "has_copy_engine", lambda device: True)
    else:
        monkeypatch.setattr(device_facts, "has_copy_engine", lambda device: False)
    kernels.expected_path = request.param
    return kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_tma_and_gather_paths(path_kernels, seed: int, dtype: torch.dtype) -> None:
    """Page size 64 and power-of-two widths: the TMA path applies; both must agree with fp64."""
    case = make_case(
        200 + seed,
        dtype=dtype,
        device=DEVICE,
        page_size=64,
        dims=(32, 16) if seed % 2 else (64, 0),
        max_len=300 if not HAS_CUDA else 3000,
    )
    out, lse = run_kernels(path_kernels, case)
    assert runtime.LAST_LAUNCH["decode_path"] == path_kernels.expected_path
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


def test_tma_path_poisons_bad_page(path_kernels) -> None:
    case = make_case(
        12, device=DEVICE, page_size=64, dims=(32, 16), lengths=[200, 200], s_q=1, num_splits=1
    )
    case.block_table[0, 2] = case.kv_c.shape[0] + 1
    out, lse = run_kernels(path_kernels, case)
    assert runtime.LAST_LAUNCH["decode_path"] == path_kernels.expected_path
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert not torch.isnan(out[1]).any()


def test_config_can_turn_tma_off(kernels, monkeypatch, caplog) -> None:
    """A tiling with use_tma=False takes per-token loads where TMA would apply, and says why."""
    monkeypatch.setattr(device_facts, "has_copy_engine", lambda device: True)
    case = make_case(
        31, device=DEVICE, page_size=64, dims=(32, 16), lengths=[200, 70], s_q=1, num_splits=2
    )
    config = tiling.TritonTiling(16, 64, 4, 2, use_tma=False)
    with caplog.at_level(logging.DEBUG, logger="mla_compile.mla_ops"):
        out_p, lse_p = runtime.decode(
            *case.op_args(), options=planner.DecodeOptions(triton_tiling=config)
        )
    assert runtime.LAST_LAUNCH["decode_path"] == "gather"
    assert "per-token loads: the tiling turns TMA off (TritonTiling.use_tma=False)" in caplog.text
    out, lse = runtime.combine(out_p, lse_p, case.q.dtype)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, case.q.dtype, case.describe())


@pytest.mark.parametrize("num_splits", [1, 7, 64, 128])
@pytest.mark.parametrize("width", [24, 300])  # 300: several column blocks, a masked last one
def test_combine_kernel_tiling(kernels, num_splits: int, width: int) -> None:
    """The combine kernel against the float64 merge, across its column-block / split tilings."""
    from tests.mla_ops.test_combine import merge64

    gen = torch.Generator().manual_seed(num_splits * 1000 + width)
    out_p = torch.randn(3, 5, num_splits, width, generator=gen).to(DEVICE)
    lse_p = (torch.randn(3, 5, num_splits, generator=gen) * 4).to(DEVICE)
    lse_p[0, 1] = float("-inf")  # an empty row
    lse_p[1, :, num_splits // 2] = float("-inf")  # an empty split; its partial must not be read
    out_p[1, :, num_splits // 2] = float("nan")
    out, lse = runtime.combine(out_p, lse_p, torch.float32)
    ref, ref_lse = merge64(out_p.cpu().double(), lse_p.cpu().double())
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_combine_tiling_widens_only_with_programs_to_spare() -> None:
    """Twice the columns (at most 512, never past the row, at most 4096 values a program) only
    where the rows still give every multiprocessor ``COMBINE_WIDE_PROGRAMS_PER_SM`` programs: case
    (h128_b32_4k)'s 4096 rows of 4 splits on 132 multiprocessors, not (h16_b64_8k_ragged)'s 1024,
    not 64 splits, and never
    without a device count."""

    assert tiling.combine_tiling(4, 512) == (4, 256)
    assert tiling.combine_tiling(4, 512, rows=4096, multiprocessors=132) == (4, 512)
    assert tiling.combine_tiling(4, 512, rows=1024, multiprocessors=132) == (4, 256)
    assert tiling.combine_tiling(64, 512, rows=128, multiprocessors=132) == (64, 64)
    assert tiling.combine_tiling(64, 512, rows=10**6, multiprocessors=132) == (64, 64)
    assert tiling.combine_tiling(8, 512, rows=10**6, multiprocessors=132) == (8, 512)
    assert tiling.combine_tiling(16, 512, rows=10**6, multiprocessors=132) == (16, 256)
    assert tiling.combine_tiling(2, 24, rows=10**6, multiprocessors=1) == (2, 32)
    assert tiling.combine_tiling(1, 512, rows=10**6, multiprocessors=1) == (2, 512)


def test_combine_tiles_by_its_rows_and_the_device(kernels, monkeypatch) -> None:
    """The combine's plan hands the tiling rule its row count and, on CUDA, the device's
    multiprocessor count (0 elsewhere, which keeps the base tiling), and the launch records the
    tiling it ran."""
    rule = tiling.combine_tiling
    out_p = torch.randn(3, 5, 4, 40, device=DEVICE)
    sms = splits.multiprocessor_count(out_p.device) if HAS_CUDA else 0
    assert planner.plan_combine(out_p) == rule(4, 40, 15, sms)
    runtime.combine(out_p, torch.randn(3, 5, 4, device=DEVICE), torch.float32)
    assert runtime.LAST_LAUNCH["combine_tiling"] == rule(4, 40, 15, sms)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_combine_kernel_wide_column_blocks(kernels, monkeypatch, num_splits: int) -> None:
    """The combine kernel in 512-column programs (the widened tiling) against the float64 merge,
    a masked column block included (width 600)."""
    from tests.mla_ops.test_combine import merge64

    options = planner.DecodeOptions(combine_tiling=(num_splits, 512))
    gen = torch.Generator().manual_seed(num_splits)
    out_p = torch.randn(2, 3, num_splits, 600, generator=gen).to(DEVICE)
    lse_p = (torch.randn(2, 3, num_splits, generator=gen) * 4).to(DEVICE)
    lse_p[1, :, 1] = float("-inf")  # an empty split; its partial must not be read
    out_p[1, :, 1] = float("nan")
    out, lse = runtime.combine(out_p, lse_p, torch.float32, options)
    assert runtime.LAST_LAUNCH["combine_tiling"] == (num_splits, 512)
    ref, ref_lse = merge64(out_p.cpu().double(), lse_p.cpu().double())
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-5, rtol=1e-5)


def run_kernels(kernels, case):
    out_p, lse_p = runtime.decode(*case.op_args())
    return runtime.combine(out_p, lse_p, case.q.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(16))
def test_random_problems(kernels, seed: int, dtype: torch.dtype) -> None:
    case = make_case(100 + seed, dtype=dtype, device=DEVICE, max_len=300 if not HAS_CUDA else None)
    out, lse = run_kernels(kernels, case)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("seed", range(6))
def test_attention_mask(kernels, seed: int, kind: str, dtype: torch.dtype) -> None:
    case = make_case(400 + seed, dtype=dtype, device=DEVICE, mask=kind, max_len=300)
    out, lse = run_kernels(kernels, case)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_mask_per_program_query_position(kernels, block_m: int, kind: str) -> None:
    """S_q = 3 x 16 heads: 16-row programs each hold one query position (its mask row and causal
    limit are one vector); 32-row programs straddle two positions (a row each)."""
    case = make_case(
        430 + block_m, device=DEVICE, s_q=3, heads=16, dims=(32, 16), mask=kind, causal=True,
        max_len=300, page_size=16,
    )  # fmt: skip
    out_p, lse_p = runtime.decode(
        *case.op_args(),
        options=planner.DecodeOptions(triton_tiling=tiling.TritonTiling(block_m, 32, 4, 2)),
    )
    out, lse = runtime.combine(out_p, lse_p, case.q.dtype)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, case.q.dtype, case.describe())


@pytest.mark.parametrize("page_size", [1, 3, 64, None])
@pytest.mark.parametrize("s_q", [1, 3, 8])
def test_partials_match_reference_impl(kernels, s_q: int, page_size: int | None) -> None:
    """Kernel and PyTorch implementation return the same partials (same split geometry)."""

    case = make_case(
        7,
        device=DEVICE,
        s_q=s_q,
        page_size=page_size,
        lengths=[0, s_q, 600, 300],
        num_splits=3,
        heads=5,
    )
    out_p, lse_p = runtime.decode(*case.op_args())
    ref_p, ref_lse_p = reference.decode(*case.op_args())
    torch.testing.assert_close(lse_p, ref_lse_p, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_p, ref_p, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("total_splits", [1, 6])
@pytest.mark.parametrize("s_q", [1, 2])
def test_balanced_partials_match_reference_impl(
    path_kernels, monkeypatch, s_q: int, total_splits: int
) -> None:
    """Chunks of one batch-wide length (``total_splits``): same partials as the PyTorch
    implementation, empty splits (zeros, -inf) written too (outputs start as NaN), and the
    lengths summed in several blocks."""

    options = planner.DecodeOptions(lengths_per_step=4)  # 9 sequences: 3 blocks
    lengths = [0, 1000, s_q, 700, 0, 300, 1400, 64, 900]
    case = make_case(
        11, device=DEVICE, s_q=s_q, page_size=64, dims=(32, 16), lengths=lengths, heads=3,
        num_splits=8, total_splits=total_splits,
    )  # fmt: skip
    out_p, lse_p = runtime.decode(*case.op_args(), options=options)
    assert runtime.LAST_LAUNCH["decode_path"] == path_kernels.expected_path
    ref_p, ref_lse_p = reference.decode(*case.op_args())
    torch.testing.assert_close(lse_p, ref_lse_p, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_p, ref_p, atol=2e-5, rtol=2e-5)
    assert bool(torch.isinf(lse_p).any())  # some splits are empty


def test_out_of_range_page_poisons_only_its_sequence(kernels) -> None:
    case = make_case(8, device=DEVICE, page_size=16, lengths=[40, 40, 40], s_q=1, num_splits=1)
    case.block_table[1, 1] = case.kv_c.shape[0] + 5  # a page id past the cache
    out, lse = run_kernels(kernels, case)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert not torch.isnan(out[[0, 2]]).any()
    case.block_table[1, 1] = -3
    out, _ = run_kernels(kernels, case)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()


def test_length_beyond_capacity_poisons_instead_of_reading_out_of_bounds(kernels) -> None:
    case = make_case(9, device=DEVICE, page_size=None, lengths=[30, 20], s_q=1, num_splits=1)
    capacity = case.kv_c.shape[1]
    case.cache_seqlens[0] = capacity + 50
    out, _ = run_kernels(kernels, case)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1]).any()


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_combine_kernel(kernels, num_splits: int) -> None:

    out_p = torch.randn(3, 4, num_splits, 40, device=DEVICE)
    lse_p = torch.randn(3, 4, num_splits, device=DEVICE) * 3
    lse_p[0, 0] = float("-inf")  # a row with no state at all
    lse_p[1, :, 0] = float("-inf")  # an empty split: its output must not be read
    out_p[1, :, 0] = float("nan")
    out, lse = runtime.combine(out_p, lse_p, torch.float16)
    ref, ref_lse = reference.combine(out_p.double(), lse_p.double(), None)
    assert out.dtype == torch.float16
    assert (out[0, 0] == 0).all() and torch.isneginf(lse[0, 0])
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_default_config_fits_shared_memory() -> None:
    """The tuned bf16 tilings stay as measured; fp32 and wide latents shrink until the bound
    fits (H100/H200: 232448 B); a width no tiling fits is refused by name."""

    bf16_64 = tiling.triton_tiling(128, 512, 64, 2, 232448)
    assert bf16_64 == tiling.TritonTiling(64, 64, 8, 2, use_tma=False)  # TMA: 30-46 % slower, H100
    # Triton 3.9 gives it 221440 B offline; the H200's Triton 3.6 reported 221184
    #
    assert 221440 <= tiling.shared_memory_bytes(bf16_64, 576, 2, 512) <= 232448
    assert tiling.triton_tiling(16, 512, 64, 2, 232448) == tiling.TritonTiling(16, 32, 4, 2)
    # float8 tiles: 64 tokens, one stage, measured fastest on the H100
    fp8_16 = tiling.triton_tiling(16, 512, 64, 2, 232448, float8_cache=True)
    assert fp8_16 == tiling.TritonTiling(16, 64, 4, 1)
    for rows, kv_len, size in [(16, 512, 4), (32, 512, 4), (128, 512, 4), (256, 512, 4),
                               (128, 1024, 2), (16, 1024, 2), (128, 1024, 4)]:  # fmt: skip
        cfg = tiling.triton_tiling(rows, kv_len, 64, size, 232448)
        assert tiling.shared_memory_bytes(cfg, kv_len + 64, size, kv_len) <= 232448
    # Dots 3 Note's sliding-window width: 64-row programs' float32 accumulator alone is 256 KB;
    # of the tilings that fit, 32 x 32 was the fastest measured
    wide = tiling.triton_tiling(128, 1024, 64, 2, 232448)
    assert wide == tiling.TritonTiling(32, 32, 8, 2, use_tma=False)
    with pytest.raises(ValueError, match=r"kv_c width 8192 .* gives a program 232448"):
        tiling.triton_tiling(16, 8192, 64, 2, 232448)


@pytest.mark.parametrize(
    ("rows", "kv_len", "dtype"),
    [(128, 512, "bf16"), (16, 512, "bf16"), (128, 1024, "bf16"), (16, 1024, "bf16"),
     (128, 512, "fp32"), (16, 512, "fp32"), (128, 1024, "fp32"), (128, 256, "bf16")],
)  # fmt: skip
def test_shared_memory_bound_holds(rows: int, kv_len: int, dtype: str) -> None:
    """``shared_memory_bytes`` bounds what the installed Triton gives the default tiling, compiled
    for sm_90 offline (no GPU): a 64-row tiling at L = 1024 that the old estimate took for
    208896 B asked the H200 for 262144."""

    size = 4 if dtype == "fp32" else 2
    cfg = tiling.triton_tiling(rows, kv_len, 64, size, 232448)
    shared = offline_compile(
        f"from mla_compile.mla_ops import tiling as tk; cfg = tk.{cfg!r}; "
        f"print(oc.compile_decode(cfg, heads={rows}, s_q=1, page_size=64, dtype={dtype!r}, "
        f"kv_len={kv_len}, rope_len=64).metadata.shared)"
    )
    assert shared <= tiling.shared_memory_bytes(cfg, kv_len + 64, size, kv_len) <= 232448, (
        cfg,
        shared,
    )


@pytest.mark.parametrize(("rows", "dtype"), [(16, "bf16"), (128, "bf16"), (16, "fp32")])
def test_combine_launches_once_the_loop_is_done(rows: int, dtype: str) -> None:
    """The decode kernel lets ``mla::combine`` launch (``griddepcontrol.launch_dependents``, PDL)
    once, after its loop's last product (offline sm_90 PTX): at the program's entry the
    benchmark's calls that run the combine took 0.5-1.3 us longer on an H200.
    An empty split returns before the loop, and its exit counts as the trigger."""

    size = 4 if dtype == "fp32" else 2
    cfg = tiling.triton_tiling(rows, 512, 64, size, 232448)
    res = offline_compile(
        f"from mla_compile.mla_ops import tiling as tk; cfg = tk.{cfg!r}; "
        f"ptx = oc.compile_decode(cfg, heads={rows}, s_q=1, page_size=64, dtype={dtype!r}, "
        "tma=cfg.use_tma is not False).asm['ptx']; r = {}; " + TRIGGER_AFTER_LOOP + "print(r)"
    )
    assert res["trigger"] == [1, True, True], (cfg, res)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else []), ids=str
)
@pytest.mark.parametrize("seed", range(4))
def test_fp8_cache(path_kernels, seed: int, dtype: torch.dtype) -> None:
    """Float8 cache tiles (TMA or gather) converted in the kernel, scale folded in."""
    case = make_case(
        600 + seed,
        dtype=dtype,
        device=DEVICE,
        page_size=64,
        dims=(32, 16) if seed % 2 else (64, 0),
        cache_dtype=torch.float8_e4m3fn,
        max_len=300 if not HAS_CUDA else 3000,
    )
    out, lse = run_kernels(path_kernels, case)
    assert runtime.LAST_LAUNCH["decode_path"] == path_kernels.expected_path
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


@pytest.mark.parametrize("fp8_in_f16", [True, False])
@pytest.mark.parametrize("query_max", [1e-6, 1.0, 6e4, 1e9])
def test_fp8_cache_query_outside_fp16_range(
    path_kernels, query_max: float, fp8_in_f16: bool
) -> None:
    """A float8 cache is computed with in fp16: a query beyond fp16's range (bf16 goes to 3e38)
    or in its subnormals is moved into its normal range by a power of two, not overflowed to inf
    or rounded away. Beyond-range and tiny bf16 queries need a GPU (the interpreter has no bf16);
    on CPU the fp16 query at 6e4 still takes the power-of-two path."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    if query_max > 6e4 and dtype == torch.float16:
        pytest.skip("fp16 queries cannot exceed fp16's range (bf16 needs a GPU here)")
    case = make_case(
        650, dtype=dtype, device=DEVICE, page_size=64, dims=(64, 16), s_q=2,
        cache_dtype=torch.float8_e4m3fn, lengths=[130, 64, 0],
    )  # fmt: skip
    case.q = case.q * (query_max / case.q.abs().max().item())
    case.softmax_scale /= query_max  # keep the scores' spread
    cfg = replace(tiling.triton_tiling(case.q.shape[2] * 2, 64), fp8_in_f16=fp8_in_f16)
    out_p, lse_p = runtime.decode(*case.op_args(), options=planner.DecodeOptions(triton_tiling=cfg))
    out, lse = runtime.combine(out_p, lse_p, case.q.dtype)
    ref_out, ref_lse = case.reference()
    assert torch.isfinite(out[:2]).all()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


def test_fp8_conversion_path_is_logged(kernels, caplog) -> None:
    """Which conversion a float8 cache gets is in the debug log: off an sm_89+ CUDA device
    (the interpreter here), Triton's cast."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    case = make_case(
        660, dtype=dtype, device=DEVICE, page_size=64, dims=(32, 16),
        cache_dtype=torch.float8_e4m3fn, lengths=[70],
    )  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="mla_compile.mla_ops"):
        runtime.decode(*case.op_args())
    ptx = device_facts.has_e4m3_convert(case.q.device)
    how = "inline PTX" if ptx else "Triton's cast"
    assert f"float8 tiles computed in fp16, converted by {how}" in caplog.text
    assert not device_facts.has_e4m3_convert(torch.device("cpu"))


@pytest.mark.skipif(not HAS_CUDA, reason="inline PTX needs a CUDA device")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("use_tma", [None, False])
@pytest.mark.parametrize("seed", range(3))
def test_fp8_ptx_conversion_matches_cast(kernels, seed: int, use_tma, heads: int) -> None:
    """The inline-PTX e4m3 -> fp16 conversion gives what Triton's cast gives (both exact)."""
    if not device_facts.has_e4m3_convert(torch.device(DEVICE)):
        pytest.skip("needs compute capability >= 8.9")
    case = make_case(
        700 + seed, dtype=torch.bfloat16, device=DEVICE, page_size=64, dims=(512, 64),
        heads=heads, cache_dtype=torch.float8_e4m3fn, max_len=3000,
    )  # fmt: skip
    rows = case.q.shape[1] * heads
    ptx = replace(tiling.triton_tiling(rows, 512, float8_cache=True), use_tma=use_tma)
    outs = []
    for cfg in (ptx, replace(ptx, fp8_ptx_convert=False)):
        out_p, lse_p = runtime.decode(
            *case.op_args(), options=planner.DecodeOptions(triton_tiling=cfg)
        )
        outs.append(runtime.combine(out_p, lse_p, torch.float32))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    ref_out, ref_lse = case.reference()
    assert_matches(*outs[0], ref_out, ref_lse, torch.bfloat16, case.describe())


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_hidden_keys_holding_nan_do_not_leak(kernels, kind: str) -> None:
    case = make_case(
        52, device=DEVICE, s_q=1, page_size=None, pair=False, mask=kind, lengths=[30, 64, 9]
    )
    poison_hidden_keys(case)
    out, lse = run_kernels(kernels, case)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, torch.float32, case.describe())


# inf - inf and 0 x inf in the interpreter, on purpose
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("merged", [False, True], ids=["decode+combine", "attention"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("mask", [None, "bool"])
def test_a_non_finite_key_reaches_only_the_rows_that_see_it(
    kernels, bad: float, mask, merged: bool
) -> None:
    """S_q = 2, causal: each sequence's last key is seen by its second query only, and the rows
    of both positions share a program (3 heads x 2 positions). With that key non-finite, the
    first position's rows (output and LSE) are bit-equal to the finite key's, and every row of
    the second position is NaN (the PyTorch implementation makes the same rows non-finite). The
    decode alone would make the first position NaN too (``0 x inf`` in ``P @ V``): the repair
    pass recomputes those programs, and leaves finite outputs as they were."""
    case = make_case(
        77, dtype=torch.float32, device=DEVICE, page_size=16, dims=(32, 16), lengths=[40, 17],
        s_q=2, heads=3, num_splits=2, causal=True, mask=mask,
    )  # fmt: skip
    for b, length in enumerate(case.cache_seqlens.tolist()):
        if case.attn_mask is not None:  # the second query sees the last key, whatever the holes
            case.attn_mask[b, 1, length - 1] = True

    def run():
        if merged:
            return runtime.attention(*case.op_args())
        return run_kernels(kernels, case)

    clean_out, clean_lse = run()
    assert "query positions" in runtime.LAST_LAUNCH["repair"]  # planned for this shape
    assert "repair_kernel" in runtime.LAST_LAUNCH  # and launched
    for b, length in enumerate(case.cache_seqlens.tolist()):
        page = case.block_table[b, (length - 1) // 16]
        case.kv_c[page, (length - 1) % 16, 5] = bad
    out, lse = run()
    assert torch.equal(out[:, 0], clean_out[:, 0]) and torch.equal(lse[:, 0], clean_lse[:, 0])
    assert torch.isnan(out[:, 1]).all() and torch.isnan(lse[:, 1]).all()
    ref_out, _ = case.reference()  # the same rows non-finite (where, within a row, may differ)
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(ref_out).any(-1))


def test_the_repair_pass_is_planned_where_programs_mix_positions() -> None:
    """``planner.repair_needed``: only programs of several query positions (S_q > 1, heads not
    a multiple of the block) under a causal or masked problem need the pass, and the plan says
    why either way."""
    assert planner.repair_needed(2, 3, 16, causal=True, masked=False)[0]
    assert planner.repair_needed(4, 16, 64, causal=False, masked=True)[0]
    assert not planner.repair_needed(1, 3, 16, causal=True, masked=True)[0]
    assert not planner.repair_needed(4, 128, 64, causal=True, masked=True)[0]
    needed, why = planner.repair_needed(2, 3, 16, causal=False, masked=False)
    assert not needed and "same keys" in why


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_the_repair_pass_can_be_turned_off(kernels) -> None:
    """``DecodeOptions(repair_non_finite=False)``: no repair launch, the plan says so, and a
    non-finite key seen only by the later position then reaches the earlier one's rows too."""
    case = make_case(
        78, dtype=torch.float32, device=DEVICE, page_size=16, dims=(32, 16), lengths=[40],
        s_q=2, heads=3, num_splits=1, causal=True,
    )  # fmt: skip
    case.kv_c[case.block_table[0, 39 // 16], 39 % 16, 5] = float("nan")
    options = planner.DecodeOptions(repair_non_finite=False)
    out, _ = runtime.attention(*case.op_args(), options=options)
    assert "turned off" in runtime.LAST_LAUNCH["repair"]
    assert "repair_kernel" not in runtime.LAST_LAUNCH
    assert torch.isnan(out[:, 0]).any(-1).all()  # the NaN column, through 0 x NaN
    out, _ = runtime.attention(*case.op_args())
    assert torch.isfinite(out[:, 0]).all() and torch.isnan(out[:, 1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fill_empty_off_leaves_empty_splits_unwritten(kernels, dtype: torch.dtype) -> None:
    """``fill_empty=False`` (what ``mla_decode`` passes): an empty split keeps whatever its ``out``
    held (NaN here, from the poisoned allocation) and still says ``lse = -inf``; every other
    partial is bit-equal to ``fill_empty=True``'s, and the combine of either gives the same
    output, since it never reads an empty split's ``out``. A sequence of 0 tokens included."""
    case = make_case(
        41, dtype=dtype, device=DEVICE, page_size=16, dims=(32, 16), lengths=[300, 0, 70],
        s_q=2, heads=3, num_splits=4, causal=True,
    )  # fmt: skip
    out_fill, lse_fill = runtime.decode(*case.op_args(), fill_empty=True)
    out_p, lse_p = runtime.decode(*case.op_args(), fill_empty=False)
    assert torch.equal(torch.isinf(lse_p), torch.isinf(lse_fill))
    empty = torch.isneginf(lse_fill).all(dim=(1, 2))  # [B, splits]: no row saw a key
    assert empty.any() and (~empty).any()
    assert torch.isnan(out_p.permute(0, 3, 1, 2, 4)[empty]).all()
    assert (out_fill.permute(0, 3, 1, 2, 4)[empty] == 0).all()
    full = ~empty
    assert torch.equal(out_p.permute(0, 3, 1, 2, 4)[full], out_fill.permute(0, 3, 1, 2, 4)[full])
    assert torch.equal(lse_p, lse_fill)
    out, lse = runtime.combine(out_p, lse_p, dtype)
    out_ref, lse_ref = runtime.combine(out_fill, lse_fill, dtype)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    ref_out, ref_lse = case.reference()
    assert_matches(out, lse, ref_out, ref_lse, dtype, case.describe())


def test_a_float16_mask_hides_at_its_minimum(kernels) -> None:
    """The kernels under a float16 mask filled with float16's minimum: the same output as under
    the bool mask it encodes (a fully hidden row: zeros and -inf)."""
    case = make_case(
        4100, dtype=torch.float16, device=DEVICE, page_size=16, dims=(32, 16), s_q=2,
        lengths=[40, 20], heads=3, num_splits=2, causal=False, mask="bool",
    )  # fmt: skip
    case.attn_mask[0, 0] = False
    additive = torch.zeros(case.attn_mask.shape, dtype=torch.float16, device=DEVICE)
    additive = additive.masked_fill(~case.attn_mask, torch.finfo(torch.float16).min)
    args = list(case.op_args())
    out, lse = runtime.attention(*args[:9], additive, *args[10:])
    ref_out, ref_lse = runtime.attention(*case.op_args())
    assert not out[0, 0].any() and torch.isneginf(lse[0, 0]).all()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
