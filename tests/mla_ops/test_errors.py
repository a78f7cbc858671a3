"""Bad input gets an error that names the argument and what was expected."""

from __future__ import annotations

import pytest
import torch

from mla_compile import mla_ops
from tests.conftest import requires_cuda

B, S, H, L, R = 2, 1, 4, 32, 16


def good(**overrides):
    args = dict(
        q=torch.randn(B, S, H, L + R),
        kv_cache=torch.randn(6, 16, L + R),
        cache_seqlens=torch.tensor([20, 5], dtype=torch.int32),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        head_dim_v=L,
        softmax_scale=0.1,
    )
    args.update(overrides)
    return args


def call(**overrides):
    a = good(**overrides)
    return mla_ops.mla_decode(a.pop("q"), a.pop("kv_cache"), a.pop("cache_seqlens"), **a)


def test_good_call_works() -> None:
    out, _ = call()
    assert out.shape == (B, S, H, L)


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({"q": torch.randn(B, S, H, L + R + 1)}, ValueError, r"q's last dimension must be L\+R"),
        ({"q": torch.randn(B, H, L + R)}, ValueError, r"q must be \[batch, S_q, heads, L\+R\]"),
        ({"q": torch.randn(B, S, H, L + R).int()}, TypeError, "q must be bfloat16"),
        ({"head_dim_v": L + R + 1}, ValueError, "head_dim_v=49 is larger than the cache row"),
        ({"head_dim_v": 0}, ValueError, "head_dim_v must be a positive int"),
        (
            {"kv_cache": (torch.randn(6, 16, L), torch.randn(6, 16, R)), "head_dim_v": 16},
            ValueError,
            "head_dim_v=16 must equal kv_c's last dimension",
        ),
        ({"kv_cache": torch.randn(6, 16, L + R).half()}, TypeError, "kv_c must have q's dtype"),
        ({"kv_cache": torch.randn(96, L + R)}, ValueError, "kv_cache must be"),
        ({"kv_cache": [torch.randn(6, 16, L)]}, TypeError, "kv_cache must be a tensor"),
        (
            {"cache_seqlens": torch.tensor([20, 5], dtype=torch.int64)},
            TypeError,
            "cache_seqlens must be int32",
        ),
        (
            {"cache_seqlens": torch.tensor([20, 5, 1], dtype=torch.int32)},
            ValueError,
            r"cache_seqlens must be \[batch=2\]",
        ),
        (
            {"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)},
            TypeError,
            "block_table must be int32",
        ),
        (
            {"block_table": torch.tensor([0, 1], dtype=torch.int32)},
            ValueError,
            "block_table must have 2 dimension",
        ),
        (
            {"cache_seqlens": torch.tensor([33, 5], dtype=torch.int32)},
            ValueError,
            r"cache_seqlens \[33, 5\] exceed block_table capacity 2 pages x 16 = 32",
        ),
        (
            {"cache_seqlens": torch.tensor([-1, 5], dtype=torch.int32)},
            ValueError,
            "cache_seqlens must be >= 0",
        ),
        (
            {"block_table": torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)},
            ValueError,
            r"block_table holds page ids outside \[0, 6\)",
        ),
        (
            {"block_table": None},
            ValueError,
            r"without block_table the cache must be \[batch=2, T, D\]",
        ),
        ({"softmax_scale": None}, TypeError, "softmax_scale must be a float"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite"),
        # finite in float64, inf in the kernels' float32: the output would be NaN
        ({"softmax_scale": 1e39}, ValueError, "softmax_scale must be finite and within float32"),
        ({"softmax_scale": True}, TypeError, "softmax_scale must be a float, got bool"),
        ({"causal": None}, TypeError, "causal must be a bool, got NoneType"),
        ({"causal": 2.5}, TypeError, "causal must be a bool, got float 2.5"),
        ({"num_splits": 0}, ValueError, r"num_splits must be in \[1, 4096\], got 0"),
        ({"num_splits": 2**40}, ValueError, r"num_splits must be in \[1, 4096\]"),
        ({"num_splits": True}, TypeError, "num_splits must be an int, got bool"),
        ({"num_splits": 2.0}, TypeError, "num_splits must be an int, got float"),
        ({"total_splits": 0}, ValueError, r"total_splits must be in \[1, 1073741824\], got 0"),
        ({"total_splits": 2**40}, ValueError, "total_splits must be in"),
        ({"total_splits": "4"}, TypeError, "total_splits must be an int or None, got str"),
        (
            {"kv_cache": torch.randn(6, 16, L + R).to(torch.float8_e4m3fn)},
            TypeError,
            "a float8_e4m3fn cache needs kv_scale",
        ),
        ({"kv_scale": 0.5}, ValueError, "kv_scale is for a float8_e4m3fn cache"),
        (
            {"kv_cache": torch.randn(6, 16, L + R).to(torch.float8_e4m3fn), "kv_scale": -1.0},
            ValueError,
            "kv_scale must be a positive finite float32 value",
        ),
        (
            {
                "q": torch.randn(B, S, H, L + R, dtype=torch.float64),
                "kv_cache": torch.randn(6, 16, L + R).to(torch.float8_e4m3fn),
                "kv_scale": 0.5,
            },
            TypeError,
            "a float8 cache takes a bfloat16, float16 or float32 q",
        ),
        (
            {"kv_cache": torch.randn(6, 16, L + R).to(torch.float8_e5m2), "kv_scale": 0.5},
            TypeError,
            r"kv_cache must be bfloat16, float16, float32 or float64 \(or float8_e4m3fn",
        ),
        (
            {"attn_mask": torch.ones(B, S, 32, dtype=torch.int32)},
            TypeError,
            r"attn_mask must be bool \(True = visible\) or floating",
        ),
        (
            {"attn_mask": torch.ones(B, 1, S, 32, dtype=torch.bool)},
            ValueError,
            r"attn_mask must be \[batch=2, S_q=1, T_m\]",
        ),
        (
            {"attn_mask": torch.ones(3, S, 32, dtype=torch.bool)},
            ValueError,
            r"attn_mask must be \[batch=2, S_q=1, T_m\] \(expand a broadcast mask first\), got "
            r"shape \(3, 1, 32\)",
        ),
        ({"attn_mask": "causal"}, TypeError, "attn_mask must be a torch.Tensor"),
    ],
)
def test_bad_input(overrides, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        call(**overrides)


def test_s_q_longer_than_sequence() -> None:
    """Causal: the lengths count the S_q new tokens, so a shorter sequence is an error. Not
    causal (a slice of a sequence, as on a rank under context parallelism), it is not."""
    short = dict(q=torch.randn(B, 3, H, L + R), cache_seqlens=torch.tensor([20, 2]).int())
    with pytest.raises(ValueError, match="each non-empty sequence needs >= 3 tokens"):
        call(**short)
    out, lse = call(**short, causal=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_softmax_scale_is_required() -> None:
    a = good()
    del a["softmax_scale"]
    with pytest.raises(TypeError, match="softmax_scale"):
        mla_ops.mla_decode(a.pop("q"), a.pop("kv_cache"), a.pop("cache_seqlens"), **a)


def test_device_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match="cache_seqlens must be on cpu"):
        call(cache_seqlens=torch.tensor([20, 5], dtype=torch.int32, device="meta"))


@pytest.mark.parametrize(
    ("out_p", "lse_p", "pattern"),
    [
        (torch.randn(3, 2, 8), torch.randn(3, 3), "lse_partial must be out_partial's shape"),
        (torch.randn(3, 2, 8).half(), torch.randn(3, 2), "out_partial must be float32 or float64"),
        (torch.randn(8), torch.randn(1), r"out_partial must be \[..., splits, L\]"),
        (torch.randn(3, 0, 8), torch.randn(3, 0), "at least one split"),
    ],
)
def test_combine_bad_input(out_p, lse_p, pattern) -> None:
    with pytest.raises((ValueError, TypeError), match=pattern):
        mla_ops.mla_combine(out_p, lse_p)


@requires_cuda
def test_value_checks_on_cuda_are_opt_in(monkeypatch) -> None:
    """On CUDA, value checks would sync the host: off by default (the kernel poisons the rows
    it cannot read instead), on with MLA_OPS_CHECK_VALUES=1."""
    too_long = torch.tensor([33, 5], dtype=torch.int32)  # capacity is 2 pages x 16 = 32
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in good().items()}
    args["cache_seqlens"] = too_long.cuda()
    monkeypatch.delenv("MLA_OPS_CHECK_VALUES", raising=False)
    out, lse = mla_ops.mla_decode(
        args.pop("q"), args.pop("kv_cache"), args.pop("cache_seqlens"), **args
    )
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert not torch.isnan(out[1]).any()
    monkeypatch.setenv("MLA_OPS_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match=r"cache_seqlens \[33, 5\] exceed"):
        call(
            **{
                k: v.cuda() if isinstance(v, torch.Tensor) else v
                for k, v in good(cache_seqlens=too_long).items()
            }
        )


@pytest.mark.parametrize("out_dtype", [3, True, torch.int32, torch.bool, "float32"])
def test_combine_out_dtype_must_be_floating(out_dtype) -> None:
    """An integer or bool ``out_dtype`` would silently truncate the merged output."""
    with pytest.raises(TypeError, match="out_dtype must be None or one of"):
        mla_ops.mla_combine(torch.randn(3, 2, 8), torch.randn(3, 2), out_dtype)


def test_ops_called_directly_check_their_arguments() -> None:
    """``torch.ops.mla.*`` reached without the wrappers gets the same errors."""
    a = good()
    q, kv = a["q"], a["kv_cache"]
    args = (q, kv[..., :L], kv[..., L:], a["cache_seqlens"], a["block_table"], 0.1, True)
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 4096\]"):
        torch.ops.mla.attention(*args, 2**40)
    with pytest.raises(ValueError, match="softmax_scale must be finite and within float32"):
        torch.ops.mla.decode(*args[:5], 1e39, True, 1)
    with pytest.raises(TypeError, match="out_dtype must be None or one of"):
        torch.ops.mla.combine(torch.randn(3, 2, 8), torch.randn(3, 2), torch.int32)
