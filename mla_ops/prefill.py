"""``mla::prefill``: MLA attention of a long query over the latent cache in bounded memory.

The un-absorbed form is the cheaper one for prefill (it amortises the ``kv_b_proj`` up-projection
over many query tokens and runs dense attention), but written the Hugging Face way it expands every
cached token to per-head keys and values at once: ``B x T x H x (P+R+V)`` values per layer, the
peak of a long prompt. This op computes the same attention chunk by chunk over the keys::

    for each chunk of C cached tokens (up to the longest sequence):
        rows       = [kv_c | k_pe] of the chunk                    # [B, C, L+R], read in place
        k, v       = up-project rows[..., :L] with kv_b_proj       # [B, H, C, P+R], [B, H, C, V]
        o_c, lse_c = attention(q, k, v, the chunk's mask)          # a fused kernel with its LSE
        o, lse     = LSE merge of (o, lse) and (o_c, lse_c)        # float32 accumulators

so the working memory is one chunk's keys, values and mask columns, sized by ``plan_prefill``, not
the context. Queries are ``[B, H, S, P+R]`` as the original attention takes them; the outputs are
what it returned, ``[B, H, S, V]`` in q's dtype, and the LSE ``[B, H, S]`` (float32; float64 for
float64).

Visibility: keys at and past ``cache_seqlens[b]`` are hidden (a static cache's unused rows are
never read: the chunks stop at the longest sequence), and ``attn_mask`` hides more: bool (True =
visible) or floating (added to the scaled scores; at or below ``reference.MASK_HIDDEN``: hidden,
the rule of ``mla::decode``). A query row that sees no key gets zeros and ``lse = -inf``.

Kernels (``plan_prefill``): on CUDA, one chunk whose LSE is not wanted (the rewrite's case) runs
``scaled_dot_product_attention`` itself, which picks the kernel it picks for the original (cuDNN
on an H100); several chunks run cuDNN attention with its LSE in bfloat16 and float16, and
memory-efficient attention in float32. On CPU, the flash kernel with its LSE. float64 on CUDA,
other devices and head dims that are not multiples of 16 run plain matmul-softmax-matmul over the
chunk. ``LAST_PLAN["prefill"]`` (a ``PrefillPlan``) says what the
latest call did and why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import reference
from .ops import (
    _check_floating,
    _check_index,
    _check_scale,
    _fail,
    _values_checked_on,
    check_pages_in_use,
)
from .splits import log

# Working memory of one key chunk that ``plan_prefill`` aims for: the chunk's expanded keys and
# values and its bias columns. A chunk of this size keeps an H100 busy (2k-4k keys against
# 16 x 8k queries) and is small beside a long context's expanded K/V.
DEFAULT_CHUNK_BYTES = 1 << 30
# Chunks are whole multiples of this many tokens: the memory-efficient kernel wants bias rows
# aligned to 16 elements.
CHUNK_GRANULE = 16
# What the memory-efficient CUDA kernel takes: these dtypes, head dims a multiple of 8.
_EFFICIENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Per-chunk attention kernels: public SDPA (one chunk, no LSE), cuDNN and memory-efficient
# attention with their LSE (CUDA), flash attention with its LSE (CPU), and plain matmuls.
KERNELS = ("sdpa", "cudnn", "efficient", "flash_cpu", "math")

# The latest call's plan, under "prefill" (diagnostics, as runtime.LAST_LAUNCH for decode).
LAST_PLAN: dict[str, PrefillPlan] = {}


@dataclass(frozen=True)
class PrefillPlan:
    """Every decision of one ``mla::prefill`` call, with the reasons (``plan_prefill``)."""

    chunk_tokens: int  # keys per chunk
    num_chunks: int  # chunks over the keys read
    keys_read: int  # the keys the chunks cover: the longest sequence, or the capacity
    kernel: str  # one of KERNELS
    chunk_bytes: int  # working memory of one chunk: keys, values, bias (and scores for "math")
    reasons: tuple[tuple[str, str], ...]

    def why(self, decision: str) -> str:
        """The reason for ``decision`` ("kernel", "chunk" or "keys")."""
        return dict(self.reasons)[decision]

    def describe(self) -> str:
        lines = [
            f"mla::prefill: {self.num_chunks} chunk(s) of {self.chunk_tokens} keys over "
            f"{self.keys_read}, kernel {self.kernel}, {self.chunk_bytes / 2**20:.1f} MiB a chunk"
        ]
        lines += [f"  {decision}: {reason}" for decision, reason in self.reasons]
        return "\n".join(lines)


def plan_prefill(
    *,
    batch: int,
    heads: int,
    q_len: int,
    nope_dim: int,
    rope_dim: int,
    v_dim: int,
    dtype: torch.dtype,
    device_type: str,
    keys_read: int,
    page_size: int = 1,
    chunk_tokens: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    need_lse: bool = True,
    kernel: str = "",
) -> PrefillPlan:
    """Plan one ``mla::prefill`` call from its shapes (no tensor values).

    ``keys_read``: the keys to cover (the longest sequence). ``chunk_tokens > 0`` fixes the chunk
    (rounded up to a whole number of pages and of ``CHUNK_GRANULE``); 0 takes the most keys whose
    working memory fits ``chunk_bytes`` (at least one granule). ``kernel`` (one of ``KERNELS``)
    overrides the choice where it can run; ``""`` is the planner's.
    """
    if kernel not in ("", *KERNELS):
        raise ValueError(f"kernel must be one of {KERNELS} or '' (the planner's), got {kernel!r}")
    reasons = []
    # The fused CUDA kernels' head dims: multiples of 16 up to 256 (a 16 x 8 problem gave the
    # cuDNN kernel a misaligned address on an H100).
    fused = (nope_dim + rope_dim) % 16 == 0 and v_dim % 16 == 0 and nope_dim + rope_dim <= 256
    on_cuda = device_type == "cuda" and dtype in _EFFICIENT_DTYPES
    itemsize = torch.empty((), dtype=dtype).element_size()
    expanded = heads * (nope_dim + v_dim) + heads * (nope_dim + rope_dim)  # [k_nope|v], keys
    per_key = batch * (expanded + q_len) * itemsize  # plus one bias column of the [B, S] rows
    plain = device_type != "cpu" and not (on_cuda and fused)
    if plain or kernel == "math":  # the scores and probabilities, in the accumulation dtype
        acc = reference.accumulation_dtype(dtype)
        per_key += 2 * batch * heads * q_len * torch.empty((), dtype=acc).element_size()
    unit = math.lcm(CHUNK_GRANULE, page_size)
    if chunk_tokens > 0:
        chunk = -(-chunk_tokens // unit) * unit
        reasons.append(("chunk", f"given: {chunk_tokens} keys, rounded up to {unit}"))
    else:
        chunk = max(unit, chunk_bytes // max(per_key, 1) // unit * unit)
        reasons.append(
            (
                "chunk",
                f"the most keys whose working memory ({per_key} B a key) fits "
                f"{chunk_bytes / 2**20:.0f} MiB, in whole multiples of {unit}",
            )
        )
    if keys_read <= chunk:  # one chunk covers everything: no wider than needed
        chunk = max(unit, -(-keys_read // unit) * unit)
    num_chunks = -(-keys_read // chunk)

    if kernel:
        runs = {
            "sdpa": num_chunks <= 1 and not need_lse,
            "cudnn": on_cuda and fused,
            "efficient": on_cuda and fused,
            "flash_cpu": device_type == "cpu",
            "math": True,
        }
        if not runs[kernel]:
            raise ValueError(
                f"attention_kernel={kernel!r} cannot run this call ({device_type}, {dtype}, head "
                f"dims {nope_dim + rope_dim} and {v_dim}, {num_chunks} chunk(s), need_lse="
                f"{need_lse}): 'sdpa' takes one chunk without LSE, 'cudnn' and 'efficient' CUDA "
                "with head dims multiples of 16 up to 256, 'flash_cpu' CPU"
            )
        reasons.append(("kernel", "given"))
    elif on_cuda and fused and num_chunks <= 1 and not need_lse:
        kernel = "sdpa"
        reasons.append(
            (
                "kernel",
                "one chunk and no LSE wanted: scaled_dot_product_attention, whose kernel "
                "PyTorch picks as for the original",
            )
        )
    elif on_cuda and fused and dtype != torch.float32:
        kernel = "cudnn"
        reasons.append(("kernel", "CUDA: PyTorch's cuDNN attention, which returns its LSE"))
    elif on_cuda and fused:
        kernel = "efficient"
        reasons.append(
            (
                "kernel",
                "CUDA float32: PyTorch's memory-efficient attention with its LSE (cuDNN's "
                "float32 results missed float32 tolerances on an H100)",
            )
        )
    elif device_type == "cpu":
        kernel = "flash_cpu"
        reasons.append(("kernel", "CPU: PyTorch's flash attention kernel with its LSE"))
    else:
        kernel = "math"
        why = (
            "float64 is a testing dtype"
            if dtype == torch.float64
            else f"head dims {nope_dim + rope_dim} and {v_dim} (the fused CUDA kernels take "
            "multiples of 16 up to 256)"
            if on_cuda
            else f"on {device_type}"
        )
        reasons.append(("kernel", f"{why}: matmul-softmax-matmul over each chunk"))
    return PrefillPlan(
        chunk_tokens=chunk,
        num_chunks=num_chunks,
        keys_read=keys_read,
        kernel=kernel,
        chunk_bytes=chunk * per_key,
        reasons=tuple(reasons),
    )


# --- argument checks ---------------------------------------------------------------------------


def check_prefill_args(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    chunk_tokens: int,
) -> tuple[int, int]:
    """Shape, dtype and device checks of ``mla::prefill`` (metadata only); returns
    ``(v_dim, capacity)``."""
    _check_floating("q", q)
    if q.dim() != 4:
        _fail(f"q must be [batch, heads, S, P+R], got shape {tuple(q.shape)}")
    batch, heads, q_len, q_dim = q.shape
    layout = "[num_pages, page_size, D]" if block_table is not None else "[batch, T, D]"
    for name, part in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_b_weight", kv_b_weight)):
        _check_floating(name, part)
        if part.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {part.dtype}")
        if part.device != q.device:
            _fail(f"{name} must be on {q.device} (q's device), got {part.device}")
        if name != "kv_b_weight" and part.dim() != 3:
            _fail(f"{name} must be {layout}, got shape {tuple(part.shape)}")
    if kv_c.shape[:2] != k_pe.shape[:2]:
        _fail(
            f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)} must agree in their "
            "leading two dimensions"
        )
    if isinstance(nope_dim, bool) or not isinstance(nope_dim, int):
        raise TypeError(f"nope_dim must be an int, got {type(nope_dim).__name__}")
    rope_dim = k_pe.shape[-1]
    if nope_dim < 1 or nope_dim + rope_dim != q_dim:
        _fail(
            f"q's last dimension {q_dim} must be nope_dim + k_pe's {rope_dim} with nope_dim "
            f">= 1, got nope_dim={nope_dim}"
        )
    kv_lora_rank = kv_c.shape[-1]
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[1] != kv_lora_rank:
        _fail(
            f"kv_b_weight must be [heads * (P+V), L={kv_lora_rank}], got shape "
            f"{tuple(kv_b_weight.shape)}"
        )
    rows = kv_b_weight.shape[0]
    if heads == 0 or rows % heads or rows // heads <= nope_dim:
        _fail(
            f"kv_b_weight's {rows} rows must be heads={heads} x (nope_dim={nope_dim} + V) "
            "with V >= 1"
        )
    v_dim = rows // heads - nope_dim
    _check_index("cache_seqlens", cache_seqlens, 1, q.device)
    if cache_seqlens.shape[0] != batch:
        _fail(f"cache_seqlens must be [batch={batch}], got {tuple(cache_seqlens.shape)}")
    if block_table is None:
        if kv_c.shape[0] != batch:
            _fail(
                f"kv_c must be [batch={batch}, T, L] without a block_table, got {tuple(kv_c.shape)}"
            )
        capacity = kv_c.shape[1]
    else:
        _check_index("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            _fail(f"block_table must be [batch={batch}, max_pages], got {tuple(block_table.shape)}")
        capacity = block_table.shape[1] * kv_c.shape[1]
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(
                f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
            )
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool or floating, got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            _fail(f"attn_mask must be on {q.device} (q's device), got {attn_mask.device}")
        shape = tuple(attn_mask.shape)
        if (
            attn_mask.dim() != 4
            or shape[0] not in (1, batch)
            or shape[1] not in (1, heads)
            or shape[2] not in (1, q_len)
        ):
            _fail(
                f"attn_mask must be [batch={batch} or 1, heads={heads} or 1, S={q_len} or 1, "
                f"T], got shape {shape}"
            )
    _check_scale("softmax_scale", softmax_scale)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
        _fail(f"chunk_tokens must be an int >= 0 (0: the planner's choice), got {chunk_tokens!r}")
    return v_dim, capacity


# --- mla::prefill ------------------------------------------------------------------------------


@torch.library.custom_op("mla::prefill", mutates_args=())
def prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    chunk_tokens: int = 0,
    need_lse: bool = True,
    attention_kernel: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked un-absorbed MLA attention over the latent cache. See the module docstring.

    Args:
        q: ``[B, H, S, P+R]`` (``q_nope`` then the roped ``q_pe``).
        kv_c, k_pe: the cache's latent ``[.., L]`` and rope key ``[.., R]`` parts, as
            ``[num_pages, page_size, .]`` with ``block_table [B, max_pages]`` (int32), else
            ``[B, T, .]``.
        cache_seqlens: ``[B]`` int32, the tokens each sequence holds.
        kv_b_weight: ``kv_b_proj.weight`` ``[H * (P+V), L]``.
        attn_mask: ``[B|1, H|1, S|1, T_m]`` over token positions, or None.
        chunk_tokens: keys per chunk; 0 lets ``plan_prefill`` choose.
        need_lse: ``False`` allows a kernel that gives no LSE (``lse`` is then empty).
        attention_kernel: one of ``KERNELS`` to override the planner's choice; ``""``: the
            planner's.

    Returns:
        ``out [B, H, S, V]`` (contiguous) in q's dtype and ``lse [B, H, S]`` (``[0]`` when
        ``need_lse`` is False).
    """
    v_dim, capacity = check_prefill_args(
        q,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table,
        kv_b_weight,
        attn_mask,
        softmax_scale,
        nope_dim,
        chunk_tokens,
    )
    keys_read, keys_reason = _keys_read(cache_seqlens, capacity)
    if block_table is not None and _values_checked_on(q.device):
        check_pages_in_use(block_table, cache_seqlens, kv_c.shape[0], kv_c.shape[1])
    batch, heads, q_len, q_dim = q.shape
    plan = plan_prefill(
        batch=batch,
        heads=heads,
        q_len=q_len,
        nope_dim=nope_dim,
        rope_dim=q_dim - nope_dim,
        v_dim=v_dim,
        dtype=q.dtype,
        device_type=q.device.type,
        keys_read=keys_read,
        page_size=kv_c.shape[1] if block_table is not None else 1,
        chunk_tokens=chunk_tokens,
        need_lse=need_lse,
        kernel=attention_kernel,
    )
    plan = dataclasses.replace(plan, reasons=(*plan.reasons, ("keys", keys_reason)))
    LAST_PLAN["prefill"] = plan
    log.debug("%s", plan.describe())
    out, lse = _run(
        plan,
        q,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table,
        kv_b_weight,
        attn_mask,
        softmax_scale,
        nope_dim,
        v_dim,
    )
    if not need_lse:
        lse = out.new_empty(0, dtype=reference.accumulation_dtype(q.dtype))
    return out.contiguous(), lse.contiguous()  # the fake function's strides


