"""The Hopper decode kernel's entry: the program's split bounds (even or balanced, computed on the
device from ``cache_seqlens``), shared memory and barriers, the choice of main loop by the
planner's constexprs, the epilogue, and the combine's programmatic-dependent-launch trigger once
the loop is done."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
)

from .compat import _thread_barrier
from .epilogue import _merge_splits, _row_lse, _store_partial_t
from .float8 import _latent_column
from .layouts import P_E4M3_SCALE, PREPARED_LAYOUT, _copy_layouts
from .loads import _allocate_ring, _copy_tile, _locate_tile, _produce_tiles
from .mainloop_one_scorer import _assist_tiles, _score_tiles
from .mainloop_query_in_registers import _pv_rest_qreg, _score_tiles_qreg
from .mainloop_rows_on_m import _consume_rows_on_m
from .mainloop_transposed import _consume_tiles
from .query import _load_query, _load_query_operand, _store_query
from .schedule import _longest_first, _sum_min_max
from .softmax import _mask_load, _prepare_mask_terms


@gluon.jit
def _mla_decode_wgmma_kernel(
    Q,  # [B, S_q, H, L+R]
    SEQLENS,  # [B] int32
    BLOCK_TABLE,  # [B, max_pages] int32
    O_PART,  # [B, S_q, H, num_splits, L] float32
    LSE_PART,  # [B, S_q, H, num_splits] float32
    OUT,  # MERGE: [B, S_q, H, L] in q's dtype, the attention output
    LSE_OUT,  # MERGE: [B, S_q, H] float32
    ARRIVALS,  # MERGE: [B * row blocks] int32, zero before the launch and after it
    KV_DESC,  # TMA descriptor of kv_c as [num_pages * page_size, L], [BLOCK_N, L] tiles
    PE_DESC,  # TMA descriptor of k_pe as [num_pages * page_size, R], [BLOCK_N, R] tiles
    KV,  # kv_c [num_pages, page_size, L] (GATHER)
    PE,  # k_pe [num_pages, page_size, R] (GATHER)
    MASK,  # HAS_MASK: [B, S_q, MASK_LEN] attention mask, bool (as uint8) or float
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_btb, stride_btp,
    stride_kvp, stride_kvt, stride_pep, stride_pet,  # GATHER: in 16-byte units
    stride_ob, stride_os, stride_oh, stride_ok, stride_od,
    stride_lb, stride_ls, stride_lh, stride_lk,
    stride_fb, stride_fs, stride_fh, stride_fd,
    stride_gb, stride_gs, stride_gh,
    stride_mb, stride_ms, stride_mt,
    NUM_PAGES,
    MAX_PAGES,
    MASK_LEN,  # HAS_MASK: keys at and past it are hidden
    scale_log2,  # softmax_scale * log2(e)
    kv_scale,  # dequantisation scale of a float8 kv_c (1.0 otherwise)
    num_splits,
    total_splits,  # 0: each sequence cut into num_splits even chunks (planner.split_bounds)
    batch,
    S_Q: gl.constexpr,
    H: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    MIN_CHUNK: gl.constexpr,
    GRANULE: gl.constexpr,
    BLOCK_M: gl.constexpr,  # query rows per program (heads x S_q flattened): the wgmma N
    BLOCK_N: gl.constexpr,  # tokens per KV tile: the wgmma M
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_PE: gl.constexpr,
    BALANCED: gl.constexpr,
    BLOCK_B: gl.constexpr,
    KV_FP8: gl.constexpr,  # kv_c in float8 e4m3: converted to fp16 in shared memory per tile
    FLOAT8_PRODUCTS: gl.constexpr,  # KV_FP8, 16 rows, L = 512, TMA: float8 wgmma, no conversion
    PE_FP8: gl.constexpr,  # k_pe in e4m3 too (R = 64): float8 products, or converted to fp16
    CHUNK: gl.constexpr,  # columns gathered (GATHER) at a time
    GATHER: gl.constexpr,  # tiles copied row by row by cp.async (any page size), not by TMA
    FILL_EMPTY: gl.constexpr,  # an empty split writes its zero out (else only its -inf lse)
    PRODUCER_WARPS: gl.constexpr,  # warps of a producer partition that copies (0: none)
    PRODUCER_REGS: gl.constexpr,  # registers per thread of the producer partition
    ROWS_ON_M: gl.constexpr,  # 64 rows, 16-bit cache: S = Q K^T, O = P V (_consume_rows_on_m)
    ONE_SCORER: gl.constexpr,  # rows on M, warpgroup 0 scores (_score_tiles, _assist_tiles)
    ASSIST_REGS: gl.constexpr,  # ONE_SCORER: registers per thread of warpgroup 1
    MERGE: gl.constexpr,  # write the final OUT/LSE_OUT: no combine kernel (_merge_splits)
    MERGE_SPLITS: gl.constexpr,  # MERGE: a power of two >= num_splits
    LONGEST_FIRST: gl.constexpr,  # BALANCED, batch <= BLOCK_B: _longest_first's order
    HAS_MASK: gl.constexpr,  # an attention mask (the transposed and one-scorer loops)
    MASK_IS_BOOL: gl.constexpr,
    QUERY_IN_REGISTERS: gl.constexpr,  # ONE_SCORER: _score_tiles_qreg, _pv_rest_qreg, ring of 3
    PV_REGS: gl.constexpr,  # QUERY_IN_REGISTERS: registers per thread of warpgroup 1
    num_warps: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    # Rows on M: one M=64 wgmma row block split by 2 warpgroups, no float8 staging, no producer.
    gl.static_assert(
        not ROWS_ON_M or (BLOCK_M == 64 and num_warps == 8 and not KV_FP8 and PRODUCER_WARPS == 0)
    )
    # One scorer: warpgroup 0 is the kernel's 4 warps, warpgroup 1 a partition of its own; two
    # P buffers match a ring of two (_score_tiles); the copy engine's whole-page tiles only.
    ONE_SCORER_STAGES: gl.constexpr = 3 if QUERY_IN_REGISTERS else 2
    gl.static_assert(
        not ONE_SCORER
        or (
            BLOCK_M == 64 and num_warps == 4 and NUM_STAGES == ONE_SCORER_STAGES
            and not KV_FP8 and not GATHER and PRODUCER_WARPS == 0 and not ROWS_ON_M
        )
    )  # fmt: skip
    # Query in registers: P takes the place of each slot's [64, 64] k_pe once it is scored.
    gl.static_assert(
        not QUERY_IN_REGISTERS
        or (
            ONE_SCORER
            and HAS_PE
            and L == 512
            and R == BLOCK_N
            and BLOCK_M == BLOCK_N
            and not HAS_MASK
        )
    )
    gl.static_assert(
        not FLOAT8_PRODUCTS or (KV_FP8 and BLOCK_M == 16 and num_warps == 4 and not GATHER)
    )
    gl.static_assert(not HAS_MASK or not ROWS_ON_M)
    # A float8 k_pe: multiplied in float8, or converted to fp16 beside kv_c (also gathered);
    # R = 64, the width the GPU tests cover (float8 wgmma's K of 32 would allow any multiple).
    gl.static_assert(not PE_FP8 or (KV_FP8 and HAS_PE and R == 64))
    q_dtype: gl.constexpr = Q.dtype.element_ty
    # The products' operand type: q's, or fp16 for a float8 kv_c (e4m3 -> fp16 is exact).
    if KV_FP8:
        dtype: gl.constexpr = gl.float16
    else:
        dtype: gl.constexpr = q_dtype
    io_layout: gl.constexpr = _copy_layouts(num_warps, KV_FP8)[0]
    gather_layout: gl.constexpr = _copy_layouts(num_warps, KV_FP8)[1]
    st_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])
    len_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])

    # Which chunk (split, sequence) this program takes. Splits vary slowest: every sequence's
    # first chunk, then every second one, ... (a uniform batch's real programs fill the first
    # wave). LONGEST_FIRST, over a batch of unequal lengths: every full chunk,
    # then the partial last chunks longest first, then the empty ones (_longest_first).
    num_row_blocks: gl.constexpr = (S_Q * H + BLOCK_M - 1) // BLOCK_M
    work = pid // num_row_blocks
    row_block = pid % num_row_blocks
    split = work // batch
    b = work % batch
    if LONGEST_FIRST:
        # A balanced plan of batch <= BLOCK_B: one step sums the lengths and finds whether they
        # are all equal, when split-major is already longest first (full, partial, empty chunks).
        offs_b = gl.arange(0, BLOCK_B, layout=len_layout)
        length = gl.load(SEQLENS + offs_b, mask=offs_b < batch, other=0)
        shortest = gl.where(offs_b < batch, length, 2147483647)
        total, shortest, longest = gl.reduce(
            (length.to(gl.int64), shortest, length), 0, _sum_min_max
        )
        balanced = gl.cdiv(gl.cdiv(total, total_splits), GRANULE) * GRANULE
        if shortest != longest:
            split, b = _longest_first(
                SEQLENS, work, batch, num_splits, balanced.to(gl.int32), MIN_CHUNK, GRANULE,
                BLOCK_N, BLOCK_B, num_warps,
            )  # fmt: skip
    b64 = b.to(gl.int64)

    # This split's token range (same formula as planner.split_bounds).
    seqlen = gl.load(SEQLENS + b)
    per_split = gl.cdiv(gl.cdiv(seqlen, num_splits), GRANULE) * GRANULE
    if BALANCED:
        if not LONGEST_FIRST:
            total = gl.zeros([BLOCK_B], dtype=gl.int64, layout=len_layout)
            for b0 in range(0, batch, BLOCK_B):
                offs_b = b0 + gl.arange(0, BLOCK_B, layout=len_layout)
                total += gl.load(SEQLENS + offs_b, mask=offs_b < batch, other=0).to(gl.int64)
            balanced = gl.cdiv(gl.cdiv(gl.sum(total, 0), total_splits), GRANULE) * GRANULE
        per_split = gl.maximum(per_split, balanced.to(gl.int32))
    chunk = gl.maximum(per_split, MIN_CHUNK)
    start = split * chunk
    end = gl.minimum(start + chunk, seqlen)

    # Rows of this program, in the layouts they are used in.
    rows_st = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    offs_l_st = gl.arange(0, L, layout=gl.SliceLayout(1, st_layout))
    row_ok_st = rows_st < S_Q * H
    n_real = gl.cdiv(seqlen, chunk)  # the sequence's chunks (MERGE: 1 writes the final rows)
    if start >= end:
        # An empty split: the contract's zeros and -inf, nothing read (FILL_EMPTY off: the -inf
        # alone; the zeros of the planner's headroom splits cost 1.8-3.4 % of (h16_b128_4k),
        # (h16_b4_64k), (h16_b64_8k_ragged)). MERGE: nothing, unless the whole
        # sequence is empty (split 0 is empty only then), whose final rows are zeros and -inf.
        zeros = gl.zeros([L, BLOCK_M], gl.float32, layout=st_layout)
        no_key = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(0, st_layout))
        if MERGE:
            if split == 0:
                _store_partial_t(
                    OUT, LSE_OUT, zeros, no_key, b64, rows_st // H, rows_st % H, 0, offs_l_st,
                    row_ok_st, stride_fb, stride_fs, stride_fh, 0, stride_fd, stride_gb,
                    stride_gs, stride_gh, 0,
                )  # fmt: skip
        else:
            _store_partial_t(
                O_PART, LSE_PART, zeros, no_key, b64, rows_st // H, rows_st % H, split, offs_l_st,
                row_ok_st, stride_ob, stride_os, stride_oh, stride_ok, stride_od, stride_lb,
                stride_ls, stride_lh, stride_lk, FILL_EMPTY,
            )  # fmt: skip
        return

    # Shared memory: the query block (the wgmma's B operand, as Q^T views), the KV ring, P^T.
    if FLOAT8_PRODUCTS:
        # The query's two e4m3 terms (_store_query).
        q_smem = gl.allocate_shared_memory(
            gl.float8e4nv, [2 * BLOCK_M, L],
            gl.NVMMASharedLayout.get_default_for([2 * BLOCK_M, L], gl.float8e4nv),
        )  # fmt: skip
    elif not QUERY_IN_REGISTERS:
        q_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_M, L], gl.NVMMASharedLayout.get_default_for([BLOCK_M, L], dtype)
        )
    kv_ring = _allocate_ring(KV, KV_DESC, L, NUM_STAGES, BLOCK_N, GATHER)
    if QUERY_IN_REGISTERS:
        q_smem = kv_ring  # unused: the nope query lives in warpgroup 0's registers
    if KV_FP8 and not FLOAT8_PRODUCTS:
        stage = gl.allocate_shared_memory(
            dtype, [BLOCK_N, L], gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
        )
    else:
        stage = kv_ring
    # The RoPE query: its two e4m3 terms (float8 products of a float8 k_pe, _store_query), fp16
    # beside a converted float8 k_pe, else q's dtype.
    if PE_FP8 and FLOAT8_PRODUCTS:
        qpe_smem = gl.allocate_shared_memory(
            gl.float8e4nv, [2 * BLOCK_M, R],
            gl.NVMMASharedLayout.get_default_for([2 * BLOCK_M, R], gl.float8e4nv),
        )  # fmt: skip
    elif HAS_PE:
        qpe_dtype: gl.constexpr = dtype if PE_FP8 else q_dtype
        qpe_smem = gl.allocate_shared_memory(
            qpe_dtype, [BLOCK_M, R], gl.NVMMASharedLayout.get_default_for([BLOCK_M, R], qpe_dtype)
        )
    else:
        qpe_smem = q_smem
    # The ring's k_pe as the cache holds it (q's dtype or e4m3).
    pe_ring = _allocate_ring(PE, PE_DESC, R, NUM_STAGES, BLOCK_N, GATHER) if HAS_PE else kv_ring
    pe_stage = kv_ring  # unused unless a float8 k_pe is converted
    if PE_FP8 and not FLOAT8_PRODUCTS:
        # Each tile's float8 k_pe converted to fp16 (8 KB at R = 64; the float8 ring slot gives
        # back half of that).
        pe_stage = gl.allocate_shared_memory(
            dtype, [BLOCK_N, R], gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype)
        )
    if FLOAT8_PRODUCTS:
        p_smem = gl.allocate_shared_memory(
            gl.float8e4nv, [BLOCK_M, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv),
        )  # fmt: skip
        # Two buffers of the softmax's row maxima across the warps (_row_max_across_warps).
        max_smem = gl.allocate_shared_memory(
            gl.float32, [2, 4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )  # fmt: skip
    elif QUERY_IN_REGISTERS:
        p_smem = pe_ring  # P is written over each slot's k_pe (_score_tiles_qreg)
    elif ROWS_ON_M or ONE_SCORER:
        p_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_M, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype),
        )  # fmt: skip
    else:
        p_smem = gl.allocate_shared_memory(
            dtype, [BLOCK_N, BLOCK_M],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype),
        )  # fmt: skip
    if not FLOAT8_PRODUCTS:
        max_smem = p_smem  # unused: Triton's reduction across warps
    if ONE_SCORER and not QUERY_IN_REGISTERS:
        # The factor that rescales the output before each tile's P.V, beside P; P (and it)
        # handed to warpgroup 1 and back.
        alpha_smem = gl.allocate_shared_memory(
            gl.float32, [BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
    terms_smem = q_smem  # unused unless allocated below
    hidden_smem = q_smem
    if ONE_SCORER and HAS_MASK and S_Q == 1:
        # Each ring slot's mask terms and whether they hide a key (_prepare_mask_terms).
        terms_smem = gl.allocate_shared_memory(
            gl.float32, [NUM_STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        hidden_smem = gl.allocate_shared_memory(
            gl.int32, [NUM_STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
    # ready: a slot's tile has landed; free: the math warps are done with a slot.
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # A copy-engine fill is one expected arrival (plus its bytes); a gathered one, every copying
    # thread's.
    copiers: gl.constexpr = (PRODUCER_WARPS if PRODUCER_WARPS > 0 else num_warps) * 32
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=copiers if GATHER else 1)
        # Query in registers: a slot is free once both warpgroups' P.V parts are done with it.
        mbarrier.init(free.index(i), count=2 if QUERY_IN_REGISTERS else 1)

    n_tiles = gl.cdiv(end - start, BLOCK_N)
    # Tokens at an invalid cache location, counted per tile row as tiles are located (a scalar
    # sum per tile costs a cross-warp reduction; summed once at the end).
    n_bad = gl.zeros([BLOCK_N], gl.int32, layout=gl.SliceLayout(1, gather_layout))
    if QUERY_IN_REGISTERS:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        # The query's loads go out first, 16 bytes a load; the prologue's
        # copies follow.
        q_rows = _load_query_operand(
            Q, b64, row_block, stride_qb, stride_qs, stride_qh, stride_qd, S_Q, H, 0, L, BLOCK_M,
            io_layout,
        )  # fmt: skip
        qpe_smem.store(
            _load_query_operand(
                Q, b64, row_block, stride_qb, stride_qs, stride_qh, stride_qd, S_Q, H, L, R,
                BLOCK_M, io_layout,
            )
        )  # fmt: skip
        fence_async_shared()
        _thread_barrier()
        # One factor row per slot (a power of two of rows: the shape must be).
        alpha_smem = gl.allocate_shared_memory(
            gl.float32, [4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        sums_smem = gl.allocate_shared_memory(
            gl.float32, [BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        bad_smem = gl.allocate_shared_memory(
            gl.int32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        # s_done: a slot's tile is scored; p_ready: its P and factor are in; sums_ready: the
        # final row sums; done: warpgroup 1's invalid-token count; stored: warpgroup 1's output
        # parts issued.
        s_done = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(s_done.index(i), count=1)
            mbarrier.init(p_ready.index(i), count=1)
        sums_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        stored = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(sums_ready, count=1)
        mbarrier.init(done, count=1)
        mbarrier.init(stored, count=1)
        # Prologue: the first NUM_STAGES - 1 tiles; warpgroup 1 copies the rest, the next one
        # once the first is scored (every program asks for its query and first tiles at once,
        # and a third tile in that burst only delays the first scores).
        for i in gl.static_range(NUM_STAGES - 1):
            if i < n_tiles:
                where, bad = _locate_tile(
                    BLOCK_TABLE, b64, start + i * BLOCK_N, end, stride_btb, stride_btp,
                    NUM_PAGES, MAX_PAGES, PAGE_SIZE, BLOCK_N, False, gather_layout,
                )  # fmt: skip
                n_bad += bad
                _copy_tile(
                    KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, i, start + i * BLOCK_N,
                    where, stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, HAS_PE,
                    False, L, R, CHUNK, gather_layout, io_layout,
                )  # fmt: skip
        bad_before = gl.sum(n_bad, 0)
        # Into the wgmma's A-operand registers through the last ring slot, whose first tile is
        # copied only once tile 0 is scored (loaded straight into that layout, the query took
        # 128 4-byte loads per thread).
        q_stage = kv_ring.index(NUM_STAGES - 1)
        q_stage.store(q_rows)
        _thread_barrier()
        q_nope = q_stage.load(gl.DotOperandLayout(0, s_layout, 2))
        gl.warp_specialize(
            [
                (
                    _score_tiles_qreg,
                    (
                        kv_ring, pe_ring, q_nope, qpe_smem, alpha_smem, sums_smem, ready, free,
                        s_done, p_ready, sums_ready, done, bad_smem, O_PART, LSE_PART, OUT,
                        LSE_OUT, b64, row_block, split, n_real, bad_before, seqlen, start, end,
                        n_tiles, scale_log2, kv_scale, stride_ob, stride_os, stride_oh,
                        stride_ok, stride_od, stride_lb, stride_ls, stride_lh, stride_lk,
                        stride_fb, stride_fs, stride_fh, stride_fd, stride_gb, stride_gs,
                        stride_gh, S_Q, H, L, BLOCK_M, NUM_STAGES, CAUSAL, MERGE,
                        ),
                ),
                (
                    _pv_rest_qreg,
                    (
                        KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, alpha_smem,
                        sums_smem, ready, free, s_done, p_ready, sums_ready, done, stored,
                        bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64, row_block, split, n_real,
                        bad_before, start, end, n_tiles, kv_scale, stride_btb, stride_btp,
                        NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet,
                        stride_ob, stride_os, stride_oh, stride_ok, stride_od, stride_lb,
                        stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh,
                        stride_fd, stride_gb, stride_gs, stride_gh, S_Q, H, PAGE_SIZE, L, R,
                        CHUNK, BLOCK_M, NUM_STAGES, MERGE, ),
                ),
            ],
            [4],
            [PV_REGS],
        )  # fmt: skip
        # Warpgroup 1's stores issued.
        mbarrier.wait(stored, 0)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(s_done.index(i))
            mbarrier.invalidate(p_ready.index(i))
        mbarrier.invalidate(sums_ready)
        mbarrier.invalidate(done)
        mbarrier.invalidate(stored)
    elif PRODUCER_WARPS > 0:
        # Warp specialisation: the producer warps copy, these warps (the default partition) do
        # the math.
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(done, count=1)
        bad_smem = gl.allocate_shared_memory(
            gl.int32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        o_t, m_i, l_i, n_bad = gl.warp_specialize(
            [
                (
                    _consume_tiles,
                    (
                        Q, KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring,
                        pe_ring, stage, p_smem, max_smem, ready, free, n_bad, b64, row_block,
                        seqlen,
                        start, end, n_tiles, stride_qb, stride_qs, stride_qh, stride_qd,
                        stride_btb, stride_btp, NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt,
                        stride_pep, stride_pet, scale_log2, kv_scale, S_Q, H, L, R,
                        PAGE_SIZE, BLOCK_M, NUM_STAGES, CAUSAL, HAS_PE, KV_FP8, CHUNK, GATHER,
                        True, FLOAT8_PRODUCTS, PE_FP8, pe_stage, MASK, stride_mb,
                        stride_ms, stride_mt, MASK_LEN, HAS_MASK, MASK_IS_BOOL,
                    ),
                ),
                (
                    _produce_tiles,
                    (
                        KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, ready, free,
                        done, bad_smem, b64, start, end, n_tiles, stride_btb, stride_btp,
                        NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet,
                        PAGE_SIZE, NUM_STAGES, HAS_PE, KV_FP8, GATHER, L, R, CHUNK,
                        ),
                ),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGS],
        )  # fmt: skip
        mbarrier.wait(done, 0)
        n_bad = bad_smem.load(gl.SliceLayout(1, gather_layout))
        mbarrier.invalidate(done)
    else:
        if ROWS_ON_M or ONE_SCORER:
            # The query's loads go out first: issued after the prologue's copies they queue
            # behind every program's first tiles.
            q_nope, q_pe = _load_query(
                Q, b64, row_block, stride_qb, stride_qs, stride_qh, stride_qd, S_Q, H, L, R,
                BLOCK_M, HAS_PE, io_layout,
            )  # fmt: skip
        # Prologue: the first NUM_STAGES tiles in flight before the query is in shared memory.
        for i in gl.static_range(NUM_STAGES):
            if i < n_tiles:
                where, bad = _locate_tile(
                    BLOCK_TABLE, b64, start + i * BLOCK_N, end, stride_btb, stride_btp,
                    NUM_PAGES, MAX_PAGES, PAGE_SIZE, BLOCK_N, GATHER, gather_layout,
                )  # fmt: skip
                n_bad += bad
                _copy_tile(
                    KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, i, start + i * BLOCK_N,
                    where, stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, HAS_PE,
                    GATHER, L, R, CHUNK, gather_layout, io_layout,
                )  # fmt: skip
        if ONE_SCORER:
            if HAS_MASK and S_Q == 1:
                # The prologue's tiles' mask terms, for warpgroup 0 (these warps) to read once
                # their tiles land; the barrier orders the stores across its warps.
                for i in gl.static_range(NUM_STAGES):
                    if i < n_tiles:
                        raw = _mask_load(
                            MASK, b64, 0, start + i * BLOCK_N, end, stride_mb, 0, stride_mt,
                            MASK_LEN, S_Q, H, BLOCK_M, BLOCK_N, MASK_IS_BOOL, PREPARED_LAYOUT, 1,
                            True,
                        )  # fmt: skip
                        _prepare_mask_terms(
                            raw, start + i * BLOCK_N, end, i, terms_smem, hidden_smem,
                            MASK_IS_BOOL,
                        )  # fmt: skip
                _thread_barrier()
            _store_query(q_nope, q_pe, q_smem, qpe_smem, 1.0, HAS_PE, False)
            done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(done, count=1)
            bad_smem = gl.allocate_shared_memory(
                gl.int32, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            )
            bad_before = gl.sum(n_bad, 0)
            # Each warpgroup stores its own output half (warpgroup 0 the LSE too).
            gl.warp_specialize(
                [
                    (
                        _score_tiles,
                        (
                            kv_ring, pe_ring, q_smem, qpe_smem, p_smem, alpha_smem, ready, free,
                            p_ready, p_free, done, bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64,
                            row_block, split, n_real, bad_before, seqlen, start, end, n_tiles,
                            scale_log2, kv_scale, stride_ob, stride_os, stride_oh, stride_ok,
                            stride_od, stride_lb, stride_ls, stride_lh, stride_lk, stride_fb,
                            stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh,
                            S_Q, H, L, BLOCK_M, NUM_STAGES, CAUSAL, HAS_PE, MERGE,
                            MASK, stride_mb, stride_ms, stride_mt, MASK_LEN, HAS_MASK,
                            MASK_IS_BOOL, terms_smem, hidden_smem,
                        ),
                    ),
                    (
                        _assist_tiles,
                        (
                            KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, q_smem,
                            p_smem, alpha_smem, ready, free, p_ready, p_free, done, bad_smem,
                            O_PART, LSE_PART, OUT, LSE_OUT, b64, row_block, split, n_real,
                            bad_before, start, end, n_tiles, kv_scale, stride_btb, stride_btp,
                            NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet,
                            stride_ob, stride_os, stride_oh, stride_ok, stride_od, stride_lb,
                            stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh,
                            stride_fd, stride_gb, stride_gs, stride_gh, S_Q, H,
                            PAGE_SIZE, NUM_STAGES, HAS_PE, L, R, CHUNK, MERGE, MASK,
                            stride_mb, stride_mt, MASK_LEN, HAS_MASK, MASK_IS_BOOL, terms_smem,
                            hidden_smem,
                        ),
                    ),
                ],
                [4],
                [ASSIST_REGS],
            )  # fmt: skip
            # Warpgroup 1's stores issued (done's second phase).
            mbarrier.wait(done, 1)
            mbarrier.invalidate(done)
            mbarrier.invalidate(p_ready)
            mbarrier.invalidate(p_free)
        elif ROWS_ON_M:
            _store_query(q_nope, q_pe, q_smem, qpe_smem, 1.0, HAS_PE, False)
            o_t, m_i, l_i, n_bad = _consume_rows_on_m(
                KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring, pe_ring,
                p_smem, ready, free, n_bad, b64, row_block, seqlen, start, end, n_tiles,
                stride_btb, stride_btp, NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt, stride_pep,
                stride_pet, scale_log2, S_Q, H, L, R, PAGE_SIZE, BLOCK_M, NUM_STAGES,
                CAUSAL, HAS_PE, CHUNK, GATHER, )  # fmt: skip
        else:
            o_t, m_i, l_i, n_bad = _consume_tiles(
                Q, KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring, pe_ring,
                stage, p_smem, max_smem, ready, free, n_bad, b64, row_block, seqlen, start, end,
                n_tiles,
                stride_qb, stride_qs, stride_qh, stride_qd, stride_btb, stride_btp, NUM_PAGES,
                MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet, scale_log2, kv_scale,
                S_Q, H, L, R, PAGE_SIZE, BLOCK_M, NUM_STAGES, CAUSAL, HAS_PE, KV_FP8,
                CHUNK, GATHER, False, FLOAT8_PRODUCTS, PE_FP8, pe_stage, MASK, stride_mb,
                stride_ms, stride_mt, MASK_LEN, HAS_MASK, MASK_IS_BOOL,
            )  # fmt: skip

    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(free.index(i))
    # Programmatic dependent launch: the combine may launch once every program is past its loop (an
    # empty split, which returned above, counts at its exit); it waits on the device for this grid's
    # writes (device.has_pdl). Issued at the program's entry instead, which launched the
    # combine while the decode still streamed, the benchmark's calls that run the combine,
    # (h128_b32_4k)-(h16_b64_8k_ragged), took 0.5-1.2 us longer on an H200 ((h16_b4_64k) 1.0-1.2
    # us).
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip
    s_st = rows_st // H
    h_st = rows_st % H
    # Without MERGE every chunk writes its partial. With MERGE, a sequence cut into one chunk
    # writes its final rows here (mla::combine of one split is exactly this cast); with more,
    # every chunk writes its partial and the program that arrives last merges them (splits past
    # the sequence's chunks exited above). One-scorer programs stored theirs in the partitions.
    if not ONE_SCORER:
        n_bad = gl.sum(n_bad, 0)
        l_st = gl.convert_layout(l_i, gl.SliceLayout(0, st_layout))
        m_st = gl.convert_layout(m_i, gl.SliceLayout(0, st_layout))
        lse, l_safe = _row_lse(m_st, l_st, n_bad > 0)
        # kv_scale: V is the dequantised kv_c (1.0 for a 16-bit cache).
        out_scale = kv_scale / P_E4M3_SCALE if FLOAT8_PRODUCTS else kv_scale
        out_t = gl.convert_layout(o_t, st_layout) * (out_scale / l_safe)[None, :]
        out_t = gl.where(n_bad > 0, float("nan"), out_t)
        if FLOAT8_PRODUCTS:
            offs_l_st = _latent_column(offs_l_st)
        if MERGE and n_real == 1:
            _store_partial_t(
                OUT, LSE_OUT, out_t, lse, b64, s_st, h_st, 0, offs_l_st, row_ok_st, stride_fb,
                stride_fs, stride_fh, 0, stride_fd, stride_gb, stride_gs, stride_gh, 0,
            )  # fmt: skip
        else:
            _store_partial_t(
                O_PART, LSE_PART, out_t, lse, b64, s_st, h_st, split, offs_l_st, row_ok_st,
                stride_ob, stride_os, stride_oh, stride_ok, stride_od,
                stride_lb, stride_ls, stride_lh, stride_lk,
            )  # fmt: skip
    if MERGE and n_real > 1:
        # Every thread's partial stores precede (bar.sync) one thread's release-acquire
        # arrival at gpu scope; the last of the row block's n_real arrivals sees them all
        # (the scalar atomic's result reaches every thread through shared memory and a
        # barrier) and puts the count back to 0.
        _thread_barrier()
        pid_bm = b * num_row_blocks + row_block
        arrived = gl.atomic_add(ARRIVALS + pid_bm, 1, sem="acq_rel", scope="gpu")
        if arrived == n_real - 1:
            gl.store(ARRIVALS + pid_bm, 0)
            _merge_splits(
                O_PART, LSE_PART, OUT, LSE_OUT, b64, s_st, h_st, row_ok_st, n_real,
                stride_ob, stride_os, stride_oh, stride_ok, stride_od,
                stride_lb, stride_ls, stride_lh, stride_lk,
                stride_fb, stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh,
                L, BLOCK_M, MERGE_SPLITS, num_warps,
            )  # fmt: skip
