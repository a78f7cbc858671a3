"""``mla::prefill`` against an independent float64 reference: the whole cache expanded at once,
one softmax per row. Randomized shapes with the awkward cases (odd heads, page size 1, empty and
ragged sequences, S = 1, masks of every accepted form, stale NaN rows past the lengths)."""

from __future__ import annotations

import math

import pytest
import torch

from mla_compile.mla_ops import plan_prefill
from mla_compile.mla_ops import prefill as prefill_op
from mla_compile.mla_ops.reference import mask_hidden_threshold


def expanded_attention64(q, latent, rope, weight, lengths, mask, scale, nope_dim):
    """The original form in float64: every key up-projected, ``softmax(q k^T) v``.
    latent ``[B, T, L]``, rope ``[B, T, R]`` dense; mask ``[.., T_m]`` bool or additive."""
    batch, heads, _, _ = q.shape
    cache_len = latent.shape[1]
    kv = (latent.double() @ weight.double().T).view(batch, cache_len, heads, -1)
    rope_heads = rope.double()[:, :, None].expand(batch, cache_len, heads, rope.shape[-1])
    keys = torch.cat([kv[..., :nope_dim], rope_heads], -1).transpose(1, 2)
    values = kv[..., nope_dim:].transpose(1, 2)
    scores = q.double() @ keys.transpose(-1, -2) * scale  # [B, H, S, T]
    visible = (torch.arange(cache_len)[None, :] < lengths[:, None])[:, None, None]
    if mask is not None:
        width = min(mask.shape[-1], cache_len)
        part = torch.zeros((*mask.shape[:-1], cache_len), dtype=torch.bool)
        if mask.dtype == torch.bool:
            part[..., :width] = mask[..., :width]
        else:
            part[..., :width] = mask[..., :width] > mask_hidden_threshold(mask.dtype)
            bias = torch.zeros((*mask.shape[:-1], cache_len), dtype=torch.float64)
            bias[..., :width] = torch.where(part[..., :width], mask[..., :width].double(), 0.0)
            scores = scores + bias
        visible = visible & part
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return probs @ values, lse


