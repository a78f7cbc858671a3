"""Storing a program's result: float32 partials and their LSE (``mla::decode``), or the final
rows in q's dtype when the kernel merges (``mla::attention`` with few splits). A sequence in
several chunks has each chunk store its partial and count its arrival on a per-row-block counter
(release/acquire at gpu scope); the chunk that arrives last merges them (``_merge_splits``) and
resets the counter, so no combine kernel runs."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .compat import _thread_barrier


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
    thread holding all splits of its columns), so the reads are in flight together rather than one
    dependent L2 round trip per split (a loop over splits cost (h128_b32_4k) 15 % of its call). Read
    with
    ``.cg``: from L2, never a stale L1 line."""
    # A warp's 32 lanes span the block's columns and, where a warp holds 16 or more rows (a
    # one-scorer program: 64 rows on 4 warps), also 4 rows, with 16-byte loads: a thread holding
    # 16 rows of every split spilled 1,912 bytes there (sm_90, Triton 3.6); 4 rows of 4 columns
    # spill nothing and merged 64-row blocks 5-20 % faster.
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
    # Column blocks software-pipelined: the next block's loads are issued before this block's stores
    # (which the compiler cannot reorder loads across: they might alias). In one-scorer programs the
    # blocks are a loop, not unrolled: the merge runs once per program, and the unrolled code (2,300
    # instructions) ran from a cold instruction cache, its warps stalled on instruction fetch (ncu);
    # rolled, (h128_b32_4k)'s merge took 5-10 us less, while 16-row programs merged 1.0-1.8 us
    # slower rolled than unrolled.
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
    (stamps). In this layout a warp's float32 store covers 8 rows x 32 bytes,
    whole sectors. 16-bit final rows would go out in 16-byte pieces, half sectors, which cost
    (h128_b64_4k_sq2) 2 %: they are staged through the query's shared memory (``q_smem``, dead once
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
    # became a runtime branch around a store, which Triton 3.6 fails to lower.
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
