"""Triton kernels for ``mla::decode`` (split-KV MQA over the latent cache) and ``mla::combine``.

Decode: one program per (sequence, block of query rows, split). Query rows are heads x S_q
flattened, so one KV tile loaded from the cache feeds every head of the block (MQA: a single KV
head). Scores are one 576-wide dot written as two: ``q_nope . kv_c`` (L) plus ``q_pe . k_pe`` (R),
so nothing is padded to 1024; the same ``kv_c`` tile is the value for ``P @ V``. Softmax runs in the
exp2 domain with the scale folded in. Partials are written in float32 with ``lse = m + log l``.
KV tiles come either from per-token addresses (any page size, any strides) or, when a tile lies
inside one page and rows are 16-byte aligned, from the copy engine (TMA) on Hopper. A float8 cache
is converted per tile, to fp16 for a 16-bit query (exact, one instruction per pair); its scale is
folded into the scores and the output. An optional
``[B, S_q, T_m]`` mask (bool, or a float bias added to the scaled scores) is read per tile and
shared by the heads of a query position.

Safety: every cache read is masked to the split, the sequence length and the cache's capacity
(TMA zero-fills outside the descriptor); a token inside ``cache_seqlens`` whose location is outside
the cache (page id out of range, length beyond capacity) is never read: its rows come out NaN
instead, with no host sync. Rows past a sequence's end are zeroed before ``P @ V`` (stale memory
may hold NaN).

This module imports triton; ``ops.py`` imports it only when a kernel is needed.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import planner
from .launcher import Data, PreparedLaunch
from .plan_cache import PlanCache, follow
from .planner import MIN_CHUNK, SPLIT_GRANULE, log, multiprocessor_count, rows_per_program
from .reference import MASK_HIDDEN, accumulation_dtype


@triton.jit
def _e4m3_to_f16(x):
    """float8 e4m3 -> fp16 (exact) by ``cvt.rn.f16x2.e4m3x2``, four values per call; sm_89+.

    Declared impure on purpose: the compiler moves a pure conversion (Triton's own cast included)
    past the shared-memory read of the ``P @ V`` operand, where a float8 tile can only be read
    byte by byte; an impure one stays here, so the tile is converted once in registers and
    stored as fp16 (a8: 259 -> 206-219 us on an H100, NOTES.md item 19).
    """
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _gather_tile_scores(
    KV_C, K_PE, BLOCK_TABLE, q_nope, q_pe, b64, offs_n, tok_ok, offs_l, offs_r,
    stride_cp, stride_ct, stride_cd, stride_pp, stride_pt, stride_pd, stride_btb, stride_btp,
    NUM_PAGES, MAX_PAGES, CAPACITY, nope_scale, pe_scale,
    L: tl.constexpr, R: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, PAGED: tl.constexpr, HAS_PE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PTX_CONVERT: tl.constexpr,
):  # fmt: skip
    """One KV tile by per-token address (any page size, any strides) and its scores.

    Returns the value tile ``kv [BLOCK_N, BLOCK_L]`` in q_nope's dtype (a float8 cache is converted
    here, its scale left to the caller), ``qk [BLOCK_M, BLOCK_N]`` (dequantised, not yet
    softmax-scaled) and the tokens actually read (in the split and at a valid cache location).
    """
    if PAGED:
        page_pos = offs_n // PAGE_SIZE
        slot = offs_n % PAGE_SIZE
        in_table = page_pos < MAX_PAGES
        page = tl.load(
            BLOCK_TABLE + b64 * stride_btb + page_pos * stride_btp,
            mask=tok_ok & in_table,
            other=-1,
        )
        loc_ok = in_table & (page >= 0) & (page < NUM_PAGES)
        page64 = tl.where(tok_ok & loc_ok, page, 0).to(tl.int64)
    else:
        slot = offs_n
        loc_ok = offs_n < CAPACITY
        page64 = tl.zeros_like(offs_n).to(tl.int64) + b64
    ld = tok_ok & loc_ok
    slot64 = tl.where(ld, slot, 0).to(tl.int64)
    kc_row = KV_C + page64 * stride_cp + slot64 * stride_ct  # [BLOCK_N]
    kv = tl.load(
        kc_row[:, None] + offs_l[None, :] * stride_cd,
        mask=ld[:, None] & (offs_l[None, :] < L),
        other=0.0,
    )  # [BLOCK_N, BLOCK_L]
    kv = _e4m3_to_f16(kv) if PTX_CONVERT else kv.to(q_nope.dtype)
    qk = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION) * nope_scale
    if HAS_PE:
        kp_row = K_PE + page64 * stride_pp + slot64 * stride_pt
        kpe = tl.load(
            kp_row[:, None] + offs_r[None, :] * stride_pd,
            mask=ld[:, None] & (offs_r[None, :] < R),
            other=0.0,
        ).to(q_pe.dtype)  # [BLOCK_N, BLOCK_R]
        qk += tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PRECISION) * pe_scale
    return kv, qk, ld


@triton.jit
def _store_partial(
    O_PART, LSE_PART, out, lse, b64, s_idx, h_idx, split, offs_l, row_ok, l_ok, stride_ob,
    stride_os, stride_oh, stride_ok, stride_od, stride_lb, stride_ls, stride_lh, stride_lk,
):  # fmt: skip
    """One split's ``out [BLOCK_M, BLOCK_L]`` and ``lse [BLOCK_M]`` into the partials."""
    o_row = O_PART + b64 * stride_ob + s_idx * stride_os + h_idx * stride_oh + split * stride_ok
    tl.store(
        o_row[:, None] + offs_l[None, :] * stride_od,
        out.to(O_PART.dtype.element_ty),
        mask=row_ok[:, None] & l_ok[None, :],
    )
    lse_ptr = LSE_PART + b64 * stride_lb + s_idx * stride_ls + h_idx * stride_lh + split * stride_lk
    tl.store(lse_ptr, lse.to(LSE_PART.dtype.element_ty), mask=row_ok)


