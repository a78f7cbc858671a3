"""Float8 (e4m3) tiles: converted to fp16 in shared memory (exact: e4m3 is a subset of fp16),
or, in 16-row programs of width 512 over copy-engine tiles, multiplied in float8 as FlashMLA's
and FlashAttention-3's float8 kernels do: the scores by float8 wgmma straight from the ring slot
with the query as two e4m3 terms (its rounding and its remainder, so that the scores keep about
bf16's precision), ``V^T`` read by ``ldmatrix.trans`` and one byte permute per register, and P
in e4m3."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .compat import _reinterpret, _thread_barrier
from .layouts import (
    _PAIRS_TO_ROWS,
    _VT_LOAD_LAYOUT,
    _VT_OFFSET_BASES,
    QUERY_REMAINDER_SCALE,
)
from .loads import _await_tile


@gluon.jit
def _convert_chunk(
    src, dst, c: gl.constexpr, tile_start, end, CHUNK: gl.constexpr, layout: gl.constexpr
):  # fmt: skip
    """Columns ``[c, c + CHUNK)`` of the float8 tile ``src [BLOCK_N, L]`` -> fp16 ``dst``
    (exact); rows at or past ``end`` become 0."""
    BLOCK_N: gl.constexpr = src.shape[0]
    if tile_start + BLOCK_N > end:
        # The split's last tile: its rows past end are stale (maybe NaN).
        rows = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        x = src.slice(c, CHUNK, dim=1).load(layout).to(gl.float16)
        dst.slice(c, CHUNK, dim=1).store(gl.where((rows < end)[:, None], x, gl.zeros_like(x)))
    else:
        # Every other tile without the select, converted in this branch of its own: a select per
        # 16-bit value (or a conversion shared with the branch that selects) costs the unpacking
        # of each converted pair and its repacking, 4.5 more instructions per pair in the sm_90
        # SASS (791 instead of 178 per thread and tile).
        dst.slice(c, CHUNK, dim=1).store(src.slice(c, CHUNK, dim=1).load(layout).to(gl.float16))


@gluon.jit
def _float8_tile(
    kv_ring, pe_ring, q_smem, qpe_smem, ready, s_zero, pos, tile_start, end, nope_scale,
    NUM_STAGES: gl.constexpr, HAS_PE: gl.constexpr, io_layout: gl.constexpr,
    PE_FP8: gl.constexpr, o_t,
):  # fmt: skip
    """``FLOAT8_PRODUCTS``: wait for the float8 tile at ring position ``pos`` (its rows past
    ``end`` zeroed in the slot) and score it by float8 wgmma straight from the slot against the
    query's two e4m3 terms (``_store_query``). Returns the scores ``S^T`` (``s_zero``'s layout,
    complete) and ``o_t``, the previous tile's P.V, which was left in flight and is complete
    too (wgmma groups complete in order); ``_float8_vt`` reads the slot's ``V^T`` later, after
    the softmax's reductions.

    ``PE_FP8``: the slot's ``k_pe`` is e4m3 too; its scores are float8 products into the same
    accumulator (``qpe_smem`` holds the RoPE query's two terms under the nope part's power of
    two). Its stale rows are not zeroed: their scores are masked before the softmax, and P.V
    reads only ``kv_c``."""
    BLOCK_N: gl.constexpr = s_zero.shape[0]
    BLOCK_M: gl.constexpr = s_zero.shape[1]
    slot = pos % NUM_STAGES
    kv = _await_tile(kv_ring, ready, pos, tile_start, end, NUM_STAGES, False, False, io_layout)
    if tile_start + BLOCK_N > end:
        _zero_stale_byte_rows(kv, tile_start, end)
    # Both query terms as one N = 2 BLOCK_M product: the slot is read once.
    s2_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * BLOCK_M, 32]
    )
    s2 = gl.zeros([BLOCK_N, 2 * BLOCK_M], gl.float32, layout=s2_layout)
    s2 = warpgroup_mma(kv, q_smem.permute((1, 0)), s2, use_acc=False, is_async=True)
    if PE_FP8:
        s2 = warpgroup_mma(pe_ring.index(slot), qpe_smem.permute((1, 0)), s2, is_async=True)
    elif HAS_PE:
        s_pe = warpgroup_mma(
            pe_ring.index(slot), qpe_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True
        )  # fmt: skip
    if HAS_PE and not PE_FP8:
        s2, s_pe, o_t = warpgroup_mma_wait(num_outstanding=0, deps=(s2, s_pe, o_t))
    else:
        s2, o_t = warpgroup_mma_wait(num_outstanding=0, deps=(s2, o_t))
    # Columns [0, BLOCK_M) scored the rounded query, the rest its remainder.
    s_round, s_rest = gl.split(gl.permute(gl.reshape(s2, [BLOCK_N, 2, BLOCK_M]), (0, 2, 1)))
    s_t = gl.convert_layout(s_round + s_rest * (1.0 / QUERY_REMAINDER_SCALE), s_zero.type.layout)
    s_t = s_t * nope_scale
    if HAS_PE and not PE_FP8:
        s_t = s_t + s_pe
    return s_t, o_t


@gluon.jit
def _float8_vt(kv, vt_layout: gl.constexpr):
    """A float8 ring slot ``kv [BLOCK_N, L]``'s ``V^T`` in the wgmma A operand ``vt_layout``
    (rows permuted: ``_VT_OFFSET_BASES``): ``ldmatrix.trans`` of 16-bit pairs, then one byte
    permute per operand register (the 16-byte loads this replaced needed three).

    Read after the softmax's row maxima, not under the scores: its 32 KB of loads then queued ahead
    of the maxima's shuffles in the shared-memory pipe (ncu: 13 % of the loop's samples on the first
    shuffle's result), and issued late they took (h16_b128_4k_fp8row) from 94.4-95.0 to 90.7-90.8 us
    on an H200 (the whole-row float8 forms of h16_b4_64k 4.5 %, h16_b64_8k_ragged 3 %; issued before
    the scores, 93.1-93.4). ``_consume_tiles`` hands the slot back right after these loads, behind a
    barrier of the warps: handed back without one, loads still queued read the next tile's bytes (an
    H200 measured wrong outputs, and NaN from stale rows). Handed back there instead of after P.V,
    with P.V left in flight, (h16_b128_4k_fp8row) was 3.4 % faster on an H200."""
    BLOCK_N: gl.constexpr = kv.shape[0]
    L: gl.constexpr = kv.shape[1]
    pairs_view = _reinterpret(
        kv, gl.int16, [L // 2, BLOCK_N], gl.SharedLinearLayout(offset_bases=_VT_OFFSET_BASES)
    )  # fmt: skip
    pairs = pairs_view.load(_VT_LOAD_LAYOUT)  # [L / 2, BLOCK_N] int16: ldmatrix.trans
    low, high = gl.inline_asm_elementwise(
        _PAIRS_TO_ROWS, "=r,=r,r,r", [pairs], dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4
    )  # fmt: skip
    # (b, w, g, k, h) -> m = 64 b + 16 w + 8 h + g: a relabelling, no data moves.
    rows = gl.reshape(gl.join(low, high), [8, 4, 8, BLOCK_N, 2])
    v_t = gl.reshape(gl.permute(rows, (0, 1, 4, 2, 3)), [L, BLOCK_N])
    return gl.convert_layout(v_t.to(gl.float8e4nv, bitcast=True), vt_layout, assert_trivial=True)


@gluon.jit
def _zero_stale_byte_rows(kv, tile_start, end):
    """Zero the rows at or past ``end`` of a float8 ring slot ``kv [BLOCK_N, L]`` (128-byte
    swizzle), as 32-bit words: each row's bytes are the 128-byte segments at ``slab * BLOCK_N * 128
    + row * 128`` (the swizzle only permutes 16-byte units within a segment), so the rows are found
    without the swizzle and no byte is selected alone. ``_await_tile``'s zeroing (a select and
    repacking per e4m3 byte) in its place was as correct and 3.3 % slower on the float8 form of
    h16_b64_8k_ragged, whose ragged chunks mostly end in a partial tile (H200: 64.2-64.4 against
    62.2-62.3 us; (h16_b128_4k_fp8 and the float8 form of h16_b4_64k 0.3-0.5 %). Fenced for the
    tensor cores, and a barrier: every
    warp then reads ``V^T`` rows that others zeroed."""
    BLOCK_N: gl.constexpr = kv.shape[0]
    SEGMENTS: gl.constexpr = kv.shape[1] // 128
    num_warps: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    words = _reinterpret(
        kv, gl.int32, [SEGMENTS * BLOCK_N, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    )  # fmt: skip
    rows = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    for segment in gl.static_range(SEGMENTS):
        part = words.slice(segment * BLOCK_N, BLOCK_N, dim=0)
        w = part.load(layout)
        part.store(gl.where((rows < end)[:, None], w, gl.zeros_like(w)))
    fence_async_shared()
    _thread_barrier()


@gluon.jit
def _latent_column(m):
    """The latent column that row ``m`` of a float8-products program's ``O^T`` holds
    (``_VT_OFFSET_BASES``): ``m = 64 b + 16 w + 8 h + g`` -> ``h + 2 g + 16 b + 128 w``."""
    return ((m >> 3) & 1) + (m & 7) * 2 + ((m >> 6) & 7) * 16 + ((m >> 4) & 3) * 128


@gluon.jit
def _e4m3_terms(q32):
    """``q32 [BLOCK_M, W]`` (float32, already within e4m3's range) as two e4m3 terms stacked
    ``[2 BLOCK_M, W]``: its rounding to e4m3, then the remainder times
    ``QUERY_REMAINDER_SCALE``; ``round + rest / QUERY_REMAINDER_SCALE`` keeps about bf16's
    precision."""
    # Rounded to e4m3's 4 significant bits in float32 (exact in e4m3 for normal values), not by
    # converting the e4m3 values back: Triton 3.6's e4m3 -> float32 of this layout returned
    # other elements' values (measured on an H200).
    bits = q32.to(gl.int32, bitcast=True)
    q_round = ((bits + 0x80000) & -1048576).to(gl.float32, bitcast=True)
    q_terms = gl.join(
        q_round.to(gl.float8e4nv), ((q32 - q_round) * QUERY_REMAINDER_SCALE).to(gl.float8e4nv)
    )  # fmt: skip
    q_terms = gl.permute(q_terms, (2, 0, 1))  # [2, BLOCK_M, W]
    return gl.reshape(q_terms, [2 * q32.shape[0], q32.shape[1]])


@gluon.jit
def _abs_max(x):
    return gl.max(gl.max(gl.abs(x), 1), 0)
