"""The copy ring: KV tiles into ``NUM_STAGES`` shared-memory slots tracked by mbarriers.

A tile's pages are looked up a tile ahead of its copy; pages of whole 64-token tiles go through
the copy engine (TMA), any other page size is gathered row by row with 16-byte ``cp.async``
copies. A token whose location is outside the cache is never read: its rows are flagged and
come out NaN. ``_produce_tiles`` is the producer partition (one warp for TMA, a warpgroup for
gathers) that keeps the ring full while the math warps consume it."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
)

from .compat import _cp_async, _thread_barrier, _tma_load
from .layouts import _copy_layouts


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
def _produce_tiles(
    KV_DESC, PE_DESC, KV, PE, BLOCK_TABLE, kv_ring, pe_ring, ready, free, done, bad_smem, b64,
    start, end, n_tiles, stride_btb, stride_btp, NUM_PAGES, MAX_PAGES, stride_kvp, stride_kvt,
    stride_pep, stride_pet, PAGE_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
    HAS_PE: gl.constexpr, KV_FP8: gl.constexpr, GATHER: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, CHUNK: gl.constexpr, ):  # fmt: skip
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
    bad_smem.store(n_bad)
    # Every producer thread's store before the one arrival.
    _thread_barrier()
    mbarrier.arrive(done, count=1)


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