@triton.jit
def _mla_decode_kernel(
    Q,  # [B, S_q, H, L+R]
    KV_C,  # [num_pages, page_size, L]  (non-paged: [B, T, L], a "page" per sequence)
    K_PE,  # [num_pages, page_size, R]
    SEQLENS,  # [B] int32
    BLOCK_TABLE,  # [B, max_pages] int32 (unused when not PAGED)
    O_PART,  # [B, S_q, H, num_splits, L] float32
    LSE_PART,  # [B, S_q, H, num_splits] float32
    KV_DESC,  # TMA descriptor of kv_c as [num_pages * page_size, L] (USE_TMA), else None
    PE_DESC,  # TMA descriptor of k_pe as [num_pages * page_size, R] (USE_TMA and HAS_PE)
    MASK,  # [B, S_q, T_m] uint8 (bool) or float attention mask (HAS_MASK), else None
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_cp,
    stride_ct,
    stride_cd,
    stride_pp,
    stride_pt,
    stride_pd,
    stride_btb,
    stride_btp,
    stride_ob,
    stride_os,
    stride_oh,
    stride_ok,
    stride_od,
    stride_lb,
    stride_ls,
    stride_lh,
    stride_lk,
    stride_mb,
    stride_ms,
    stride_mt,
    MASK_LEN,  # T_m: keys at and past it are hidden
    NUM_PAGES,
    MAX_PAGES,
    CAPACITY,  # tokens per sequence when not PAGED
    scale_log2,  # softmax_scale * log2(e)
    nope_scale,  # dequantisation scale of kv_c (1.0 unless float8)
    pe_scale,  # dequantisation scale of k_pe (1.0 unless float8)
    num_splits,
    total_splits,  # 0: each sequence cut into num_splits even chunks (planner.split_bounds)
    batch,
    S_Q: tl.constexpr,
    H: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    GRANULE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,  # PAGED and PAGE_SIZE % BLOCK_N == 0: a tile is rows of one page
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    MASK_HIDDEN: tl.constexpr,
    KV_F16: tl.constexpr,  # float8 kv_c with a 16-bit query: nope dots and P @ V in fp16
    PTX_CONVERT: tl.constexpr,  # KV_F16 on sm_89+ CUDA: float8 tiles converted by _e4m3_to_f16
    BALANCED: tl.constexpr,  # total_splits > 0
    ONE_POSITION: tl.constexpr,  # S_Q == 1 or H % BLOCK_M == 0: a program's rows share one s
    BLOCK_B: tl.constexpr,  # sequences summed per step when BALANCED
    FILL_EMPTY: tl.constexpr,  # an empty split writes its zero out (else only its -inf lse)
    LAUNCH_DEPENDENTS: tl.constexpr,  # let the next kernel (the combine) launch early (PDL)
):
    pid_bm = tl.program_id(0)
    split = tl.program_id(1)
    num_row_blocks = tl.cdiv(S_Q * H, BLOCK_M)
    b = pid_bm // num_row_blocks
    row_block = pid_bm % num_row_blocks
    b64 = b.to(tl.int64)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query row = s * H + h
    row_ok = rows < S_Q * H
    s_idx = rows // H
    h_idx = rows % H
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < L

    # This split's token range (same formula as planner.split_bounds).
    seqlen = tl.load(SEQLENS + b)
    per_split = tl.cdiv(tl.cdiv(seqlen, num_splits), GRANULE) * GRANULE
    if BALANCED:
        # One chunk length for the whole batch, from its total length (every program sums the
        # lengths: B int32 from L2, against the thousands of cache rows it reads).
        total = tl.zeros([BLOCK_B], dtype=tl.int64)
        for b0 in range(0, batch, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            total += tl.load(SEQLENS + offs_b, mask=offs_b < batch, other=0).to(tl.int64)
        balanced = tl.cdiv(tl.cdiv(tl.sum(total, 0), total_splits), GRANULE) * GRANULE
        per_split = tl.maximum(per_split, balanced.to(tl.int32))
    chunk = tl.maximum(per_split, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)

    if start >= end:
        # An empty split (past its sequence's end): the contract's zeros and -inf, without reading
        # the query (FILL_EMPTY off: the -inf alone). A balanced plan leaves up to
        # RAGGED_HEADROOM x more splits than it fills.
        _store_partial(
            O_PART, LSE_PART, tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32),
            tl.full([BLOCK_M], float("-inf"), tl.float32), b64, s_idx, h_idx, split, offs_l,
            row_ok, l_ok & FILL_EMPTY, stride_ob, stride_os, stride_oh, stride_ok, stride_od,
            stride_lb, stride_ls, stride_lh, stride_lk,
        )  # fmt: skip
        return

    q_row = Q + b64 * stride_qb + s_idx * stride_qs + h_idx * stride_qh  # [BLOCK_M]
    q_nope = tl.load(
        q_row[:, None] + offs_l[None, :] * stride_qd,
        mask=row_ok[:, None] & l_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_L]
    qk_nope_scale = nope_scale
    if KV_F16:
        # A float8 kv_c becomes fp16 in one instruction per pair, exactly (e4m3 is a subset of
        # fp16); to bf16 it takes that plus one more per element (NOTES.md item 19). The nope
        # dots and P @ V then run in fp16, so the bf16 query moves
        # into fp16's normal range by a power of two (exact; its largest value lands in
        # (2^13, 2^14], clear of overflow and of subnormals), given back with the scores' scale.
        q_max = tl.max(tl.max(tl.abs(q_nope.to(tl.float32)), 1), 0)
        q_shift = tl.where(q_max > 0.0, tl.ceil(tl.log2(q_max)) - 14.0, 0.0)
        q_nope = (q_nope.to(tl.float32) * tl.exp2(-q_shift)).to(tl.float16)
        qk_nope_scale = nope_scale * tl.exp2(q_shift)
    if HAS_PE:
        q_pe = tl.load(
            q_row[:, None] + (L + offs_r[None, :]) * stride_qd,
            mask=row_ok[:, None] & (offs_r[None, :] < R),
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
    else:
        q_pe = tl.zeros([BLOCK_M, BLOCK_R], dtype=q_nope.dtype)

    if ONE_POSITION:
        # Every row here is one query position (S_q = 1, or heads a multiple of BLOCK_M): key
        # visibility and the mask row are one [1, BLOCK_N] vector broadcast over the heads, not a
        # [BLOCK_M, BLOCK_N] tile of equal rows. On an H100 a float mask then costs 1.04-1.06x the
        # unmasked call instead of 1.12-1.13x (benchmarks/NOTES.md item 22).
        key_pos = tl.zeros([1], dtype=tl.int32) + (row_block * BLOCK_M) // H
        pos_ok = key_pos < S_Q
    else:
        key_pos = s_idx  # [BLOCK_M]
        pos_ok = row_ok
    # Causal: query i sees keys [0, seqlen - S_q + i]; otherwise all of [0, seqlen).
    last_key = seqlen - S_Q + key_pos if CAUSAL else tl.zeros_like(key_pos) + seqlen - 1

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    n_bad = tl.zeros([BLOCK_N], dtype=tl.int32)

    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < end
        # Visibility from the lengths, causality and the mask, known before any cache row is read:
        # [BLOCK_M, BLOCK_N], or [1, BLOCK_N] when ONE_POSITION.
        visible = tok_ok[None, :] & (offs_n[None, :] <= last_key[:, None])
        if HAS_MASK:
            # One mask row per query position, shared by its heads (rows of one s hit the cache).
            in_mask = pos_ok[:, None] & tok_ok[None, :] & (offs_n[None, :] < MASK_LEN)
            m_ptr = MASK + b64 * stride_mb + key_pos[:, None] * stride_ms
            m_ptr += offs_n[None, :] * stride_mt
            if MASK_IS_BOOL:
                visible = visible & in_mask & (tl.load(m_ptr, mask=in_mask, other=0) != 0)
            else:
                bias = tl.load(m_ptr, mask=in_mask, other=float("-inf")).to(tl.float32)
                # At or below MASK_HIDDEN a bias hides the key (finfo.min masks): adding it would
                # overflow in log2 units and leave the split's lse unable to hold log(n).
                visible = visible & (bias > MASK_HIDDEN)
            # A key hidden from every row here (left padding) is not read at all: it may hold NaN
            # (Hugging Face's eager float64 prefill writes NaN at pad positions), and leaving it
            # out of the load predicate costs nothing, where zeroing the loaded tile afterwards
            # cost a pass over it (2.1-2.6x slower, benchmarks/NOTES.md item 15).
            tok_ok = tok_ok & (tl.max(visible.to(tl.int32), 0) > 0)
        if USE_TMA:
            # The tile lies inside one page (split starts are multiples of GRANULE, a multiple of
            # BLOCK_N): one page id, one bulk copy per operand. Rows past the cache's end come
            # back as zeros from the copy engine, so a bad page id never reads out of bounds.
            page_pos = tile_start // PAGE_SIZE
            page = tl.load(
                BLOCK_TABLE + b64 * stride_btb + page_pos * stride_btp,
                mask=page_pos < MAX_PAGES,
                other=-1,
            )
            page_ok = (page_pos < MAX_PAGES) & (page >= 0) & (page < NUM_PAGES)
            n_bad += (tok_ok & ~page_ok).to(tl.int32)
            row0 = tl.where(page_ok, page, NUM_PAGES) * PAGE_SIZE + tile_start % PAGE_SIZE
            ld = tok_ok & page_ok
            # Rows past the sequence's end hold stale cache data (maybe NaN): zero them so that
            # p = 0 times them stays 0 in P @ V.
            # Operation order matters to the compiled loop (NOTES.md item 20): the 16-bit tile as
            # one expression (predicate first); as three statements a masked decode cost
            # 1.34-1.92x the unmasked one on an H100 instead of 1.04-1.10x. The float8 PTX path
            # stays in the order it was measured in (item 19b).
            if PTX_CONVERT:
                kv = KV_DESC.load([row0, 0])
                kv = _e4m3_to_f16(kv)
                kv = tl.where(ld[:, None], kv, 0.0)
            else:
                kv = tl.where(ld[:, None], KV_DESC.load([row0, 0]).to(q_nope.dtype), 0.0)
            qk = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION) * qk_nope_scale
            if HAS_PE:
                kpe = tl.where(ld[:, None], PE_DESC.load([row0, 0]).to(q_pe.dtype), 0.0)
                qk += tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PRECISION) * pe_scale
        else:
            kv, qk, ld = _gather_tile_scores(
                KV_C,
                K_PE,
                BLOCK_TABLE,
                q_nope,
                q_pe,
                b64,
                offs_n,
                tok_ok,
                offs_l,
                offs_r,
                stride_cp,
                stride_ct,
                stride_cd,
                stride_pp,
                stride_pt,
                stride_pd,
                stride_btb,
                stride_btp,
                NUM_PAGES,
                MAX_PAGES,
                CAPACITY,
                qk_nope_scale,
                pe_scale,
                L,
                R,
                PAGE_SIZE,
                BLOCK_L,
                BLOCK_R,
                PAGED,
                HAS_PE,
                DOT_PRECISION,
                PTX_CONVERT,
            )
            n_bad += (tok_ok & ~ld).to(tl.int32)
        qk = qk * scale_log2
        visible = visible & ld[None, :]
        if HAS_MASK and not MASK_IS_BOOL:
            qk += tl.where(bias > MASK_HIDDEN, bias, 0.0) * 1.4426950408889634
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(qk - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m_i = m_new

    if LAUNCH_DEPENDENTS:
        # The combine may launch once every program is past its loop (an empty split, which
        # returned above, counts at its exit); it waits on the device for this grid's writes.
        # At the entry instead, the benchmark's calls took 0.5-1.3 us longer on an H200 with
        # this kernel ((c), (d), (e); (b) level), as they did with the wgmma kernel (NOTES.md
        # items 84 and 85).
        gdc_launch_dependents()
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None] * nope_scale  # the value is kv_c: dequantise once, here
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    poisoned = tl.sum(n_bad, 0) > 0
    out = tl.where(poisoned, float("nan"), out)
    lse = tl.where(poisoned, float("nan"), lse)

    _store_partial(
        O_PART, LSE_PART, out, lse, b64, s_idx, h_idx, split, offs_l, row_ok, l_ok, stride_ob,
        stride_os, stride_oh, stride_ok, stride_od, stride_lb, stride_ls, stride_lh, stride_lk,
    )  # fmt: skip