@prefill.register_fake
def _prefill_fake(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    chunk_tokens: int = 0,
    need_lse: bool = True,
    attention_kernel: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    v_dim, _ = check_prefill_args(
        q,
        kv_c,
        k_pe,
        cache_seqlens,
        block_table,
        kv_b_weight,
        attn_mask,
        softmax_scale,
        nope_dim,
        chunk_tokens,
    )
    batch, heads, q_len, _ = q.shape
    out = q.new_empty((batch, heads, q_len, v_dim))
    acc = reference.accumulation_dtype(q.dtype)
    lse = q.new_empty((batch, heads, q_len) if need_lse else (0,), dtype=acc)
    return out, lse


def _keys_read(cache_seqlens: torch.Tensor, capacity: int) -> tuple[int, str]:
    """How many key positions the chunks cover, and why: the longest sequence (a host read of
    the lengths, checked against the capacity), or the capacity while a CUDA graph is captured
    (no host read there; rows past each length stay hidden)."""
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return capacity, "CUDA graph capture: no host read, the chunks cover the capacity"
    lengths = cache_seqlens.long().cpu()
    if lengths.numel() and bool(((lengths < 0) | (lengths > capacity)).any()):
        _fail(
            f"cache_seqlens must be in [0, {capacity}] (the cache's capacity), got "
            f"{lengths.tolist()}"
        )
    longest = int(lengths.max()) if lengths.numel() else 0
    return longest, f"the longest sequence ({longest} of {capacity} positions)"


def _run(
    plan: PrefillPlan,
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_b_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    softmax_scale: float,
    nope_dim: int,
    v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunks' attention, merged: ``(out, lse)``; lse None from the "sdpa" kernel."""
    batch, heads, q_len, _ = q.shape
    acc = reference.accumulation_dtype(q.dtype)
    lengths = cache_seqlens.long()
    if plan.num_chunks == 0:  # no sequence holds a key
        out = q.new_zeros((batch, heads, q_len, v_dim))
        return out, q.new_full((batch, heads, q_len), float("-inf"), dtype=acc)
    out = lse = None  # the first chunk's, then the merged state
    merged = None  # float accumulators once a second chunk arrives
    for start in range(0, plan.keys_read, plan.chunk_tokens):
        end = min(start + plan.chunk_tokens, plan.keys_read)
        token = torch.arange(start, end, device=q.device)  # [C]
        stored = token[None, :] < lengths[:, None]  # [B, C]
        latent = reference.gather_rows(kv_c, cache_seqlens, block_table, start, end)
        rope = reference.gather_rows(k_pe, cache_seqlens, block_table, start, end)
        # Rows past a sequence's end are stale memory (maybe NaN): 0 * NaN would leak.
        latent = latent.masked_fill(~stored[..., None], 0.0)  # [B, C, L]
        rope = rope.masked_fill(~stored[..., None], 0.0)  # [B, C, R]
        keys, values = _expand(latent, rope, kv_b_weight, heads, nope_dim)
        visible, mask_values = _chunk_mask(attn_mask, stored, start, end)
        out_c, lse_c = _attend(plan.kernel, q, keys, values, visible, mask_values, softmax_scale)
        seen = visible.any(dim=-1).expand(batch, heads, q_len)  # the row sees a key here
        out_c = torch.where(seen[..., None], out_c, 0.0)
        if lse_c is None:  # "sdpa": one chunk, no LSE wanted
            return out_c, None
        lse_c = torch.where(seen, lse_c.to(acc), float("-inf"))
        if start == 0:
            out, lse = out_c.to(q.dtype), lse_c
            continue
        if merged is None:
            merged = out.to(acc)
        new_lse = torch.logaddexp(lse, lse_c)
        shift = torch.where(torch.isneginf(new_lse), 0.0, new_lse)  # no key yet: weights 0
        merged.mul_(torch.exp(lse - shift)[..., None])
        merged.addcmul_(out_c.to(acc), torch.exp(lse_c - shift)[..., None])
        lse = new_lse
    if merged is not None:
        out = merged.to(q.dtype)
    return out, lse


def _expand(
    latent: torch.Tensor, rope: torch.Tensor, kv_b_weight: torch.Tensor, heads: int, nope_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's per-head keys ``[B, H, C, P+R]`` and values ``[B, H, C, V]``."""
    batch, chunk, _ = latent.shape
    kv = torch.nn.functional.linear(latent, kv_b_weight).view(batch, chunk, heads, -1)
    rope_heads = rope[:, :, None, :].expand(batch, chunk, heads, rope.shape[-1])
    keys = torch.cat([kv[..., :nope_dim], rope_heads], dim=-1).transpose(1, 2)
    return keys, kv[..., nope_dim:].transpose(1, 2)


def _chunk_mask(
    attn_mask: torch.Tensor | None, stored: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which keys ``start .. end - 1`` each query row sees, ``[B, H|1, S|1, C]`` bool, and the
    float mask's values over them (None for a bool mask or none)."""
    width = stored.shape[1]
    visible = stored[:, None, None, :]  # [B, 1, 1, C]
    if attn_mask is None:
        return visible, None
    taken = attn_mask[..., start:end]
    if taken.shape[-1] < width:  # positions past the mask: hidden
        fill = False if taken.dtype == torch.bool else float("-inf")
        taken = torch.nn.functional.pad(taken, (0, width - taken.shape[-1]), value=fill)
    if taken.dtype == torch.bool:
        return visible & taken, None
    return visible & (taken > reference.mask_hidden_threshold(taken.dtype)), taken


def _bias(visible: torch.Tensor, values: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive bias ``[.., C]``: the mask's value (or 0) where visible, -inf where hidden;
    rows allocated 16-aligned (the fused CUDA kernels' requirement), sliced to the chunk."""
    width = visible.shape[-1]
    padded = -(-width // CHUNK_GRANULE) * CHUNK_GRANULE
    bias = torch.empty((*visible.shape[:-1], padded), dtype=dtype, device=visible.device)
    bias = bias[..., :width]
    if values is None:
        bias.zero_()
    else:
        bias.copy_(values)
    return bias.masked_fill_(~visible, float("-inf"))


def _attend(
    kernel: str,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    mask_values: torch.Tensor | None,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q [B, H, S, P+R]`` over one chunk: ``(out [B, H, S, V], lse [B, H, S])``
    (lse None for "sdpa"). Rows that see no key are fixed by the caller."""
    batch, heads, q_len, _ = q.shape
    width = visible.shape[-1]
    if kernel == "sdpa":  # the bool mask as the original passed it, when there is no float one
        mask = visible if mask_values is None else _bias(visible, mask_values, q.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=softmax_scale
        )
        return out, None
    acc = reference.accumulation_dtype(q.dtype)
    bias = _bias(visible, mask_values, q.dtype if kernel != "math" else acc)
    full_bias = bias.expand(batch, heads, q_len, width)
    if kernel == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, keys, values, full_bias, True, 0.0, False, False, scale=softmax_scale
        )[:2]
        return out, lse.reshape(batch, heads, -1)[..., :q_len]
    if kernel == "efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, keys, values, full_bias, True, 0.0, False, scale=softmax_scale
        )[:2]
        return out, lse[..., :q_len]
    if kernel == "flash_cpu":
        # The CPU kernel wants one head size for queries, keys and values: pad with zeros.
        size = max(q.shape[-1], values.shape[-1])
        pad = (0, size - q.shape[-1])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            torch.nn.functional.pad(q, pad),
            torch.nn.functional.pad(keys, pad),
            torch.nn.functional.pad(values, (0, size - values.shape[-1])),
            attn_mask=full_bias,
            scale=softmax_scale,
        )
        return out[..., : values.shape[-1]], lse
    scores = torch.matmul(q.to(acc), keys.to(acc).transpose(-1, -2)) * softmax_scale + bias
    row_max = scores.amax(dim=-1, keepdim=True)  # [B, H, S, 1]
    probs = torch.exp(scores - torch.where(torch.isneginf(row_max), 0.0, row_max))
    total = probs.sum(dim=-1)  # [B, H, S]
    probs = probs / torch.where(total == 0, 1.0, total)[..., None]
    out = torch.matmul(probs, values.to(acc)).to(q.dtype)
    return out, row_max.squeeze(-1) + torch.log(total)
