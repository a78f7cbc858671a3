"""The host side of the Hopper kernel: ``prepare`` turns a plan's configuration into a
``PreparedLaunch`` (grid, strides and constexprs fixed; it reads no tensor data, so one serves
every call of a signature), ``launch_data`` fills each call's tensors, TMA descriptors and float
scalars. ``launch`` does both (tests and tools call it directly)."""

from __future__ import annotations

import functools
import inspect

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..launcher import Data, PreparedLaunch
from ..tiling import (
    _can_rank,
    default_float8_products,
    default_longest_first,
    default_producer_warps,
    default_query_in_registers,
    default_rows_on_m,
)
from .kernel import _mla_decode_wgmma_kernel
from .layouts import BLOCK_N, GATHER_CHUNK, LONGEST_FIRST_MAX_SPLITS

_GL_DTYPES = {
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float8_e4m3fn: gl.float8e4nv,
}


# Registers per thread of a one-scorer program's warpgroup 1 (launch(one_scorer=True)): its half
# of the output is 128 float32 per thread.
ASSIST_REGS = 232


# Registers per thread of such a program's warpgroup 1: 448 columns of output, 224 float32.
PV_REGS = 256


# Registers per thread of the producer partition (setmaxnreg; a multiple of 8 from 24): TMA
# issue is a few scalars, a gather holds its row addresses. (TMA, gather)
PRODUCER_REGS = (40, 88)


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
        arg["gather"], merge_into=arg["merge_into"],
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
        "kv_desc": kv_desc,
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
        if (
            rows_on_m
            or block_m != 64
            or num_warps != 4
            or num_stages not in (2, 3)
            or gather
            or float8
        ):
            raise ValueError(
                "one_scorer: expected block_m=64, num_warps=4, num_stages=2 (3 with the query in "
                "registers), rows_on_m not set, "
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
    elif one_scorer and num_stages != 2:
        raise ValueError(
            f"one_scorer: num_stages must be 2 without the query in registers, got {num_stages}"
        )
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
    names = ("q", "cache_seqlens", "block_table", "out", "lse", "final_out", "final_lse",
             "arrivals", "kv_desc", "pe_desc", "kv_c", "pe", "mask")  # fmt: skip
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
        LONGEST_FIRST=longest_first,
        HAS_MASK=attn_mask is not None,
        MASK_IS_BOOL=attn_mask is not None and attn_mask.dtype == torch.bool,
        QUERY_IN_REGISTERS=query_in_registers,
        PV_REGS=PV_REGS,
        num_warps=num_warps,
    )
    return PreparedLaunch(_mla_decode_wgmma_kernel, grid, args, constexprs)