@triton.jit
def _mla_combine_kernel(
    O_PART,  # [rows, S, L]
    LSE_PART,  # [rows, S]
    OUT,  # [rows, L]
    LSE,  # [rows]
    stride_or,
    stride_ok,
    stride_od,
    stride_lr,
    stride_lk,
    stride_out_r,
    stride_out_d,
    NUM_SPLITS,
    L,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
    ACC: tl.constexpr,
    WAIT_PRIMARY: tl.constexpr,  # launched early (PDL): wait for the previous kernel's writes
):
    if WAIT_PRIMARY:
        # Nothing is read or written before the decode's partials are complete and visible.
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    l_block = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    lse_s = tl.load(LSE_PART + row * stride_lr + offs_s * stride_lk, mask=s_ok, other=float("-inf"))
    lse_s = lse_s.to(ACC)
    poisoned = tl.sum((lse_s != lse_s).to(tl.int32), 0) > 0  # any NaN
    lse_max = tl.max(lse_s, 0)
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp(lse_s - shift)
    total = tl.sum(weight, 0)
    lse = tl.where(total == 0.0, float("-inf"), shift + tl.log(tl.where(total == 0.0, 1.0, total)))
    weight = weight / tl.where(total == 0.0, 1.0, total)
    read = s_ok & (weight > 0.0)  # an empty split's output is never read
    lse = tl.where(poisoned, float("nan"), lse)
    if l_block == 0:
        tl.store(LSE + row, lse.to(LSE.dtype.element_ty))
    # Each program merges one BLOCK_L-wide column block of the row (the weights are recomputed
    # per block: a few exps, against reading num_splits x BLOCK_L partial values).
    offs_l = l_block * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = offs_l < L
    part = tl.load(
        O_PART + row * stride_or + offs_s[:, None] * stride_ok + offs_l[None, :] * stride_od,
        mask=read[:, None] & l_ok[None, :],
        other=0.0,
    ).to(ACC)
    out = tl.sum(part * weight[:, None], 0)
    out = tl.where(poisoned, float("nan"), out)
    tl.store(
        OUT + row * stride_out_r + offs_l * stride_out_d, out.to(OUT.dtype.element_ty), mask=l_ok
    )


# Sequence lengths one decode program sums per step for a balanced split (``total_splits``).
# Fixed, not the batch's power of two: one compiled kernel for every batch size, and on an H100
# a 32-wide block left the 64-row kernel with 168 spilled registers instead of 22 (case (b) 1.57x
# slower); 128- and 1024-wide blocks ran as fast as the unbalanced kernel (benchmarks/NOTES.md
# item 21).
LENGTHS_PER_STEP = 128

