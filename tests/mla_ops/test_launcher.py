"""Prepared launches and the op's plans: one call signature's choices and kernel arguments made
once, each call's data filled in (on CUDA after the first launch, straight through the compiled
kernel's launcher; on CPU through Triton's interpreter, which dispatches every launch)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mla_compile.mla_ops import planner, reference, runtime, splits, tiling, triton_kernels  # noqa: F401
from tests.conftest import HAS_CUDA, requires_cuda, triton_available
from tests.mla_ops.cases import assert_matches, make_case

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DEVICE = "cuda" if HAS_CUDA else "cpu"

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled_copy(X, Y, n, factor, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * factor, mask=offs < n)


def _prepared(n: int):
    from mla_compile.mla_ops.launcher import Data, PreparedLaunch

    grid = (triton.cdiv(n, 16),)
    return PreparedLaunch(_scaled_copy, grid, [Data("x"), Data("y"), n, Data("factor")],
                          {"BLOCK": 16})  # fmt: skip


def test_prepared_launch_fills_each_calls_data() -> None:
    prepared = _prepared(37)
    for factor in (2.0, -0.5, 3.0):
        x = torch.randn(37, device=DEVICE)
        y = torch.full_like(x, float("nan"))
        prepared.launch({"x": x, "y": y, "factor": factor})
        torch.testing.assert_close(y, x * factor)
    expected = "direct" if HAS_CUDA else "Triton's dispatch"
    assert prepared.how == expected


def test_prepared_launch_needs_every_parameter() -> None:
    from mla_compile.mla_ops.launcher import Data, PreparedLaunch

    if not isinstance(_scaled_copy, triton.runtime.jit.JITFunction):
        pytest.skip("the interpreter's kernels are dispatched by Triton, which names the argument")
    with pytest.raises(TypeError, match="BLOCK"):
        PreparedLaunch(_scaled_copy, (1,), [Data("x"), Data("y"), 4, Data("factor")], {})


@requires_cuda
def test_check_mode_catches_a_signature_the_launch_was_not_prepared_for(monkeypatch) -> None:
    """``MLA_OPS_CHECK_LAUNCH=1`` asks Triton's own dispatch which compiled kernel each direct
    launch's arguments select: a pointer off the 16-byte alignment the kernel was compiled for
    (a key that missed it) is refused before the launch."""
    monkeypatch.setenv("MLA_OPS_CHECK_LAUNCH", "1")
    prepared = _prepared(32)
    x, y = torch.randn(40, device="cuda"), torch.zeros(40, device="cuda")
    prepared.launch({"x": x, "y": y, "factor": 1.0})
    prepared.launch({"x": x, "y": y, "factor": 2.0})  # same specialisation: passes the check
    assert prepared.how == "direct"
    with pytest.raises(RuntimeError, match="MLA_OPS_CHECK_LAUNCH"):
        prepared.launch({"x": x[1:], "y": y, "factor": 1.0})  # 4 bytes off


def _redrawn(case, seed: int):
    """A problem of ``case``'s call signature (shapes, strides, dtypes, alignment) with new
    tensors and new values: a new query, cache, mask and block table, and lengths at most the
    old ones (the pages past them hold junk ids)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def moved(t: torch.Tensor | None, values=None) -> torch.Tensor | None:
        # Same shape, strides and storage offset in a new storage of the same layout.
        if t is None:
            return None
        base = t if t._base is None else t._base
        fresh = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=t.device)
        if values is not None:
            fresh.copy_(values(base))
        elif base.dtype == torch.bool:
            fresh.copy_(torch.rand(base.shape, generator=gen) > 0.3)
        elif base.dtype.is_floating_point:
            fresh.copy_(torch.randn(base.shape, generator=gen).to(base.dtype))
        else:
            fresh.copy_(base)
        return fresh.as_strided(t.shape, t.stride(), t.storage_offset())

    s_q = case.q.shape[1]
    lengths = [0 if n < s_q else rng.randint(s_q, n) for n in case.cache_seqlens.tolist()]
    new = dataclasses.replace(
        case,
        q=moved(case.q),
        kv_c=moved(case.kv_c),
        cache_seqlens=moved(case.cache_seqlens, lambda b: torch.tensor(lengths, dtype=b.dtype)),
        block_table=moved(case.block_table),
        attn_mask=moved(case.attn_mask),
        softmax_scale=case.softmax_scale * rng.uniform(0.5, 1.5),
    )
    if case.k_pe._base is not None and case.k_pe._base is case.kv_c._base:
        new.k_pe = new.kv_c._base.as_strided(
            case.k_pe.shape, case.k_pe.stride(), case.k_pe.storage_offset()
        )
    else:
        new.k_pe = moved(case.k_pe)
    return new


