"""MLA decode and combine: ``torch.library`` custom ops, fake functions and the public wrappers.

Two ops in namespace ``mla``:

* ``mla::decode(q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits,
  kv_scale=None, attn_mask=None, total_splits=None, fill_empty=True) -> (out_partial [B, S_q, H,
  num_splits, L], lse_partial [B, S_q, H, num_splits])``: split-KV attention of the absorbed query
  over the latent cache (MQA, one KV head). Scores are ``[q_nope, q_pe] . [kv_c, k_pe] *
  softmax_scale`` (plus a float ``attn_mask``); the value is ``kv_c``. Empty splits give ``lse =
  -inf`` and ``out = 0``; with ``fill_empty=False`` the CUDA kernels leave an empty split's ``out``
  unwritten (``mla::combine`` never reads it, and writing the zeros of the planner's headroom splits
  cost 1.8-3.4 % of cases (h16_b128_4k), (h16_b4_64k), (h16_b64_8k_ragged) on an H100:
  ``mla_decode`` passes False). Where each split starts and ends: ``planner.split_bounds``
  (``total_splits`` balances a ragged batch).
* ``mla::combine(out_partial [..., S, L], lse_partial [..., S], out_dtype)
  -> (out [..., L], lse [...])``: the LSE merge of attention states (the splits above, or
  e.g. a prefix and a suffix).
* ``mla::attention(<mla::decode's arguments but fill_empty>) -> (out [B, S_q, H, L] in q's dtype,
  lse [B, S_q, H])``: ``mla::decode`` then ``mla::combine``, as one op (what ``mla_decode``
  calls). Same values, but on CUDA the Hopper kernel writes the output itself when a call has
  few splits: a sequence in one chunk directly, a sequence in several by the program that
  finishes last, with no combine kernel (``planner.plan_decode`` decides; its plan's
  ``merge_in_kernel`` and ``reasons`` say so).

CUDA runs the kernels that ``planner.plan_decode`` chooses (``runtime`` launches them); every
other device, and float64, runs the PyTorch implementation in ``reference.py``.
The fake functions let ``torch.compile(fullgraph=True)`` and ``torch.export`` treat each op as
one node with symbolic batch and cache length.

Value checks (lengths against the cache, page ids) need the values. Off CUDA they always run. On
CUDA they would cost a host synchronisation, so they run only with ``MLA_OPS_CHECK_VALUES=1``;
without it the kernel never reads outside the cache and returns NaN rows for a token whose
location is out of range.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence

import torch

from . import reference
from .planner import default_splits
from .splits import log

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# A latent cache may also be stored in float8 e4m3 with one dequantisation scale (kv_scale).
FP8_CACHE_DTYPE = torch.float8_e4m3fn

KVCache = torch.Tensor | Sequence[torch.Tensor]


# Split counts beyond these are refused by name: the partials are [B, S_q, H, num_splits, L]
# floats (a huge count fails to allocate, or overflows the kernels' 32-bit grid and indices).
MAX_NUM_SPLITS = 4096
MAX_TOTAL_SPLITS = 2**30
# The kernels compute in float32: a scale past its range becomes inf and the output NaN.
FLOAT32_MAX = torch.finfo(torch.float32).max


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_scale(name: str, value: float) -> None:
    """A finite float within float32's range (the kernels' arithmetic)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        _fail(f"{name} must be finite and within float32's range (|x| <= {FLOAT32_MAX:.3g}), "
              f"got {value}")  # fmt: skip


