"""The absorbed query ``[q_nope @ W_UK, q_pe]``: loaded for the program's rows, stored into shared
memory as the scores' B operand (a float8 cache's query moved into fp16's range by a power of
two), or kept in registers as the A operand of one-scorer programs."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
)

from .float8 import _abs_max, _e4m3_terms


@gluon.jit
def _load_query(
    Q, b64, row_block, stride_qb, stride_qs, stride_qh, stride_qd, S_Q: gl.constexpr,
    H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr,
    HAS_PE: gl.constexpr, io_layout: gl.constexpr,
):  # fmt: skip
    """The query block (rows ``row_block * BLOCK_M ...`` of heads x S_q; rows past ``S_q * H``
    are zeros) into registers: the nope part ``[BLOCK_M, L]`` and the RoPE part ``[BLOCK_M, R]``
    (the nope part again without one). Split from ``_store_query`` so a program can issue these
    loads before its first tiles' copies and store them after."""
    rows_io = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    q_row = Q + b64 * stride_qb + (rows_io // H) * stride_qs + (rows_io % H) * stride_qh
    row_ok_io = rows_io < S_Q * H
    offs_l_io = gl.arange(0, L, layout=gl.SliceLayout(0, io_layout))
    q_nope = gl.load(q_row[:, None] + offs_l_io[None, :] * stride_qd, mask=row_ok_io[:, None])
    if HAS_PE:
        offs_r_io = gl.arange(0, R, layout=gl.SliceLayout(0, io_layout))
        q_pe = gl.load(
            q_row[:, None] + (L + offs_r_io[None, :]) * stride_qd, mask=row_ok_io[:, None]
        )
    else:
        q_pe = q_nope
    return q_nope, q_pe


@gluon.jit
def _store_query(
    q_nope, q_pe, q_smem, qpe_smem, kv_scale, HAS_PE: gl.constexpr, KV_FP8: gl.constexpr,
    FLOAT8_PRODUCTS: gl.constexpr = False, PE_FP8: gl.constexpr = False,
):  # fmt: skip
    """``_load_query``'s parts into shared memory (``q_smem [BLOCK_M, L]``, ``qpe_smem``).
    Returns the nope scores' scale (``kv_scale``, times the power of two below for a float8
    cache). ``FLOAT8_PRODUCTS``: ``q_smem`` is e4m3 ``[2 BLOCK_M, L]``, the query's two terms
    (``_e4m3_terms``). ``PE_FP8`` (a float8 ``k_pe``): ``qpe_smem`` is e4m3 ``[2 BLOCK_M, R]``,
    the RoPE part's two terms under the same power of two, so both parts' scores add up in one
    accumulator with one scale; converted (not ``FLOAT8_PRODUCTS``), the RoPE part in fp16 under
    the nope part's power of two, so both parts' scores take the one scale."""
    dtype: gl.constexpr = q_smem.dtype
    nope_scale = kv_scale
    if FLOAT8_PRODUCTS:
        # A power of two puts the largest value in (224, 448], e4m3's top octave.
        q32 = q_nope.to(gl.float32)
        q_max = _abs_max(q32)
        if PE_FP8:
            qpe32 = q_pe.to(gl.float32)
            q_max = gl.maximum(q_max, _abs_max(qpe32))
        q_shift = gl.where(q_max > 0.0, gl.ceil(gl.log2(q_max / 448.0)), 0.0)
        q_smem.store(_e4m3_terms(q32 * gl.exp2(-q_shift)))
        if PE_FP8:
            qpe_smem.store(_e4m3_terms(qpe32 * gl.exp2(-q_shift)))
        nope_scale = kv_scale * gl.exp2(q_shift)
    elif KV_FP8:
        # The nope query in fp16 (exact for bf16): a power of two puts its largest value in
        # (2^13, 2^14], clear of fp16's overflow and subnormals (bf16 reaches 3e38); the nope
        # scores take it back with kv_scale, in float32 (_tile_scores). PE_FP8: the RoPE query
        # too, under the same power of two, against the tile's k_pe converted to fp16.
        q32 = q_nope.to(gl.float32)
        q_max = _abs_max(q32)
        if PE_FP8:
            qpe32 = q_pe.to(gl.float32)
            q_max = gl.maximum(q_max, _abs_max(qpe32))
        q_shift = gl.where(q_max > 0.0, gl.ceil(gl.log2(q_max)) - 14.0, 0.0)
        q_smem.store((q32 * gl.exp2(-q_shift)).to(dtype))
        if PE_FP8:
            qpe_smem.store((qpe32 * gl.exp2(-q_shift)).to(dtype))
        nope_scale = kv_scale * gl.exp2(q_shift)
    else:
        q_smem.store(q_nope)
    if HAS_PE and not PE_FP8:
        qpe_smem.store(q_pe)
    fence_async_shared()
    return nope_scale


@gluon.jit
def _load_query_operand(
    Q, b64, row_block, stride_qb, stride_qs, stride_qh, stride_qd, S_Q: gl.constexpr,
    H: gl.constexpr, COL0: gl.constexpr, WIDTH: gl.constexpr, BLOCK_M: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    """Columns ``[COL0, COL0 + WIDTH)`` of the query block, ``[BLOCK_M, WIDTH]`` loaded from
    global memory in ``layout`` (rows past ``S_q * H`` are zeros): a query-in-registers
    program's nope query (then taken into the wgmma's A-operand layout through a ring slot) and
    its RoPE query."""
    rows = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    q_row = Q + b64 * stride_qb + (rows // H) * stride_qs + (rows % H) * stride_qh
    offs_l = COL0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    return gl.load(q_row[:, None] + offs_l[None, :] * stride_qd, mask=(rows < S_Q * H)[:, None])