# The compiled kernel of the latest launch, for diagnostics (registers, spills, PTX).
LAST_LAUNCH: dict[str, object] = {}


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (uninitialised: the kernels write every element).

    Tests replace this with an allocator that fills NaN, to prove that claim.
    """
    return torch.empty(shape, dtype=dtype, device=device)


def _next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the decode kernel: rows per program, tokens per KV tile, warps, pipeline depth."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool | None = None  # None: whenever tma_path() allows it
    # float8 kv_c, 16-bit query: nope dots and P @ V in fp16 (False: Triton kernel, bf16 dots)
    fp8_in_f16: bool = True
    fp8_ptx_convert: bool = True  # ... converted by inline PTX where it compiles (sm_89+ CUDA)
    use_wgmma: bool | None = None  # None: the Gluon wgmma kernel whenever wgmma_path() allows it


def has_copy_engine(device: torch.device) -> bool:
    """Tensor-memory-accelerator (bulk tensor copy) hardware: Hopper and later.

    Tests replace this to run the TMA path in Triton's interpreter, which emulates descriptors.
    """
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): CUDA (not ROCm), compute capability
    >= 9, compiled kernels. The decode kernels let the combine launch while their last programs
    run, and the combine waits for their writes on the device: its launch latency leaves the
    critical path (inside CUDA graphs too, as a programmatic edge)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def has_e4m3_convert(device: torch.device) -> bool:
    """The PTX float8 e4m3 -> fp16 conversion: CUDA (not ROCm), compute capability >= 8.9, and
    compiled kernels (Triton's interpreter runs no inline PTX)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def tma_path(
    kv_c: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor | None, block_n: int
) -> tuple[bool, str]:
    """Whether KV tiles can be fetched by the copy engine (TMA) and, if not, why."""
    if not has_copy_engine(kv_c.device):
        return False, "needs a CUDA device of compute capability >= 9 (Hopper)"
    if block_table is None:
        return False, "cache is not paged"
    page_size = kv_c.shape[1]
    if page_size % block_n:
        return False, f"page_size {page_size} is not a multiple of the {block_n}-token tile"
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[-1] == 0:
            continue
        width = t.shape[-1]
        if width & (width - 1) or width * t.element_size() < 16:
            return False, f"{name} width {width} is not a power of two of >= 16 bytes"
        if t.stride(2) != 1 or t.stride(0) != page_size * t.stride(1):
            return False, f"{name} rows are not a 2-D [tokens, width] view (strides {t.stride()})"
        if (t.stride(1) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False, f"{name} rows or base are not 16-byte aligned"
    return True, "paged, page-aligned tiles, 16-byte aligned rows"


def has_wgmma(device: torch.device) -> bool:
    """Warpgroup MMA (``wgmma``): CUDA compute capability 9.0 exactly (Hopper; Blackwell has
    other tensor-core instructions), compiled kernels, and Triton's Gluon frontend importable."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from . import wgmma_decode  # noqa: F401
    except ImportError:  # a Triton without Gluon's Hopper module
        return False
    return True


def shared_memory_optin(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (``DEFAULT_SHARED_MEMORY`` off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SHARED_MEMORY
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Not functools.cache: dynamo traces this when the planner asks under torch.compile.
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def wgmma_tiling(query_rows: int) -> tuple[int, int]:
    """``(block_m, num_warps)`` of the wgmma kernel for ``query_rows`` (heads x S_q) per sequence.

    Rows per program as the Triton kernel (``planner.rows_per_program``: 16, 32 or 64, the wgmma's
    N). 16-row programs are one warpgroup (O^T is 64 float32 registers per thread); 32 and 64 rows
    take two warpgroups, which split the scores' rows (64 rows over a 16-bit cache: tokens, with
    the rows on M, ``wgmma_decode.default_rows_on_m``) and the output's latent columns, so the
    output stays at 64 or 128 registers per thread (offline sm_90 compile: 165 / 228 registers,
    no spills). 64-row programs whose 16-bit tiles arrive by TMA are one-scorer programs instead
    (``wgmma_decode.default_one_scorer``): the launch's ``num_warps`` is then 4, warpgroup 0's,
    and warpgroup 1 is a partition of its own.
    """
    block_m = rows_per_program(query_rows)
    return block_m, 4 if block_m <= 16 else 8


def wgmma_shared_memory(
    block_m: int, kv_len: int, rope_len: int, num_stages: int = 2, float8: bool = False
) -> int:
    """Upper bound on the wgmma kernel's shared memory in bytes: the 16-bit query block, the KV
    ring and ``P^T``, plus 2 KB for alignment padding and the ring's barriers. ``float8``: kv_c
    in e4m3 (one byte per value in the ring) plus the fp16 tile it is converted into (16-row
    programs that multiply in float8, ``wgmma_decode.default_float8_products``, need no such
    tile and take less: 101,932 bytes at two slots, offline sm_90). 64 rows,
    L=512, R=64, 16-bit: 231424 (the offline sm_90 compile allocates 230416; an H100 allows
    232448)."""
    from .wgmma_decode import BLOCK_N

    ring_row = kv_len * (1 if float8 else 2) + 2 * rope_len
    staging = 2 * BLOCK_N * kv_len if float8 else 0
    query = 2 * block_m * (kv_len + rope_len)
    return query + num_stages * BLOCK_N * ring_row + staging + 2 * BLOCK_N * block_m + 2048


def wgmma_stages(block_m: int, kv_len: int, rope_len: int, float8: bool, shared_memory: int) -> int:
    """Ring slots of the wgmma kernel: three where they fit in ``shared_memory`` (a float8 cache
    at 32 rows), else two (the fewest its pipeline takes). 16-row programs take two: over a
    float8 cache three were 1-2.5 % slower on four H100 machines (a8, d8, e8; NOTES.md item 51),
    their loop being bound by its one math warpgroup's chain of work per tile (its shared-memory
    traffic, item 55), not by the bytes in flight; a float8 query's loop, nearer its copies, was
    2-5 % slower with three too (items 52-56), and float8 products (their first build) with three
    to five slots 2.3-8 % slower on the H100, where the copies alone ran as fast with two as with
    five (item 57)."""
    if block_m <= 16:
        return 2
    fits = wgmma_shared_memory(block_m, kv_len, rope_len, 3, float8) <= shared_memory
    return 3 if fits else 2


def wgmma_plan_path(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
) -> tuple[bool, str]:
    """Whether ``mla::decode`` runs the Gluon wgmma kernel (``wgmma_decode``) and, if not, why,
    from shapes, dtypes and the device only (so the planner can ask under tracing too)."""
    if not has_wgmma(q.device):
        return False, "needs Hopper (compute capability 9.0), compiled kernels and Triton's Gluon"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q is {q.dtype}, the wgmma kernel takes bf16/fp16"
    float8 = kv_c.dtype == torch.float8_e4m3fn
    pe_fp8 = bool(k_pe.shape[-1]) and k_pe.dtype == torch.float8_e4m3fn
    if (kv_c.dtype != q.dtype and not float8) or (
        k_pe.shape[-1] and k_pe.dtype != q.dtype and not (float8 and pe_fp8)
    ):
        return False, (
            f"cache dtypes ({kv_c.dtype}, {k_pe.dtype}) are neither q's ({q.dtype}) nor a "
            "float8_e4m3fn kv_c with k_pe in q's dtype or in float8_e4m3fn"
        )
    if pe_fp8:
        why = _float8_pe_refusal(k_pe)
        if why:
            return False, why
    if block_table is None:
        return False, "cache is not paged"
    # Widths the kernel was checked at on the GPU (L 64..512, R 0 or 16..64); wider rows need more
    # shared memory than two ring slots leave.
    widths = (("kv_c", kv_c.shape[-1], 64, 512), ("k_pe", k_pe.shape[-1], 16, 64))
    for name, width, lo, hi in widths:
        if (width or name == "kv_c") and (width & (width - 1) or not lo <= width <= hi):
            return False, f"{name} width {width} is not a power of two in [{lo}, {hi}]"
    block_m, _ = wgmma_tiling(q.shape[1] * q.shape[2])
    need = wgmma_shared_memory(block_m, kv_c.shape[-1], k_pe.shape[-1], 2, float8)
    have = shared_memory_optin(q.device)
    if need > have:
        return False, f"{block_m}-row programs need {need} bytes of shared memory, GPU has {have}"
    what = ("float8 kv_c and k_pe" if pe_fp8 else "float8 kv_c") if float8 else "bf16/fp16"
    mask = "no mask" if attn_mask is None else f"a {attn_mask.dtype} attn_mask"
    return True, f"Hopper, {what}, paged, {mask}"


def _float8_pe_refusal(k_pe: torch.Tensor) -> str | None:
    """Why the wgmma kernel cannot take a float8 ``k_pe`` (None if it can): it reads one at
    DeepSeek's RoPE width of 64, the width the GPU tests cover; 16-row programs of width 512 over
    whole 64-token pages multiply it in float8, every other program converts it to fp16 as it
    does a float8 ``kv_c`` (NOTES.md items 58 and 62). Elsewhere the Triton kernel takes the
    call."""
    if k_pe.shape[-1] != 64:
        return (
            "a float8_e4m3fn k_pe is read by the wgmma kernel at a width of 64; got k_pe width "
            f"{k_pe.shape[-1]}"
        )
    return None


def gather_path(
    kv_c: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor | None
) -> tuple[bool, str]:
    """Whether the wgmma kernel can gather a paged cache row by row with 16-byte ``cp.async``
    copies (any page size) and, if not, why: contiguous rows, page and token strides of whole
    16-byte units, a 16-byte aligned base."""
    if block_table is None:
        return False, "cache is not paged"
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[-1] == 0:
            continue
        unit = 16 // t.element_size()
        if t.stride(2) != 1 or t.stride(0) % unit or t.stride(1) % unit:
            return False, f"{name} rows are not contiguous 16-byte units (strides {t.stride()})"
        if t.data_ptr() % 16:
            return False, f"{name} base is not 16-byte aligned"
    return True, "rows gathered by cp.async"


def wgmma_loads(
    kv_c: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor | None
) -> tuple[str | None, str]:
    """How the wgmma kernel fetches KV tiles: ``"tma"`` (the copy engine, pages of whole 64-token
    tiles), ``"gather"`` (``cp.async`` row by row, any page size), or ``None``; and why."""
    from .wgmma_decode import BLOCK_N

    tma, why_tma = tma_path(kv_c, k_pe, block_table, BLOCK_N)
    if tma:
        return "tma", why_tma
    gather, why_gather = gather_path(kv_c, k_pe, block_table)
    if gather:
        return "gather", f"{why_gather} (no TMA: {why_tma})"
    return None, f"no TMA ({why_tma}) and no gather ({why_gather})"


def wgmma_path(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
) -> tuple[str | None, str]:
    """``wgmma_plan_path`` plus what only real tensors show: how the kernel fetches the cache's
    tiles (``wgmma_loads``: ``"tma"`` or ``"gather"``), or ``None`` if it cannot run; and why."""
    ok, why = wgmma_plan_path(q, kv_c, k_pe, block_table, attn_mask)
    if not ok:
        return None, why
    loads, why_loads = wgmma_loads(kv_c, k_pe, block_table)
    return loads, f"{why}; {why_loads}"


def _descriptor(t: torch.Tensor, block_n: int):
    """TMA descriptor of a paged ``[num_pages, page_size, W]`` view as ``[tokens, W]`` rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, width = t.shape[0] * t.shape[1], t.shape[2]
    return TensorDescriptor(t, [rows, width], [t.stride(1), 1], [block_n, width])


