"""Hopper decode kernel written in Gluon: warpgroup MMA (``wgmma``) with the KV tile as operand A.

Same contract as ``triton_kernels._mla_decode_kernel`` (partials ``[B, S_q, H, splits, L]`` in
float32 and their lse, the same split bounds, NaN rows for tokens at an invalid cache location), for
the common serving layout only: a paged cache (pages of whole 64-token tiles go through TMA, any
other page size is gathered row by row), with ``kv_c`` in q's dtype (bf16/fp16) or in float8 e4m3
with a per-tensor scale (``k_pe`` in q's dtype, or in e4m3 too at a width of 64), and optionally
an attention mask (bool or float, read by the transposed and one-scorer loops; NOTES.md items 63
and 64). ``wgmma_path`` says whether a call qualifies and, if not, why.

Why a second kernel: the Triton kernel's 16-row programs put the query rows on the MMA's M side,
so Triton emits ``mma.sync`` with every warp holding the whole 16 x 576 query in registers; the
loop is then latency-bound at 8 warps per SM (benchmarks/NOTES.md items 5, 12, 17). Gluon states
the MMA and the shared-memory operands explicitly, so here the roles are swapped:

* scores ``S^T [BLOCK_N tokens, BLOCK_M rows] = K [BLOCK_N, L+R] @ Q^T`` and
  ``O^T [L, BLOCK_M] += V^T [L, BLOCK_N] @ P^T``: the cache tile is the M=64 operand, read by the
  tensor cores straight from the shared memory the copy engine (TMA) wrote it to; the query
  (``Q^T``) and ``P^T`` are the small N side, also in shared memory. Nothing is padded: 16 heads
  are an N=16 ``wgmma``.
* per thread: ``O^T`` is ``L x BLOCK_M / 128`` float32 registers (64 for 16 rows), the scores
  ``BLOCK_N x BLOCK_M / 128`` (8); the query lives in shared memory, not registers (but see
  the query-in-registers programs below).
* 64-row programs of a 16-bit cache (DeepSeek's 128 heads) put the rows back on M
  (``_consume_rows_on_m``: ``S = Q K^T``, ``O = P V``, both warpgroups splitting the tile's tokens
  in the scores and the latent columns in the output): with 64 rows the M=64 side is full either
  way, and a row's softmax reductions then stay within a warp quad instead of crossing the four
  warps a transposed tile's tokens lie over (benchmarks/NOTES.md items 24 and 28). Splitting the
  tokens makes each warpgroup read the whole query from shared memory for its 32: the scores run
  at the shared-memory bound, 1.5x the time one warpgroup takes for the whole tile (item 43).
  Where the tiles arrive by TMA, the op therefore runs one-scorer programs instead
  (``launch(one_scorer=True)``, ``default_one_scorer``): warpgroup 0 scores whole tiles with
  ``m64n64k16`` and runs the softmax, then hands ``P`` to warpgroup 1, a partition of its own
  that issues the copies and takes the other half of P.V (``_score_tiles``, ``_assist_tiles``;
  FlashMLA's split of the work; 17-23 % faster on cases (b) and (f) on an H100, item 44).
  Over DeepSeek's row (L = 512, R = 64) without a mask, warpgroup 0 keeps the nope query in
  registers instead (``QUERY_IN_REGISTERS``, ``_score_tiles_qreg``, ``_pv_rest_qreg``, item 78):
  the freed 64 KB hold a third ring slot, so warpgroup 1 can multiply each tile's P.V once the
  next tile is scored, under warpgroup 0's softmax (a tile 9-11 % faster; P is written over the
  tile's dead k_pe part; the output splits 64 + 448 columns, as the query's 128 registers allow).
* KV tiles arrive through a ring of ``NUM_STAGES`` shared-memory slots filled by TMA (or
  ``cp.async`` gathers) and tracked by mbarriers, so the loads run ahead of the math without any
  warp waiting on them. In 16-row programs a producer partition of its own (warp specialisation:
  one warp for TMA, a warpgroup for gathers) looks up the pages and issues the copies, each into
  a slot as soon as the math warps hand it back on its ``free`` barrier; 32- and 64-row programs
  (8 math warps, up to 241 registers each) issue their copies themselves
  (``default_producer_warps``).

Rows past a split's end in its last tile hold stale cache memory (maybe NaN); they are zeroed in
shared memory before the tile is used, so ``p = 0`` times them stays 0.

With ``MERGE`` (``mla::attention`` with few splits, ``triton_kernels.merge_path``) the kernel
writes the attention output itself: a sequence in one chunk stores its rows in q's dtype directly,
and a sequence in several has each chunk store its float32 partial and count its arrival on a
per-row-block counter (release/acquire at gpu scope); the chunk that arrives last merges them
(``_merge_splits``) and resets the counter, so no ``mla::combine`` runs.

A float8 ``kv_c`` tile in 16-row programs of DeepSeek's width (L = 512, copy-engine tiles) is
multiplied in float8 (``FLOAT8_PRODUCTS``, ``default_float8_products``), as FlashMLA's and
FlashAttention-3's float8 kernels do: the nope scores by float8 wgmma straight from the ring slot,
with the query as two e4m3 terms (its rounding and its remainder, side by side as N = 32 rows, so
that the scores keep about bf16's precision); ``V^T`` read from the slot into the wgmma's A
registers (``ldmatrix.trans`` of 16-bit pairs, then one byte permute per register; the
output's rows are a fixed permutation of the latent columns, ``_latent_column``); and P in e4m3
(times ``P_E4M3_SCALE``). No staging tile and no conversion (NOTES.md item 57). These programs
also take a ``k_pe`` in e4m3 (``PE_FP8``: the whole 576-wide row in float8 under one scale,
vLLM's ``fp8`` MLA cache, 576 bytes a token against FlashMLA's 640): its scores are float8
products into the nope scores' accumulator, against the RoPE query's two e4m3 terms (NOTES.md
item 58).
The error against the bf16 result is the float8 cache's own (6.07e-2 against 6.00e-2 on
(a8)); against float64 attention over the dequantised cache it is about 1e-2 (P's rounding),
against 1.7e-3.

Every other float8 tile arrives by TMA as bytes and is converted to fp16 (exactly: e4m3 is a subset
of fp16) into one shared-memory staging tile that both products read. wgmma's own float8 form
needs both operands K-major, which ``V^T`` in ``O^T = V^T P^T`` is not. The query's nope part is
stored as fp16, moved into fp16's range by a power of two (as the Triton kernel does); the nope
scores get ``kv_scale`` and that power of two back in float32, in an accumulator of their own,
and ``k_pe`` in q's dtype keeps its own. A float8 ``k_pe`` (vLLM's whole-row cache) is converted
too, into a small fp16 tile of its own, with the RoPE query in fp16 under the nope part's power of
two, so that both parts' scores take the one scale (NOTES.md item 62). The ring slot is free as
soon as it has been converted and its scores are done, so it is refilled a whole P.V earlier
than a 16-bit slot.

This module imports Triton's experimental Gluon frontend; ``triton_kernels`` imports it only when a
CUDA device qualifies.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gluon_builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .launcher import Data, PreparedLaunch
from .plan_cache import follow

# Triton 3.6 names the bulk tensor load ``async_copy_global_to_shared``; later Gluon releases
# renamed it ``async_load`` and made the old name raise. Same arguments (descriptor, coordinates,
# barrier, destination).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# Likewise for the per-thread asynchronous copy (``cp.async``): ``async_load`` in later releases.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@_gluon_builtin
def _reinterpret(desc, dtype, shape, layout, _semantic=None):
    """``desc`` (shared memory) seen as another dtype, shape and layout: ``_reinterpret`` in
    Triton 3.6, ``reinterpret`` in later Gluon releases."""
    view = getattr(desc, "reinterpret", None) or desc._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


# The barrier of all threads executing the region (a partition's own under warp specialisation):
# ``thread_barrier`` in Triton 3.6, ``barrier`` later.
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# Tokens per KV tile: the M of every wgmma (64 is the instruction's M for one warpgroup).
BLOCK_N = 64

# FLOAT8_PRODUCTS: a float8 ring slot [64 tokens, 512] (128-byte swizzle: four [64, 128-byte]
# slabs, each row's 16-byte units XOR the row's low 3 bits) read as V^T [512 (m), 64 (k)] into
# the wgmma's A registers. In that operand thread (warp w, lane 4g + q) holds rows m = 64 b +
# 16 w + 8 h + g (b the 64-row block, h = 0, 1) of tokens 4q + {0..3} (+ 16, 32, 48), 4 tokens
# of one row per 32-bit register. Row m is given latent column c = h + 2 g + 16 b + 128 w, so
# that rows m and m + 8 are the two bytes of one 16-bit pair (column 2 g + h of a 16-byte unit).
# The slot is then read as 16-bit pairs [256 (mp), 64 (k)], mp = 32 b + 8 w + g, by ldmatrix
# .trans (8 x 8 matrices of pairs, rows = tokens): a thread gets one pair of two tokens per
# register, and one byte permute per operand register (``_PAIRS_TO_ROWS``) takes two such
# registers (tokens 4q .. 4q + 3) to rows m and m + 8. Offset bit i of the slot, in 2-byte units,
# -> (mp, k):
_VT_OFFSET_BASES = gl.constexpr([
    [1, 0], [2, 0], [4, 0],  # the pair within its 16-byte unit (c bits 1-3): g
    [32, 0], [64, 0], [128, 0],  # the 16-byte unit (c bits 4-6): b, unswizzled
    [32, 1], [64, 2], [128, 4],  # token bits 0-2, with the swizzle they XOR into the unit
    [0, 8], [0, 16], [0, 32],  # token bits 3-5
    [8, 0], [16, 0],  # the slab (c bits 7-8): w
])  # fmt: skip
# The pairs as ldmatrix.trans gives them: registers 0-1 tokens 4q + {0..3} (so a group of 4
# is one operand register's tokens), lanes 4g + q, warps w; Triton lowers this load to
# ``ldmatrix.trans`` (16 ``LDSM.16.MT88.4`` a tile, each matrix's rows the tokens
# {0, 1, 4, 5, 8, 9, 12, 13} + 2 (register bit 1) + 16 j).
_VT_LOAD_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [32, 0], [64, 0], [128, 0]],
    lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[8, 0], [16, 0]],
    block_bases=[], shape=[256, 64],
))  # fmt: skip
# Pairs of tokens k, k + 1 ($2) and k + 2, k + 3 ($3) -> their low bytes (row m: $0) and high
# bytes (row m + 8: $1), each 4 tokens in order.
_PAIRS_TO_ROWS = gl.constexpr("prmt.b32 $0, $2, $3, 0x6420;\n prmt.b32 $1, $2, $3, 0x7531;")
# P (at most 1) is stored in e4m3 times this, well inside e4m3's 448, so that small weights keep
# their bits; the output takes it back.
P_E4M3_SCALE = gl.constexpr(256.0)
# The query's second e4m3 term is its remainder after rounding times this: at most half an e4m3
# step (1/16 of the value), so at most 28 x 16 = 448.
QUERY_REMAINDER_SCALE = gl.constexpr(16.0)
# A float attention mask's value at or below this hides its key (``reference.MASK_HIDDEN``; a
# test checks that they agree: this module also loads from a file of its own for A/B runs).
MASK_HIDDEN = gl.constexpr(-1e30)

# Phase stamps (``launch(stamps=...)``, benchmarks/experiments/phase_stamps.py): one row of
# ``STAMP_SLOTS`` int64 per program. Global-timer readings (ns) unless said otherwise:
STAMP_FIELDS = (
    "entry",  # kernel entry
    "bounds",  # the split's token range known (its sequence length loaded)
    "query",  # math warps: the query staged in shared memory
    "first_tile",  # math warps: the first tile's scores done (its copy landed)
    "loop_end",  # math warps: the last tile's P.V done
    "first_copy",  # producer: the first tile's copy issued
    "last_copy",  # producer: the last tile's copy issued
    "exit",  # the partials (or the final rows, or the merge) stored
    "sm",  # not a time: the multiprocessor the program ran on
    "tiles",  # not a time: KV tiles of the split (0 for an empty split)
    # One-scorer programs' epilogue, each warpgroup storing its own output half:
    "assist_end",  # warpgroup 1: its last P.V done
    "sums_handed",  # warpgroup 0: the final row sums handed to warpgroup 1
    "assist_stored",  # warpgroup 1: its half's stores issued
)
STAMP_SLOTS = gl.constexpr(16)

# Most splits per sequence that _longest_first ranks: a program's (sequence, split) is packed as
# sequence * this + split, and its per-sequence chunk counts sum to 16 bits apiece.
LONGEST_FIRST_MAX_SPLITS = gl.constexpr(128)
STAMP_ENTRY = gl.constexpr(STAMP_FIELDS.index("entry"))
STAMP_BOUNDS = gl.constexpr(STAMP_FIELDS.index("bounds"))
STAMP_QUERY = gl.constexpr(STAMP_FIELDS.index("query"))
STAMP_FIRST_TILE = gl.constexpr(STAMP_FIELDS.index("first_tile"))
STAMP_LOOP_END = gl.constexpr(STAMP_FIELDS.index("loop_end"))
STAMP_FIRST_COPY = gl.constexpr(STAMP_FIELDS.index("first_copy"))
STAMP_LAST_COPY = gl.constexpr(STAMP_FIELDS.index("last_copy"))
STAMP_EXIT = gl.constexpr(STAMP_FIELDS.index("exit"))
STAMP_SM = gl.constexpr(STAMP_FIELDS.index("sm"))
STAMP_TILES = gl.constexpr(STAMP_FIELDS.index("tiles"))
STAMP_ASSIST_END = gl.constexpr(STAMP_FIELDS.index("assist_end"))
STAMP_SUMS_HANDED = gl.constexpr(STAMP_FIELDS.index("sums_handed"))
STAMP_ASSIST_STORED = gl.constexpr(STAMP_FIELDS.index("assist_stored"))


@gluon.constexpr_function
def _copy_layouts(num_warps, kv_fp8):
    """Register layouts of ``num_warps`` warps for tile rows: ``io`` (16-bit values, 8 per
    thread and row: 16 bytes) and ``gather`` (kv_c rows copied 16 bytes per thread: 16 float8
    values per thread and row for a float8 kv_c, else ``io``). A float8 tile's conversion has its
    own (``_conversion_layout``)."""
    io = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    fp8_rows = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    return io, fp8_rows if kv_fp8 else io


@gluon.constexpr_function
def _conversion_layout(num_warps, chunk):
    """The register layout converting ``[64, chunk]`` float8 columns of a tile to fp16 with no
    bank conflicts on either side: 8 values per thread and row (8 bytes loaded, 16 stored), 8
    threads along 64 columns, lanes 8-15 four rows below lanes 0-7 and lanes 16-31 one row below
    lanes 0-15.

    Why those rows: a float8 tile at least 128 columns wide and the fp16 one both have 128-byte
    rows whose 16-byte chunks are swizzled by the row's index mod 8. An fp16 store serves 8 lanes
    at a time, which here cover one 128-byte row. An 8-byte float8 load serves 16 lanes at a
    time, which cover 64 bytes of two rows; rows ``r`` and ``r + 4`` put them on opposite halves
    of the banks, where ``r`` and ``r + 1`` (the 16-bit ``io`` layout's rows) put them on the
    same half, a two-way conflict (ncu on (a8): 2.1 of 4.6 million load wavefronts with ``io``,
    none left with these rows; the float8 cases 3.8-5 % faster). 16 values per thread, the layout
    before ``io``, had its stores conflict instead (4.4 of 8.9 million). A 64-column float8 tile
    has 64-byte rows, where ``io`` has no conflict. NOTES.md items 52-53."""
    if chunk < 128:
        return _copy_layouts(num_warps, False)[0]
    warp_bits = num_warps.bit_length() - 1
    rows = [2, 8, 16, 32]  # after lanes' 4 and 1
    col_regs = [[0, c] for c in (64, 128, 256) if c < chunk]
    return gl.DistributedLinearLayout(
        [[0, 1], [0, 2], [0, 4]] + col_regs + [[r, 0] for r in rows[warp_bits:]],
        [[0, 8], [0, 16], [0, 32], [4, 0], [1, 0]],
        [[r, 0] for r in rows[:warp_bits]],
        [],
        [64, chunk],
    )


@gluon.constexpr_function
def _conversion_chunk(kv_len):
    """Columns of a float8 ``kv_c`` tile of width ``kv_len`` converted at a time."""
    return min(kv_len, FP8_CONVERT_CHUNK)


@gluon.jit
def _stamp(STAMP_ROW, slot: gl.constexpr, ON: gl.constexpr):
    """With ``ON``: the global timer (ns) into ``STAMP_ROW[slot]``, the program's stamp row
    (every thread stores the same value). Compiled out otherwise."""
    if ON:
        now = gl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
        )
        gl.store(STAMP_ROW + slot, now)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _sum_min_max(total_a, low_a, high_a, total_b, low_b, high_b):
    return total_a + total_b, gl.minimum(low_a, low_b), gl.maximum(high_a, high_b)


@gluon.jit
def _longest_first(
    SEQLENS, work, batch, num_splits, balanced, MIN_CHUNK: gl.constexpr, GRANULE: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """``(split, sequence)`` of the chunk that program ``work`` (its index without the row
    blocks) takes, for ``batch <= BLOCK_B`` sequences and ``num_splits <=
    LONGEST_FIRST_MAX_SPLITS``, cut as ``planner.split_bounds`` cuts them: all full chunks,
    sequence by sequence; then the partial last chunks, longest first (ties in sequence order);
    then the empty chunks. The blocks are dispatched roughly in program order, so the long
    chunks start in the first wave and the late programs are the short ones (longest processing
    time first; ragged case (e), NOTES.md item 39)."""
    # Sequences on the lanes; a [16, BLOCK_B] block compares 16 sequences' partials with all.
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    pair_layout: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, num_warps], [0, 1])
    col_layout: gl.constexpr = gl.SliceLayout(0, pair_layout)
    seq = gl.arange(0, BLOCK_B, layout=lane_layout)
    length = gl.load(SEQLENS + seq, mask=seq < batch, other=0)
    chunk = gl.maximum(gl.cdiv(gl.cdiv(length, num_splits), GRANULE) * GRANULE, balanced)
    chunk = gl.maximum(chunk, MIN_CHUNK)
    full = length // chunk
    rest = length - full * chunk
    part_tiles = gl.cdiv(rest, BLOCK_N)  # 0: no partial chunk
    has_part = (rest > 0).to(gl.int32)
    empty = gl.where(seq < batch, num_splits - full - has_part, 0)
    # One scan for both counts: at most 128 chunks x 128 sequences each, 16 bits apiece.
    counts = full + (empty << 16)
    before = gl.associative_scan(counts, 0, _add) - counts
    totals = gl.max(before + counts, 0)
    full_before = before & 0xFFFF
    empty_before = before >> 16
    n_full = totals & 0xFFFF
    n_part = batch * num_splits - n_full - (totals >> 16)
    is_full = (work >= full_before) & (work < full_before + full)
    r_empty = work - n_full - n_part
    is_empty = (r_empty >= empty_before) & (r_empty < empty_before + empty)
    split = gl.where(is_empty, full + has_part + r_empty - empty_before, full)
    split = gl.where(is_full, work - full_before, split)
    match = is_full | is_empty
    tiles_smem = gl.allocate_shared_memory(
        gl.int32, [BLOCK_B], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    if (work >= n_full) & (work < n_full + n_part):
        # Rank of each partial among the partials: longer first, then lower sequence index.
        tiles_smem.store(part_tiles)
        _thread_barrier()
        t2 = gl.expand_dims(gl.convert_layout(part_tiles, col_layout), 0)
        s2 = gl.expand_dims(gl.arange(0, BLOCK_B, layout=col_layout), 0)
        rank = gl.zeros([BLOCK_B], gl.int32, layout=col_layout)
        for i0 in gl.static_range(0, BLOCK_B, 16):
            o2 = gl.expand_dims(tiles_smem.slice(i0, 16).load(gl.SliceLayout(1, pair_layout)), 1)
            os2 = gl.expand_dims(i0 + gl.arange(0, 16, layout=gl.SliceLayout(1, pair_layout)), 1)
            ahead = (o2 > t2) | ((o2 == t2) & (os2 < s2))
            rank += gl.sum(ahead.to(gl.int32), 0)
        rank = gl.convert_layout(rank, lane_layout)
        match = match | ((has_part > 0) & (rank == work - n_full))
    # Exactly one lane matches; its sequence and split in one reduction.
    found = gl.max(gl.where(match, seq * LONGEST_FIRST_MAX_SPLITS + split, -1), 0)
    return found % LONGEST_FIRST_MAX_SPLITS, found // LONGEST_FIRST_MAX_SPLITS


@gluon.jit
def _row_lse(m_i, l_i, poisoned):
    """Rows' LSE (natural log) from the running max ``m_i`` (log2 domain) and sum ``l_i``:
    ``-inf`` for a row with no visible key, NaN where ``poisoned`` (a token at an invalid cache
    location was never read: the whole split's rows are NaN); and ``l_i`` safe to divide by."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    return gl.where(poisoned, float("nan"), lse), l_safe


@gluon.jit
def _store_partial_t(
    O_PART, LSE_PART, out_t, lse, b64, s_idx, h_idx, split, offs_l, row_ok,
    stride_ob, stride_os, stride_oh, stride_ok, stride_od,
    stride_lb, stride_ls, stride_lh, stride_lk, WRITE_OUT: gl.constexpr = True,
):  # fmt: skip
    """``out_t [L, BLOCK_M]`` (transposed; unless not ``WRITE_OUT``) and ``lse [BLOCK_M]`` into
    the partials at ``split``, or into the final ``[B, S_q, H, L]`` / ``[B, S_q, H]`` outputs
    (``split`` 0, its strides 0); values are cast to the destination's dtype."""
    if WRITE_OUT:
        base = O_PART + b64 * stride_ob + split * stride_ok
        col = s_idx * stride_os + h_idx * stride_oh  # [BLOCK_M]
        ptrs = base + offs_l[:, None] * stride_od + col[None, :]
        gl.store(ptrs, out_t, mask=row_ok[None, :])
    lse_base = LSE_PART + b64 * stride_lb + split * stride_lk
    gl.store(lse_base + s_idx * stride_ls + h_idx * stride_lh, lse, mask=row_ok)


@gluon.jit
def _merge_splits(
    O_PART, LSE_PART, OUT, LSE_OUT, b64, s_idx, h_idx, row_ok, n_real,
    stride_ob, stride_os, stride_oh, stride_ok, stride_od,
    stride_lb, stride_ls, stride_lh, stride_lk,
    stride_fb, stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh,
    L: gl.constexpr, BLOCK_M: gl.constexpr, MAX_SPLITS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """The LSE merge of this row block's ``n_real <= MAX_SPLITS`` partials (``mla::combine``'s
    arithmetic) into the final ``OUT [B, S_q, H, L]`` (its dtype) and ``LSE_OUT [B, S_q, H]``,
    run by the split program that arrives last.

    Every split's values of a column block are one load (``[MAX_SPLITS, CHUNK_L, BLOCK_M]``, each
    thread holding all splits of its columns), so the reads are in flight together rather than
    one dependent L2 round trip per split (a loop over splits cost (b) 15 % of its call). Read with
    ``.cg``: from L2, never a stale L1 line."""
    # A warp's 32 lanes span the block's columns and, where a warp holds 16 or more rows (a
    # one-scorer program: 64 rows on 4 warps), also 4 rows, with 16-byte loads: a thread holding
    # 16 rows of every split spilled 1,912 bytes there (sm_90, Triton 3.6); 4 rows of 4 columns
    # spill nothing and merged 64-row blocks 5-20 % faster (NOTES.md item 45).
    ROW_LANES: gl.constexpr = 4 if BLOCK_M // num_warps >= 16 else 1
    VEC: gl.constexpr = 4 if ROW_LANES > 1 else 2
    CHUNK_L: gl.constexpr = min(32 if ROW_LANES > 1 else 64, L)
    parts_layout: gl.constexpr = gl.BlockedLayout(
        [MAX_SPLITS, VEC, 1], [1, 32 // ROW_LANES, ROW_LANES], [1, 1, num_warps], [1, 0, 2]
    )
    split_layout: gl.constexpr = gl.SliceLayout(1, parts_layout)  # [MAX_SPLITS, BLOCK_M]
    out_layout: gl.constexpr = gl.SliceLayout(0, parts_layout)  # [CHUNK_L, BLOCK_M]
    rows_s = gl.convert_layout(
        gl.expand_dims(s_idx * stride_os + h_idx * stride_oh, 0), split_layout
    )  # fmt: skip
    lse_rows = gl.convert_layout(
        gl.expand_dims(s_idx * stride_ls + h_idx * stride_lh, 0), split_layout
    )  # fmt: skip
    ok = gl.convert_layout(gl.expand_dims(row_ok, 0), split_layout)
    k = gl.arange(0, MAX_SPLITS, layout=gl.SliceLayout(1, split_layout))[:, None]
    real = ok & (k < n_real)  # [MAX_SPLITS, BLOCK_M]
    lse_k = gl.load(
        LSE_PART + b64 * stride_lb + k * stride_lk + lse_rows, mask=real, other=float("-inf"),
        cache_modifier=".cg",
    )  # fmt: skip
    poisoned = gl.max((lse_k != lse_k).to(gl.int32), 0) > 0  # [BLOCK_M]
    lse_max = gl.max(lse_k, 0)
    # All of a row's splits empty of visible keys: shift by 0 so every weight is exactly 0.
    shift = gl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = gl.exp(lse_k - shift[None, :])
    total = gl.sum(weight, 0)
    total_safe = gl.where(total == 0.0, 1.0, total)
    weight = weight / total_safe[None, :]
    lse = gl.where(total == 0.0, float("-inf"), shift + gl.log(total_safe))
    lse = gl.where(poisoned, float("nan"), lse)
    # A split with no visible key for a row is never read for it (as in the combine).
    read = gl.expand_dims(real & (weight > 0.0), 1)  # [MAX_SPLITS, 1, BLOCK_M]
    part_rows = O_PART + b64 * stride_ob + gl.expand_dims(k * stride_ok + rows_s, 1)
    offs_c = gl.arange(0, CHUNK_L, layout=gl.SliceLayout(1, out_layout))
    rows_out = gl.convert_layout(
        s_idx * stride_fs + h_idx * stride_fh, gl.SliceLayout(0, out_layout)
    )
    ok_out = gl.convert_layout(row_ok, gl.SliceLayout(0, out_layout))
    nan_out = gl.convert_layout(poisoned, gl.SliceLayout(0, out_layout))
    row_layout: gl.constexpr = gl.SliceLayout(0, split_layout)
    lse_out = gl.convert_layout(s_idx * stride_gs + h_idx * stride_gh, row_layout)
    gl.store(LSE_OUT + b64 * stride_gb + lse_out, lse, mask=gl.convert_layout(row_ok, row_layout))
    # Column blocks software-pipelined: the next block's loads are issued before this block's
    # stores (which the compiler cannot reorder loads across: they might alias). In one-scorer
    # programs the blocks are a loop, not unrolled: the merge runs once per program, and the
    # unrolled code (2,300 instructions) ran from a cold instruction cache, its warps stalled on
    # instruction fetch (ncu); rolled, (b)'s merge took 5-10 us less, while 16-row programs
    # merged 1.0-1.8 us slower rolled than unrolled (NOTES.md item 45).
    NUM_BLOCKS: gl.constexpr = L // CHUNK_L
    part = _merge_block_load(part_rows, offs_c, stride_od, read, 0, CHUNK_L)
    if ROW_LANES > 1:
        for c in range(NUM_BLOCKS):
            following = _merge_block_load(
                part_rows, offs_c, stride_od, read & (c + 1 < NUM_BLOCKS), c + 1, CHUNK_L
            )  # fmt: skip
            _merge_block_store(part, weight, nan_out, OUT + b64 * stride_fb, rows_out, ok_out,
                               offs_c, stride_fd, c, CHUNK_L)  # fmt: skip
            part = following
    else:
        for c in gl.static_range(NUM_BLOCKS):
            if c + 1 < NUM_BLOCKS:
                following = _merge_block_load(part_rows, offs_c, stride_od, read, c + 1, CHUNK_L)
            _merge_block_store(part, weight, nan_out, OUT + b64 * stride_fb, rows_out, ok_out,
                               offs_c, stride_fd, c, CHUNK_L)  # fmt: skip
            if c + 1 < NUM_BLOCKS:
                part = following


@gluon.jit
def _merge_block_load(part_rows, offs_c, stride_od, read, c, CHUNK_L: gl.constexpr):
    """Column block ``c`` of every split's partial rows: ``[MAX_SPLITS, CHUNK_L, BLOCK_M]``, read
    past L1 (``.cg``: from L2, never a stale L1 line)."""
    cols = gl.expand_dims(gl.expand_dims((c * CHUNK_L + offs_c) * stride_od, 1), 0)
    return gl.load(part_rows + cols, mask=read, other=0.0, cache_modifier=".cg")


@gluon.jit
def _merge_block_store(
    part, weight, nan_out, OUT_B, rows_out, ok_out, offs_c, stride_fd, c, CHUNK_L: gl.constexpr
):
    """Column block ``c`` of the merged rows: the splits of ``part`` weighted by ``weight`` (NaN
    rows where a split was poisoned), stored in ``OUT_B``'s dtype."""
    out = gl.sum(part * gl.expand_dims(weight, 1), 0)  # [CHUNK_L, BLOCK_M]
    out = gl.where(nan_out[None, :], float("nan"), out)
    ptrs = OUT_B + (c * CHUNK_L + offs_c)[:, None] * stride_fd + rows_out[None, :]
    gl.store(ptrs, out, mask=ok_out[None, :])


@gluon.jit
def _locate_tile(
    BLOCK_TABLE, b64, tile_start, end, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES,
    PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, GATHER: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """Where the tile at ``tile_start`` lies in the cache (the page-table lookup, made a tile
    ahead of its copy so that the lookup's latency hides behind the math), and its tokens at an
    invalid cache location.

    Copy engine: the cache row where the tile begins (it lies inside one page: split starts are
    multiples of 64 and pages hold whole tiles; an invalid page id points past the descriptor's
    last row, where the copy engine reads zeros), and 1 if its page id is invalid (0 for a tile
    at or past ``end``). Gathered: each row's page id (-1 for rows at or past ``end`` or on an
    invalid page id, which are zero-filled rather than read) and a ``[BLOCK_N]`` vector marking
    the rows before ``end`` on an invalid page id.
    """
    if GATHER:
        pos = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        page_pos = pos // PAGE_SIZE
        live = pos < end
        page = gl.load(
            BLOCK_TABLE + b64 * stride_btb + page_pos * stride_btp,
            mask=live & (page_pos < MAX_PAGES),
            other=-1,
        )
        ok = (page >= 0) & (page < NUM_PAGES)
        where = gl.where(live & ok, page, -1)
        bad = (live & ~ok).to(gl.int32)
    else:
        page_pos = tile_start // PAGE_SIZE
        page = gl.load(
            BLOCK_TABLE + b64 * stride_btb + page_pos * stride_btp,
            mask=page_pos < MAX_PAGES,
            other=-1,
        )
        ok = (page_pos < MAX_PAGES) & (page >= 0) & (page < NUM_PAGES)
        where = gl.where(ok, page, NUM_PAGES) * PAGE_SIZE + tile_start % PAGE_SIZE
        bad = ((tile_start < end) & ~ok).to(gl.int32)
    return where, bad


@gluon.jit
def _gather_rows(
    SRC, dst, page, pos, stride_p, stride_t, PAGE_SIZE: gl.constexpr, WIDTH: gl.constexpr,
    CHUNK: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """``cp.async`` of token rows ``pos`` (on pages ``page``) of ``SRC [pages, PAGE_SIZE, WIDTH]``
    into ``dst [BLOCK_N, WIDTH]``, ``CHUNK`` columns at a time; rows with page -1 are zero-filled.

    ``stride_p`` and ``stride_t`` count 16-byte units: multiplying back by the constant proves to
    the compiler that every row starts 16 bytes aligned, so each copy moves 16 bytes.
    """
    VEC: gl.constexpr = 128 // SRC.dtype.element_ty.primitive_bitwidth
    row = (page.to(gl.int64) * stride_p + (pos % PAGE_SIZE) * stride_t) * VEC
    rows = gl.convert_layout(row, gl.SliceLayout(1, layout))
    keep = gl.convert_layout(page >= 0, gl.SliceLayout(1, layout))[:, None]
    for c in gl.static_range(0, WIDTH, CHUNK):
        cols = c + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        _cp_async(dst.slice(c, CHUNK, dim=1), SRC + rows[:, None] + cols[None, :], mask=keep)


@gluon.jit
def _copy_tile(
    KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, slot, tile_start, where,
    stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE: gl.constexpr,
    HAS_PE: gl.constexpr, GATHER: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    CHUNK: gl.constexpr, kv_layout: gl.constexpr, pe_layout: gl.constexpr,
):  # fmt: skip
    """Start filling ring slot ``slot`` with the tile at ``tile_start``, located at ``where``
    (``_locate_tile``).

    Copy engine: one TMA box per operand, from one thread, counted in bytes on the slot's
    barrier. Gathered (pages of any size; the copy engine moves only boxes of whole pages):
    ``cp.async`` of 16 bytes per thread and copy, from every thread, each arriving on the slot's
    barrier once its own copies have landed.
    """
    bar = ready.index(slot)
    if GATHER:
        BLOCK_N: gl.constexpr = kv_ring.shape[1]
        pos = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        _gather_rows(
            KV, kv_ring.index(slot), where, pos, stride_kvp, stride_kvt, PAGE_SIZE, L, CHUNK,
            kv_layout,
        )  # fmt: skip
        if HAS_PE:
            _gather_rows(
                PE, pe_ring.index(slot), where, pos, stride_pep, stride_pet, PAGE_SIZE, R, R,
                pe_layout,
            )  # fmt: skip
        # The barrier counts every thread, so the arrival does not raise the expected count.
        async_copy.mbarrier_arrive(bar, increment_count=False)
    elif HAS_PE:
        mbarrier.expect(bar, KV_DESC.block_type.nbytes + PE_DESC.block_type.nbytes)
        _tma_load(KV_DESC, [where, 0], bar, kv_ring.index(slot))
        _tma_load(PE_DESC, [where, 0], bar, pe_ring.index(slot))
    else:
        mbarrier.expect(bar, KV_DESC.block_type.nbytes)
        _tma_load(KV_DESC, [where, 0], bar, kv_ring.index(slot))


@gluon.jit
def _hand_back(
    KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, free, slot, i, n_tiles, next_start,
    next_where, stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr, HAS_PE: gl.constexpr, GATHER: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, CHUNK: gl.constexpr, PRODUCER: gl.constexpr, kv_layout: gl.constexpr,
    pe_layout: gl.constexpr,
):  # fmt: skip
    """The math warps are done with ring slot ``slot`` (tile ``i``): hand it to the producer
    partition, or without one start the tile ``NUM_STAGES`` ahead (at ``next_start``, located at
    ``next_where``) into it themselves."""
    if PRODUCER:
        mbarrier.arrive(free.index(slot), count=1)
    elif i + NUM_STAGES < n_tiles:
        _copy_tile(
            KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, slot, next_start, next_where,
            stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, HAS_PE, GATHER, L, R,
            CHUNK, kv_layout, pe_layout,
        )  # fmt: skip


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
        # SASS (791 instead of 178 per thread and tile; NOTES.md item 37).
        dst.slice(c, CHUNK, dim=1).store(src.slice(c, CHUNK, dim=1).load(layout).to(gl.float16))


@gluon.jit
def _await_tile(
    kv_ring, ready, pos, tile_start, end, NUM_STAGES: gl.constexpr, GATHER: gl.constexpr,
    ZERO_STALE: gl.constexpr, io_layout: gl.constexpr,
):  # fmt: skip
    """Wait for the tile at ring position ``pos`` and return its ``kv_c`` slot.

    The split's last tile may run past ``end`` into stale rows (maybe NaN). ``ZERO_STALE``: a
    copy-engine tile has them zeroed in shared memory (a gathered one was zero-filled), so that
    ``p = 0`` times them stays 0 in P.V.
    """
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    slot = pos % NUM_STAGES
    mbarrier.wait(ready.index(slot), (pos // NUM_STAGES) & 1)
    if GATHER:
        # cp.async wrote the tile through the generic proxy; wgmma reads through the async one.
        fence_async_shared()
    kv = kv_ring.index(slot)
    if ZERO_STALE and not GATHER and tile_start + BLOCK_N > end:
        offs_io = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
        _zero_rows(kv, (offs_io < end)[:, None], io_layout)
    return kv


@gluon.jit
def _zero_rows(tile, keep, io_layout: gl.constexpr, ZERO_CHUNK: gl.constexpr = 128):
    """Zero the rows of ``tile [BLOCK_N, W]`` in shared memory where ``keep [BLOCK_N, 1]`` (in
    ``io_layout``) is false, then fence for the wgmma that reads it. In column chunks: a whole
    64 x 512 tile is 128 registers per thread of one warpgroup."""
    WIDTH: gl.constexpr = tile.shape[1]
    CHUNK: gl.constexpr = ZERO_CHUNK if WIDTH > ZERO_CHUNK else WIDTH
    for c in gl.static_range(0, WIDTH, CHUNK):
        part = tile.slice(c, CHUNK, dim=1)
        values = part.load(io_layout)
        part.store(gl.where(keep, values, gl.zeros_like(values)))
    fence_async_shared()


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
    (zeroing the rows past ``end`` on the way) while the tensor cores run its RoPE scores, and
    the nope scores read it there; they take ``nope_scale`` (kv_scale and the query's power of
    two) in float32, apart from the RoPE part's, so the fp16 query needs no rounding. With
    ``HAND_BACK`` (a producer partition) its ring slot goes back on ``free`` before the nope
    scores are waited for: 0.4-0.8 % faster on (a8), (d8) and (e8), level on page size 1 (NOTES.md
    item 53). ``PE_FP8``: the slot's ``k_pe`` is float8 too; it is converted into ``pe_stage``
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
    permute per operand register (the 16-byte loads this replaced needed three: NOTES.md item 59).

    Read after the softmax's row maxima, not under the scores: its 32 KB of loads then queued
    ahead of the maxima's shuffles in the shared-memory pipe (ncu: 13 % of the loop's samples on
    the first shuffle's result), and issued late they took (a8e) from 94.4-95.0 to 90.7-90.8 us
    on an H200 ((d8e) 4.5 %, (e8e) 3 %; issued before the scores, 93.1-93.4; NOTES.md item 58).
    ``_consume_tiles`` hands the slot back right after these loads, behind a barrier of the
    warps: handed back without one, loads still queued read the next tile's bytes (an H200
    measured wrong outputs, and NaN from stale rows; NOTES.md item 57). Handed back there
    instead of after P.V, with P.V left in flight, (a8e) was 3.4 % faster on an H200 (NOTES.md
    item 59)."""
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
    swizzle), as 32-bit words: each row's bytes are the 128-byte segments at ``slab * BLOCK_N *
    128 + row * 128`` (the swizzle only permutes 16-byte units within a segment), so the rows
    are found without the swizzle and no byte is selected alone. ``_await_tile``'s zeroing (a
    select and repacking per e4m3 byte) in its place was as correct and 3.3 % slower on (e8),
    whose ragged chunks mostly end in a partial tile (H200: 64.2-64.4 against 62.2-62.3 us;
    (a8) and (d8) 0.3-0.5 %; NOTES.md item 57). Fenced for the tensor cores, and a barrier: every
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
def _e4m3_terms(q32):
    """``q32 [BLOCK_M, W]`` (float32, already within e4m3's range) as two e4m3 terms stacked
    ``[2 BLOCK_M, W]``: its rounding to e4m3, then the remainder times
    ``QUERY_REMAINDER_SCALE``; ``round + rest / QUERY_REMAINDER_SCALE`` keeps about bf16's
    precision."""
    # Rounded to e4m3's 4 significant bits in float32 (exact in e4m3 for normal values), not by
    # converting the e4m3 values back: Triton 3.6's e4m3 -> float32 of this layout returned
    # other elements' values (measured on an H200; NOTES.md item 57).
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
def _row_start(
    row_block, seqlen, S_Q: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
    CAUSAL: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """Each query row's last visible key (causal: row s of S_q sees keys ``[0, seqlen - S_q +
    s]``; otherwise all of ``[0, seqlen)``) and its running max before the first tile (-inf), as
    ``[BLOCK_M]`` vectors in ``layout``."""
    rows = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
    if CAUSAL:
        last_key = seqlen - S_Q + rows // H
    else:
        last_key = gl.zeros([BLOCK_M], gl.int32, layout=layout) + seqlen - 1
    return last_key, gl.full([BLOCK_M], float("-inf"), gl.float32, layout=layout)


@gluon.jit
def _row_max_across_warps(s_t, max_smem):
    """The row maxima of ``S^T [64, 16]`` (tokens on the wgmma's M: 16 a warp, 4 warps), each
    warp's own by its shuffles, then exchanged once through ``max_smem [4, 16]`` float32 behind
    one barrier, in ``S^T``'s column layout. Triton's reduction across warps takes two barriers
    and a second round of shuffles; with this one (float8 products, P.V in flight) (a8e) was
    1.2 % and (a8) 1.1 % faster on an H200 (NOTES.md item 59). The caller alternates two
    buffers: a warp can write tile i + 2's maxima only after every warp has passed tile i + 1's
    barriers, so after every warp has read tile i's."""
    BLOCK_N: gl.constexpr = s_t.shape[0]
    BLOCK_M: gl.constexpr = s_t.shape[1]
    gl.static_assert(BLOCK_N == 64 and BLOCK_M == 16 and gl.num_warps() == 4)
    max_smem.store(gl.max(gl.reshape(s_t, [4, BLOCK_N // 4, BLOCK_M]), 1))  # [warp, row]
    _thread_barrier()
    # Every thread reads the 4 warps' maxima of its own columns: a wgmma accumulator with N = 16
    # gives lane 4 g + q columns 2 q + {0, 1} + {0, 8}.
    all_warps: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [1, 0], [2, 0]],
        lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]], warp_bases=[[0, 0], [0, 0]],
        block_bases=[], shape=[4, BLOCK_M],
    )  # fmt: skip
    tile_max = gl.max(max_smem.load(all_warps), 0)
    return gl.convert_layout(tile_max, gl.SliceLayout(0, s_t.type.layout))


@gluon.jit
def _mask_load(
    MASK, b64, row_block, tile_start, end, stride_mb, stride_ms, stride_mt, MASK_LEN,
    S_Q: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    MASK_IS_BOOL: gl.constexpr, layout: gl.constexpr, TOKENS: gl.constexpr = 0,
    ONE_ROW: gl.constexpr = False,
):  # fmt: skip
    """The attention mask's values over one tile as stored, in the scores' layout: ``S^T
    [BLOCK_N tokens, BLOCK_M rows]`` (``TOKENS`` 0) or ``S [BLOCK_M, BLOCK_N]`` (1, rows on M);
    a row's mask row is its query position's (``row // H``), shared by the heads. Nothing is read
    at keys past ``end`` or ``MASK_LEN`` or in rows past ``S_Q * H`` (a bool mask gives 0 there,
    a float one -inf). The loads must run under a tile's math: the transposed loop issues them a
    tile ahead, the one-scorer loop before its scores at S_q > 1, and at S_q = 1 its warpgroup 1
    before its waits (``_prepare_mask_terms``); ``_mask_visible``, ``_mask_bias`` read them.
    ``ONE_ROW`` (S_q = 1): the one mask row as a
    ``[BLOCK_N]`` vector in the token axis's slice of ``layout``, which its users broadcast over
    the rows (``_over_rows``)."""
    ROWS: gl.constexpr = 1 - TOKENS
    tokens = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(ROWS, layout))
    if ONE_ROW:
        # S_q = 1: every row reads the one mask row; a [BLOCK_N] vector in the scores' token
        # slice, broadcast over the rows by its users.
        ok = (tokens < end) & (tokens < MASK_LEN)
        ptr = MASK + b64 * stride_mb + tokens * stride_mt
    else:
        rows = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(TOKENS, layout))
        token_ok = gl.expand_dims((tokens < end) & (tokens < MASK_LEN), ROWS)
        ok = token_ok & gl.expand_dims(rows < S_Q * H, TOKENS)
        ptr = (
            MASK + b64 * stride_mb + gl.expand_dims((rows // H) * stride_ms, TOKENS)
            + gl.expand_dims(tokens * stride_mt, ROWS)
        )  # fmt: skip
    if MASK_IS_BOOL:
        return gl.load(ptr, mask=ok, other=0)
    else:
        return gl.load(ptr, mask=ok, other=float("-inf"))


@gluon.jit
def _mask_visible(raw, MASK_IS_BOOL: gl.constexpr):
    """Which keys ``_mask_load``'s values leave visible: a bool mask's true ones, a float mask's
    above ``MASK_HIDDEN`` (the Triton kernel's and ``reference.mask_over_capacity``'s rule)."""
    if MASK_IS_BOOL:
        return raw != 0
    else:
        return raw.to(gl.float32) > MASK_HIDDEN


@gluon.jit
def _mask_bias(raw, visible):
    """A float mask's bias in log2 units, 0 where it hides the key."""
    return gl.where(visible, raw.to(gl.float32) * 1.4426950408889634, 0.0)


# A one-row (S_q = 1) mask's terms, prepared per ring slot by whoever issues the slot's copy
# (``_prepare_mask_terms``) and read by the one-scorer loop's scorer. The row is loaded in this
# layout's token slice (``_mask_load``'s ``ONE_ROW``): 64 tokens over one warpgroup, each twice.
PREPARED_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0]))
FLAG_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _prepare_mask_terms(
    raw, tile_start, end, slot, terms_smem, hidden_smem, MASK_IS_BOOL: gl.constexpr
):
    """Store one tile's S_q = 1 mask row, as ``_mask_load`` read it (``ONE_ROW`` in
    ``PREPARED_LAYOUT``), into ring slot ``slot`` of ``terms_smem [NUM_STAGES, BLOCK_N]``: -inf
    where it hides a key, else what the scorer adds to the scaled scores in log2 units (0, or a
    float mask's bias); and into ``hidden_smem [NUM_STAGES, 1]`` whether it hides any key before
    ``end`` (whose value rows the scorer then zeroes). The caller makes the stores visible before
    the slot's tile can land (a barrier, then the copy's arrival)."""
    visible = _mask_visible(raw, MASK_IS_BOOL)
    if MASK_IS_BOOL:
        terms = gl.where(visible, 0.0, float("-inf"))
    else:
        terms = gl.where(visible, _mask_bias(raw, visible), float("-inf"))
    terms_smem.index(slot).store(terms)
    hidden = _hidden_keys(visible, tile_start, end, 1)
    any_hidden = gl.max(hidden.to(gl.int32), 0)
    hidden_smem.index(slot).store(gl.zeros([1], gl.int32, layout=FLAG_LAYOUT) + any_hidden)


@gluon.jit
def _over_rows(v, TOKENS: gl.constexpr):
    """A mask term shaped for ``_online_softmax``: a ``ONE_ROW`` ``[BLOCK_N]`` vector broadcast
    over the rows (axis ``1 - TOKENS`` of the scores), a tile as it is."""
    if len(v.shape) == 1:
        return gl.expand_dims(v, 1 - TOKENS)
    else:
        return v


@gluon.jit
def _hidden_keys(visible, tile_start, end, TOKENS: gl.constexpr):
    """``[BLOCK_N]``: the tile's keys before ``end`` that ``visible`` (``_mask_visible``'s, a
    tile with its token axis ``TOKENS``, or a ``ONE_ROW`` vector) hides from every row."""
    ROWS: gl.constexpr = 1 - TOKENS
    if len(visible.shape) == 1:
        # One mask row for every row of the program: no reduction over the rows.
        BLOCK_N: gl.constexpr = visible.shape[0]
        tokens = tile_start + gl.arange(0, BLOCK_N, layout=visible.type.layout)
        return ~visible & (tokens < end)
    else:
        BLOCK_N: gl.constexpr = visible.shape[TOKENS]
        tokens = tile_start + gl.arange(
            0, BLOCK_N, layout=gl.SliceLayout(ROWS, visible.type.layout)
        )
        return (gl.max(visible.to(gl.int32), ROWS) == 0) & (tokens < end)


@gluon.jit
def _zero_hidden_rows(
    tile, visible, tile_start, end, io_layout: gl.constexpr, TOKENS: gl.constexpr = 0
):  # fmt: skip
    """Zero the rows of ``tile [BLOCK_N, W]`` (a value tile in shared memory) whose key the mask
    hides from every row of the program, when there are any before ``end``: ``P = 0`` times what
    such a row holds must stay 0, and Hugging Face's eager float64 prefill writes NaN at pad
    positions (the Triton kernel leaves those rows out of its loads). ``visible``:
    ``_mask_visible``'s.
    Rows past ``end`` are zeroed (or never read) elsewhere. ``TOKENS``: ``visible``'s token axis;
    a ``[BLOCK_N]`` ``visible`` (``_mask_load``'s ``ONE_ROW``) is every row's.
    """
    hidden = _hidden_keys(visible, tile_start, end, TOKENS)
    if gl.max(hidden.to(gl.int32), 0) > 0:
        _zero_rows(
            tile, gl.convert_layout(~hidden, gl.SliceLayout(1, io_layout))[:, None], io_layout
        )


@gluon.jit
def _zero_hidden_columns(v_t, visible, tile_start, end):
    """``_zero_hidden_rows`` for float8 products: ``V^T``'s columns (tokens) in registers, not
    the ring slot's rows (stores into the slot there made ptxas serialise the loop's wgmma:
    NOTES.md item 63)."""
    hidden = _hidden_keys(visible, tile_start, end, 0)
    if gl.max(hidden.to(gl.int32), 0) > 0:
        keep = gl.convert_layout(~hidden, gl.SliceLayout(0, v_t.type.layout))[None, :]
        v_t = gl.where(keep, v_t, gl.zeros_like(v_t))
    return v_t


@gluon.jit
def _online_softmax(
    s, m_i, l_i, offs_n, end, last_key, scale_log2, TOKENS: gl.constexpr = 0, max_smem=None,
    mask_visible=None, mask_bias=None,
):  # fmt: skip
    """One tile's step of the online softmax in the exp2 domain.

    s: raw scores of the tokens at ``offs_n`` along axis ``TOKENS`` (0: ``S^T [BLOCK_N,
    BLOCK_M]``; 1: ``S [BLOCK_M, BLOCK_N]``). l_i: the running sum ``[BLOCK_M]``, or partial sums
    shaped like ``s`` whose total along ``TOKENS`` is the running sum (when a row's tokens lie
    across warpgroups, this leaves the cross-warpgroup sum to the end). ``max_smem``: the row
    maxima across warps through this buffer (``_row_max_across_warps``) instead of Triton's
    reduction. ``mask_visible``, ``mask_bias``: an attention mask's (``_mask_visible``,
    ``_mask_bias``, shaped like ``s``; no bias for a bool mask). Returns ``P`` (or ``P^T``), the
    new running max and sum, and ``alpha``, the factor that rescales the output accumulated so
    far.
    """
    ROWS: gl.constexpr = 1 - TOKENS
    keys = gl.expand_dims(offs_n, ROWS)
    visible = (keys < end) & (keys <= gl.expand_dims(last_key, TOKENS))
    if mask_visible is None:
        s = gl.where(visible, s * scale_log2, float("-inf"))
    elif mask_bias is None:
        s = gl.where(visible & mask_visible, s * scale_log2, float("-inf"))
    else:
        s = gl.where(visible & mask_visible, s * scale_log2 + mask_bias, float("-inf"))
    if max_smem is None:  # noqa: SIM108 (a compile-time choice; one branch is compiled)
        tile_max = gl.max(s, TOKENS)
    else:
        tile_max = _row_max_across_warps(s, max_smem)
    m_new = gl.maximum(m_i, tile_max)
    # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(s - gl.expand_dims(m_shift, TOKENS))
    if len(l_i.shape) == 1:
        l_new = l_i * alpha + gl.sum(p, TOKENS)
    else:
        l_new = l_i * gl.expand_dims(alpha, TOKENS) + p
    return p, m_new, l_new, alpha


@gluon.jit
def _produce_tiles(
    KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, ready, free, done, bad_smem, b64,
    start, end, n_tiles, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt,
    stride_pep, stride_pet, STAMP_ROW, PAGE_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
    HAS_PE: gl.constexpr, KV_FP8: gl.constexpr, GATHER: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, CHUNK: gl.constexpr, STAMPS: gl.constexpr,
):  # fmt: skip
    """The producer partition (``PRODUCER_WARPS`` warps of their own): locate and copy every tile
    of the split into the ring, each into a slot as soon as the math warps have freed it; then
    the tokens at an invalid cache location into ``bad_smem``, signalled on ``done``.

    The page-table lookups, the copy instructions (36 ``cp.async`` per thread and tile when a
    16-row warpgroup gathers them itself) and the waits for free slots leave the math warps'
    critical path.
    """
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    io_layout: gl.constexpr = _copy_layouts(gl.num_warps(), KV_FP8)[0]
    gather_layout: gl.constexpr = _copy_layouts(gl.num_warps(), KV_FP8)[1]
    n_bad = gl.zeros([BLOCK_N], gl.int32, layout=gl.SliceLayout(1, gather_layout))
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        tile_start = start + i * BLOCK_N
        # Located before the wait: the lookup's latency overlaps the math on the slot.
        where, bad = _locate_tile(
            BLOCK_TABLE, b64, tile_start, end, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES,
            PAGE_SIZE, BLOCK_N, GATHER, gather_layout,
        )  # fmt: skip
        n_bad += bad
        # A fresh barrier counts as having completed the phase before its first: the first
        # NUM_STAGES waits pass at once.
        mbarrier.wait(free.index(slot), ((i // NUM_STAGES) & 1) ^ 1)
        if GATHER:
            # cp.async writes through the generic proxy what wgmma last read through the async one.
            fence_async_shared()
        _copy_tile(
            KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, slot, tile_start, where,
            stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, HAS_PE, GATHER, L, R,
            CHUNK, gather_layout, io_layout,
        )  # fmt: skip
        if i == 0:
            _stamp(STAMP_ROW, STAMP_FIRST_COPY, STAMPS)
    _stamp(STAMP_ROW, STAMP_LAST_COPY, STAMPS)
    bad_smem.store(n_bad)
    # Every producer thread's store before the one arrival.
    _thread_barrier()
    mbarrier.arrive(done, count=1)


@gluon.jit
def _consume_tiles(
    Q, KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring, pe_ring, stage, p_smem,
    max_smem, ready, free, n_bad, b64, row_block, seqlen, start, end, n_tiles, stride_qb, stride_qs,
    stride_qh, stride_qd, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt,
    stride_pep, stride_pet, scale_log2, kv_scale, STAMP_ROW, S_Q: gl.constexpr,
    H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_PE: gl.constexpr,
    KV_FP8: gl.constexpr, CHUNK: gl.constexpr, GATHER: gl.constexpr, PRODUCER: gl.constexpr,
    STAMPS: gl.constexpr, FLOAT8_PRODUCTS: gl.constexpr = False, PE_FP8: gl.constexpr = False,
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
    _stamp(STAMP_ROW, STAMP_QUERY, STAMPS)

    last_key, m_i = _row_start(
        row_block, seqlen, S_Q, H, BLOCK_M, CAUSAL, gl.SliceLayout(0, s_layout)
    )
    if KV_FP8:
        # The running sum as per-thread partial sums shaped like the scores, summed across the
        # four warps once after the loop instead of once per tile: 5 % of a float8 tile's time
        # (its loop is bound by this warpgroup's serial chain); a 16-bit tile's loop, bound by
        # its copies, measured 0.8 % slower with it on (d) (NOTES.md item 37).
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
    # waits for tile i+1's copy. NOTES.md item 24.)
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
        if i == 0:
            _stamp(STAMP_ROW, STAMP_FIRST_TILE, STAMPS)
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
            # queued read the next tile's bytes: NOTES.md item 57).
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
    _stamp(STAMP_ROW, STAMP_LOOP_END, STAMPS)
    if KV_FP8:
        l_i = gl.sum(l_i, 0)
    return o_t, m_i, l_i, n_bad


@gluon.jit
def _scores_on_m(
    kv_ring, pe_ring, q_smem, qpe_smem, ready, s_zero, pos, tile_start, end,
    NUM_STAGES: gl.constexpr, HAS_PE: gl.constexpr, GATHER: gl.constexpr, io_layout: gl.constexpr,
):  # fmt: skip
    """Wait for the tile at ring position ``pos`` (``_await_tile``, stale rows zeroed); return
    its ``kv_c`` slot and its scores with the rows on M, ``S [BLOCK_M, N] = Q K^T`` (``N`` is
    ``s_zero``'s: the tile's tokens split over the warpgroups of ``s_zero``'s layout, or all of
    them for one warpgroup)."""
    kv = _await_tile(kv_ring, ready, pos, tile_start, end, NUM_STAGES, GATHER, True, io_layout)
    s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if HAS_PE:
        slot = pos % NUM_STAGES
        s = warpgroup_mma(qpe_smem, pe_ring.index(slot).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    return kv, s


@gluon.jit
def _consume_rows_on_m(
    KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring, pe_ring, p_smem, ready,
    free, n_bad, b64, row_block, seqlen, start, end, n_tiles, stride_btb, stride_btp, NUM_PAGES,
    MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet, scale_log2, STAMP_ROW,
    S_Q: gl.constexpr, H: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, HAS_PE: gl.constexpr, CHUNK: gl.constexpr, GATHER: gl.constexpr,
    STAMPS: gl.constexpr,
):  # fmt: skip
    """The loop of a 64-row program with the query rows on the MMA's M side (16-bit cache, two
    warpgroups, no producer partition): ``S [64, BLOCK_N] = Q K^T``, ``O [64, L] += P V``.

    The two warpgroups split the scores' tokens (``S`` is 64 x 32 per warpgroup) and the output's
    latent columns (``O`` is 64 x L/2: 128 float32 registers per thread at L = 512), so no
    product is computed twice. The row max crosses the warpgroups once per tile (a reduction
    through shared memory); the row sums stay per thread until the end. ``P`` goes through shared
    memory because each warpgroup's P.V needs both halves. Unlike the transposed loop
    (``_consume_tiles``), a row's softmax reductions stay inside a warp quad and its
    warpgroup. The query is in shared memory already (the kernel loads it ahead of the ring's
    first copies). Returns ``O^T`` (as ``_consume_tiles``), the running max and sum, and
    ``n_bad``.
    """
    BLOCK_N: gl.constexpr = kv_ring.shape[1]
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_smem.dtype
    WG: gl.constexpr = num_warps // 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BLOCK_N // WG, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, L // WG, 16]
    )
    io_layout: gl.constexpr = _copy_layouts(num_warps, False)[0]
    gather_layout: gl.constexpr = _copy_layouts(num_warps, False)[1]

    last_key, m_i = _row_start(
        row_block, seqlen, S_Q, H, BLOCK_M, CAUSAL, gl.SliceLayout(1, s_layout)
    )
    l_part = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([BLOCK_M, L], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        tile_start = start + i * BLOCK_N
        # The tile that refills this slot, located now (nothing past end counts as bad).
        next_start = tile_start + NUM_STAGES * BLOCK_N
        next_where, bad = _locate_tile(
            BLOCK_TABLE, b64, next_start, end, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES,
            PAGE_SIZE, BLOCK_N, GATHER, gather_layout,
        )  # fmt: skip
        n_bad += bad
        kv, s = _scores_on_m(
            kv_ring, pe_ring, q_smem, qpe_smem, ready, s_zero, i, tile_start, end, NUM_STAGES,
            HAS_PE, GATHER, io_layout,
        )  # fmt: skip
        if i == 0:
            _stamp(STAMP_ROW, STAMP_FIRST_TILE, STAMPS)
        p, m_i, l_part, alpha = _online_softmax(
            s, m_i, l_part, tile_start + offs_tile, end, last_key, scale_log2, 1
        )
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_smem.store(p.to(dtype))
        fence_async_shared()
        o = warpgroup_mma(p_smem, kv, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        # The slot is free again.
        _hand_back(
            KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, free, slot, i, n_tiles, next_start,
            next_where, stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, NUM_STAGES,
            HAS_PE, GATHER, L, R, CHUNK, False, gather_layout, io_layout,
        )  # fmt: skip
    _stamp(STAMP_ROW, STAMP_LOOP_END, STAMPS)
    l_i = gl.sum(l_part, 1)
    # O^T in the epilogue's layout: latent columns across a warp's lanes, then transposed.
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    o_t = gl.permute(gl.convert_layout(o, rows_layout), (1, 0))
    return o_t, m_i, l_i, n_bad


@gluon.jit
def _store_output_half(
    O_PART, LSE_PART, OUT, LSE_OUT, q_smem, o, m_i, l_i, poisoned, kv_scale, b64, row_block, split,
    n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od, stride_lb, stride_ls, stride_lh,
    stride_lk, stride_fb, stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh,
    COL0: gl.constexpr, S_Q: gl.constexpr, H: gl.constexpr, L: gl.constexpr, BLOCK_M: gl.constexpr,
    MERGE: gl.constexpr, WITH_LSE: gl.constexpr, WIDTH: gl.constexpr = 0,
):  # fmt: skip
    """One warpgroup of a one-scorer program stores its output half ``o [BLOCK_M, L/2]``
    (columns ``COL0 ..``) straight from its wgmma accumulator, divided by the row sums ``l_i``
    (times ``kv_scale``), NaN where ``poisoned``; ``WITH_LSE``: also the rows' LSE (``m_i`` in
    the log2 domain). Into the partials at ``split``, or, with ``MERGE`` and a sequence in one
    chunk, into the final ``OUT``/``LSE_OUT`` in their dtypes.

    Why from the accumulator: handing warpgroup 1's half to warpgroup 0 through shared memory and
    storing both halves from 4 warps took 7.2 us after the loop, 5.3 of them in the stores
    (stamps, NOTES.md item 48). In this layout a warp's float32 store covers 8 rows x 32 bytes,
    whole sectors. 16-bit final rows would go out in 16-byte pieces, half sectors, which cost
    (f) 2 % (item 48): they are staged through the query's shared memory (``q_smem``, dead once
    the last tile is scored) and stored 16 bytes a lane, 128 bytes a row.

    ``WIDTH``: the part's columns when not ``L/2`` (query-in-registers programs; the
    accumulator's wgmma N is the part's width)."""
    PART: gl.constexpr = WIDTH if WIDTH > 0 else L // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PART, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
    row_ok = rows < S_Q * H
    s_idx = rows // H
    h_idx = rows % H
    cols = COL0 + gl.arange(0, PART, layout=gl.SliceLayout(0, o_layout))
    l_i = gl.convert_layout(l_i, row_layout)
    lse, l_safe = _row_lse(gl.convert_layout(m_i, row_layout), l_i, poisoned)
    out = o * (kv_scale / l_safe)[:, None]
    out = gl.where(poisoned, float("nan"), out)
    # The condition spelled out in each if: held in a variable, its constant False (no MERGE)
    # became a runtime branch around a store, which Triton 3.6 fails to lower (NOTES.md item 33).
    if MERGE and n_real == 1:
        stage = q_smem.slice(COL0, PART, dim=1)
        stage.store(out.to(q_smem.dtype))
        _thread_barrier()
        wide: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows_w = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, wide))
        cols_w = COL0 + gl.arange(0, PART, layout=gl.SliceLayout(0, wide))
        out_rows = OUT + b64 * stride_fb + ((rows_w // H) * stride_fs + (rows_w % H) * stride_fh)
        out_ptrs = out_rows[:, None] + cols_w[None, :] * stride_fd
        gl.store(out_ptrs, stage.load(wide), mask=(rows_w < S_Q * H)[:, None])
    else:
        part_rows = O_PART + b64 * stride_ob + split * stride_ok
        part_rows += (s_idx * stride_os + h_idx * stride_oh)[:, None]
        gl.store(part_rows + cols[None, :] * stride_od, out, mask=row_ok[:, None])
    if WITH_LSE:
        if MERGE and n_real == 1:
            lse_ptrs = LSE_OUT + b64 * stride_gb + s_idx * stride_gs + h_idx * stride_gh
        else:
            lse_ptrs = LSE_PART + b64 * stride_lb + split * stride_lk
            lse_ptrs += s_idx * stride_ls + h_idx * stride_lh
        gl.store(lse_ptrs, lse, mask=row_ok)


@gluon.jit
def _score_tiles(
    kv_ring, pe_ring, q_smem, qpe_smem, p_smem, alpha_smem, ready, free, p_ready, p_free, done,
    bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64, row_block, split, n_real, bad_before, seqlen,
    start, end, n_tiles, scale_log2, kv_scale, stride_ob, stride_os, stride_oh, stride_ok,
    stride_od, stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh,
    stride_fd, stride_gb, stride_gs, stride_gh, STAMP_ROW, S_Q: gl.constexpr, H: gl.constexpr,
    L: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    HAS_PE: gl.constexpr, MERGE: gl.constexpr, STAMPS: gl.constexpr, MASK=None, stride_mb=0,
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
    shared-memory bound (1840 clocks per tile against 1221 for one warpgroup scoring all 64;
    NOTES.md item 43).

    At the end: warpgroup 1's count of tokens at invalid cache locations (``done``, its first
    phase), the final row sums to warpgroup 1 through ``alpha_smem`` (``p_ready``, once more),
    then this half and the rows' LSE stored (``_store_output_half``). In that order: warpgroup 1
    completes ``done``'s second phase only once it has the sums, so the first wait cannot miss
    its phase.

    ``HAS_MASK``: an attention mask. At S_q = 1 its one row per tile is prepared by whoever
    issues the tile's copy (the prologue, then warpgroup 1: ``_prepare_mask_terms``) into
    ``terms_smem``/``hidden_smem`` beside the ring slot, so this warpgroup only selects keys by
    them and adds a float mask's bias (NOTES.md item 69; loading and decoding the row here cost
    the loop 1.20x). Otherwise
    a row per query position is loaded under the tile's own scores (``_mask_load``). The value
    rows of keys it hides from every row are zeroed in the slot before ``P`` is handed over, so
    that both warpgroups' P.V read them zeroed (NOTES.md item 64).
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
            # (NOTES.md item 64).
            mask_raw = _mask_load(
                MASK, b64, row_block, tile_start, end, stride_mb, stride_ms, stride_mt, MASK_LEN,
                S_Q, H, BLOCK_M, BLOCK_N, MASK_IS_BOOL, s_layout, 1, False,
            )  # fmt: skip
        kv, s = _scores_on_m(
            kv_ring, pe_ring, q_smem, qpe_smem, ready, s_zero, i, tile_start, end, NUM_STAGES,
            HAS_PE, False, io_layout,
        )  # fmt: skip
        if i == 0:
            _stamp(STAMP_ROW, STAMP_FIRST_TILE, STAMPS)
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
    _stamp(STAMP_ROW, STAMP_LOOP_END, STAMPS)
    mbarrier.wait(done, 0)
    bad = bad_smem.load(gl.SliceLayout(1, _copy_layouts(4, False)[1]))
    poisoned = bad_before + gl.sum(bad, 0) > 0
    # alpha_smem is free once warpgroup 1 has read the last tile's alpha (its P.V done).
    mbarrier.wait(p_free, (n_tiles & 1) ^ 1)
    alpha_smem.store(l_i)
    _thread_barrier()
    mbarrier.arrive(p_ready, count=1)
    _stamp(STAMP_ROW, STAMP_SUMS_HANDED, STAMPS)
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
    stride_fd, stride_gb, stride_gs, stride_gh, STAMP_ROW, S_Q: gl.constexpr, H: gl.constexpr,
    PAGE_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_PE: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, CHUNK: gl.constexpr, MERGE: gl.constexpr, STAMPS: gl.constexpr, MASK=None,
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
    _stamp(STAMP_ROW, STAMP_ASSIST_END, STAMPS)
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
    _stamp(STAMP_ROW, STAMP_ASSIST_STORED, STAMPS)
    # The stores issued by every warp before the arrival: a merging program's release at gpu
    # scope (the kernel's arrival atomic) follows this phase.
    _thread_barrier()
    mbarrier.arrive(done, count=1)


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


@gluon.jit
def _score_tiles_qreg(
    kv_ring, pe_ring, q_nope, qpe_smem, alpha_smem, sums_smem, ready, free, s_done, p_ready,
    sums_ready, done, bad_smem, O_PART, LSE_PART, OUT, LSE_OUT, b64, row_block, split, n_real,
    bad_before, seqlen, start, end, n_tiles, scale_log2, kv_scale, stride_ob, stride_os,
    stride_oh, stride_ok, stride_od, stride_lb, stride_ls, stride_lh, stride_lk, stride_fb,
    stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh, STAMP_ROW, S_Q: gl.constexpr,
    H: gl.constexpr, L: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, MERGE: gl.constexpr, STAMPS: gl.constexpr,
):  # fmt: skip
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
        if i == 0:
            _stamp(STAMP_ROW, STAMP_FIRST_TILE, STAMPS)
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
    _stamp(STAMP_ROW, STAMP_LOOP_END, STAMPS)
    sums_smem.store(l_i)
    _thread_barrier()
    mbarrier.arrive(sums_ready, count=1)
    _stamp(STAMP_ROW, STAMP_SUMS_HANDED, STAMPS)
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
    STAMP_ROW, STAMPS: gl.constexpr,
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
    _stamp(STAMP_ROW, STAMP_ASSIST_END, STAMPS)
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
    _stamp(STAMP_ROW, STAMP_ASSIST_STORED, STAMPS)
    # The stores issued by every warp before the arrival (a merging program's release follows).
    _thread_barrier()
    mbarrier.arrive(stored, count=1)


@gluon.jit
def _allocate_ring(
    SRC, DESC, WIDTH: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    GATHER: gl.constexpr,
):  # fmt: skip
    """A ring of ``NUM_STAGES`` ``[BLOCK_N, WIDTH]`` tiles of a cache part in the cache's dtype:
    the copy engine's layout (``DESC``), or for gathered tiles (``SRC``'s rows by ``cp.async``)
    the default wgmma operand layout."""
    if GATHER:
        return gl.allocate_shared_memory(
            SRC.dtype.element_ty, [NUM_STAGES, BLOCK_N, WIDTH],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, WIDTH], SRC.dtype.element_ty),
        )  # fmt: skip
    else:
        return gl.allocate_shared_memory(DESC.dtype, [NUM_STAGES, BLOCK_N, WIDTH], DESC.layout)


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
    STAMP_BUF,  # STAMPS: [programs, STAMP_SLOTS] int64
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
    STAMPS: gl.constexpr,  # write phase stamps into STAMP_BUF (an instrument; off in the op)
    LONGEST_FIRST: gl.constexpr,  # BALANCED, batch <= BLOCK_B: _longest_first's order
    HAS_MASK: gl.constexpr,  # an attention mask (the transposed and one-scorer loops)
    MASK_IS_BOOL: gl.constexpr,
    QUERY_IN_REGISTERS: gl.constexpr,  # ONE_SCORER: _score_tiles_qreg, _pv_rest_qreg, ring of 3
    PV_REGS: gl.constexpr,  # QUERY_IN_REGISTERS: registers per thread of warpgroup 1
    num_warps: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    STAMP_ROW = STAMP_BUF + pid * STAMP_SLOTS
    _stamp(STAMP_ROW, STAMP_ENTRY, STAMPS)
    if STAMPS:
        sm = gl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.store(STAMP_ROW + STAMP_SM, sm.to(gl.int64))
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
    # wave; NOTES.md item 26). LONGEST_FIRST, over a batch of unequal lengths: every full chunk,
    # then the partial last chunks longest first, then the empty ones (_longest_first; item 39).
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
    _stamp(STAMP_ROW, STAMP_BOUNDS, STAMPS)
    if STAMPS:
        tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        gl.store(STAMP_ROW + STAMP_TILES, tiles.to(gl.int64))

    # Rows of this program, in the layouts they are used in.
    rows_st = row_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    offs_l_st = gl.arange(0, L, layout=gl.SliceLayout(1, st_layout))
    row_ok_st = rows_st < S_Q * H
    n_real = gl.cdiv(seqlen, chunk)  # the sequence's chunks (MERGE: 1 writes the final rows)
    if start >= end:
        # An empty split: the contract's zeros and -inf, nothing read (FILL_EMPTY off: the -inf
        # alone; the zeros of the planner's headroom splits cost 1.8-3.4 % of (a), (d), (e),
        # NOTES item 26). MERGE: nothing, unless the whole sequence is empty (split 0 is empty
        # only then), whose final rows are zeros and -inf.
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
        _stamp(STAMP_ROW, STAMP_EXIT, STAMPS)
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
        # The query's loads go out first (NOTES.md item 43), 16 bytes a load; the prologue's
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
        _stamp(STAMP_ROW, STAMP_QUERY, STAMPS)
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
                        stride_gh, STAMP_ROW, S_Q, H, L, BLOCK_M, NUM_STAGES, CAUSAL, MERGE,
                        STAMPS,
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
                        CHUNK, BLOCK_M, NUM_STAGES, MERGE, STAMP_ROW, STAMPS,
                    ),
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
                        stride_pep, stride_pet, scale_log2, kv_scale, STAMP_ROW, S_Q, H, L, R,
                        PAGE_SIZE, BLOCK_M, NUM_STAGES, CAUSAL, HAS_PE, KV_FP8, CHUNK, GATHER,
                        True, STAMPS, FLOAT8_PRODUCTS, PE_FP8, pe_stage, MASK, stride_mb,
                        stride_ms, stride_mt, MASK_LEN, HAS_MASK, MASK_IS_BOOL,
                    ),
                ),
                (
                    _produce_tiles,
                    (
                        KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, ready, free,
                        done, bad_smem, b64, start, end, n_tiles, stride_btb, stride_btp,
                        NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet,
                        STAMP_ROW, PAGE_SIZE, NUM_STAGES, HAS_PE, KV_FP8, GATHER, L, R, CHUNK,
                        STAMPS,
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
            # behind every program's first tiles (NOTES.md item 43).
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
            _stamp(STAMP_ROW, STAMP_QUERY, STAMPS)
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
                            STAMP_ROW, S_Q, H, L, BLOCK_M, NUM_STAGES, CAUSAL, HAS_PE, MERGE,
                            STAMPS, MASK, stride_mb, stride_ms, stride_mt, MASK_LEN, HAS_MASK,
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
                            stride_fd, stride_gb, stride_gs, stride_gh, STAMP_ROW, S_Q, H,
                            PAGE_SIZE, NUM_STAGES, HAS_PE, L, R, CHUNK, MERGE, STAMPS, MASK,
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
            _stamp(STAMP_ROW, STAMP_QUERY, STAMPS)
            o_t, m_i, l_i, n_bad = _consume_rows_on_m(
                KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring, pe_ring,
                p_smem, ready, free, n_bad, b64, row_block, seqlen, start, end, n_tiles,
                stride_btb, stride_btp, NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt, stride_pep,
                stride_pet, scale_log2, STAMP_ROW, S_Q, H, L, R, PAGE_SIZE, BLOCK_M, NUM_STAGES,
                CAUSAL, HAS_PE, CHUNK, GATHER, STAMPS,
            )  # fmt: skip
        else:
            o_t, m_i, l_i, n_bad = _consume_tiles(
                Q, KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, q_smem, qpe_smem, kv_ring, pe_ring,
                stage, p_smem, max_smem, ready, free, n_bad, b64, row_block, seqlen, start, end,
                n_tiles,
                stride_qb, stride_qs, stride_qh, stride_qd, stride_btb, stride_btp, NUM_PAGES,
                MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet, scale_log2, kv_scale,
                STAMP_ROW, S_Q, H, L, R, PAGE_SIZE, BLOCK_M, NUM_STAGES, CAUSAL, HAS_PE, KV_FP8,
                CHUNK, GATHER, False, STAMPS, FLOAT8_PRODUCTS, PE_FP8, pe_stage, MASK, stride_mb,
                stride_ms, stride_mt, MASK_LEN, HAS_MASK, MASK_IS_BOOL,
            )  # fmt: skip

    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(free.index(i))
    # Programmatic dependent launch: the combine may launch once every program is past its loop
    # (an empty split, which returned above, counts at its exit); it waits on the device for
    # this grid's writes (triton_kernels.has_pdl). Issued at the program's entry instead, which
    # launched the combine while the decode still streamed, the benchmark's calls that run the
    # combine, (b)-(e), took 0.5-1.2 us longer on an H200 ((d) 1.0-1.2 us; NOTES.md item 84).
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
        # barrier) and puts the count back to 0 for the next launch.
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
    _stamp(STAMP_ROW, STAMP_EXIT, STAMPS)


_GL_DTYPES = {
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float8_e4m3fn: gl.float8e4nv,
}

# Columns of any tile gathered (cp.async) at a time, the kernel's CHUNK: 128 float8 values fill
# one swizzle atom's width.
GATHER_CHUNK = 128

# Columns of a float8 tile converted at a time (_conversion_chunk): 256 measured 1.2-2 % faster
# than 128 on (a8), (d8) and (e8), and 512 no faster than 256; each chunk ends at a barrier of the
# math warps (the staging tile's stores), and fewer chunks mean fewer (NOTES.md item 53).
FP8_CONVERT_CHUNK = 256


# Registers per thread of a one-scorer program's warpgroup 1 (launch(one_scorer=True)): its half
# of the output is 128 float32 per thread.
ASSIST_REGS = 232

# One-scorer programs with the nope query in warpgroup 0's registers and a ring of three, P.V
# under the next tile's softmax (_score_tiles_qreg, NOTES.md item 78), where P fits a k_pe slot
# (R = 64) and no mask is given; False keeps every one-scorer program on _score_tiles.
QUERY_IN_REGISTERS = True

# Registers per thread of such a program's warpgroup 1: 448 columns of output, 224 float32.
PV_REGS = 256

# Output columns of such a program's warpgroup 0 (beside the query's 128 registers per thread).
QREG_COLS = gl.constexpr(64)

# Registers per thread of the producer partition (setmaxnreg; a multiple of 8 from 24): TMA
# issue is a few scalars, a gather holds its row addresses. (TMA, gather)
PRODUCER_REGS = (40, 88)


def default_producer_warps(num_warps: int, gather: bool) -> int:
    """Warps of the producer partition for a kernel of ``num_warps`` math warps: a warpgroup
    of four for gathers (144 16-byte copies per tile and thread for one warp), one warp for the
    copy engine; 0 (the math warps copy) for 8 math warps, whose 241 registers per thread at 64
    rows leave nothing to give a producer (registers are allotted per warpgroup)."""
    if num_warps > 4:
        return 0
    return 4 if gather else 1


def default_rows_on_m(block_m: int, num_warps: int, float8: bool) -> bool:
    """Whether a program puts its query rows on the MMA's M side (``_consume_rows_on_m``):
    64-row programs of two warpgroups over a 16-bit cache (a float8 cache keeps the transposed
    loop, which converts each tile once for both products). The op asks only where
    ``default_one_scorer`` declines: gathered tiles."""
    return block_m == 64 and num_warps == 8 and not float8


def default_query_in_registers(one_scorer: bool, kv_len: int, rope_len: int, masked: bool) -> bool:
    """Whether a one-scorer program keeps the nope query in registers and a ring of three
    (``_score_tiles_qreg``): ``QUERY_IN_REGISTERS``, for DeepSeek's row (``kv_len`` 512, whose
    output the two warpgroups split 64 + 448; ``rope_len`` 64, a k_pe slot that P fits), no
    mask."""
    return (
        QUERY_IN_REGISTERS and one_scorer and kv_len == 512 and rope_len == BLOCK_N and not masked
    )


def default_one_scorer(block_m: int, float8: bool, gather: bool) -> bool:
    """Whether a program is a one-scorer program (``launch(one_scorer=True)``: warpgroup 0 scores
    whole tiles, warpgroup 1 is a partition of its own that copies and takes half of P.V): 64 rows
    over a 16-bit cache whose tiles arrive by TMA (warpgroup 1 issues bulk copies only). A
    gathered cache keeps the rows-on-M loop, a float8 cache the transposed loop (it converts each
    tile once for both products)."""
    return block_m == 64 and not float8 and not gather


def default_float8_products(block_m: int, kv_len: int, float8: bool, gather: bool) -> bool:
    """Whether a float8 ``kv_c`` is multiplied in float8 (``launch(float8_products=True)``,
    ``_float8_tile``): 16-row programs (one math warpgroup, whose staged fp16 tile was bound by
    its shared-memory traffic, NOTES.md item 55) of DeepSeek's width L = 512 (the ``V^T``
    register operand's row permutation is built for it) over copy-engine tiles. On an H200
    20 % faster than the fp16 products on (a8) (100 against 125 us), 17 % on (d8), 14 % on (e8);
    on an H100, whose float8 loop runs at its copies' rate either way, level to 0.6 % slower
    (NOTES.md item 57). 32- and 64-row programs (two math warpgroups) and gathered tiles keep the
    fp16 staging tile."""
    return float8 and block_m == 16 and kv_len == 512 and not gather


def default_longest_first(
    batch: int, num_splits: int, total_splits: int | None, lengths_per_step: int, rows_on_m: bool
) -> bool:
    """Whether programs take the batch's chunks longest first (``_longest_first``): for a
    balanced plan (``total_splits``) of at most ``lengths_per_step`` sequences (one block of
    lanes ranks them) and ``LONGEST_FIRST_MAX_SPLITS`` splits. Programs with the rows on M keep
    the split-major order: with the chunk held in registers across their loop, ptxas spilled
    168-176 bytes (offline sm_90 compile, Triton 3.6; NOTES.md item 39)."""
    return _can_rank(batch, num_splits, total_splits, lengths_per_step) and not rows_on_m


def _can_rank(batch: int, num_splits: int, total_splits: int | None, lengths_per_step: int):
    return (
        total_splits is not None
        and batch <= lengths_per_step
        and num_splits <= LONGEST_FIRST_MAX_SPLITS.value
    )


@functools.cache
def _shared_layout(block_n: int, width: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    # Built once per tile shape: it takes several microseconds of a launch's host time.
    return gl.NVMMASharedLayout.get_default_for([block_n, width], _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, block_n: int = BLOCK_N) -> TensorDescriptor:
    """Gluon TMA descriptor of a paged ``[num_pages, page_size, W]`` cache as ``[tokens, W]``."""
    rows, width = t.shape[0] * t.shape[1], t.shape[2]
    layout = _shared_layout(block_n, width, t.dtype)
    return TensorDescriptor(t, [rows, width], [t.stride(1), 1], [block_n, width], layout)


def prepared_call(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    kv_scale: float | None,
    causal: bool,
    *plan: object,
    **options: object,
) -> tuple[PreparedLaunch, dict[str, object]]:
    """``launch``'s two steps, not yet run: ``(prepared, data)``, where
    ``prepared = prepare(q, kv_c, k_pe, block_table, out, lse, causal, *plan, **options)``
    (``plan`` from ``num_splits`` on; see ``prepare`` for every argument) and ``data`` is this
    call's ``launch_data``. ``prepared.launch(data)`` runs it; an experiment may change the
    prepared launch (its grid, say) first."""
    # Bound to prepare's signature so that the per-call tensors launch_data also needs are found
    # whether they came by position or by keyword.
    bound = inspect.signature(prepare).bind(
        q, kv_c, k_pe, block_table, out, lse, causal, *plan, **options
    )
    prepared = prepare(*bound.args, **bound.kwargs)  # checks the arguments first
    bound.apply_defaults()
    arg = bound.arguments
    data = launch_data(
        q, kv_c, k_pe, cache_seqlens, block_table, out, lse, softmax_scale, kv_scale,
        arg["gather"], merge_into=arg["merge_into"], stamps=arg["stamps"],
        attn_mask=arg["attn_mask"],
    )  # fmt: skip
    return prepared, data


def launch(*args: object, **options: object):
    """Launch the kernel into preallocated partials ``out``/``lse``; returns the compiled kernel.
    The arguments are ``prepared_call``'s: ``q, kv_c, k_pe, cache_seqlens, block_table, out,
    lse, softmax_scale, kv_scale, causal, *plan, **options``."""
    prepared, data = prepared_call(*args, **options)
    return prepared.launch(data)


# The launch this module ships: the op prepares it (``prepare``) and calls a replacement instead
# (an experiment's variant, a test's instrument), unprepared.
SHIPPED_LAUNCH = launch


def launch_data(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    kv_scale: float | None,
    gather: bool,
    merge_into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    stamps: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> dict[str, object]:
    """One call's data for a launch ``prepare`` made (its ``Data`` slots by name): the tensors,
    the cache's TMA descriptors (none for gathered tiles) and the float scalars."""
    # Without merge_into the final pointers are never used: the partials stand in for them.
    final_out, final_lse, arrivals = merge_into or (out, lse, cache_seqlens)
    kv_desc = pe_desc = None
    if not gather:
        kv_desc = descriptor(kv_c)
        pe_desc = descriptor(k_pe) if k_pe.shape[-1] else kv_desc
    mask = arrivals
    if attn_mask is not None:
        # A bool tensor is read as bytes (same storage, no copy).
        mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
    return {
        "q": q, "cache_seqlens": cache_seqlens, "block_table": block_table, "out": out,
        "lse": lse, "final_out": final_out, "final_lse": final_lse, "arrivals": arrivals,
        "stamps": arrivals if stamps is None else stamps, "kv_desc": kv_desc,
        "pe_desc": pe_desc, "kv_c": kv_c, "pe": k_pe if k_pe.shape[-1] else kv_c, "mask": mask,
        "scale_log2": softmax_scale * 1.4426950408889634,
        "kv_scale": 1.0 if kv_scale is None else kv_scale,
    }  # fmt: skip


def prepare(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    num_splits: int,
    total_splits: int | None,
    block_m: int,
    num_warps: int,
    num_stages: int,
    min_chunk: int,
    granule: int,
    lengths_per_step: int,
    gather: bool = False,
    fill_empty: bool = True,
    producer_warps: int | None = None,
    rows_on_m: bool | None = None,
    one_scorer: bool = False,
    merge_into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    stamps: torch.Tensor | None = None,
    longest_first: bool | None = None,
    float8_products: bool | None = None,
    attn_mask: torch.Tensor | None = None,
    query_in_registers: bool | None = None,
) -> PreparedLaunch:
    """The kernel's launch for these tensors' shapes, strides and dtypes, into preallocated
    partials ``out``/``lse``, with each call's data left as slots (``launch_data`` fills them).
    Reads no tensor's data: a prepared launch serves every call of the same signature.

    gather: copy KV tiles row by row with ``cp.async`` (any page size) instead of by TMA
    (``triton_kernels.wgmma_loads`` says which a cache allows). fill_empty: an empty split writes
    its zero ``out`` (False: only its ``lse = -inf``). producer_warps: warps of a partition of
    their own that issue the copies (0: the math warps issue them; None: ``producer_warps``).
    rows_on_m: the query rows on the MMA's M side (``_consume_rows_on_m``; None:
    ``default_rows_on_m``). one_scorer: 64 rows on M with warpgroup 0 scoring whole tiles
    and the two warpgroups splitting P.V (``_score_tiles``, ``_assist_tiles``; the op's choice
    is ``default_one_scorer``): ``num_warps`` is then warpgroup 0's 4, ``num_stages`` 2,
    copy-engine tiles of a 16-bit cache. longest_first: programs take the chunks longest first
    (``_longest_first``; None: ``default_longest_first``), else split-major. float8_products: a
    float8 ``kv_c`` multiplied in float8 (``_float8_tile``; None: ``default_float8_products``),
    else converted to fp16. A float8 ``k_pe`` (the whole cache in e4m3, one ``kv_scale``) needs a
    float8 ``kv_c`` and a width of 64; without float8 products it is converted to fp16 as
    ``kv_c`` is.
    merge_into: ``(final_out [B, S_q, H, L] in q's dtype, final_lse [B, S_q, H] float32,
    arrivals [B * row blocks] int32 zeros)``: the kernel writes the attention itself, merging a
    sequence's chunks in the program that finishes last (no ``mla::combine``); ``out``/``lse``
    are then its scratch (never read or written when ``num_splits`` is 1). ``arrivals`` is
    zero again when the kernel ends.
    stamps: an instrument, ``[programs, STAMP_SLOTS]`` int64 that every program fills with its
    phase stamps (``STAMP_FIELDS``; the op never passes one).
    attn_mask: ``[B, S_q, T_m]`` bool or float (``mla::decode``'s rules), read by the transposed
    and one-scorer loops (not ``rows_on_m``).
    query_in_registers: a one-scorer program keeps the nope query in warpgroup 0's registers and
    a ring of three (``_score_tiles_qreg``; ``num_stages`` is then 3; None:
    ``default_query_in_registers``); only over ``kv_c`` width 512 and ``k_pe`` width 64,
    unmasked, else refused.
    """
    if producer_warps is None:
        producer_warps = default_producer_warps(num_warps, gather)
    float8 = kv_c.dtype == torch.float8_e4m3fn
    if one_scorer:
        if rows_on_m or block_m != 64 or num_warps != 4 or num_stages != 2 or gather or float8:
            raise ValueError(
                "one_scorer: expected block_m=64, num_warps=4, num_stages=2, rows_on_m not set, "
                f"copy-engine tiles of a 16-bit cache; got block_m={block_m}, "
                f"num_warps={num_warps}, num_stages={num_stages}, rows_on_m={rows_on_m}, "
                f"gather={gather}, kv_c {kv_c.dtype}"
            )
        rows_on_m = False
        producer_warps = 0
    if query_in_registers is None:
        query_in_registers = default_query_in_registers(
            one_scorer, kv_c.shape[-1], k_pe.shape[-1], attn_mask is not None
        )
    if query_in_registers:
        if (
            not one_scorer or kv_c.shape[-1] != 512 or k_pe.shape[-1] != BLOCK_N
            or attn_mask is not None
        ):  # fmt: skip
            raise ValueError(
                "query_in_registers: expected one_scorer over a kv_c width of 512 and a k_pe "
                f"width of {BLOCK_N}, no attn_mask; got one_scorer={one_scorer}, kv_c width "
                f"{kv_c.shape[-1]}, k_pe width {k_pe.shape[-1]}, attn_mask "
                f"{'given' if attn_mask is not None else 'None'}"
            )
        num_stages = 3
    if rows_on_m is None:
        rows_on_m = default_rows_on_m(block_m, num_warps, float8) and attn_mask is None
    if attn_mask is not None and rows_on_m:
        raise ValueError(
            "attn_mask: read by the transposed and one-scorer loops, not with rows_on_m=True"
        )
    kv_len, rope_len = kv_c.shape[-1], k_pe.shape[-1]
    pe_fp8 = rope_len > 0 and k_pe.dtype == torch.float8_e4m3fn
    if float8_products is None:
        float8_products = default_float8_products(block_m, kv_len, float8, gather)
    elif float8_products and not (
        float8 and block_m == 16 and num_warps == 4 and kv_len == 512 and not gather
    ):
        raise ValueError(
            "float8_products: expected a float8_e4m3fn kv_c of width 512 in 16-row programs "
            f"(4 warps) of copy-engine tiles; got kv_c {kv_c.dtype} of width {kv_len}, "
            f"block_m={block_m}, num_warps={num_warps}, gather={gather}"
        )
    if pe_fp8 and not (float8 and rope_len == 64):
        raise ValueError(
            "a float8_e4m3fn k_pe is read with a float8_e4m3fn kv_c at a k_pe width of 64; got "
            f"kv_c {kv_c.dtype}, k_pe width {rope_len}"
        )
    batch, s_q, heads, _ = q.shape
    if longest_first is None:
        # A one-scorer program keeps the rows-on-M order (its loop holds the chunk the same way).
        longest_first = default_longest_first(
            batch, num_splits, total_splits, lengths_per_step, rows_on_m or one_scorer
        )
    if longest_first and not _can_rank(batch, num_splits, total_splits, lengths_per_step):
        raise ValueError(
            f"longest_first needs a balanced plan (total_splits, got {total_splits}) of at most "
            f"lengths_per_step={lengths_per_step} sequences (got {batch}) and "
            f"{LONGEST_FIRST_MAX_SPLITS.value} splits (got {num_splits})"
        )
    pe = k_pe if rope_len else kv_c

    def vec_strides(t: torch.Tensor) -> tuple[int, int]:
        # Page and token strides in 16-byte units (wgmma_loads checked that they divide).
        unit = 16 // t.element_size()
        return t.stride(0) // unit, t.stride(1) // unit

    grid = (batch * triton.cdiv(s_q * heads, block_m) * num_splits,)
    final_strides = (0,) * 7
    if merge_into:
        final_strides = (*merge_into[0].stride(), *merge_into[1].stride())
    mask_strides, mask_len = (0, 0, 0), 0
    if attn_mask is not None:
        mask_strides, mask_len = attn_mask.stride(), attn_mask.shape[-1]
    if stamps is not None and (
        stamps.dtype != torch.int64 or tuple(stamps.shape) != (grid[0], STAMP_SLOTS.value)
    ):
        raise ValueError(
            f"stamps: expected int64 [{grid[0]}, {STAMP_SLOTS.value}] (programs x slots), got "
            f"{stamps.dtype} {list(stamps.shape)}"
        )
    names = ("q", "cache_seqlens", "block_table", "out", "lse", "final_out", "final_lse",
             "arrivals", "stamps", "kv_desc", "pe_desc", "kv_c", "pe", "mask")  # fmt: skip
    args = [Data(name) for name in names]
    args += [
        *q.stride(),
        *block_table.stride(),
        *vec_strides(kv_c),
        *vec_strides(pe),
        *out.stride(),
        *lse.stride(),
        *final_strides,
        *mask_strides,
        kv_c.shape[0],
        block_table.shape[1],
        mask_len,
        Data("scale_log2"),
        Data("kv_scale"),
        num_splits,
        total_splits or 0,
        batch,
    ]
    constexprs = dict(
        S_Q=s_q,
        H=heads,
        L=kv_len,
        R=rope_len,
        PAGE_SIZE=kv_c.shape[1],
        MIN_CHUNK=min_chunk,
        GRANULE=granule,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        NUM_STAGES=num_stages,
        CAUSAL=causal,
        HAS_PE=rope_len > 0,
        BALANCED=total_splits is not None,
        BLOCK_B=lengths_per_step,
        KV_FP8=float8,
        FLOAT8_PRODUCTS=float8_products,
        PE_FP8=pe_fp8,
        CHUNK=min(kv_len, GATHER_CHUNK),
        GATHER=gather,
        FILL_EMPTY=fill_empty,
        PRODUCER_WARPS=producer_warps,
        PRODUCER_REGS=PRODUCER_REGS[bool(gather)],
        ROWS_ON_M=rows_on_m,
        ONE_SCORER=one_scorer,
        ASSIST_REGS=ASSIST_REGS,
        MERGE=merge_into is not None,
        MERGE_SPLITS=triton.next_power_of_2(num_splits) if merge_into is not None else 1,
        STAMPS=stamps is not None,
        LONGEST_FIRST=longest_first,
        HAS_MASK=attn_mask is not None,
        MASK_IS_BOOL=attn_mask is not None and attn_mask.dtype == torch.bool,
        QUERY_IN_REGISTERS=query_in_registers,
        PV_REGS=PV_REGS,
        num_warps=num_warps,
    )
    return PreparedLaunch(_mla_decode_wgmma_kernel, grid, args, constexprs)


follow(__name__)
