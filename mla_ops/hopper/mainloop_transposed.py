"""The transposed main loop of 16- and 32-row programs: ``S^T = K Q^T`` and
``O^T += V^T P^T``, the 64-token KV tile on the MMA's M side and the query rows on N, so 16 heads
are one N = 16 wgmma with nothing padded. A producer partition keeps the ring full while one
math warpgroup (two for 32 rows) scores, runs the softmax and multiplies P.V from the same tile
(the 576-wide dot split 512 + 64)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .compat import _thread_barrier
from .float8 import _convert_chunk, _float8_tile, _float8_vt
from .layouts import P_E4M3_SCALE, _conversion_chunk, _conversion_layout, _copy_layouts
from .loads import _await_tile, _hand_back, _locate_tile
from .query import _load_query, _store_query
from .softmax import (
    _mask_bias,
    _mask_load,
    _mask_visible,
    _online_softmax,
    _over_rows,
    _row_start,
    _zero_hidden_columns,
    _zero_hidden_rows,
)


@gluon.jit
def _tile_scores(
    kv_ring, pe_ring, stage, q_smem, qpe_smem, ready, s_zero, pos, tile_start, end, nope_scale,
    NUM_STAGES: gl.constexpr, HAS_PE: gl.constexpr, KV_FP8: gl.constexpr, GATHER: gl.constexpr,
    L: gl.constexpr, CHUNK: gl.constexpr, io_layout: gl.constexpr, conv_layout: gl.constexpr,
    free=None, HAND_BACK: gl.constexpr = False, pe_stage=None, PE_FP8: gl.constexpr = False,
):  # fmt: skip
    """Wait for the tile at ring position ``pos`` (``_await_tile``); its scores ``S^T = K Q^T``
    (complete).

    A float8 tile is converted (``CHUNK`` columns at a time, in ``conv_layout``) into ``stage``
    (zeroing the rows past ``end`` on the way) while the tensor cores run its RoPE scores, and the
    nope scores read it there; they take ``nope_scale`` (kv_scale and the query's power of two) in
    float32, apart from the RoPE part's, so the fp16 query needs no rounding. With ``HAND_BACK`` (a
    producer partition) its ring slot goes back on ``free`` before the nope scores are waited for:
    0.4-0.8 % faster on the float8 forms of h16_b128_4k, h16_b4_64k and h16_b64_8k_ragged, level on
    page size 1. ``PE_FP8``: the slot's ``k_pe`` is float8 too; it is converted into ``pe_stage``
    first (``[BLOCK_N, R]`` fp16, 16 values per thread at 8 warps), and its scores take the nope
    scores' scale (``_store_query``).
    """
    slot = pos % NUM_STAGES
    kv = _await_tile(
        kv_ring, ready, pos, tile_start, end, NUM_STAGES, GATHER, not KV_FP8, io_layout
    )
    q_t = q_smem.permute((1, 0))
    if KV_FP8:
        if HAS_PE:
            pe_tile = pe_ring.index(slot)
            if PE_FP8:
                R: gl.constexpr = pe_tile.shape[1]
                pe_layout: gl.constexpr = _conversion_layout(gl.num_warps(), R)
                _convert_chunk(pe_tile, pe_stage, 0, tile_start, end, R, pe_layout)
                fence_async_shared()
                pe_tile = pe_stage
            # The RoPE scores run on the tensor cores while the warps convert kv_c.
            s_pe = warpgroup_mma(
                pe_tile, qpe_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
        for c in gl.static_range(0, L, CHUNK):
            _convert_chunk(kv_ring.index(slot), stage, c, tile_start, end, CHUNK, conv_layout)
        fence_async_shared()
        s_t = warpgroup_mma(stage, q_t, s_zero, use_acc=False, is_async=True)
        if HAND_BACK:
            # The slot is read: its kv_c by the conversion, its k_pe by the RoPE scores (the
            # older of the two wgmma groups; a float8 k_pe by its conversion). The producer
            # refills it under the nope scores.
            if HAS_PE and not PE_FP8:
                s_pe = warpgroup_mma_wait(num_outstanding=1, deps=(s_pe,))
            mbarrier.arrive(free.index(slot), count=1)
        if HAS_PE:
            s_t, s_pe = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, s_pe))
            if PE_FP8:  # noqa: SIM108 (a compile-time choice; one branch is compiled)
                s_t = (s_t + s_pe) * nope_scale
            else:
                s_t = s_t * nope_scale + s_pe
        else:
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            s_t = s_t * nope_scale
    else:
        s_t = warpgroup_mma(kv, q_t, s_zero, use_acc=False, is_async=True)
        if HAS_PE:
            s_t = warpgroup_mma(pe_ring.index(slot), qpe_smem.permute((1, 0)), s_t, is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
    return s_t


@gluon.jit
def _consume_tiles(
    Q, KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring, pe_ring, stage, p_smem,
    max_smem, ready, free, n_bad, b64, row_block, seqlen, start, end, n_tiles, stride_qb, stride_qs,
    stride_qh, stride_qd, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt,
    stride_pep, stride_pet, scale_log2, kv_scale, S_Q: gl.constexpr,
    H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_PE: gl.constexpr,
    KV_FP8: gl.constexpr, CHUNK: gl.constexpr, GATHER: gl.constexpr, PRODUCER: gl.constexpr,
    FLOAT8_PRODUCTS: gl.constexpr = False, PE_FP8: gl.constexpr = False,
    pe_stage=None, MASK=None, stride_mb=0, stride_ms=0, stride_mt=0, MASK_LEN=0,
    HAS_MASK: gl.constexpr = False, MASK_IS_BOOL: gl.constexpr = False,
):  # fmt: skip
    """The math warps: the query into shared memory, then for each tile its scores, the online
    softmax and P.V; returns ``O^T``, the running max and sum, and ``n_bad``.
    ``FLOAT8_PRODUCTS``: float8 products (``_float8_tile``; ``PE_FP8``: ``k_pe`` in e4m3 too);
    ``O^T``'s rows are then permuted (``_latent_column``) and scaled by ``P_E4M3_SCALE``.
    Otherwise a float8 ``k_pe`` (``PE_FP8``) is converted into ``pe_stage`` (``_tile_scores``).
    ``HAS_MASK``: an attention mask ``MASK [B, S_q, MASK_LEN]`` (bool as bytes, or float) read
    a tile ahead (``_mask_load``; one row per tile at S_q = 1), its fully hidden keys' value
    rows zeroed (``_zero_hidden_rows``, ``_zero_hidden_columns``).

    With a producer partition (``PRODUCER``) each slot is handed back on its ``free`` barrier;
    without one, these warps locate and copy the tile ``NUM_STAGES`` ahead into the slot
    themselves (the first ``NUM_STAGES`` were issued before the call) and count its invalid
    tokens into ``n_bad``.
    """
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_smem.dtype
    WG: gl.constexpr = num_warps // 4
    # Scores S^T [BLOCK_N, BLOCK_M]: one warpgroup per 64 tokens, further warpgroups split the rows.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BLOCK_M // WG, 16]
    )
    # O^T [L, BLOCK_M]: warpgroups split the L latent columns. (float8 wgmma's K is 32; the
    # accumulator's layout is the same as for K = 16.)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BLOCK_M, 32 if FLOAT8_PRODUCTS else 16],
    )  # fmt: skip
    io_layout: gl.constexpr = _copy_layouts(num_warps, KV_FP8)[0]
    CONV_CHUNK: gl.constexpr = _conversion_chunk(L)
    conv_layout: gl.constexpr = _conversion_layout(num_warps, CONV_CHUNK)
    gather_layout: gl.constexpr = _copy_layouts(num_warps, KV_FP8)[1]

    q_nope, q_pe = _load_query(
        Q, b64, row_block, stride_qb, stride_qs, stride_qh, stride_qd, S_Q, H, L, R, BLOCK_M,
        HAS_PE, io_layout,
    )  # fmt: skip
    nope_scale = _store_query(
        q_nope, q_pe, q_smem, qpe_smem, kv_scale, HAS_PE, KV_FP8, FLOAT8_PRODUCTS, PE_FP8
    )  # fmt: skip

    last_key, m_i = _row_start(
        row_block, seqlen, S_Q, H, BLOCK_M, CAUSAL, gl.SliceLayout(0, s_layout)
    )
    if KV_FP8:
        # The running sum as per-thread partial sums shaped like the scores, summed across the
        # four warps once after the loop instead of once per tile: 5 % of a float8 tile's time
        # (its loop is bound by this warpgroup's serial chain); a 16-bit tile's loop, bound by
        # its copies, measured 0.8 % slower with it on (h16_b4_64k).
        l_i = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    else:
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(0, s_layout))
    if FLOAT8_PRODUCTS:
        gl.static_assert(num_warps == 4 and L == 512 and BLOCK_N == 64 and not GATHER)
        vt_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 4)
    o_t = gl.zeros([L, BLOCK_M], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    offs_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    if FLOAT8_PRODUCTS:
        # P.V stays in flight into the next tile (an accumulator from here on).
        o_t = warpgroup_mma_init(o_t)
    if HAS_MASK:
        mask_raw = _mask_load(
            MASK, b64, row_block, start, end, stride_mb, stride_ms, stride_mt, MASK_LEN, S_Q, H,
            BLOCK_M, BLOCK_N, MASK_IS_BOOL, s_layout, 0, S_Q == 1,
        )  # fmt: skip

    # One tile at a time: scores, softmax, P.V. (Issuing tile i+1's scores before tile i's P.V,
    # to overlap the softmax with the P.V, measured slower: with two slots, tile i's P.V then
    # waits for tile i+1's copy..)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        tile_start = start + i * BLOCK_N
        # The tile that refills this slot, located now (nothing past end counts as bad).
        next_start = tile_start + NUM_STAGES * BLOCK_N
        next_where = 0  # unused with a producer partition
        if not PRODUCER:
            next_where, bad = _locate_tile(
                BLOCK_TABLE, b64, next_start, end, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES,
                PAGE_SIZE, BLOCK_N, GATHER, gather_layout,
            )  # fmt: skip
            n_bad += bad
        mask_visible = None
        mask_bias = None
        if HAS_MASK:
            # The next tile's values go out now and are read one tile later: loaded in the
            # tile that uses them, they put a load's latency into the float8 loop's chain.
            mask_next = _mask_load(
                MASK, b64, row_block, tile_start + BLOCK_N, end, stride_mb, stride_ms, stride_mt,
                MASK_LEN, S_Q, H, BLOCK_M, BLOCK_N, MASK_IS_BOOL, s_layout, 0, S_Q == 1,
            )  # fmt: skip
            row_visible = _mask_visible(mask_raw, MASK_IS_BOOL)
            mask_visible = _over_rows(row_visible, 0)
            if not MASK_IS_BOOL:
                mask_bias = _over_rows(_mask_bias(mask_raw, row_visible), 0)
            mask_raw = mask_next
        if FLOAT8_PRODUCTS:
            s_t, o_t = _float8_tile(
                kv_ring, pe_ring, q_smem, qpe_smem, ready, s_zero, i, tile_start, end,
                nope_scale, NUM_STAGES, HAS_PE, io_layout, PE_FP8, o_t,
            )  # fmt: skip
        else:
            s_t = _tile_scores(
                kv_ring, pe_ring, stage, q_smem, qpe_smem, ready, s_zero, i, tile_start, end,
                nope_scale, NUM_STAGES, HAS_PE, KV_FP8, GATHER, L, CONV_CHUNK, io_layout,
                conv_layout, free, KV_FP8 and PRODUCER, pe_stage, PE_FP8,
            )  # fmt: skip
        if HAS_MASK and not FLOAT8_PRODUCTS:
            # The value rows of keys hidden from every row: the ring slot's (read by P.V), or a
            # converted tile's. (Float8 products zero them in V^T's registers instead.)
            v_tile = stage if KV_FP8 else kv_ring.index(slot)
            _zero_hidden_rows(v_tile, row_visible, tile_start, end, io_layout)
        if FLOAT8_PRODUCTS:
            p_t, m_i, l_i, alpha = _online_softmax(
                s_t, m_i, l_i, tile_start + offs_tile, end, last_key, scale_log2, 0,
                max_smem.index(i % 2), mask_visible, mask_bias,
            )  # fmt: skip
            v_t = _float8_vt(kv_ring.index(slot), vt_layout)
            if HAS_MASK:
                v_t = _zero_hidden_columns(v_t, row_visible, tile_start, end)
            # V^T is in registers and the scores' products have read the slot: it goes back to
            # the copies now, not after P.V (which reads only registers and p_smem). The barrier
            # makes every warp's loads complete first (handed back without one, loads still
            # queued read the next tile's bytes:).
            _thread_barrier()
        # A float8 slot is converted (or in registers) and its k_pe read by now: refill it here,
        # not after P.V (a converted slot with a producer partition: _tile_scores has handed it
        # back already).
        if FLOAT8_PRODUCTS or (KV_FP8 and not PRODUCER):
            _hand_back(
                KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, free, slot, i, n_tiles,
                next_start, next_where, stride_kvp, stride_kvt, stride_pep, stride_pet,
                PAGE_SIZE, NUM_STAGES, HAS_PE, GATHER, L, R, CHUNK, PRODUCER, gather_layout,
                io_layout,
            )  # fmt: skip
        if not FLOAT8_PRODUCTS:
            p_t, m_i, l_i, alpha = _online_softmax(
                s_t, m_i, l_i, tile_start + offs_tile, end, last_key, scale_log2, 0, None,
                mask_visible, mask_bias,
            )  # fmt: skip
        o_t = o_t * gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
        if FLOAT8_PRODUCTS:
            # P^T K-major, as float8 wgmma's B must be: p_smem is [BLOCK_M, BLOCK_N] e4m3.
            p_smem.store(gl.permute((p_t * P_E4M3_SCALE).to(gl.float8e4nv), (1, 0)))
            fence_async_shared()
            o_t = warpgroup_mma(v_t, p_smem.permute((1, 0)), o_t, is_async=True)
        else:
            p_smem.store(p_t.to(dtype))
            fence_async_shared()
            v_tile = stage if KV_FP8 else kv_ring.index(slot)
            o_t = warpgroup_mma(v_tile.permute((1, 0)), p_smem, o_t, is_async=True)
        if not FLOAT8_PRODUCTS:
            # (Float8 products leave P.V in flight: the next tile's scores wait for it.)
            o_t = warpgroup_mma_wait(num_outstanding=0, deps=(o_t,))
        # The slot is free again.
        if not KV_FP8:
            _hand_back(
                KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, free, slot, i, n_tiles,
                next_start, next_where, stride_kvp, stride_kvt, stride_pep, stride_pet,
                PAGE_SIZE, NUM_STAGES, HAS_PE, GATHER, L, R, CHUNK, PRODUCER, gather_layout,
                io_layout,
            )  # fmt: skip
    if FLOAT8_PRODUCTS:
        o_t = warpgroup_mma_wait(num_outstanding=0, deps=(o_t,))
    if KV_FP8:
        l_i = gl.sum(l_i, 0)
    return o_t, m_i, l_i, n_bad