def random_case(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    batch, heads, q_len = pick(1, 2, 3), pick(1, 3, 5, 16), pick(1, 2, 9, 20)
    nope, rope_dim, v_dim, rank = pick(8, 12, 48), pick(4, 8, 16), pick(8, 10, 16, 32), pick(16, 24)
    page_size = pick(None, 1, 4, 16)
    capacity = pick(1, 17, 40, 64)
    if page_size:
        capacity = -(-capacity // page_size) * page_size
    lengths = torch.randint(0, capacity + 1, (batch,), generator=gen)
    lengths[0] = pick(0, capacity, int(lengths[0]))
    q = randn(batch, heads, q_len, nope + rope_dim)
    latent = randn(batch, capacity, rank)
    rope = randn(batch, capacity, rope_dim)
    weight = randn(heads * (nope + v_dim), rank) / math.sqrt(rank)
    # rows past each length are stale: NaN, which must never reach the output
    truth = (q, latent.clone(), rope.clone(), weight, lengths)
    stale = torch.arange(capacity)[None, :] >= lengths[:, None]
    latent[stale], rope[stale] = float("nan"), float("nan")
    mask_form = pick("none", "bool", "float", "heads", "short", "broadcast")
    mask = None
    if mask_form != "none":
        mask_heads = heads if mask_form == "heads" else 1
        mask_batch = 1 if mask_form == "broadcast" else batch
        width = max(1, capacity - 5) if mask_form == "short" else capacity
        shown = torch.rand(mask_batch, mask_heads, q_len, width, generator=gen) > 0.3
        if mask_form in ("float", "heads"):
            values = randn(mask_batch, mask_heads, q_len, width)
            mask = torch.where(shown, values, torch.finfo(dtype).min)
        else:
            mask = shown
    chunk_tokens = pick(0, 16, 32)
    if page_size:
        block_table = torch.randperm(batch * capacity // page_size, generator=gen)
        block_table = block_table.view(batch, -1).to(torch.int32)
        pool = torch.full((block_table.numel() + 1, page_size, rank + rope_dim), float("nan"))
        pool = pool.to(dtype)
        rows = torch.cat([latent, rope], -1).view(batch, -1, page_size, rank + rope_dim)
        pool[block_table.long()] = rows
        kv_c, k_pe = pool[..., :rank], pool[..., rank:]
    else:
        block_table, kv_c, k_pe = None, latent, rope
    args = (q, kv_c, k_pe, lengths.to(torch.int32), block_table, weight, mask, 0.3, nope)
    truth = (*truth, mask, 0.3, nope)
    return args, chunk_tokens, truth


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_expanded_form_float64(seed: int) -> None:
    args, chunk_tokens, truth = random_case(seed, torch.float64)
    out, lse = torch.ops.mla.prefill(*args, chunk_tokens)
    want_out, want_lse = expanded_attention64(*truth)
    seen = torch.isfinite(want_lse)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse[seen], want_lse[seen], rtol=1e-10, atol=1e-12)
    assert torch.isneginf(lse[~seen]).all() and (out[~seen] == 0).all()  # rows that see no key


@pytest.mark.parametrize("seed", range(6))
def test_float32_is_within_float32_rounding(seed: int) -> None:
    args, chunk_tokens, truth = random_case(100 + seed, torch.float32)
    out, lse = torch.ops.mla.prefill(*args, chunk_tokens)
    want_out, _ = expanded_attention64(*truth)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    # the fake function's layout, which a compiled graph (Inductor) asserts
    assert out.is_contiguous() and lse.is_contiguous(), prefill_op.LAST_PLAN["prefill"].describe()


def test_chunks_are_merged() -> None:
    """The same call in one chunk and in many gives the same rows (the merge is exact), and the
    plan records the chunks."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 5, 12, generator=gen, dtype=torch.float64)
    kv_c = torch.randn(2, 70, 16, generator=gen, dtype=torch.float64)
    k_pe = torch.randn(2, 70, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(3 * 18, 16, generator=gen, dtype=torch.float64) / 4
    lengths = torch.tensor([70, 33], dtype=torch.int32)
    args = (q, kv_c, k_pe, lengths, None, weight, None, 0.3, 8)
    one, lse_one = torch.ops.mla.prefill(*args, 4096)
    assert prefill_op.LAST_PLAN["prefill"].num_chunks == 1
    many, lse_many = torch.ops.mla.prefill(*args, 16)
    assert prefill_op.LAST_PLAN["prefill"].num_chunks == 5  # 70 keys
    torch.testing.assert_close(many, one, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse_many, lse_one, rtol=1e-12, atol=1e-13)


def test_plan_sizes_chunks_from_the_memory_budget() -> None:
    shape = dict(batch=16, heads=16, q_len=8192, nope_dim=128, rope_dim=64, v_dim=128)
    plan = plan_prefill(
        **shape, dtype=torch.bfloat16, device_type="cuda", keys_read=32768, page_size=64
    )
    per_key = 16 * (16 * 256 + 16 * 192 + 8192) * 2
    assert plan.kernel == "cudnn" and plan.chunk_tokens % 64 == 0
    assert plan.chunk_bytes <= prefill_op.DEFAULT_CHUNK_BYTES < plan.chunk_bytes + 64 * per_key
    assert plan.num_chunks == -(-32768 // plan.chunk_tokens)
    small = plan_prefill(**shape, dtype=torch.bfloat16, device_type="cuda", keys_read=100)
    assert small.num_chunks == 1 and small.chunk_tokens == 112  # one chunk, no wider than needed
    assert small.kernel == "cudnn"  # the LSE is wanted
    no_lse = plan_prefill(
        **shape, dtype=torch.bfloat16, device_type="cuda", keys_read=100, need_lse=False
    )
    assert no_lse.kernel == "sdpa"  # one chunk, no LSE: PyTorch's own choice of kernel
    forced = plan_prefill(
        **shape, dtype=torch.bfloat16, device_type="cuda", keys_read=100, kernel="efficient"
    )
    assert forced.kernel == "efficient" and forced.why("kernel") == "given"
    with pytest.raises(ValueError, match="'sdpa' takes one chunk without LSE"):
        plan_prefill(
            **shape, dtype=torch.bfloat16, device_type="cuda", keys_read=100, kernel="sdpa"
        )
    with pytest.raises(ValueError, match="cannot run this call"):
        plan_prefill(**shape, dtype=torch.float32, device_type="cpu", keys_read=1, kernel="cudnn")
    with pytest.raises(ValueError, match="kernel must be one of"):
        plan_prefill(**shape, dtype=torch.bfloat16, device_type="cuda", keys_read=1, kernel="x")
    given = plan_prefill(
        **shape, dtype=torch.float32, device_type="cpu", keys_read=100, page_size=5, chunk_tokens=7
    )
    assert given.chunk_tokens == 80 and given.kernel == "flash_cpu"  # lcm(16, 5) = 80
    assert plan_prefill(**shape, dtype=torch.float64, device_type="cuda", keys_read=9).kernel == (
        "math"
    )
    odd = dict(shape, v_dim=8)
    assert "multiples of 16" in plan_prefill(
        **odd, dtype=torch.bfloat16, device_type="cuda", keys_read=9
    ).why("kernel")
    assert (
        plan_prefill(**shape, dtype=torch.bfloat16, device_type="cuda", keys_read=0).num_chunks == 0
    )


def test_bad_arguments_are_named() -> None:
    args, _, _ = random_case(3, torch.float32)
    q, kv_c, k_pe, lengths, block_table, weight, mask, scale, nope = args
    with pytest.raises(ValueError, match="nope_dim"):
        torch.ops.mla.prefill(q, kv_c, k_pe, lengths, block_table, weight, mask, scale, nope + 1)
    with pytest.raises(ValueError, match="kv_b_weight"):
        torch.ops.mla.prefill(q, kv_c, k_pe, lengths, block_table, weight[:, 1:], mask, scale, nope)
    with pytest.raises(ValueError, match="attn_mask must be"):
        bad = torch.ones(1, 1, 1, 1, 1, dtype=torch.bool)
        torch.ops.mla.prefill(q, kv_c, k_pe, lengths, block_table, weight, bad, scale, nope)
    with pytest.raises(ValueError, match="cache_seqlens must be in"):
        too_long = lengths + 10**6
        torch.ops.mla.prefill(q, kv_c, k_pe, too_long, block_table, weight, mask, scale, nope)
    with pytest.raises(ValueError, match="chunk_tokens"):
        torch.ops.mla.prefill(q, kv_c, k_pe, lengths, block_table, weight, mask, scale, nope, -1)
    with pytest.raises(TypeError, match="kv_b_weight must have q's dtype"):
        torch.ops.mla.prefill(q, kv_c, k_pe, lengths, block_table, weight.double(), mask, scale,
                              nope)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", range(12))
def test_cuda_matches_the_expanded_form(seed: int, dtype: torch.dtype) -> None:
    """On CUDA, each kernel that takes the shapes (cuDNN, memory-efficient, public SDPA without
    the LSE, plain where head dims are not multiples of 16), chunks merged, against float64 truth
    at the dtype's rounding."""
    args, chunk_tokens, truth = random_case(200 + seed, dtype)
    cuda_args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    want_out, want_lse = expanded_attention64(*truth)
    seen = torch.isfinite(want_lse)
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}[dtype]
    q_dim, v_dim = args[0].shape[-1], want_out.shape[-1]
    fused = q_dim % 16 == 0 and v_dim % 16 == 0
    runs = [("", True), ("efficient", True), ("", False)] if fused else [("", True)]
    for kernel, need_lse in runs:
        out, lse = torch.ops.mla.prefill(*cuda_args, chunk_tokens, need_lse, kernel)
        torch.cuda.synchronize()
        plan = prefill_op.LAST_PLAN["prefill"]
        if not kernel:
            with_lse = "efficient" if dtype == torch.float32 else "cudnn"
            lse_kernel = need_lse or plan.num_chunks > 1
            expected = "math" if not fused else with_lse if lse_kernel else "sdpa"
            assert plan.kernel == expected, plan.describe()
        assert out.is_contiguous() and lse.is_contiguous(), plan.describe()  # the fake's layout
        got = out.cpu().double()
        torch.testing.assert_close(got, want_out, rtol=tolerance, atol=tolerance, msg=plan.describe)
        assert (got[~seen] == 0).all()
        if need_lse:
            lse = lse.cpu().double()
            # keys are expanded in the dtype, as the original does: scores round with them
            torch.testing.assert_close(lse[seen], want_lse[seen], rtol=tolerance, atol=tolerance)
            assert torch.isneginf(lse[~seen]).all()
        else:
            assert lse.numel() == 0
