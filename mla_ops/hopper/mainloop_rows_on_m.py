"""64-row programs over gathered tiles: the query rows on the MMA's M side (``S = Q K^T``,
``O = P V``), the two warpgroups splitting the tile's tokens in the scores and the latent
columns in the output, so that a row's softmax reductions stay within a warp quad."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .layouts import _copy_layouts
from .loads import _await_tile, _hand_back, _locate_tile
from .softmax import _online_softmax, _row_start


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
    MAX_PAGES, stride_kvp, stride_kvt, stride_pep, stride_pet, scale_log2, S_Q: gl.constexpr,
    H: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, HAS_PE: gl.constexpr, CHUNK: gl.constexpr, GATHER: gl.constexpr,
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
    l_i = gl.sum(l_part, 1)
    # O^T in the epilogue's layout: latent columns across a warp's lanes, then transposed.
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    o_t = gl.permute(gl.convert_layout(o, rows_layout), (1, 0))
    return o_t, m_i, l_i, n_bad
