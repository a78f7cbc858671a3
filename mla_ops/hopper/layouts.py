"""Tile sizes, register and shared-memory layouts, and constants the Hopper kernel's files share.

The float8 ``V^T`` layouts (``_VT_OFFSET_BASES``, ``_VT_LOAD_LAYOUT``, ``_PAIRS_TO_ROWS``) read a
float8 ring slot straight into the wgmma's A registers; ``_conversion_layout`` converts float8
columns to fp16 with no shared-memory bank conflicts on either side."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..tiling import LONGEST_FIRST_MAX_SPLITS as _LONGEST_FIRST_MAX_SPLITS
from ..tiling import WGMMA_BLOCK_N

# Tokens per KV tile: the M of every wgmma (the planner's tiling decides it).
BLOCK_N = WGMMA_BLOCK_N


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


# Most splits per sequence that _longest_first ranks (``tiling.LONGEST_FIRST_MAX_SPLITS``).
LONGEST_FIRST_MAX_SPLITS = gl.constexpr(_LONGEST_FIRST_MAX_SPLITS)


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

    Why those rows: a float8 tile at least 128 columns wide and the fp16 one both have 128-byte rows
    whose 16-byte chunks are swizzled by the row's index mod 8. An fp16 store serves 8 lanes at a
    time, which here cover one 128-byte row. An 8-byte float8 load serves 16 lanes at a time, which
    cover 64 bytes of two rows; rows ``r`` and ``r + 4`` put them on opposite halves of the banks,
    where ``r`` and ``r + 1`` (the 16-bit ``io`` layout's rows) put them on the same half, a two-way
    conflict (ncu on (h16_b128_4k_fp8): 2.1 of 4.6 million load wavefronts with ``io``, none left
    with these rows; the float8 cases 3.8-5 % faster). 16 values per thread, the layout before
    ``io``, had its stores conflict instead (4.4 of 8.9 million). A 64-column float8 tile
    has 64-byte rows, where ``io`` has no conflict.."""
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


# A one-row (S_q = 1) mask's terms, prepared per ring slot by whoever issues the slot's copy
# (``_prepare_mask_terms``) and read by the one-scorer loop's scorer. The row is loaded in this
# layout's token slice (``_mask_load``'s ``ONE_ROW``): 64 tokens over one warpgroup, each twice.
PREPARED_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0]))


FLAG_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


# Columns of any tile gathered (cp.async) at a time, the kernel's CHUNK: 128 float8 values fill
# one swizzle atom's width.
GATHER_CHUNK = 128


# Columns of a float8 tile converted at a time (_conversion_chunk): 256 measured 1.2-2 % faster than
# 128 on the float8 forms of h16_b128_4k, h16_b4_64k and h16_b64_8k_ragged, and 512 no faster than
# 256; each chunk ends at a barrier of the math warps (the staging tile's stores), and fewer chunks
# mean fewer.
FP8_CONVERT_CHUNK = 256


# Output columns of such a program's warpgroup 0 (beside the query's 128 registers per thread).
QREG_COLS = gl.constexpr(64)