# Shared memory one program may use when the device cannot be asked (the interpreter): H100/H200.
DEFAULT_SHARED_MEMORY = 232448


def shared_memory_bytes(cfg: DecodeConfig, row_width: int, element_size: int, kv_width: int) -> int:
    """Shared memory of the decode kernel, bounded from above.

    row_width: padded row width (power-of-two L block plus power-of-two R block); kv_width: the
    power-of-two L block.

    The query block plus two or more KV tiles: pipelined, Triton keeps ``num_stages`` of them; with
    one stage it stages the tile through shared memory for the dots, which took as much as a second
    stage or less in every tiling compiled. The epilogue converts the float32 ``[block_m, L]``
    accumulator through shared memory too, which bounds 64-row programs at L = 1024 (256 KB).
    Plus 1 KB for barriers. Checked against ``metadata.shared`` of offline sm_90 compiles (NOTES.md
    items 8 and 76; ``test_shared_memory_bound_holds``).
    """
    tiles = max(cfg.num_stages, 2) * cfg.block_n
    loop = (cfg.block_m + tiles) * row_width * element_size
    epilogue = cfg.block_m * kv_width * 4
    return max(loop, epilogue) + 1024


def default_config(
    query_rows: int,
    kv_len: int,
    rope_len: int = 64,
    element_size: int = 2,
    shared_memory: int = DEFAULT_SHARED_MEMORY,
    float8_cache: bool = False,
) -> DecodeConfig:
    """The tiling used when none is given, shrunk until it fits ``shared_memory`` bytes.

    Measured on an H200 with L=512 (benchmarks/NOTES.md, sweeps of 2026-11-22): 16-row programs are
    fastest with 32-token tiles and 4 warps, 64-row programs with 64-token tiles and 8 warps; two
    pipeline stages beat three or four in both. On an H100, 64-row programs are 30-46 % slower
    with TMA loads than with per-token loads (NOTES.md item 17), so they use per-token loads;
    16-row programs keep TMA (3 % faster there). Over a float8 cache (tiles converted to fp16 in
    registers and stored to shared memory as fp16), 16-row programs are fastest with 64-token
    tiles and no pipelining on the H100 (item 19). fp32 needs smaller tiles to fit.
    """
    block_m = rows_per_program(query_rows)
    if _next_pow2(kv_len) <= 128:  # small test dims: registers are no concern
        cfg = DecodeConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=2)
    elif block_m <= 16 and float8_cache:
        cfg = DecodeConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=1)
    elif block_m <= 16:
        cfg = DecodeConfig(block_m=block_m, block_n=32, num_warps=4, num_stages=2)
    else:
        tma = False if block_m >= 64 else None
        cfg = DecodeConfig(block_m=block_m, block_n=64, num_warps=8, num_stages=2, use_tma=tma)
    kv_width = _next_pow2(kv_len)
    row = kv_width + (_next_pow2(rope_len) if rope_len else 0)
    # Stages past two first (one stage needs no less than two, shared_memory_bytes), then rows
    # down to 32, then tokens: at L=1024 (64 heads, bf16, H200) 32 x 32 tiles took 445 us where
    # 32 x 16 took 685 and 16 x 16 559 (NOTES.md item 76).
    while (need := shared_memory_bytes(cfg, row, element_size, kv_width)) > shared_memory:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_m > 32:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        elif cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > 16:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        else:
            raise ValueError(
                f"the decode kernel's smallest tiling needs {need} bytes of shared memory for "
                f"kv_c width {kv_len} and k_pe width {rope_len} at {element_size}-byte elements; "
                f"this GPU gives a program {shared_memory}"
            )
    return cfg


def _decode_path(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    config: DecodeConfig | None,
) -> tuple[DecodeConfig, str | None]:
    """The Triton kernel's tiling and whether the wgmma kernel takes the call instead (its loads,
    ``wgmma_loads``; None: the Triton kernel), logged with the reason at debug level."""
    if config is None:
        float8 = kv_c.dtype == torch.float8_e4m3fn
        smem = shared_memory_optin(q.device)
        config = default_config(
            q.shape[1] * q.shape[2], kv_c.shape[-1], k_pe.shape[-1], q.element_size(), smem, float8
        )
    loads, why = None, "turned off (DecodeConfig.use_wgmma=False)"
    if config.use_wgmma is not False:
        loads, why = wgmma_path(q, kv_c, k_pe, block_table, attn_mask)
        if loads and kv_c.dtype == torch.float8_e4m3fn and not config.fp8_in_f16:
            # The wgmma kernel computes a float8 cache in fp16 only.
            loads, why = None, "DecodeConfig.fp8_in_f16=False (the wgmma kernel uses fp16)"
        if config.use_wgmma and not loads:
            raise ValueError(f"DecodeConfig.use_wgmma=True, but the wgmma kernel cannot run: {why}")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("mla::decode: %s kernel (%s)", "Gluon wgmma" if loads else "Triton", why)
    return config, loads


