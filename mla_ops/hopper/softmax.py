"""Causal bounds, attention masks and the online softmax, in the exp2 domain with the scale
folded in. A mask is read one row per tile at S_q = 1 (prepared by warpgroup 1 in one-scorer
programs); hidden keys get a zero probability, and a row with no visible key gives zeros and
``-inf``. Rows past a split's end hold stale cache memory (maybe NaN) and are zeroed before use."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .compat import _thread_barrier
from .layouts import FLAG_LAYOUT, MASK_HIDDEN
from .loads import _zero_rows


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
    warp's own by its shuffles, then exchanged once through ``max_smem [4, 16]`` float32 behind one
    barrier, in ``S^T``'s column layout. Triton's reduction across warps takes two barriers and a
    second round of shuffles; with this one (float8 products, P.V in flight) (h16_b128_4k_fp8row)
    was 1.2 % and (h16_b128_4k_fp8) 1.1 % faster on an H200. The caller alternates two buffers: a
    warp can write tile i + 2's maxima only after every warp has passed tile i + 1's
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
    the ring slot's rows (stores into the slot there made ptxas serialise the loop's wgmma:)."""
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
