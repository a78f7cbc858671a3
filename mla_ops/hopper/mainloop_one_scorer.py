"""One-scorer 64-row programs (DeepSeek's 128 heads over copy-engine tiles of a 16-bit cache),
FlashMLA's division of the work: warpgroup 0 scores whole tiles with ``m64n64k16`` and runs the
softmax, then hands P to warpgroup 1, a partition of its own that issues the copies and takes
the other half of P.V; each warpgroup stores its own part of the output."""

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
from .layouts import FLAG_LAYOUT, PREPARED_LAYOUT, _copy_layouts
from .loads import _copy_tile, _locate_tile, _zero_rows
from .mainloop_rows_on_m import _scores_on_m
from .softmax import (
    _mask_bias,
    _mask_load,
    _mask_visible,
    _online_softmax,
    _over_rows,
    _prepare_mask_terms,
    _row_start,
    _zero_hidden_rows,
)


@gluon.jit
def _score_tiles(
    kv_ring, pe_ring, q_smem, qpe_smem, p_smem, alpha_smem, ready, free, p_ready, p_free, done,
    bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64, row_block, split, n_real, bad_before, seqlen,
    start, end, n_tiles, scale_log2, kv_scale, stride_ob, stride_os, stride_oh, stride_ok,
    stride_od, stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh,
    stride_fd, stride_gb, stride_gs, stride_gh, S_Q: gl.constexpr, H: gl.constexpr,
    L: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    HAS_PE: gl.constexpr, MERGE: gl.constexpr, MASK=None, stride_mb=0,
    stride_ms=0, stride_mt=0, MASK_LEN=0, HAS_MASK: gl.constexpr = False,
    MASK_IS_BOOL: gl.constexpr = False, terms_smem=None, hidden_smem=None,
):  # fmt: skip
    """Warpgroup 0 of a one-scorer program (``ONE_SCORER``): for each tile the whole scores
    ``S [64, BLOCK_N] = Q K^T`` (``m64n64k16``), the online softmax, ``P`` and the output's
    rescaling factor handed to warpgroup 1 (``_assist_tiles``) through ``p_smem``/``alpha_smem``
    (``p_ready``; one buffer, as a second does not fit beside the query and a ring of two: it is
    free again on ``p_free``, when warpgroup 1's P.V on it is done), then its own half of the
    output, ``O[:, :L/2] += P V[:, :L/2]``.

    Why: when both warpgroups score half of the tile's tokens each (``_consume_rows_on_m``), each
    reads the whole 64 x 576 query from shared memory for its 32 tokens, and the scores run at the
    shared-memory bound (1840 clocks per tile against 1221 for one warpgroup scoring all 64).

    At the end: warpgroup 1's count of tokens at invalid cache locations (``done``, its first
    phase), the final row sums to warpgroup 1 through ``alpha_smem`` (``p_ready``, once more),
    then this half and the rows' LSE stored (``_store_output_half``). In that order: warpgroup 1
    completes ``done``'s second phase only once it has the sums, so the first wait cannot miss
    its phase.

    ``HAS_MASK``: an attention mask. At S_q = 1 its one row per tile is prepared by whoever
    issues the tile's copy (the prologue, then warpgroup 1: ``_prepare_mask_terms``) into
    ``terms_smem``/``hidden_smem`` beside the ring slot, so this warpgroup only selects keys by
    them and adds a float mask's bias. Otherwise
    a row per query position is loaded under the tile's own scores (``_mask_load``). The value
    rows of keys it hides from every row are zeroed in the slot before ``P`` is handed over, so
    that both warpgroups' P.V read them zeroed.
    """
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, L // 2, 16]
    )
    io_layout: gl.constexpr = _copy_layouts(4, False)[0]
    last_key, m_i = _row_start(
        row_block, seqlen, S_Q, H, BLOCK_M, CAUSAL, gl.SliceLayout(1, s_layout)
    )
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    o = gl.zeros([BLOCK_M, L // 2], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    PREPARED: gl.constexpr = HAS_MASK and S_Q == 1
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        tile_start = start + i * BLOCK_N
        mask_visible = None
        mask_bias = None
        if HAS_MASK and not PREPARED:
            # A row per query position, loaded in the tile that uses it, under its scores: a
            # tile ahead, the two 64 x 64 tiles of values in flight made ptxas spill 56-136 bytes
            # .
            mask_raw = _mask_load(
                MASK, b64, row_block, tile_start, end, stride_mb, stride_ms, stride_mt, MASK_LEN,
                S_Q, H, BLOCK_M, BLOCK_N, MASK_IS_BOOL, s_layout, 1, False,
            )  # fmt: skip
        kv, s = _scores_on_m(
            kv_ring, pe_ring, q_smem, qpe_smem, ready, s_zero, i, tile_start, end, NUM_STAGES,
            HAS_PE, False, io_layout,
        )  # fmt: skip
        if PREPARED:
            # The slot's terms landed with its tile (written before the copy's arrival). A
            # hidden key is left out by a select, not by its -inf term: the scores of the NaN
            # rows Hugging Face leaves at pads are NaN, and NaN - inf is NaN.
            terms = terms_smem.index(slot).load(gl.SliceLayout(0, s_layout))
            term_visible = terms > float("-inf")
            mask_visible = _over_rows(term_visible, 1)
            if not MASK_IS_BOOL:
                mask_bias = _over_rows(terms, 1)
        elif HAS_MASK:
            row_visible = _mask_visible(mask_raw, MASK_IS_BOOL)
            mask_visible = _over_rows(row_visible, 1)
            if not MASK_IS_BOOL:
                mask_bias = _over_rows(_mask_bias(mask_raw, row_visible), 1)
        p, m_i, l_i, alpha = _online_softmax(
            s, m_i, l_i, tile_start + offs_tile, end, last_key, scale_log2, 1, None, mask_visible,
            mask_bias,
        )  # fmt: skip
        # Before P goes to warpgroup 1: its P.V reads the slot's other half.
        if PREPARED:
            if gl.max(hidden_smem.index(slot).load(FLAG_LAYOUT), 0) != 0:
                _zero_hidden_rows(kv, term_visible, tile_start, end, io_layout, 1)
        elif HAS_MASK:
            _zero_hidden_rows(kv, row_visible, tile_start, end, io_layout, 1)
        # P and alpha to warpgroup 1, once its P.V of the tile before is done. A fresh barrier
        # counts as having completed the phase before its first: the first wait passes at once.
        mbarrier.wait(p_free, (i & 1) ^ 1)
        p_smem.store(p.to(dtype))
        alpha_smem.store(alpha)
        fence_async_shared()
        _thread_barrier()
        mbarrier.arrive(p_ready, count=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p_smem, kv.slice(0, L // 2, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        # This warpgroup is done with the slot; warpgroup 1 refills it.
        _thread_barrier()
        mbarrier.arrive(free.index(slot), count=1)
    mbarrier.wait(done, 0)
    bad = bad_smem.load(gl.SliceLayout(1, _copy_layouts(4, False)[1]))
    poisoned = bad_before + gl.sum(bad, 0) > 0
    # alpha_smem is free once warpgroup 1 has read the last tile's alpha (its P.V done).
    mbarrier.wait(p_free, (n_tiles & 1) ^ 1)
    alpha_smem.store(l_i)
    _thread_barrier()
    mbarrier.arrive(p_ready, count=1)
    _store_output_half(
        O_PART, LSE_PART, OUT, LSE_OUT, q_smem, o, m_i, l_i, poisoned, kv_scale, b64, row_block,
        split, n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od, stride_lb, stride_ls,
        stride_lh, stride_lk, stride_fb, stride_fs, stride_fh, stride_fd, stride_gb, stride_gs,
        stride_gh, 0, S_Q, H, L, BLOCK_M, MERGE, True,
    )  # fmt: skip


@gluon.jit
def _assist_tiles(
    KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, q_smem, p_smem, alpha_smem, ready,
    free, p_ready, p_free, done, bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64, row_block, split,
    n_real, bad_before, start, end, n_tiles, kv_scale, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES,
    stride_kvp, stride_kvt, stride_pep, stride_pet, stride_ob, stride_os, stride_oh, stride_ok,
    stride_od, stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh,
    stride_fd, stride_gb, stride_gs, stride_gh, S_Q: gl.constexpr, H: gl.constexpr,
    PAGE_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_PE: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, CHUNK: gl.constexpr, MERGE: gl.constexpr, MASK=None,
    stride_mb=0, stride_mt=0, MASK_LEN=0, HAS_MASK: gl.constexpr = False,
    MASK_IS_BOOL: gl.constexpr = False, terms_smem=None, hidden_smem=None,
):  # fmt: skip
    """Warpgroup 1 of a one-scorer program: for each tile, once warpgroup 0 has handed over
    ``P`` and the rescaling factor, the output's other half ``O[:, L/2:] += P V[:, L/2:]``; then,
    once warpgroup 0 is done with the slot too, the copy of the tile ``NUM_STAGES`` ahead into it
    (the first ``NUM_STAGES`` were issued before the partitions), and with an S_q = 1 mask that
    tile's mask terms beside it (``_prepare_mask_terms``; its row loaded before the waits, as
    the tile's pages are located). At the end: the invalid tokens
    it counted into ``bad_smem`` (``done``, first phase), then, with the final row sums from
    warpgroup 0 (``p_ready`` once more), its output half stored (``_store_output_half``) and
    ``done``'s second phase."""
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    BLOCK_M: gl.constexpr = p_smem.shape[0]
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, L // 2, 16]
    )
    io_layout: gl.constexpr = _copy_layouts(4, False)[0]
    gather_layout: gl.constexpr = _copy_layouts(4, False)[1]
    n_bad = gl.zeros([BLOCK_N], gl.int32, layout=gl.SliceLayout(1, gather_layout))
    o = gl.zeros([BLOCK_M, L // 2], gl.float32, layout=o_layout)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        next_start = start + (i + NUM_STAGES) * BLOCK_N
        # Located before the waits: the lookup's latency overlaps them.
        next_where, bad = _locate_tile(
            BLOCK_TABLE, b64, next_start, end, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES,
            PAGE_SIZE, BLOCK_N, False, gather_layout,
        )  # fmt: skip
        n_bad += bad
        if HAS_MASK and S_Q == 1:
            mask_next = _mask_load(
                MASK, b64, 0, next_start, end, stride_mb, 0, stride_mt, MASK_LEN, S_Q, H, BLOCK_M,
                BLOCK_N, MASK_IS_BOOL, PREPARED_LAYOUT, 1, True,
            )  # fmt: skip
        mbarrier.wait(p_ready, i & 1)
        alpha = alpha_smem.load(gl.SliceLayout(1, o_layout))
        o = o * alpha[:, None]
        v_hi = kv_ring.index(slot).slice(L // 2, L // 2, dim=1)
        o = warpgroup_mma(p_smem, v_hi, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        # Every warp's reads of P and alpha done: the buffer is warpgroup 0's again.
        _thread_barrier()
        mbarrier.arrive(p_free, count=1)
        if i + NUM_STAGES < n_tiles:
            mbarrier.wait(free.index(slot), (i // NUM_STAGES) & 1)
            if HAS_MASK and S_Q == 1:
                # Warpgroup 0 read the slot's last terms before it freed the slot; these are
                # visible to it once the copy's arrival (after this barrier) completes the slot.
                _prepare_mask_terms(
                    mask_next, next_start, end, slot, terms_smem, hidden_smem, MASK_IS_BOOL
                )
                _thread_barrier()
            _copy_tile(
                KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, slot, next_start, next_where,
                stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, HAS_PE, False, L, R,
                CHUNK, gather_layout, io_layout,
            )  # fmt: skip
    bad_smem.store(n_bad)
    _thread_barrier()
    mbarrier.arrive(done, count=1)
    mbarrier.wait(p_ready, n_tiles & 1)
    l_i = alpha_smem.load(gl.SliceLayout(1, o_layout))
    poisoned = bad_before + gl.sum(n_bad, 0) > 0
    _store_output_half(
        O_PART, LSE_PART, OUT, LSE_OUT, q_smem, o, l_i, l_i, poisoned, kv_scale, b64, row_block,
        split, n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od, stride_lb, stride_ls,
        stride_lh, stride_lk, stride_fb, stride_fs, stride_fh, stride_fd, stride_gb, stride_gs,
        stride_gh, L // 2, S_Q, H, L, BLOCK_M, MERGE, False,
    )  # fmt: skip
    # The stores issued by every warp before the arrival: a merging program's release at gpu
    # scope (the kernel's arrival atomic) follows this phase.
    _thread_barrier()
    mbarrier.arrive(done, count=1)


@gluon.jit
def _pv_part(p_smem, kv, o, COL0: gl.constexpr, tile_start, end, alpha):
    """``o [BLOCK_M, W] * alpha + P V[:, COL0 : COL0 + W]`` (issued, not waited), with the
    split's stale rows past ``end`` zeroed first in these value columns (P is 0 there; the rows
    may hold NaN)."""
    BLOCK_N: gl.constexpr = kv.shape[0]
    WIDTH: gl.constexpr = o.shape[1]
    io_layout: gl.constexpr = _copy_layouts(4, False)[0]
    v = kv.slice(COL0, WIDTH, dim=1)
    if tile_start + BLOCK_N > end:
        offs_io = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
        _zero_rows(v, (offs_io < end)[:, None], io_layout, 32)
    o = o * alpha[:, None]
    return warpgroup_mma(p_smem, v, o, is_async=True)