def _on_device(device: torch.device):
    """The context for a launch on ``device``: its CUDA device made current (Triton launches on
    the current one), nothing off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class _DecodeKernel:
    """``mla::decode``'s kernel for one call signature: the Gluon wgmma kernel (``path``'s loads)
    or the Triton one, its choices made and its launch prepared (``launcher.PreparedLaunch``) at
    the first launch, from that call's shapes, strides and dtypes; later launches fill in the
    data only. ``record``: the choices, as ``LAST_LAUNCH`` reports them."""

    def __init__(
        self,
        path: tuple[DecodeConfig, str | None],
        causal: bool,
        num_splits: int,
        total_splits: int | None,
        fill_empty: bool,
    ) -> None:
        self.cfg, self.loads = path
        self.causal, self.num_splits, self.total_splits = causal, num_splits, total_splits
        self.fill_empty = fill_empty
        self.prepared: PreparedLaunch | None = None
        self.choices: dict[str, object] | None = None  # the wgmma kernel's (_wgmma_choices)
        self.record: dict[str, object] = {}
        self.use_tma = False

    def launch(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor,
        softmax_scale: float,
        kv_scale: float | None,
        attn_mask: torch.Tensor | None,
        merge_into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Launch into partials ``out``/``lse`` (and with ``merge_into``, the final output:
        ``wgmma_decode.prepare``); ``LAST_LAUNCH["decode"]`` is the compiled kernel."""
        from . import wgmma_decode

        float8 = kv_c.dtype == torch.float8_e4m3fn
        if self.loads and self.choices is None:
            self.choices = self._wgmma_choices(q, kv_c, k_pe, attn_mask)
        if self.loads and wgmma_decode.launch is not wgmma_decode.SHIPPED_LAUNCH:
            # Replaced by an experiment's variant or a test's instrument: called as the op
            # always called it, with this signature's choices, unprepared.
            LAST_LAUNCH.update(self.record)
            with _on_device(q.device):
                LAST_LAUNCH["decode"] = wgmma_decode.launch(
                    q, kv_c, k_pe, cache_seqlens, block_table, out, lse, softmax_scale,
                    kv_scale if float8 else None, self.causal, self.num_splits,
                    self.total_splits, merge_into=merge_into, attn_mask=attn_mask,
                    **self.choices,
                )  # fmt: skip
            LAST_LAUNCH["decode_launch"] = "wgmma_decode.launch replaced: Triton's dispatch"
            return
        if self.prepared is None and self.loads:
            self.prepared = wgmma_decode.prepare(
                q, kv_c, k_pe, block_table, out, lse, self.causal, self.num_splits,
                self.total_splits, merge_into=merge_into, attn_mask=attn_mask, **self.choices,
            )  # fmt: skip
        elif self.prepared is None:
            self.prepared = self._prepare_triton(q, kv_c, k_pe, block_table, out, lse, attn_mask)
        LAST_LAUNCH.update(self.record)
        if self.loads:
            data = wgmma_decode.launch_data(
                q, kv_c, k_pe, cache_seqlens, block_table, out, lse, softmax_scale,
                kv_scale if float8 else None, self.loads == "gather", merge_into=merge_into,
                attn_mask=attn_mask,
            )  # fmt: skip
        else:
            data = self._triton_data(q, kv_c, k_pe, cache_seqlens, block_table, out, lse,
                                     softmax_scale, kv_scale, attn_mask)  # fmt: skip
        with _on_device(q.device):
            LAST_LAUNCH["decode"] = self.prepared.launch(data)
        LAST_LAUNCH["decode_launch"] = self.prepared.how

    def _wgmma_choices(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        attn_mask: torch.Tensor | None,
    ) -> dict[str, object]:
        """The wgmma kernel's default tiling and loop, as ``wgmma_decode.launch``'s keyword
        arguments. An ``attn_mask`` is read by the transposed and one-scorer loops, so gathered
        64-row programs take the transposed loop instead of the rows-on-M one (NOTES.md items
        63-64)."""
        from . import wgmma_decode

        record = self.record
        kv_len, rope_len = kv_c.shape[-1], k_pe.shape[-1]
        record["decode_path"] = "wgmma"
        record["wgmma_loads"] = self.loads
        block_m, num_warps = wgmma_tiling(q.shape[1] * q.shape[2])
        float8 = kv_c.dtype == torch.float8_e4m3fn
        gather = self.loads == "gather"
        stages = wgmma_stages(block_m, kv_len, rope_len, float8, shared_memory_optin(q.device))
        masked = attn_mask is not None
        one_scorer = wgmma_decode.default_one_scorer(block_m, float8, gather)
        record["wgmma_one_scorer"] = one_scorer
        if one_scorer:
            # num_warps is warpgroup 0's; warpgroup 1 is a partition of its own that also copies.
            # Its pipeline is built for two ring slots, even where a narrower row would fit three
            # (MiniCPM3's L=256, R=32 at 40 heads, NOTES.md item 76).
            num_warps, producer_warps, rows_on_m, stages = 4, 0, False, 2
        else:
            producer_warps = wgmma_decode.default_producer_warps(num_warps, gather)
            rows_on_m = wgmma_decode.default_rows_on_m(block_m, num_warps, float8) and not masked
        record["wgmma_producer_warps"] = producer_warps
        record["wgmma_rows_on_m"] = rows_on_m
        query_in_registers = wgmma_decode.default_query_in_registers(
            one_scorer, kv_len, rope_len, masked
        )
        record["wgmma_query_in_registers"] = query_in_registers
        float8_products = wgmma_decode.default_float8_products(block_m, kv_len, float8, gather)
        record["wgmma_float8_products"] = float8_products
        longest_first = wgmma_decode.default_longest_first(
            q.shape[0], self.num_splits, self.total_splits, LENGTHS_PER_STEP,
            rows_on_m or one_scorer,
        )  # fmt: skip
        record["wgmma_order"] = "longest-first" if longest_first else "split-major"
        if log.isEnabledFor(logging.DEBUG):
            loop = "one-scorer" if one_scorer else "rows-on-M" if rows_on_m else "transposed"
            if query_in_registers:
                loop += " query-in-registers"
            if float8_products:
                loop += " float8-products"
            log.debug(
                "mla::decode wgmma: %d-row %s programs (%s loads, %s cache), %s",
                block_m, loop, self.loads, kv_c.dtype, record["wgmma_order"],
            )  # fmt: skip
        return dict(
            block_m=block_m, num_warps=num_warps, num_stages=stages, min_chunk=MIN_CHUNK,
            granule=SPLIT_GRANULE, lengths_per_step=LENGTHS_PER_STEP, gather=gather,
            fill_empty=self.fill_empty, producer_warps=producer_warps, rows_on_m=rows_on_m,
            one_scorer=one_scorer, longest_first=longest_first, float8_products=float8_products,
            query_in_registers=query_in_registers,
        )  # fmt: skip

    def _prepare_triton(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        block_table: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor,
        attn_mask: torch.Tensor | None,
    ) -> PreparedLaunch:
        """The Triton kernel with tiling ``cfg``."""
        cfg = self.cfg
        batch, s_q, heads, _ = q.shape
        kv_len, rope_len = kv_c.shape[-1], k_pe.shape[-1]
        rows = s_q * heads
        block_l = _next_pow2(kv_len)
        block_r = _next_pow2(max(rope_len, 1))
        paged = block_table is not None
        if paged:
            num_pages, page_size, capacity = kv_c.shape[0], kv_c.shape[1], 0
            max_pages = block_table.shape[1]
            bt_strides = block_table.stride()
        else:  # page_size is a compile-time constant: the cache length must not be one
            num_pages, page_size, max_pages, capacity = batch, 1, 1, kv_c.shape[1]
            bt_strides = (0, 0)  # never read
        # fp32 inputs get IEEE fp32 dots (not tf32): users asking for fp32 expect fp32 accuracy.
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        use_tma, why = tma_path(kv_c, k_pe, block_table, cfg.block_n)
        if cfg.use_tma is False and use_tma:
            use_tma, why = False, "the tiling turns TMA off (DecodeConfig.use_tma=False)"
        self.use_tma = use_tma
        if log.isEnabledFor(logging.DEBUG):
            how = "TMA" if use_tma else "gather"
            log.debug("mla::decode kernel: %s loads (%s), %s", how, why, cfg)
        self.record["decode_path"] = "tma" if use_tma else "gather"
        # A float8 kv_c is computed with in fp16 (bf16 and fp16 queries; fp32 keeps fp32 dots).
        kv_f16 = kv_c.dtype == torch.float8_e4m3fn and q.element_size() == 2 and cfg.fp8_in_f16
        ptx_convert = kv_f16 and cfg.fp8_ptx_convert and has_e4m3_convert(q.device)
        if kv_f16 and log.isEnabledFor(logging.DEBUG):
            how = "inline PTX" if ptx_convert else "Triton's cast (no sm_89+ CUDA device or off)"
            log.debug("mla::decode kernel: float8 tiles computed in fp16, converted by %s", how)
        mask_strides, mask_len = (0, 0, 0), 0
        if attn_mask is not None:
            mask_strides, mask_len = attn_mask.stride(), attn_mask.shape[-1]
        grid = (batch * math.ceil(rows / cfg.block_m), self.num_splits)
        names = ("q", "kv_c", "k_pe", "cache_seqlens", "bt", "out", "lse", "kv_desc", "pe_desc",
                 "mask")  # fmt: skip
        args = [Data(name) for name in names]
        args += [
            *q.stride(),
            *kv_c.stride(),
            *k_pe.stride(),
            *bt_strides,
            *out.stride(),
            *lse.stride(),
            *mask_strides,
            mask_len,
            num_pages,
            max_pages,
            capacity,
            Data("scale_log2"),
            Data("kv_scale_c"),
            Data("kv_scale_pe"),
            self.num_splits,
            self.total_splits or 0,
            batch,
        ]
        constexprs = dict(
            S_Q=s_q,
            H=heads,
            L=kv_len,
            R=rope_len,
            PAGE_SIZE=page_size,
            MIN_CHUNK=MIN_CHUNK,
            GRANULE=SPLIT_GRANULE,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_L=block_l,
            BLOCK_R=block_r,
            PAGED=paged,
            CAUSAL=self.causal,
            HAS_PE=rope_len > 0,
            DOT_PRECISION=precision,
            USE_TMA=use_tma,
            HAS_MASK=attn_mask is not None,
            MASK_IS_BOOL=attn_mask is not None and attn_mask.dtype == torch.bool,
            MASK_HIDDEN=MASK_HIDDEN,
            KV_F16=kv_f16,
            PTX_CONVERT=ptx_convert,
            BALANCED=self.total_splits is not None,
            ONE_POSITION=s_q == 1 or heads % cfg.block_m == 0,
            BLOCK_B=LENGTHS_PER_STEP,
            FILL_EMPTY=self.fill_empty,
            LAUNCH_DEPENDENTS=has_pdl(q.device),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return PreparedLaunch(_mla_decode_kernel, grid, args, constexprs)

    def _triton_data(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor,
        softmax_scale: float,
        kv_scale: float | None,
        attn_mask: torch.Tensor | None,
    ) -> dict[str, object]:
        """One call's data for the Triton kernel's prepared launch."""
        use_tma, block_n = self.use_tma, self.cfg.block_n
        mask = None
        if attn_mask is not None:
            # A bool tensor is read as bytes (same storage, no copy).
            mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
        return {
            "q": q, "kv_c": kv_c, "k_pe": k_pe, "cache_seqlens": cache_seqlens,
            # Unpaged: never read.
            "bt": block_table if block_table is not None else cache_seqlens,
            "out": out, "lse": lse,
            "kv_desc": _descriptor(kv_c, block_n) if use_tma else None,
            "pe_desc": _descriptor(k_pe, block_n) if use_tma and k_pe.shape[-1] else None,
            "mask": mask, "scale_log2": softmax_scale * 1.4426950408889634,
            "kv_scale_c": kv_scale if kv_c.dtype == torch.float8_e4m3fn else 1.0,
            "kv_scale_pe": kv_scale if k_pe.dtype == torch.float8_e4m3fn else 1.0,
        }  # fmt: skip


def decode(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
    config: DecodeConfig | None = None,
    fill_empty: bool = True,
    kernel: _DecodeKernel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the decode kernel; same contract as ``reference.decode``. bf16/fp16/fp32 q only.

    fill_empty: write an empty split's zero ``out`` (False: only its ``lse = -inf``).
    kernel: the call signature's kernel when the caller keeps one (``attention``'s plans); else
    the one kept here per ``call_signature`` (with ``config``, made for this call alone).
    """
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Triton decode kernel takes bf16/fp16/fp32 q, got {q.dtype}")
    batch, s_q, heads, _ = q.shape
    kv_len = kv_c.shape[-1]
    out = new_output((batch, s_q, heads, num_splits, kv_len), torch.float32, q.device)
    lse = new_output((batch, s_q, heads, num_splits), torch.float32, q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if kernel is None and config is None:
        key = (call_signature(q, kv_c, k_pe, cache_seqlens, block_table, causal, num_splits,
                              kv_scale, attn_mask, total_splits), fill_empty)  # fmt: skip
        kernel = _DECODE_KERNELS.lookup(key)
        if kernel is None:
            path = _decode_path(q, kv_c, k_pe, block_table, attn_mask, None)
            kernel = _DECODE_KERNELS.put(
                key, _DecodeKernel(path, causal, num_splits, total_splits, fill_empty)
            )
    elif kernel is None:  # a tiling of the caller's: chosen for this call alone
        path = _decode_path(q, kv_c, k_pe, block_table, attn_mask, config)
        kernel = _DecodeKernel(path, causal, num_splits, total_splits, fill_empty)
    kernel.launch(q, kv_c, k_pe, cache_seqlens, block_table, out, lse, softmax_scale, kv_scale,
                  attn_mask)  # fmt: skip
    return out, lse


# Programs per multiprocessor that the combine keeps when it widens its column blocks
# (combine_tiling): (b)'s 4096 wide programs on 132 multiprocessors (31 each) gained, (e)'s 1024
# (7.8 each) lost (NOTES.md item 50).
COMBINE_WIDE_PROGRAMS_PER_SM = 16


def combine_tiling(
    num_splits: int, kv_len: int, rows: int = 0, multiprocessors: int = 0
) -> tuple[int, int]:
    """The combine kernel's ``(BLOCK_S, BLOCK_L)``: every split of a ``BLOCK_L``-column block of
    one row per program (2 warps), about 4096 partial values. Measured on an H100 against the
    former fixed 128 columns x 4 warps: 11-18 % faster with 64 splits and 2x with 1 split
    (NOTES.md item 18).

    Where the 256-column cap, not the 4096 values, set the width (up to 8 splits), twice the
    columns (at most 512) if ``rows`` leave every one of ``multiprocessors`` at least
    ``COMBINE_WIDE_PROGRAMS_PER_SM`` programs even so: inside a call, where the combine follows
    the decode's last programs, (b)'s 4096 rows of 4 splits took 1.4 us less in 512-column
    programs than in 256, while (e)'s 1024 rows took 0.4 us more (item 50)."""
    block_s = _next_pow2(num_splits, floor=2)
    block_l = min(_next_pow2(kv_len), max(32, min(256, 4096 // block_s)))
    wide = min(2 * block_l, 512, _next_pow2(kv_len))
    programs = rows * -(-kv_len // wide)
    if (
        wide > block_l
        and block_s * wide <= 4096
        and multiprocessors > 0
        and programs >= COMBINE_WIDE_PROGRAMS_PER_SM * multiprocessors
    ):
        block_l = wide
    return block_s, block_l


class _CombineKernel:
    """``mla::combine``'s kernel for one call signature, prepared at its first launch (as
    ``_DecodeKernel``); ``record``: its tiling, as ``LAST_LAUNCH`` reports it."""

    def __init__(self) -> None:
        self.prepared: PreparedLaunch | None = None
        self.record: dict[str, object] = {}

    def launch(
        self, out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:  # fmt: skip
        """Merge ``out_partial [..., S, L]``/``lse_partial [..., S]`` into ``out [..., L]`` and
        ``lse [...]``."""
        num_splits, kv_len = out_partial.shape[-2:]
        o3 = out_partial.reshape(-1, num_splits, kv_len)
        l2 = lse_partial.reshape(-1, num_splits)
        out2 = out.view(-1, kv_len)
        lse1 = lse.view(-1)
        if self.prepared is None:
            self.prepared = self._prepare(o3, l2, out2, lse1)
        LAST_LAUNCH.update(self.record)
        with _on_device(out.device):
            self.prepared.launch({"o3": o3, "l2": l2, "out2": out2, "lse1": lse1})

    def _prepare(
        self, o3: torch.Tensor, l2: torch.Tensor, out2: torch.Tensor, lse1: torch.Tensor
    ) -> PreparedLaunch:
        rows, num_splits, kv_len = o3.shape
        sms = multiprocessor_count(out2.device) if out2.is_cuda else 0
        block_s, block_l = combine_tiling(num_splits, kv_len, rows, sms)
        self.record["combine_tiling"] = (block_s, block_l)
        pdl = has_pdl(out2.device)
        args = [Data("o3"), Data("l2"), Data("out2"), Data("lse1"), *o3.stride(), *l2.stride(),
                *out2.stride(), num_splits, kv_len]  # fmt: skip
        constexprs = dict(
            BLOCK_S=block_s,
            BLOCK_L=block_l,
            ACC=tl.float64 if lse1.dtype == torch.float64 else tl.float32,
            WAIT_PRIMARY=pdl,
            num_warps=2,
            **({"launch_pdl": True} if pdl else {}),
        )
        return PreparedLaunch(_mla_combine_kernel, (rows, triton.cdiv(kv_len, block_l)), args,
                              constexprs)  # fmt: skip


def combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out_dtype: torch.dtype | None,
    kernel: _CombineKernel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the combine kernel; same contract as ``reference.combine``. kernel: as
    ``decode``'s (kept here per partials' signature and output dtype when not given)."""
    lead = out_partial.shape[:-2]
    kv_len = out_partial.shape[-1]
    out = new_output((*lead, kv_len), out_dtype or out_partial.dtype, out_partial.device)
    lse = new_output(tuple(lead), accumulation_dtype(out_partial.dtype), out_partial.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if kernel is None:
        key = (out_partial.device, _tensor_signature(out_partial),
               _tensor_signature(lse_partial), out.dtype)  # fmt: skip
        kernel = _COMBINE_KERNELS.lookup(key) or _COMBINE_KERNELS.put(key, _CombineKernel())
    kernel.launch(out_partial, lse_partial, out, lse)
    return out, lse


# Splits per sequence up to which the wgmma kernel writes the output itself (``merge_path``): a
# sequence in one chunk directly, one in several merged by the chunk's program that finishes last
# (reading the others' float32 partials from L2). Measured on an H100 (benchmarks/NOTES.md item
# 29, ``experiments/merge_in_kernel.py``): the planner's 2-split plans of uniform batches, one
# real chunk per sequence, gain 1.4-6 % ((a) 0.911 -> 0.928, (f) 0.589 -> 0.627, (g) 0.891 ->
# 0.902); sequences in several chunks merge as fast as ``mla::combine`` at 2 splits ((b) 0.511
# vs 0.507) and slower at 4 ((b) 0.507 -> 0.489, (e) 0.723 -> 0.706), where the merge runs after
# the last chunk on one multiprocessor per row block instead of across the machine. With
# one-scorer 64-row programs (item 45, H100 and H200) a batch of one chunk per sequence gains 7 %
# ((f)), and sequences in two chunks lose: (b) at 2 splits 88-90 against 81-84 us, a ragged
# 40-sequence batch 159-160 against 153-154 us. The plan reads no lengths, so it cannot tell them
# apart.
MERGE_MAX_SPLITS = 2

# Arrival counters of the merging wgmma kernel, per (device index, stream): every launch leaves
# them zero (the last arrival of a row block resets its count), so one zeroing at allocation
# serves every later launch on that stream.
_ARRIVALS: dict[tuple[int, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """``[count]`` int32 zeros for a merging launch (``wgmma_decode.launch``'s ``merge_into``).

    Outside CUDA-graph capture: a buffer kept per (device, stream) and grown as needed, since each
    launch leaves it zero; launches on one stream run in order and other streams get their own.
    During capture: a fresh buffer zeroed by the graph itself (a memset node at every replay), so
    graphs replayed on other streams never share counters.
    """
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _ARRIVALS[key] = counters
    return counters


def merge_path(loads: str | None, num_splits: int) -> tuple[bool, str]:
    """Whether ``attention`` merges splits inside the decode kernel (no ``mla::combine`` launch)
    and, if not, why."""
    if not loads:
        return False, "the Triton decode kernel writes partials only"
    if num_splits > MERGE_MAX_SPLITS:
        return False, (
            f"num_splits={num_splits} > {MERGE_MAX_SPLITS}: mla::combine spreads the merge over "
            "the machine"
        )
    return True, f"wgmma kernel, num_splits={num_splits} <= {MERGE_MAX_SPLITS}"


def _tensor_signature(t: torch.Tensor | None) -> tuple | None:
    # What a launch is specialised on: shape, strides, dtype, and the base's 16-byte alignment
    # (Triton's pointer specialisation; the TMA and gather paths' condition).
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16


def call_signature(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    causal: bool,
    num_splits: int,
    kv_scale: float | None,
    attn_mask: torch.Tensor | None,
    total_splits: int | None,
) -> tuple:
    """Everything ``attention``'s choices and kernel launches depend on besides tensor data and
    the float scalars: shapes, strides, dtypes, 16-byte alignment, the device and the integer
    and flag arguments. Calls of one signature share an ``_AttentionPlan``."""
    return (
        q.device,
        _tensor_signature(q),
        _tensor_signature(kv_c),
        _tensor_signature(k_pe),
        _tensor_signature(cache_seqlens),
        _tensor_signature(block_table),
        _tensor_signature(attn_mask),
        causal,
        num_splits,
        kv_scale is None,
        total_splits,
    )


class _AttentionPlan:
    """What ``mla::attention`` does for one call signature (``call_signature``): merge in the
    decode kernel or launch ``mla::combine``, each kernel prepared at its first launch."""

    def __init__(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        block_table: torch.Tensor | None,
        causal: bool,
        num_splits: int,
        attn_mask: torch.Tensor | None,
        total_splits: int | None,
    ) -> None:
        path = _decode_path(q, kv_c, k_pe, block_table, attn_mask, None)
        self.merge, why = merge_path(path[1], num_splits)
        self.record = {"merge": ("decode kernel: " if self.merge else "mla::combine: ") + why}
        if log.isEnabledFor(logging.DEBUG):
            log.debug("mla::attention: splits merged by the %s", self.record["merge"])
        self.decode = _DecodeKernel(path, causal, num_splits, total_splits, fill_empty=False)
        self.combine = _CombineKernel()

    def run(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor | None,
        softmax_scale: float,
        num_splits: int,
        kv_scale: float | None,
        attn_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        LAST_LAUNCH.update(self.record)
        if not self.merge:
            out_partial, lse_partial = decode(
                q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, self.decode.causal,
                num_splits, kv_scale, attn_mask, self.decode.total_splits, fill_empty=False,
                kernel=self.decode,
            )  # fmt: skip
            return combine(out_partial, lse_partial, q.dtype, kernel=self.combine)
        batch, s_q, heads, _ = q.shape
        kv_len = kv_c.shape[-1]
        out = new_output((batch, s_q, heads, kv_len), q.dtype, q.device)
        lse = new_output((batch, s_q, heads), torch.float32, q.device)
        if out.numel() == 0 and lse.numel() == 0:
            return out, lse
        # Scratch for sequences in several chunks; with one split per sequence none is ever
        # written.
        rows = (batch, s_q, heads) if num_splits > 1 else (1, 1, 1)
        out_partial = torch.empty((*rows, num_splits, kv_len), dtype=torch.float32, device=q.device)
        lse_partial = torch.empty((*rows, num_splits), dtype=torch.float32, device=q.device)
        block_m, _ = wgmma_tiling(s_q * heads)
        arrivals = arrival_counters(q.device, batch * math.ceil(s_q * heads / block_m))
        self.decode.launch(
            q, kv_c, k_pe, cache_seqlens, block_table, out_partial, lse_partial, softmax_scale,
            kv_scale, attn_mask, merge_into=(out, lse, arrivals),
        )  # fmt: skip
        return out, lse


# Plans of mla::attention by call signature; dropped whenever a global of ``ops``, ``planner``,
# this module or ``wgmma_decode`` is rebound, added or removed (``plan_cache.follow``: tests and
# experiments patch choices and knobs).
_PLANS = PlanCache()
# The same for mla::decode's and mla::combine's kernels called as ops on their own.
_DECODE_KERNELS = PlanCache()
_COMBINE_KERNELS = PlanCache()


def attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla::attention`` on CUDA: ``out [B, S_q, H, L]`` in q's dtype and ``lse [B, S_q, H]``.

    When the wgmma kernel takes the call and ``num_splits <= MERGE_MAX_SPLITS`` it writes the
    output itself (``merge_path``): a sequence in one chunk directly, a sequence in several by the
    program that finishes last. Otherwise the decode kernel's partials go through the combine
    kernel. ``LAST_LAUNCH["merge"]`` says which and why.

    The choices and the kernels' arguments are made once per ``call_signature`` and kept (an
    ``_AttentionPlan``); later calls of the signature only allocate and launch, each kernel
    straight through its compiled launcher (``launcher.PreparedLaunch``;
    ``LAST_LAUNCH["decode_launch"]`` says how the decode kernel went).
    """
    key = call_signature(q, kv_c, k_pe, cache_seqlens, block_table, causal, num_splits, kv_scale,
                         attn_mask, total_splits)  # fmt: skip
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.put(key, _AttentionPlan(q, kv_c, k_pe, block_table, causal, num_splits,
                                              attn_mask, total_splits))  # fmt: skip
    return plan.run(q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, num_splits,
                    kv_scale, attn_mask)  # fmt: skip


follow(__name__)
follow(planner.__name__)
