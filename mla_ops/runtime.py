"""Launching plans: ``mla::decode``, ``mla::combine`` and ``mla::attention`` on CUDA.

The planner (``planner.plan_decode``) decides; this module only prepares each kernel's launch
once per call signature (``launcher.PreparedLaunch``: grid, constexprs and strides fixed, each
call's tensors filled in) and launches it. ``LAST_LAUNCH`` records the latest launch: its plan's
``record``, the compiled kernel and how the launch went.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import device
from .launcher import Data, PreparedLaunch
from .plan_cache import PlanCache
from .planner import (
    DEFAULT_OPTIONS,
    DecodeOptions,
    DecodePlan,
    TritonPlan,
    plan_combine,
    plan_decode,
)
from .reference import MASK_HIDDEN, accumulation_dtype, mask_hidden_threshold
from .splits import MIN_CHUNK, SPLIT_GRANULE
from .tiling import next_pow2
from .triton_kernels import _mla_combine_kernel, _mla_decode_kernel

# The latest launch, for diagnostics: the plan's record, the compiled kernels ("decode",
# "combine", "repair_kernel": registers, spills, PTX) and how the decode was launched
# ("decode_launch").
LAST_LAUNCH: dict[str, object] = {}


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (uninitialised: the kernels write every element).

    Tests replace this with an allocator that fills NaN, to prove that claim.
    """
    return torch.empty(shape, dtype=dtype, device=device)