def _check_count(name: str, value: int, most: int, what: str = "an int") -> None:
    """An int (not a bool) in ``[1, most]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if not 1 <= value <= most:
        _fail(f"{name} must be in [1, {most}], got {value}")


def _check_floating(name: str, t: torch.Tensor, allow_fp8: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES and not (allow_fp8 and t.dtype == FP8_CACHE_DTYPE):
        extra = " (or float8_e4m3fn with kv_scale)" if allow_fp8 else ""
        raise TypeError(
            f"{name} must be bfloat16, float16, float32 or float64{extra}, got {t.dtype}"
        )


def _check_index(name: str, t: torch.Tensor | None, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} must be on {device} (q's device), got {t.device}")


def check_decode_args(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> None:
    """Shape, dtype and device checks of ``mla::decode``, arguments in the op's order (metadata
    only: no host sync)."""
    _check_floating("q", q)
    if q.dim() != 4:
        _fail(f"q must be [batch, S_q, heads, L+R], got shape {tuple(q.shape)}")
    batch, _, _, q_dim = q.shape
    for name, part in (("kv_c", kv_c), ("k_pe", k_pe)):
        _check_floating(name, part, allow_fp8=True)
        if part.dtype not in (q.dtype, FP8_CACHE_DTYPE):
            raise TypeError(
                f"{name} must have q's dtype {q.dtype} (or float8_e4m3fn), got {part.dtype}"
            )
        if part.device != q.device:
            _fail(f"{name} must be on {q.device} (q's device), got {part.device}")
        if part.dim() != 3:
            layout = "[num_pages, page_size, D]" if block_table is not None else "[batch, T, D]"
            _fail(f"{name} must be {layout}, got shape {tuple(part.shape)}")
    if kv_c.shape[:2] != k_pe.shape[:2]:
        _fail(
            f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)} must agree in their leading "
            "two dimensions"
        )
    kv_len, rope_len = kv_c.shape[-1], k_pe.shape[-1]
    if kv_len < 1:
        _fail(f"kv_c's last dimension (L, the value width) must be >= 1, got {kv_len}")
    if q_dim != kv_len + rope_len:
        _fail(
            f"q's last dimension must be L+R = {kv_len}+{rope_len} = {kv_len + rope_len} "
            f"(the cache row width), got {q_dim}"
        )
    _check_index("cache_seqlens", cache_seqlens, 1, q.device)
    if cache_seqlens.shape[0] != batch:
        _fail(f"cache_seqlens must be [batch={batch}], got shape {tuple(cache_seqlens.shape)}")
    if block_table is None:
        if kv_c.shape[0] != batch:
            _fail(
                f"without block_table the cache must be [batch={batch}, T, D], got "
                f"{tuple(kv_c.shape)}"
            )
    else:
        _check_index("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            _fail(f"block_table must be [batch={batch}, max_pages], got {tuple(block_table.shape)}")
    _check_scale("softmax_scale", softmax_scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    _check_count("num_splits", num_splits, MAX_NUM_SPLITS)
    if total_splits is not None:
        _check_count("total_splits", total_splits, MAX_TOTAL_SPLITS, "an int or None")
    fp8 = FP8_CACHE_DTYPE in (kv_c.dtype, k_pe.dtype)
    if fp8 and kv_scale is None:
        raise TypeError("a float8_e4m3fn cache needs kv_scale (stored value x kv_scale = real)")
    if kv_scale is not None:
        if not fp8:
            _fail(f"kv_scale is for a float8_e4m3fn cache; this cache is {kv_c.dtype}")
        if q.dtype == torch.float64:
            raise TypeError("a float8 cache takes a bfloat16, float16 or float32 q, not float64")
        if not (math.isfinite(kv_scale) and 0 < kv_scale <= FLOAT32_MAX):
            _fail(f"kv_scale must be a positive finite float32 value, got {kv_scale}")
    if attn_mask is not None:
        _check_mask(attn_mask, q)


def _check_mask(attn_mask: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"attn_mask must be bool (True = visible) or floating (added to the scores), got "
            f"{attn_mask.dtype}"
        )
    batch, s_q = q.shape[:2]
    if attn_mask.dim() != 3 or tuple(attn_mask.shape[:2]) != (batch, s_q):
        _fail(
            f"attn_mask must be [batch={batch}, S_q={s_q}, T_m] (expand a broadcast mask first), "
            f"got shape {tuple(attn_mask.shape)}"
        )
    if attn_mask.device != q.device:
        _fail(f"attn_mask must be on {q.device} (q's device), got {attn_mask.device}")


def check_decode_values(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    causal: bool = True,
) -> None:
    """Value checks of ``mla::decode``: lengths against capacity (and S_q when causal: the
    lengths count the new tokens), page ids in range."""
    s_q = q.shape[1]
    lengths = cache_seqlens.long().cpu()
    if block_table is None:
        capacity = kv_c.shape[1]
        where = f"the cache length T={capacity}"
    else:
        page_size = kv_c.shape[1]
        capacity = block_table.shape[1] * page_size
        where = f"block_table capacity {block_table.shape[1]} pages x {page_size} = {capacity}"
    if bool((lengths < 0).any()):
        _fail(f"cache_seqlens must be >= 0, got {lengths.tolist()}")
    if bool((lengths > capacity).any()):
        _fail(f"cache_seqlens {lengths.tolist()} exceed {where} tokens")
    short = (lengths > 0) & (lengths < s_q)
    if causal and bool(short.any()):
        _fail(
            f"cache_seqlens counts the S_q={s_q} new tokens, so each non-empty sequence needs "
            f">= {s_q} tokens; got {lengths.tolist()}"
        )
    if block_table is not None:
        check_pages_in_use(block_table, lengths, kv_c.shape[0], kv_c.shape[1])


def check_pages_in_use(
    block_table: torch.Tensor, lengths: torch.Tensor, num_pages: int, page_size: int
) -> None:
    """Every page holding one of a sequence's first ``lengths`` tokens is a page id in
    ``[0, num_pages)`` (entries past a sequence's pages are never read, so they are free)."""
    if not block_table.numel():
        return
    lengths = lengths.long().cpu()
    pages_used = (lengths + page_size - 1) // page_size
    in_use = torch.arange(block_table.shape[1])[None, :] < pages_used[:, None]
    used_ids = block_table.long().cpu()[in_use]
    bad = (used_ids < 0) | (used_ids >= num_pages)
    if bool(bad.any()):
        _fail(
            f"block_table holds page ids outside [0, {num_pages}) for pages in use: "
            f"{sorted(set(used_ids[bad].tolist()))[:8]}"
        )


def _values_checked_on(device: torch.device) -> bool:
    return device.type != "cuda" or os.environ.get("MLA_OPS_CHECK_VALUES", "0") == "1"


def _check_decode(*args) -> None:
    """Every check of a real (non-fake) decode call (the op's arguments): metadata always, values
    where allowed."""
    check_decode_args(*args)
    q, kv_c, _, cache_seqlens, block_table, _, causal = args[:7]
    if _values_checked_on(q.device):
        check_decode_values(q, kv_c, cache_seqlens, block_table, causal)


# --- mla::decode -----------------------------------------------------------------------------


@torch.library.custom_op("mla::decode", mutates_args=())
def decode(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
    fill_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV MLA decode partials. See the module docstring for shapes."""
    args = (q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits, kv_scale,
            attn_mask, total_splits)  # fmt: skip
    _check_decode(*args)
    return reference.decode(*args)


@decode.register_kernel("cuda")
def _decode_cuda(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
    fill_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits, kv_scale,
            attn_mask, total_splits)  # fmt: skip
    _check_decode(*args)
    if q.dtype == torch.float64:
        # Triton passes float scalars (the scale) as fp32, which caps accuracy near 1e-8: float64
        # is a testing dtype, so it runs the PyTorch implementation on the GPU instead.
        log.debug("mla::decode: float64 on CUDA runs the PyTorch implementation")
        return reference.decode(*args)
    from . import runtime

    return runtime.decode(*args, fill_empty=fill_empty)


@decode.register_fake
def _decode_fake(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
    fill_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits, kv_scale,
            attn_mask, total_splits)  # fmt: skip
    check_decode_args(*args)
    batch, s_q, heads, _ = q.shape
    acc = reference.accumulation_dtype(q.dtype)
    out = q.new_empty((batch, s_q, heads, num_splits, kv_c.shape[-1]), dtype=acc)
    lse = q.new_empty((batch, s_q, heads, num_splits), dtype=acc)
    return out, lse


# --- mla::combine ----------------------------------------------------------------------------


def _check_out_dtype(out_dtype: torch.dtype | None) -> None:
    if out_dtype is not None and (
        not isinstance(out_dtype, torch.dtype) or out_dtype not in SUPPORTED_DTYPES
    ):
        raise TypeError(
            f"out_dtype must be None or one of {[str(d) for d in SUPPORTED_DTYPES]}, got "
            f"{out_dtype!r}"
        )


def check_combine_args(
    out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype | None = None
) -> None:
    """Shape and dtype checks of ``mla::combine``."""
    _check_out_dtype(out_dtype)
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
    if out_partial.dim() < 2:
        _fail(f"out_partial must be [..., splits, L], got shape {tuple(out_partial.shape)}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        _fail(
            f"lse_partial must be out_partial's shape without the last dimension, "
            f"{tuple(out_partial.shape[:-1])}, got {tuple(lse_partial.shape)}"
        )
    if out_partial.shape[-2] < 1:
        _fail("out_partial needs at least one split (dimension -2)")
    if lse_partial.device != out_partial.device:
        _fail(f"lse_partial must be on {out_partial.device}, got {lse_partial.device}")


@torch.library.custom_op("mla::combine", mutates_args=())
def combine(
    out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge over dimension -2 of ``out_partial``. See the module docstring for shapes."""
    check_combine_args(out_partial, lse_partial, out_dtype)
    return reference.combine(out_partial, lse_partial, out_dtype)


@combine.register_kernel("cuda")
def _combine_cuda(
    out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_combine_args(out_partial, lse_partial, out_dtype)
    from . import runtime

    return runtime.combine(out_partial, lse_partial, out_dtype)


@combine.register_fake
def _combine_fake(
    out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_combine_args(out_partial, lse_partial, out_dtype)
    out = out_partial.new_empty(
        (*out_partial.shape[:-2], out_partial.shape[-1]), dtype=out_dtype or out_partial.dtype
    )
    lse = out_partial.new_empty(
        out_partial.shape[:-2], dtype=reference.accumulation_dtype(out_partial.dtype)
    )
    return out, lse


# --- mla::attention --------------------------------------------------------------------------


@torch.library.custom_op("mla::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla::decode`` then ``mla::combine`` into q's dtype, as one op. See the module docstring."""
    args = (q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits, kv_scale,
            attn_mask, total_splits)  # fmt: skip
    _check_decode(*args)
    return reference.combine(*reference.decode(*args), q.dtype)


@attention.register_kernel("cuda")
def _attention_cuda(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits, kv_scale,
            attn_mask, total_splits)  # fmt: skip
    _check_decode(*args)
    if q.dtype == torch.float64:  # as mla::decode: the PyTorch implementation
        return reference.combine(*reference.decode(*args), q.dtype)
    from . import runtime

    return runtime.attention(*args)


@attention.register_fake
def _attention_fake(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_decode_args(q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                      kv_scale, attn_mask, total_splits)  # fmt: skip
    out = q.new_empty((*q.shape[:3], kv_c.shape[-1]))
    lse = q.new_empty(q.shape[:3], dtype=reference.accumulation_dtype(q.dtype))
    return out, lse


# --- mla::paged_rows --------------------------------------------------------------------------


def _check_paged_lengths(
    name: str, lengths: torch.Tensor, block_table: torch.Tensor, pool: torch.Tensor
) -> None:
    capacity = block_table.shape[1] * pool.shape[1]
    values = lengths.long().cpu()
    if bool(((values < 0) | (values > capacity)).any()):
        _fail(f"{name} must be in [0, {capacity}] (block_table's capacity), got {values.tolist()}")


def check_paged_rows_args(
    pool: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor
) -> None:
    """Shape, dtype and device checks of ``mla::paged_rows`` (metadata only)."""
    _check_floating("pool", pool)
    if pool.dim() != 3:
        _fail(f"pool must be [num_pages, page_size, D], got shape {tuple(pool.shape)}")
    _check_index("block_table", block_table, 2, pool.device)
    _check_index("cache_seqlens", cache_seqlens, 1, pool.device)
    if cache_seqlens.shape[0] != block_table.shape[0]:
        _fail(
            f"cache_seqlens must be [batch={block_table.shape[0]}] (block_table's rows), got "
            f"{tuple(cache_seqlens.shape)}"
        )


@torch.library.custom_op("mla::paged_rows", mutates_args=())
def paged_rows(
    pool: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor
) -> torch.Tensor:
    """Rows of a paged cache in token order: ``[B, max_pages * page_size, D]``, zero past each
    sequence's length (stale or unallocated pages are never read into the result).

    The dense view an unrewritten attention needs; one node that ``fx_passes`` recognises and
    replaces by ``mla_decode`` over the pages themselves.
    """
    check_paged_rows_args(pool, block_table, cache_seqlens)
    if _values_checked_on(pool.device):
        _check_paged_lengths("cache_seqlens", cache_seqlens, block_table, pool)
        check_pages_in_use(block_table, cache_seqlens, pool.shape[0], pool.shape[1])
    rows = reference.gather_rows(pool, cache_seqlens, block_table)  # [B, capacity, D]
    lengths = cache_seqlens.long()
    token = torch.arange(rows.shape[1], device=pool.device)
    beyond = token[None, :] >= lengths[:, None]  # [B, capacity]
    rows = rows.masked_fill(beyond[..., None], 0.0)
    # A sequence longer than the block table's capacity (a static cache appended past its end
    # under a compiled step, where no host check runs) has lost rows: all of its rows are NaN,
    # so the step's output shows it, as mla_decode's rows do, instead of drifting silently.
    overlong = lengths > block_table.shape[1] * pool.shape[1]  # [B]
    return rows.masked_fill(overlong[:, None, None], float("nan"))


@paged_rows.register_fake
def _paged_rows_fake(
    pool: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor
) -> torch.Tensor:
    check_paged_rows_args(pool, block_table, cache_seqlens)
    batch, max_pages = block_table.shape
    return pool.new_empty((batch, max_pages * pool.shape[1], pool.shape[2]))


# --- mla::paged_append ------------------------------------------------------------------------


@torch.library.custom_op("mla::paged_append", mutates_args=("pool", "cache_seqlens"))
def paged_append(
    pool: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, rows: torch.Tensor
) -> None:
    """Write ``rows [B, S, D]`` at token positions ``cache_seqlens .. cache_seqlens + S - 1`` of
    each sequence's pages, then add S to ``cache_seqlens``; in place, no host read.

    A position past the block table's capacity rewrites the sequence's last row instead: no write
    leaves the sequence's own pages (the caller checks the capacity where it can read lengths;
    ``mla_decode``'s value checks then report the overlong sequence).
    """
    check_paged_rows_args(pool, block_table, cache_seqlens)
    if rows.dim() != 3 or rows.shape[0] != block_table.shape[0] or rows.shape[2] != pool.shape[2]:
        _fail(
            f"rows must be [batch={block_table.shape[0]}, S, {pool.shape[2]}], got "
            f"{tuple(rows.shape)}"
        )
    page_size = pool.shape[1]
    capacity = block_table.shape[1] * page_size
    if _values_checked_on(pool.device):
        _check_paged_lengths("cache_seqlens", cache_seqlens, block_table, pool)
        # the pages the new rows land on (past the capacity: the sequence's last row)
        end = (cache_seqlens.long() + rows.shape[1]).clamp_max(capacity)
        check_pages_in_use(block_table, end, pool.shape[0], page_size)
    new = torch.arange(rows.shape[1], device=pool.device)
    positions = (cache_seqlens.long()[:, None] + new).clamp_max(capacity - 1)  # [B, S]
    pages = block_table.long().gather(1, positions // page_size)  # [B, S]
    slots = pages * page_size + positions % page_size  # [B, S] row in the pool
    flat = pool.view(-1, pool.shape[2])
    flat.index_copy_(0, slots.reshape(-1), rows.reshape(-1, rows.shape[2]).to(pool.dtype))
    cache_seqlens.add_(rows.shape[1])


@paged_append.register_fake
def _paged_append_fake(
    pool: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, rows: torch.Tensor
) -> None:
    check_paged_rows_args(pool, block_table, cache_seqlens)


# --- mla::paged_write -------------------------------------------------------------------------


@torch.library.custom_op("mla::paged_write", mutates_args=("pool",))
def paged_write(
    pool: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
) -> None:
    """Write ``rows [B, S, D]`` at the token positions ``positions [B, S]`` (int64) of each
    sequence's pages; in place, no host read, fixed shapes (compiles and captures in a CUDA
    graph). A negative position writes nothing the cache reads: its row lands in the pool's last
    page, which the caller keeps out of every block table (a scratch page). A position past the
    block table's capacity rewrites the sequence's last row, as ``mla::paged_append`` does.
    """
    _check_floating("pool", pool)
    if pool.dim() != 3 or pool.shape[0] < 2:
        _fail(f"pool must be [num_pages >= 2, page_size, D] (its last page is scratch), got "
              f"shape {tuple(pool.shape)}")  # fmt: skip
    _check_index("block_table", block_table, 2, pool.device)
    if rows.dim() != 3 or rows.shape[0] != block_table.shape[0] or rows.shape[2] != pool.shape[2]:
        _fail(
            f"rows must be [batch={block_table.shape[0]}, S, {pool.shape[2]}], got "
            f"{tuple(rows.shape)}"
        )
    if positions.dtype != torch.int64 or tuple(positions.shape) != tuple(rows.shape[:2]):
        _fail(f"positions must be int64 [{rows.shape[0]}, {rows.shape[1]}], got {positions.dtype} "
              f"{tuple(positions.shape)}")  # fmt: skip
    page_size, scratch = pool.shape[1], pool.shape[0] - 1
    capacity = block_table.shape[1] * page_size
    if _values_checked_on(pool.device) and bool((block_table == scratch).any()):
        _fail(f"block_table uses page {scratch}, the pool's last page, which paged_write keeps "
              "for the rows it does not write")  # fmt: skip
    written = positions >= 0
    clamped = positions.clamp(0, capacity - 1)
    pages = block_table.long().gather(1, clamped // page_size)  # [B, S]
    slots = torch.where(written, pages * page_size + clamped % page_size, scratch * page_size)
    flat = pool.view(-1, pool.shape[2])
    flat.index_copy_(0, slots.reshape(-1), rows.reshape(-1, rows.shape[2]).to(pool.dtype))


@paged_write.register_fake
def _paged_write_fake(
    pool: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
) -> None:
    return None


# --- mla::expanded_kv_update: a marker for fx_passes --------------------------------------------


@torch.library.custom_op("mla::expanded_kv_update", mutates_args=())
def expanded_kv_update(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a latent cache receives from attention that caches expanded K/V (transformers
    <= 5.14): the new ``key_states [B, H, S, P+R]`` and ``value_states [B, H, S, V]``, which
    the cache cannot store as latents. It only exists in a traced graph, where ``fx_passes``
    replaces it by a latent append and a re-expansion of the cache (``[B, H, capacity, .]``);
    running it means the graph was not rewritten.
    """
    raise RuntimeError(
        "mla::expanded_kv_update ran un-rewritten: an MLACache under torch.compile with "
        "transformers < 5.15 needs backend='mla' (or 'mla_eager'), whose rewrite stores latents"
    )


@expanded_kv_update.register_fake
def _expanded_kv_update_fake(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads = key_states.shape[:2]
    capacity = block_table.shape[1] * pool.shape[1]
    keys = key_states.new_empty((batch, heads, capacity, key_states.shape[-1]))
    values = value_states.new_empty((batch, heads, capacity, value_states.shape[-1]))
    return keys, values


# --- public wrappers -------------------------------------------------------------------------


def split_kv_cache(kv_cache: KVCache, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_c, k_pe)`` views of a cache given as one ``[..., L+R]`` tensor or a pair. No copy."""
    if not isinstance(head_dim_v, int) or isinstance(head_dim_v, bool) or head_dim_v < 1:
        _fail(f"head_dim_v must be a positive int, got {head_dim_v!r}")
    if isinstance(kv_cache, torch.Tensor):
        _check_floating("kv_cache", kv_cache, allow_fp8=True)
        if kv_cache.dim() != 3:
            _fail(
                "kv_cache must be [num_pages, page_size, L+R] (with block_table) or "
                f"[batch, T, L+R], got shape {tuple(kv_cache.shape)}"
            )
        if head_dim_v > kv_cache.shape[-1]:
            _fail(
                f"head_dim_v={head_dim_v} is larger than the cache row ({kv_cache.shape[-1]} "
                "values)"
            )
        return kv_cache[..., :head_dim_v], kv_cache[..., head_dim_v:]
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        kv_c, k_pe = kv_cache
        _check_floating("kv_cache[0] (kv_c)", kv_c, allow_fp8=True)
        _check_floating("kv_cache[1] (k_pe)", k_pe, allow_fp8=True)
        if kv_c.shape[-1] != head_dim_v:
            _fail(
                f"head_dim_v={head_dim_v} must equal kv_c's last dimension ({kv_c.shape[-1]}) "
                "when kv_cache is a (kv_c, k_pe) pair: the value is all of kv_c"
            )
        return kv_c, k_pe
    raise TypeError(
        "kv_cache must be a tensor [..., L+R] or a pair (kv_c [..., L], k_pe [..., R]), got "
        f"{type(kv_cache).__name__}"
    )


def mla_decode(
    q: torch.Tensor,
    kv_cache: KVCache,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool = True,
    num_splits: int | None = None,
    kv_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    total_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head latent attention decode over a (paged) latent cache.

    Args:
        q: ``[B, S_q, H, L+R]`` absorbed query: ``q_nope @ W_UK`` concatenated with roped ``q_pe``.
        kv_cache: paged ``[num_pages, page_size, L+R]`` when ``block_table`` is given, else
            ``[B, T, L+R]``; or a pair ``(kv_c [..., L], k_pe [..., R])``. Any strides, no copy.
        cache_seqlens: ``[B]`` int32, valid cached tokens per sequence, the S_q new ones included.
        block_table: ``[B, max_pages]`` int32 page ids into ``kv_cache``.
        head_dim_v: L, the value width: the value is ``kv_cache[..., :head_dim_v]``.
        softmax_scale: applied to the scores; DeepSeek's is ``(P+R)**-0.5 * mscale**2``.
        causal: query i of S_q sees keys ``[0, cache_seqlens - S_q + i]``.
        num_splits: split-KV chunks per sequence, each ``ceil(len / num_splits)`` tokens rounded
            up (``planner.split_bounds``); ``None`` lets the planner choose the number and also
            balance a ragged batch (chunks of one length across the batch, ``plan_splits``).
        total_splits: with it, chunks are about ``sum(cache_seqlens) / total_splits`` tokens for
            every sequence (no sequence cut into more than ``num_splits``), so that a ragged
            batch balances; ``None`` with ``num_splits=None``: the planner's.
        kv_scale: dequantisation scale of a ``float8_e4m3fn`` cache (real = stored x kv_scale),
            one per tensor; required for fp8, rejected otherwise. In the pair form k_pe may stay
            in q's dtype (unscaled) while kv_c is fp8. See ``quantize_kv_fp8``.
        attn_mask: optional ``[B, S_q, T_m]`` (or broadcastable to it, e.g. ``[B, 1, T_m]``) over
            token positions ``0 .. T_m-1`` of each sequence, shared by all heads: bool (True =
            visible, as in SDPA) or floating (added to the scaled scores, as Hugging Face's eager
            masks are). Keys at ``T_m`` and past are hidden. It combines with ``cache_seqlens``
            and ``causal``; it is how left padding is expressed. A row with no visible key gives
            zeros and ``-inf``.

    Returns:
        ``out [B, S_q, H, L]`` in q's dtype and ``lse [B, S_q, H]`` (natural log; float32, or
        float64 for float64 inputs). A sequence with no cached tokens gives zeros and ``-inf``.
    """
    kv_c, k_pe = split_kv_cache(kv_cache, head_dim_v)
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() == 3 and q.dim() == 4:
        with contextlib.suppress(RuntimeError):  # not broadcastable: the check names the shapes
            attn_mask = attn_mask.expand(q.shape[0], q.shape[1], attn_mask.shape[-1])
    _check_scale("softmax_scale", softmax_scale)
    check_decode_args(
        q,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table,
        softmax_scale,
        causal,
        1 if num_splits is None else num_splits,
        None if kv_scale is None else float(kv_scale),
        attn_mask,
        total_splits,
    )
    if num_splits is None:
        plan = default_splits(q, kv_c, k_pe, block_table, attn_mask)
        num_splits = plan.num_splits
        total_splits = plan.total_splits if total_splits is None else total_splits
    return torch.ops.mla.attention(
        q,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table,
        float(softmax_scale),
        causal,
        num_splits,
        None if kv_scale is None else float(kv_scale),
        attn_mask,
        total_splits,
    )


def quantize_kv_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-tensor float8 e4m3 quantisation of a latent cache: ``(kv_fp8, kv_scale)``.

    ``kv_fp8 * kv_scale`` approximates ``kv``; pass both to ``mla_decode``. Reads the amax back to
    the host (one sync): meant for filling a cache, not for the decode step.
    """
    amax = kv.abs().amax().float().item()
    scale = max(amax, 1e-12) / torch.finfo(FP8_CACHE_DTYPE).max
    return (kv.float() / scale).to(FP8_CACHE_DTYPE), scale


def mla_combine(
    out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention states by their log-sum-exp.

    Args:
        out_partial: ``[..., S, L]`` normalized partial outputs (float32/float64).
        lse_partial: ``[..., S]`` their log-sum-exps (natural log); ``-inf`` marks an empty state.
        out_dtype: dtype of ``out``; defaults to ``out_partial``'s.

    Returns:
        ``out [..., L]`` and ``lse [...]``; rows whose states are all empty give zeros and ``-inf``.
    """
    _check_out_dtype(out_dtype)  # before the schema, which would take an int as a dtype
    return torch.ops.mla.combine(out_partial, lse_partial, out_dtype)
