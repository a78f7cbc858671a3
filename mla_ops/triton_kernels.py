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
may hold NaN). The same kernel with ``REPAIR`` is the repair pass after a decode whose programs
mix query positions (``planner.repair_needed``): it recomputes only programs whose outputs came
out non-finite, isolating keys that only some of their rows see.

This module imports triton; ``ops.py`` imports it only when a kernel is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _e4m3_to_f16(x):
    """float8 e4m3 -> fp16 (exact) by ``cvt.rn.f16x2.e4m3x2``, four values per call; sm_89+.

    Declared impure on purpose: the compiler moves a pure conversion (Triton's own cast included)
    past the shared-memory read of the ``P @ V`` operand, where a float8 tile can only be read
    byte by byte; an impure one stays here, so the tile is converted once in registers and
    stored as fp16 (h16_b128_4k_fp8: 259 -> 206-219 us on an H100).
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
    REPAIR: tl.constexpr,  # the repair pass (see below), over outputs already written
    WAIT_PRIMARY: tl.constexpr,  # REPAIR launched early (PDL): wait for the decode's writes
):
    if WAIT_PRIMARY:
        # Before anything else, so that the repair grid ends after the decode's in every case
        # (the combine launched after it waits on this grid alone).
        gdc_wait()
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
        # RAGGED_HEADROOM x more splits than it fills. The repair pass has nothing to redo here.
        if not REPAIR:
            _store_partial(
                O_PART, LSE_PART, tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32),
                tl.full([BLOCK_M], float("-inf"), tl.float32), b64, s_idx, h_idx, split, offs_l,
                row_ok, l_ok & FILL_EMPTY, stride_ob, stride_os, stride_oh, stride_ok, stride_od,
                stride_lb, stride_ls, stride_lh, stride_lk,
            )  # fmt: skip
        return

    if REPAIR:
        # The repair pass (planner.repair_plan): a program of several query positions under a
        # causal or masked problem computes P @ V over keys that some of its rows do not see, so
        # a non-finite key seen only by later positions makes the earlier rows NaN (0 x inf).
        # Here the rows already written are checked, and only a program holding a non-finite
        # value computes them again, isolating such keys: found in the scores (the query is
        # finite, so the key's score is non-finite in every row), their value rows zeroed before
        # P @ V, and the rows that see one set to NaN at the end. Finite outputs cost one read.
        o_row = O_PART + b64 * stride_ob + s_idx * stride_os + h_idx * stride_oh
        written = tl.load(
            o_row[:, None] + split * stride_ok + offs_l[None, :] * stride_od,
            mask=row_ok[:, None] & l_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, BLOCK_L]
        non_finite = (written != written) | (tl.abs(written) == float("inf"))
        if tl.max(tl.max(non_finite.to(tl.int32), 1), 0) == 0:
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
        # fp16); to bf16 it takes that plus one more per element. The nope
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
        # unmasked call instead of 1.12-1.13x.
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
    saw_non_finite = tl.zeros([BLOCK_M], dtype=tl.int32)  # REPAIR: rows that see such a key

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
            # cost a pass over it (2.1-2.6x slower).
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
            # Operation order matters to the compiled loop: the 16-bit tile as
            # one expression (predicate first); as three statements a masked decode cost
            # 1.34-1.92x the unmasked one on an H100 instead of 1.04-1.10x. The float8 PTX path
            # stays in the order it was measured in.
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
        if REPAIR:
            key_non_finite = tl.max(((qk != qk) | (tl.abs(qk) == float("inf"))).to(tl.int32), 0)
            kv = tl.where(key_non_finite[:, None] > 0, 0.0, kv).to(kv.dtype)
        qk = qk * scale_log2
        visible = visible & ld[None, :]
        if REPAIR:
            sees = visible & (key_non_finite[None, :] > 0)  # [BLOCK_M or 1, BLOCK_N]
            saw_non_finite = saw_non_finite | tl.max(sees.to(tl.int32), 1)
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
        # The combine may launch once every program is past its loop (an empty split, which returned
        # above, counts at its exit); it waits on the device for this grid's writes. At the entry
        # instead, the benchmark's calls took 0.5-1.3 us longer on an H200 with this kernel
        # ((h128_b1_32k), (h16_b4_64k), (h16_b64_8k_ragged); (h128_b32_4k) level), as they did with
        # the wgmma kernel.
        gdc_launch_dependents()
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None] * nope_scale  # the value is kv_c: dequantise once, here
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    poisoned = tl.sum(n_bad, 0) > 0
    out = tl.where(poisoned, float("nan"), out)
    lse = tl.where(poisoned, float("nan"), lse)
    if REPAIR:
        out = tl.where(saw_non_finite[:, None] > 0, float("nan"), out)
        lse = tl.where(saw_non_finite > 0, float("nan"), lse)

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