def _signature(case):
    return runtime.call_signature(
        case.q, case.kv_c, case.k_pe, case.cache_seqlens, case.block_table, case.causal,
        case.num_splits, case.kv_scale, case.attn_mask, case.total_splits,
    )  # fmt: skip


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_kept_plan_runs_each_calls_data(kernels, seed: int, dtype: torch.dtype) -> None:
    """Three calls of one signature with new tensors and values each time (query, cache, lengths,
    block table, mask, scale): every output matches its float64 reference, and one plan serves
    them all."""
    case = make_case(5100 + seed, dtype=dtype, device=DEVICE, mask="random",
                     total_splits=random.Random(seed).choice([None, 7]))  # fmt: skip
    cases = [case, _redrawn(case, 1), _redrawn(case, 2)]
    assert len({_signature(c) for c in cases}) == 1
    # Triton's interpreter adds its names to a kernel's module on the first run of the kernel, a
    # change of that module that drops the plans once; a warm-up call takes it.
    runtime.attention(*make_case(5150, device=DEVICE, mask="bool", num_splits=3).op_args())
    plans = []
    for i, c in enumerate(cases):
        out, lse = runtime.attention(*c.op_args())
        plans.append(
            runtime._LAUNCHES.lookup(("attention", _signature(c), planner.DEFAULT_OPTIONS))
        )
        assert_matches(out, lse, *c.reference(), dtype, f"call {i}: {c.describe()}")
    assert plans[0] is not None and all(plan is plans[0] for plan in plans)
    if HAS_CUDA:
        assert runtime.LAST_LAUNCH["decode_launch"] == "direct"


def test_options_key_their_own_plans(kernels) -> None:
    """Options are part of a kept plan's key: the same signature with another combine tiling
    launches that tiling, and the default options keep theirs."""
    case = make_case(5200, dtype=torch.float32, device=DEVICE, num_splits=3, heads=4, s_q=1,
                     dims=(64, 0), lengths=[300, 90])  # fmt: skip
    runtime.attention(*case.op_args())
    assert runtime.LAST_LAUNCH["merge"].startswith("mla::combine")
    assert runtime.LAST_LAUNCH["combine_tiling"][1] > 16
    default_tiling = runtime.LAST_LAUNCH["combine_tiling"]
    options = planner.DecodeOptions(combine_tiling=(4, 16))
    out, lse = runtime.attention(*case.op_args(), options=options)
    assert runtime.LAST_LAUNCH["combine_tiling"] == (4, 16)
    assert_matches(out, lse, *case.reference(), torch.float32, case.describe())
    runtime.attention(*case.op_args())
    assert runtime.LAST_LAUNCH["combine_tiling"] == default_tiling


def test_signatures_differ_in_what_launches_depend_on(kernels) -> None:
    case = make_case(5300, dtype=torch.float32, device=DEVICE, page_size=16, mask="bool")
    base = _signature(case)
    assert _signature(_redrawn(case, 1)) == base
    variants = [
        dataclasses.replace(case, q=case.q.transpose(1, 2).contiguous().transpose(1, 2)),
        dataclasses.replace(case, num_splits=case.num_splits + 1),
        dataclasses.replace(case, causal=not case.causal),
        dataclasses.replace(case, total_splits=(case.total_splits or 0) + 5),
        dataclasses.replace(case, attn_mask=None),
        dataclasses.replace(case, attn_mask=case.attn_mask.float()),
        dataclasses.replace(case, block_table=case.block_table[:, :1]),
        # The same values 4 bytes off a 16-byte boundary: Triton compiles for the alignment.
        dataclasses.replace(case, cache_seqlens=torch.cat([case.cache_seqlens[:1],
                                                           case.cache_seqlens])[1:]),
    ]  # fmt: skip
    for variant in variants:
        assert _signature(variant) != base


def test_decode_and_combine_ops_keep_their_kernels(kernels) -> None:
    """``mla::decode`` and ``mla::combine`` called on their own keep their kernels per signature
    too: calls with new tensors and values match the reference, and one kept kernel serves
    each op."""
    case = make_case(5400, dtype=torch.float32, device=DEVICE, num_splits=3, mask="bool")
    runtime.combine(*runtime.decode(*case.op_args()), case.q.dtype)  # the interpreter's first run
    kept = []
    for c in (case, _redrawn(case, 1), _redrawn(case, 2)):
        out_p, lse_p = runtime.decode(*c.op_args())
        out, lse = runtime.combine(out_p, lse_p, c.q.dtype)
        assert_matches(out, lse, *c.reference(), torch.float32, c.describe())
        sig_p, sig_l = runtime._tensor_signature(out_p), runtime._tensor_signature(lse_p)
        combine_key = ("combine", out_p.device, sig_p, sig_l, c.q.dtype, planner.DEFAULT_OPTIONS)
        decode_key = ("decode", _signature(c), True, planner.DEFAULT_OPTIONS)
        kept.append((runtime._LAUNCHES.lookup(decode_key), runtime._LAUNCHES.lookup(combine_key)))
    assert all(k is not None for pair in kept for k in pair)
    assert all(pair[0] is kept[0][0] and pair[1] is kept[0][1] for pair in kept)
