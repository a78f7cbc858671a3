"""The one-scorer loop over DeepSeek's row (L = 512, R = 64, no mask) with the nope query in
warpgroup 0's registers as the scores' A operand: the freed shared memory holds a third ring
slot, so warpgroup 1 multiplies each tile's P.V once the next tile is scored, under warpgroup
0's softmax. P is written over the tile's dead k_pe part; the output splits 64 + 448 columns
between the warpgroups, as the query's 128 registers a thread allow."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .compat import _thread_barrier
from .epilogue import _store_output_half
from .layouts import QREG_COLS, _copy_layouts
from .loads import _await_tile, _copy_tile, _locate_tile
from .mainloop_one_scorer import _pv_part
from .softmax import _online_softmax, _row_start


@gluon.jit
def _score_tiles_qreg(
    kv_ring, pe_ring, q_nope, qpe_smem, alpha_smem, sums_smem, ready, free, s_done, p_ready,
    sums_ready, done, bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64, row_block, split, n_real,
    bad_before, seqlen, start, end, n_tiles, scale_log2, kv_scale, stride_ob, stride_os,
    stride_oh, stride_ok, stride_od, stride_lb, stride_ls, stride_lh, stride_lk, stride_fb,
    stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh, S_Q: gl.constexpr,
    H: gl.constexpr, L: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, MERGE: gl.constexpr, ):  # fmt: skip
    """Warpgroup 0 of a query-in-registers program (``QUERY_IN_REGISTERS``): per tile the scores
    ``S [64, BLOCK_N] = Q K^T`` with the nope query as the wgmma's A operand in registers
    (``q_nope``) and the RoPE query in ``qpe_smem``; ``s_done``; the online softmax; ``P`` into
    the slot's own k_pe part (dead once scored: the same [64, 64] 16-bit shape and swizzle) and
    the rescaling factor beside it, ``p_ready``; then its own narrow part of the output,
    ``O[:, :QREG_COLS] += P V``. Warpgroup 1 (``_pv_rest_qreg``) multiplies the rest of tile
    ``i`` once tile ``i + 1`` is scored, so that its products run under this warpgroup's softmax.

    Why: in a one-scorer program (``_score_tiles``) the tensor cores wait for every tile's
    softmax. Running P.V under the next tile's softmax holds each slot one tile longer, which
    needs a ring of three, and three 72 KB slots fit in shared memory only without the 64 KB
    query. Registers set the split of P.V: the query takes 128 per thread here, so this
    warpgroup keeps 64 columns (32) and warpgroup 1 the other 448 (224)."""
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    dtype: gl.constexpr = kv_ring.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QREG_COLS, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    last_key, m_i = _row_start(row_block, seqlen, S_Q, H, BLOCK_M, CAUSAL, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    o = gl.zeros([BLOCK_M, QREG_COLS], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        tile_start = start + i * BLOCK_N
        # Stale rows past the split's end stay: their scores are masked, and each P.V zeroes
        # its own value columns of them (_pv_part).
        kv = _await_tile(kv_ring, ready, i, tile_start, end, NUM_STAGES, False, False, s_layout)
        pe = pe_ring.index(slot)
        s = warpgroup_mma(q_nope, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qpe_smem, pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        # Every warp's reads of the slot's k_pe are done before P overwrites it.
        _thread_barrier()
        mbarrier.arrive(s_done.index(slot), count=1)
        p, m_i, l_i, alpha = _online_softmax(
            s, m_i, l_i, tile_start + offs_tile, end, last_key, scale_log2, 1
        )
        pe.store(p.to(dtype))
        alpha_smem.index(slot).store(alpha)
        fence_async_shared()
        _thread_barrier()
        mbarrier.arrive(p_ready.index(slot), count=1)
        o = _pv_part(
            pe, kv, o, 0, tile_start, end, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        )
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        _thread_barrier()
        mbarrier.arrive(free.index(slot), count=1)
    sums_smem.store(l_i)
    _thread_barrier()
    mbarrier.arrive(sums_ready, count=1)
    mbarrier.wait(done, 0)
    io_layout: gl.constexpr = _copy_layouts(4, False)[0]
    poisoned = bad_before + gl.sum(bad_smem.load(gl.SliceLayout(1, io_layout)), 0) > 0
    _store_output_half(
        O_PART, LSE_PART, OUT, LSE_OUT, kv_ring.index(0), o, m_i, l_i, poisoned, kv_scale, b64,
        row_block, split, n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od,
        stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh, stride_fd,
        stride_gb, stride_gs, stride_gh, 0, S_Q, H, L, BLOCK_M, MERGE, True, QREG_COLS,
    )  # fmt: skip


@gluon.jit
def _pv_rest_qreg(
    KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, alpha_smem, sums_smem, ready, free,
    s_done, p_ready, sums_ready, done, stored, bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64,
    row_block, split, n_real, bad_before, start, end, n_tiles, kv_scale, stride_btb, stride_btp,
    NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet, stride_ob, stride_os,
    stride_oh, stride_ok, stride_od, stride_lb, stride_ls, stride_lh, stride_lk, stride_fb,
    stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh, S_Q: gl.constexpr,
    H: gl.constexpr, PAGE_SIZE: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, MERGE: gl.constexpr,
    ):  # fmt: skip
    """Warpgroup 1 of a query-in-registers program: ``O[:, QREG_COLS:] += P V`` per tile (448
    columns as 256 + 128 + 64: a wgmma's N is at most 256 and a tensor's shape a power of two),
    issued once warpgroup 0 has handed over the
    tile's ``P`` (``p_ready``) and scored the next tile (``s_done``), so that the products run
    under that tile's softmax. Then, once warpgroup 0 is done with the slot too (``free`` counts
    both), the copy of the tile ``NUM_STAGES`` ahead into it (the first ``NUM_STAGES`` were
    issued before the partitions), and the tokens at invalid cache locations counted into
    ``bad_smem`` (``done``). At the end its columns are stored with the final row sums
    (``sums_ready``), then ``stored``."""
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    io_layout: gl.constexpr = _copy_layouts(4, False)[0]
    gl.static_assert(L == 512 and QREG_COLS == 64)
    # Each part starts at a multiple of its width: a swizzled tile is sliced only so.
    COL_A: gl.constexpr = 256
    COL_B: gl.constexpr = 128
    COL_C: gl.constexpr = 64
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
    )
    b_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]
    )
    c_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    n_bad = gl.zeros([BLOCK_N], gl.int32, layout=gl.SliceLayout(1, io_layout))
    o_a = gl.zeros([BLOCK_M, 256], gl.float32, layout=a_layout)
    o_b = gl.zeros([BLOCK_M, 128], gl.float32, layout=b_layout)
    o_c = gl.zeros([BLOCK_M, 64], gl.float32, layout=c_layout)
    if n_tiles > 0:
        # The first tile's scoring is waited for too, though its P (p_ready) comes later and
        # implies it: every phase of s_done then has a waiter (compute-sanitizer's synccheck
        # reports a completed phase that nobody waited for as "Missing wait").
        mbarrier.wait(s_done.index(0), 0)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        tile_start = start + i * BLOCK_N
        next_start = start + (i + NUM_STAGES) * BLOCK_N
        # Located before the waits: the lookup's latency overlaps them.
        next_where, bad = _locate_tile(
            BLOCK_TABLE, b64, next_start, end, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES,
            PAGE_SIZE, BLOCK_N, False, io_layout,
        )  # fmt: skip
        n_bad += bad
        mbarrier.wait(p_ready.index(slot), (i // NUM_STAGES) & 1)
        if i == 0 and n_tiles > NUM_STAGES - 1:
            # The prologue's missing tile, into a slot never used yet.
            late_start = start + (NUM_STAGES - 1) * BLOCK_N
            late_where, late_bad = _locate_tile(
                BLOCK_TABLE, b64, late_start, end, stride_btb, stride_btp, NUM_PAGES,
                MAX_PAGES, PAGE_SIZE, BLOCK_N, False, io_layout,
            )  # fmt: skip
            n_bad += late_bad
            _copy_tile(
                KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, NUM_STAGES - 1, late_start,
                late_where, stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, True,
                False, L, R, CHUNK, io_layout, io_layout,
            )  # fmt: skip
        if i + 1 < n_tiles:
            mbarrier.wait(s_done.index((i + 1) % NUM_STAGES), ((i + 1) // NUM_STAGES) & 1)
        alpha = alpha_smem.index(slot).load(gl.SliceLayout(1, a_layout))
        kv = kv_ring.index(slot)
        p_smem = pe_ring.index(slot)
        o_a = _pv_part(p_smem, kv, o_a, COL_A, tile_start, end, alpha)
        alpha_b = gl.convert_layout(alpha, gl.SliceLayout(1, b_layout))
        o_b = _pv_part(p_smem, kv, o_b, COL_B, tile_start, end, alpha_b)
        alpha_c = gl.convert_layout(alpha, gl.SliceLayout(1, c_layout))
        o_c = _pv_part(p_smem, kv, o_c, COL_C, tile_start, end, alpha_c)
        o_a, o_b, o_c = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b, o_c))
        # Every warp's reads of the slot done; the copy waits for warpgroup 0's too.
        _thread_barrier()
        mbarrier.arrive(free.index(slot), count=1)
        if i + NUM_STAGES < n_tiles:
            mbarrier.wait(free.index(slot), (i // NUM_STAGES) & 1)
            _copy_tile(
                KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, slot, next_start, next_where,
                stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, True, False, L, R,
                CHUNK, io_layout, io_layout,
            )  # fmt: skip
    bad_smem.store(n_bad)
    _thread_barrier()
    mbarrier.arrive(done, count=1)
    mbarrier.wait(sums_ready, 0)
    l_i = sums_smem.load(gl.SliceLayout(1, a_layout))
    poisoned = bad_before + gl.sum(n_bad, 0) > 0
    # Final 16-bit rows (MERGE, one chunk) are staged in slot 0's columns of each part: no P.V
    # reads it any more, and every copy has landed. Smallest part first: converting the widest
    # while the other two are still held spilled 224 bytes a thread (Triton 3.6).
    _store_output_half(
        O_PART, LSE_PART, OUT, LSE_OUT, kv_ring.index(0), o_c, l_i, l_i, poisoned, kv_scale, b64,
        row_block, split, n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od,
        stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh, stride_fd,
        stride_gb, stride_gs, stride_gh, COL_C, S_Q, H, L, BLOCK_M, MERGE, False, 64,
    )  # fmt: skip
    _store_output_half(
        O_PART, LSE_PART, OUT, LSE_OUT, kv_ring.index(0), o_b, l_i, l_i, poisoned, kv_scale, b64,
        row_block, split, n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od,
        stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh, stride_fd,
        stride_gb, stride_gs, stride_gh, COL_B, S_Q, H, L, BLOCK_M, MERGE, False, 128,
    )  # fmt: skip
    _store_output_half(
        O_PART, LSE_PART, OUT, LSE_OUT, kv_ring.index(0), o_a, l_i, l_i, poisoned, kv_scale, b64,
        row_block, split, n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od,
        stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh, stride_fd,
        stride_gb, stride_gs, stride_gh, COL_A, S_Q, H, L, BLOCK_M, MERGE, False, 256,
    )  # fmt: skip
    # The stores issued by every warp before the arrival (a merging program's release follows).
    _thread_barrier()
    mbarrier.arrive(stored, count=1)