def _descriptor(t: torch.Tensor, block_n: int):
    """TMA descriptor of a paged ``[num_pages, page_size, W]`` view as ``[tokens, W]`` rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, width = t.shape[0] * t.shape[1], t.shape[2]
    return TensorDescriptor(t, [rows, width], [t.stride(1), 1], [block_n, width])


def _hidden_keys_explicit(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels hide a key at a float mask value at or below ``reference.MASK_HIDDEN``
    (-1e30). A mask dtype that cannot hold that (float16) hides at its own minimum
    (``reference.mask_hidden_threshold``): those keys become -inf, one elementwise pass, for such
    masks only."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    hidden_at = mask_hidden_threshold(attn_mask.dtype)
    if hidden_at <= MASK_HIDDEN:
        return attn_mask
    return attn_mask.masked_fill(attn_mask <= hidden_at, float("-inf"))


def _on_device(device: torch.device):
    """The context for a launch on ``device``: its CUDA device made current (Triton launches on
    the current one), nothing off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class _DecodeLaunch:
    """A plan's decode kernel, its launch prepared at the first call (from that call's shapes,
    strides and dtypes; the signature fixes them); later calls fill in the data only."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan
        self.prepared: PreparedLaunch | None = None
        self.repair: PreparedLaunch | None = None

    def launch(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor,
        softmax_scale: float,
        kv_scale: float | None,
        attn_mask: torch.Tensor | None,
        merge_into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Launch into partials ``out``/``lse`` (and with ``merge_into``, the final output:
        ``hopper.prepare``); ``LAST_LAUNCH["decode"]`` is the compiled kernel."""
        plan = self.plan
        float8 = kv_c.dtype == torch.float8_e4m3fn
        if plan.wgmma is not None:
            from . import hopper

            if self.prepared is None:
                self.prepared = hopper.prepare(
                    q, kv_c, k_pe, block_table, out, lse, plan.causal, plan.num_splits,
                    plan.total_splits, fill_empty=plan.fill_empty, merge_into=merge_into,
                    attn_mask=attn_mask, **plan.wgmma.prepare_kwargs(),
                )  # fmt: skip
            data = hopper.launch_data(
                q, kv_c, k_pe, cache_seqlens, block_table, out, lse, softmax_scale,
                kv_scale if float8 else None, plan.wgmma.loads == "gather",
                merge_into=merge_into, attn_mask=attn_mask,
            )  # fmt: skip
        else:
            if self.prepared is None:
                self.prepared = _prepare_triton(
                    plan.triton, plan.num_splits, plan.total_splits, plan.causal,
                    plan.fill_empty, q, kv_c, k_pe, block_table, out, lse, attn_mask,
                )  # fmt: skip
            data = _triton_data(plan.triton, q, kv_c, k_pe, cache_seqlens, block_table, out,
                                lse, softmax_scale, kv_scale, attn_mask)  # fmt: skip
        LAST_LAUNCH.clear()  # nothing of an earlier plan's launch stays
        LAST_LAUNCH.update(plan.record)
        with _on_device(q.device):
            LAST_LAUNCH["decode"] = self.prepared.launch(data)
        LAST_LAUNCH["decode_launch"] = self.prepared.how
        if plan.repair is not None:
            self._launch_repair(q, kv_c, k_pe, cache_seqlens, block_table, out, lse,
                                softmax_scale, kv_scale, attn_mask, merge_into)  # fmt: skip

    def _launch_repair(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor,
        softmax_scale: float,
        kv_scale: float | None,
        attn_mask: torch.Tensor | None,
        merge_into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """The repair pass (``planner.repair_needed``) over what the decode wrote: its partials,
        split as the decode split them, or the final rows when the Hopper kernel merged them
        (``[B, S_q, H, 1, L]``, recomputed over whole sequences)."""
        plan = self.plan
        splits = (plan.num_splits, plan.total_splits)
        if merge_into is not None:
            out, lse = merge_into[0].unsqueeze(3), merge_into[1].unsqueeze(3)
            splits = (1, None)
        if self.repair is None:
            self.repair = _prepare_triton(
                plan.repair, *splits, plan.causal, False, q, kv_c, k_pe, block_table, out, lse,
                attn_mask, repair=True,
            )  # fmt: skip
        data = _triton_data(plan.repair, q, kv_c, k_pe, cache_seqlens, block_table, out, lse,
                            softmax_scale, kv_scale, attn_mask)  # fmt: skip
        with _on_device(q.device):
            LAST_LAUNCH["repair_kernel"] = self.repair.launch(data)


def _prepare_triton(
    triton_plan: TritonPlan,
    num_splits: int,
    total_splits: int | None,
    causal: bool,
    fill_empty: bool,
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    repair: bool = False,
) -> PreparedLaunch:
    """The Triton kernel's launch for ``triton_plan``'s tiling over ``num_splits`` splits
    (``repair``: the repair pass, ``planner.repair_needed``)."""
    cfg = triton_plan.tiling
    batch, s_q, heads, _ = q.shape
    kv_len, rope_len = kv_c.shape[-1], k_pe.shape[-1]
    rows = s_q * heads
    block_l = next_pow2(kv_len)
    block_r = next_pow2(max(rope_len, 1))
    paged = block_table is not None
    if paged:
        num_pages, page_size, capacity = kv_c.shape[0], kv_c.shape[1], 0
        max_pages = block_table.shape[1]
        bt_strides = block_table.stride()
    else:  # page_size is a compile-time constant: the cache length must not be one
        num_pages, page_size, max_pages, capacity = batch, 1, 1, kv_c.shape[1]
        bt_strides = (0, 0)  # never read
    # fp32 inputs get IEEE fp32 dots (not tf32): users asking for fp32 expect fp32 accuracy.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    use_tma, kv_f16 = triton_plan.use_tma, triton_plan.kv_f16
    ptx_convert = triton_plan.ptx_convert
    mask_strides, mask_len = (0, 0, 0), 0
    if attn_mask is not None:
        mask_strides, mask_len = attn_mask.stride(), attn_mask.shape[-1]
    grid = (batch * math.ceil(rows / cfg.block_m), num_splits)
    names = ("q", "kv_c", "k_pe", "cache_seqlens", "bt", "out", "lse", "kv_desc", "pe_desc",
             "mask")  # fmt: skip
    args = [Data(name) for name in names]
    args += [
        *q.stride(),
        *kv_c.stride(),
        *k_pe.stride(),
        *bt_strides,
        *out.stride(),
        *lse.stride(),
        *mask_strides,
        mask_len,
        num_pages,
        max_pages,
        capacity,
        Data("scale_log2"),
        Data("kv_scale_c"),
        Data("kv_scale_pe"),
        num_splits,
        total_splits or 0,
        batch,
    ]
    constexprs = dict(
        S_Q=s_q,
        H=heads,
        L=kv_len,
        R=rope_len,
        PAGE_SIZE=page_size,
        MIN_CHUNK=MIN_CHUNK,
        GRANULE=SPLIT_GRANULE,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        PAGED=paged,
        CAUSAL=causal,
        HAS_PE=rope_len > 0,
        DOT_PRECISION=precision,
        USE_TMA=use_tma,
        HAS_MASK=attn_mask is not None,
        MASK_IS_BOOL=attn_mask is not None and attn_mask.dtype == torch.bool,
        MASK_HIDDEN=MASK_HIDDEN,
        KV_F16=kv_f16,
        PTX_CONVERT=ptx_convert,
        BALANCED=total_splits is not None,
        ONE_POSITION=s_q == 1 or heads % cfg.block_m == 0,
        BLOCK_B=triton_plan.lengths_per_step,
        FILL_EMPTY=fill_empty,
        LAUNCH_DEPENDENTS=device.has_pdl(q.device),
        REPAIR=repair,
        # The repair pass launches while the decode's programs finish (PDL), and waits for them.
        WAIT_PRIMARY=repair and device.has_pdl(q.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if constexprs["WAIT_PRIMARY"]:
        constexprs["launch_pdl"] = True
    return PreparedLaunch(_mla_decode_kernel, grid, args, constexprs)


def _triton_data(
    triton_plan: TritonPlan,
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    kv_scale: float | None,
    attn_mask: torch.Tensor | None,
) -> dict[str, object]:
    """One call's data for the Triton kernel's prepared launch."""
    use_tma, block_n = triton_plan.use_tma, triton_plan.tiling.block_n
    mask = None
    if attn_mask is not None:
        # A bool tensor is read as bytes (same storage, no copy).
        mask = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask
    return {
        "q": q, "kv_c": kv_c, "k_pe": k_pe, "cache_seqlens": cache_seqlens,
        # Unpaged: never read.
        "bt": block_table if block_table is not None else cache_seqlens,
        "out": out, "lse": lse,
        "kv_desc": _descriptor(kv_c, block_n) if use_tma else None,
        "pe_desc": _descriptor(k_pe, block_n) if use_tma and k_pe.shape[-1] else None,
        "mask": mask, "scale_log2": softmax_scale * 1.4426950408889634,
        "kv_scale_c": kv_scale if kv_c.dtype == torch.float8_e4m3fn else 1.0,
        "kv_scale_pe": kv_scale if k_pe.dtype == torch.float8_e4m3fn else 1.0,
    }  # fmt: skip


class _CombineLaunch:
    """The combine kernel with a fixed ``(BLOCK_S, BLOCK_L)`` tiling, prepared at its first
    launch for one partials signature."""

    def __init__(self, tiling: tuple[int, int]) -> None:
        self.tiling = tiling
        self.prepared: PreparedLaunch | None = None

    def launch(
        self, out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:  # fmt: skip
        """Merge ``out_partial [..., S, L]``/``lse_partial [..., S]`` into ``out [..., L]`` and
        ``lse [...]``."""
        num_splits, kv_len = out_partial.shape[-2:]
        o3 = out_partial.reshape(-1, num_splits, kv_len)
        l2 = lse_partial.reshape(-1, num_splits)
        out2 = out.view(-1, kv_len)
        lse1 = lse.view(-1)
        if self.prepared is None:
            self.prepared = self._prepare(o3, l2, out2, lse1)
        LAST_LAUNCH["combine_tiling"] = self.tiling
        with _on_device(out.device):
            LAST_LAUNCH["combine"] = self.prepared.launch(
                {"o3": o3, "l2": l2, "out2": out2, "lse1": lse1}
            )

    def _prepare(
        self, o3: torch.Tensor, l2: torch.Tensor, out2: torch.Tensor, lse1: torch.Tensor
    ) -> PreparedLaunch:
        rows, num_splits, kv_len = o3.shape
        block_s, block_l = self.tiling
        pdl = device.has_pdl(out2.device)
        args = [Data("o3"), Data("l2"), Data("out2"), Data("lse1"), *o3.stride(), *l2.stride(),
                *out2.stride(), num_splits, kv_len]  # fmt: skip
        constexprs = dict(
            BLOCK_S=block_s,
            BLOCK_L=block_l,
            ACC=tl.float64 if lse1.dtype == torch.float64 else tl.float32,
            WAIT_PRIMARY=pdl,
            num_warps=2,
            **({"launch_pdl": True} if pdl else {}),
        )
        return PreparedLaunch(_mla_combine_kernel, (rows, triton.cdiv(kv_len, block_l)), args,
                              constexprs)  # fmt: skip


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """``[count]`` int32 zeros for a merging launch (``hopper.prepare``'s ``merge_into``): a fresh
    buffer each call (in a CUDA graph, a memset node at every replay).

    Not a buffer kept between calls: the first call may run where allocations come from a CUDA
    graph's private pool (Inductor's CUDA-graph trees warm a graph up in its pool before
    recording it), and a kept tensor from that pool is a live allocation the trees do not track
    ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs").
    """
    return torch.zeros(count, dtype=torch.int32, device=device)


def _tensor_signature(t: torch.Tensor | None) -> tuple | None:
    # What a launch is specialised on: shape, strides, dtype, and the base's 16-byte alignment
    # (Triton's pointer specialisation; the TMA and gather paths' condition).
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16


def call_signature(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    causal: bool,
    num_splits: int,
    kv_scale: float | None,
    attn_mask: torch.Tensor | None,
    total_splits: int | None,
) -> tuple:
    """Everything ``attention``'s choices and kernel launches depend on besides tensor data and
    the float scalars: shapes, strides, dtypes, 16-byte alignment, the device and the integer
    and flag arguments. Calls of one signature share an ``_AttentionPlan``."""
    return (
        q.device,
        _tensor_signature(q),
        _tensor_signature(kv_c),
        _tensor_signature(k_pe),
        _tensor_signature(cache_seqlens),
        _tensor_signature(block_table),
        _tensor_signature(attn_mask),
        causal,
        num_splits,
        kv_scale is None,
        total_splits,
    )


class _AttentionLaunch:
    """One ``mla::attention`` signature's plan and prepared launches."""

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan
        self.decode = _DecodeLaunch(plan)
        self.combine = _CombineLaunch(plan.combine) if plan.combine is not None else None

    def run(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor | None,
        softmax_scale: float,
        kv_scale: float | None,
        attn_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        batch, s_q, heads, _ = q.shape
        kv_len = kv_c.shape[-1]
        if not plan.merge_in_kernel:
            out_partial, lse_partial = _run_decode(
                self.decode, q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, kv_scale,
                attn_mask,
            )  # fmt: skip
            return _run_combine(self.combine, out_partial, lse_partial, q.dtype)
        out = new_output((batch, s_q, heads, kv_len), q.dtype, q.device)
        lse = new_output((batch, s_q, heads), torch.float32, q.device)
        if out.numel() == 0 and lse.numel() == 0:
            return out, lse
        num_splits = plan.num_splits
        # Scratch for sequences in several chunks; with one split per sequence none is written.
        rows = (batch, s_q, heads) if num_splits > 1 else (1, 1, 1)
        out_partial = torch.empty((*rows, num_splits, kv_len), dtype=torch.float32, device=q.device)
        lse_partial = torch.empty((*rows, num_splits), dtype=torch.float32, device=q.device)
        block_m = plan.wgmma.block_m
        arrivals = arrival_counters(q.device, batch * math.ceil(s_q * heads / block_m))
        self.decode.launch(
            q, kv_c, k_pe, cache_seqlens, block_table, out_partial, lse_partial, softmax_scale,
            kv_scale, attn_mask, merge_into=(out, lse, arrivals),
        )  # fmt: skip
        return out, lse


# Prepared launches by call signature and options (the plan is part of what they keep).
_LAUNCHES = PlanCache()


def _lookup(key: tuple, make):
    """The launch object kept under ``key``, made (and kept) by ``make()`` on a miss."""
    found = _LAUNCHES.lookup(key)
    return found if found is not None else _LAUNCHES.put(key, make())


def _run_decode(
    launch: _DecodeLaunch,
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    kv_scale: float | None,
    attn_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, s_q, heads, _ = q.shape
    num_splits, kv_len = launch.plan.num_splits, kv_c.shape[-1]
    out = new_output((batch, s_q, heads, num_splits, kv_len), torch.float32, q.device)
    lse = new_output((batch, s_q, heads, num_splits), torch.float32, q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    launch.launch(q, kv_c, k_pe, cache_seqlens, block_table, out, lse, softmax_scale, kv_scale,
                  attn_mask)  # fmt: skip
    return out, lse


def _run_combine(
    launch: _CombineLaunch,
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    lead = out_partial.shape[:-2]
    kv_len = out_partial.shape[-1]
    out = new_output((*lead, kv_len), out_dtype or out_partial.dtype, out_partial.device)
    lse = new_output(tuple(lead), accumulation_dtype(out_partial.dtype), out_partial.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    launch.launch(out_partial, lse_partial, out, lse)
    return out, lse


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
    options: DecodeOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla::decode`` on CUDA (same contract as ``reference.decode``): float32 partials
    ``[B, S_q, H, num_splits, L]`` and ``lse [B, S_q, H, num_splits]``. bf16/fp16/fp32 q only.

    fill_empty: write an empty split's zero ``out`` (False: only its ``lse = -inf``).
    options: the planner's overrides (``planner.DecodeOptions``).
    """
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the CUDA decode kernels take bf16/fp16/fp32 q, got {q.dtype}")
    attn_mask = _hidden_keys_explicit(attn_mask)
    key = ("decode", call_signature(q, kv_c, k_pe, cache_seqlens, block_table, causal,
           num_splits, kv_scale, attn_mask, total_splits), fill_empty, options)  # fmt: skip
    launch = _lookup(key, lambda: _DecodeLaunch(plan_decode(
        q, kv_c, k_pe, block_table, attn_mask, causal=causal, num_splits=num_splits,
        total_splits=total_splits, fill_empty=fill_empty, merge=False, options=options,
    )))  # fmt: skip
    return _run_decode(launch, q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, kv_scale,
                       attn_mask)  # fmt: skip


def combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out_dtype: torch.dtype | None,
    options: DecodeOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla::combine`` on CUDA; same contract as ``reference.combine``."""
    key = ("combine", out_partial.device, _tensor_signature(out_partial),
           _tensor_signature(lse_partial), out_dtype, options)  # fmt: skip
    launch = _lookup(key, lambda: _CombineLaunch(plan_combine(out_partial, options)))
    return _run_combine(launch, out_partial, lse_partial, out_dtype)


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
    options: DecodeOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla::attention`` on CUDA: ``out [B, S_q, H, L]`` in q's dtype and ``lse [B, S_q, H]``.

    The plan (``planner.plan_decode``) says whether the Hopper kernel merges the splits itself
    or ``mla::combine`` runs; it is made once per call signature and options, with the kernels'
    launches prepared at the first call; later calls only allocate and launch.
    """
    attn_mask = _hidden_keys_explicit(attn_mask)
    key = ("attention", call_signature(q, kv_c, k_pe, cache_seqlens, block_table, causal,
           num_splits, kv_scale, attn_mask, total_splits), options)  # fmt: skip
    launch = _lookup(key, lambda: _AttentionLaunch(plan_decode(
        q, kv_c, k_pe, block_table, attn_mask, causal=causal, num_splits=num_splits,
        total_splits=total_splits, fill_empty=False, merge=True, options=options,
    )))  # fmt: skip
    return launch.run(q, kv_c, k_pe, cache_seqlens, block_table, softmax_scale, kv_scale,
                      attn_mask)  # fmt: skip
