"""Which chunk of which sequence each program takes.

Split-major by default (every sequence's first chunk, then every second one, ...): a uniform
batch's real programs fill the first wave. For a balanced plan of a ragged batch,
``_longest_first`` ranks the chunks on the device (no host sync): every full chunk, then the
partial last chunks longest first, then the empty ones, so that the programs that start late
are the short ones (longest processing time first)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .compat import _thread_barrier
from .layouts import LONGEST_FIRST_MAX_SPLITS


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
    time first; ragged h16_b64_8k_ragged)."""
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
