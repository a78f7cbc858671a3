"""The planner: every decision of an ``mla::decode`` / ``mla::attention`` call, made once.

``plan_decode`` reads shapes, strides, dtypes and device facts (never tensor values, so it needs
no host synchronisation) and returns a frozen ``DecodePlan``: which kernel, its tiling and main
loop, how tiles are loaded, the split plan, the order programs take chunks in, whether the
splits are merged in the kernel or by ``mla::combine`` and with which tiling, each with the reason
it was chosen (``DecodePlan.reasons``). Launching a plan (``runtime``) decides nothing.

Choices reach the planner only as arguments: ``DecodeOptions`` holds every override a test, a
benchmark or a user may want (the defaults are what ``mla_decode`` runs). The plan's ``record``
is what the runtime reports of a launch (``runtime.LAST_LAUNCH``), available before it.

    plan = plan_decode(q, kv_c, k_pe, block_table, None, causal=True, num_splits=4,
                       total_splits=None)
    print(plan.describe())
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch

from . import device
from .plan_cache import PlanCache
from .splits import MIN_CHUNK, SPLIT_GRANULE, SplitPlan, log, plan_splits
from .tiling import (
    LENGTHS_PER_STEP,
    MERGE_MAX_SPLITS,
    WGMMA_BLOCK_N,
    TritonTiling,
    combine_tiling,
    default_float8_products,
    default_longest_first,
    default_one_scorer,
    default_producer_warps,
    default_query_in_registers,
    default_rows_on_m,
    merge_path,
    tma_support,
    triton_tiling,
    wgmma_path,
    wgmma_stages,
    wgmma_support,
    wgmma_tiling,
)


@dataclass(frozen=True)
class DecodeOptions:
    """Overrides of the planner's choices; ``None`` (and every default) is the planner's own.

    use_wgmma: ``False`` runs the Triton kernel; ``True`` requires the Hopper kernel (an error
        saying why if it cannot run); ``None`` takes it wherever it can run.
    triton_tiling: the Triton kernel's tiling (default: ``tiling.triton_tiling``).
    merge_max_splits: the most splits per sequence that the Hopper kernel merges itself (no
        ``mla::combine`` launch); 0 always launches the combine.
    query_in_registers: allow the one-scorer loop with the query in registers.
    one_scorer, rows_on_m, producer_warps, float8_products, longest_first: the Hopper kernel's
        main loop, producer partition, float8 products and chunk order.
    combine_tiling: the combine kernel's ``(BLOCK_S, BLOCK_L)``.
    lengths_per_step: sequence lengths one program sums per step for a balanced split.
    repair_non_finite: run the repair pass where programs mix query positions
        (``repair_needed``); ``False`` saves its read of the outputs, and a non-finite key seen
        only by later positions then also turns earlier positions' rows of its program into NaN.
    """

    use_wgmma: bool | None = None
    triton_tiling: TritonTiling | None = None
    merge_max_splits: int = MERGE_MAX_SPLITS
    query_in_registers: bool = True
    one_scorer: bool | None = None
    rows_on_m: bool | None = None
    producer_warps: int | None = None
    float8_products: bool | None = None
    longest_first: bool | None = None
    combine_tiling: tuple[int, int] | None = None
    lengths_per_step: int = LENGTHS_PER_STEP
    repair_non_finite: bool = True


DEFAULT_OPTIONS = DecodeOptions()


@dataclass(frozen=True)
class WgmmaPlan:
    """The Hopper kernel's configuration for one call signature (``hopper.prepare``'s arguments).

    loads: ``"tma"`` (the copy engine, pages of whole 64-token tiles) or ``"gather"``
    (``cp.async`` row by row, any page size). loop: ``"one-scorer"``, ``"rows-on-m"`` or
    ``"transposed"`` (see ``docs/kernels.md``)."""

    loads: str
    block_m: int
    num_warps: int
    num_stages: int
    producer_warps: int
    loop: str
    query_in_registers: bool
    float8_products: bool
    longest_first: bool
    lengths_per_step: int

    def prepare_kwargs(self) -> dict[str, object]:
        """``hopper.prepare``'s keyword arguments for this configuration."""
        return dict(
            block_m=self.block_m, num_warps=self.num_warps, num_stages=self.num_stages,
            min_chunk=MIN_CHUNK, granule=SPLIT_GRANULE, lengths_per_step=self.lengths_per_step,
            gather=self.loads == "gather", producer_warps=self.producer_warps,
            rows_on_m=self.loop == "rows-on-m", one_scorer=self.loop == "one-scorer",
            longest_first=self.longest_first, float8_products=self.float8_products,
            query_in_registers=self.query_in_registers,
        )  # fmt: skip


@dataclass(frozen=True)
class TritonPlan:
    """The Triton kernel's configuration: its tiling, TMA loads or per-token loads, and a float8
    cache's products in fp16 (``kv_f16``, converted by inline PTX where ``ptx_convert``)."""

    tiling: TritonTiling
    use_tma: bool
    kv_f16: bool
    ptx_convert: bool
    lengths_per_step: int = LENGTHS_PER_STEP


@dataclass(frozen=True)
class DecodePlan:
    """Every decision of one call signature. ``kernel``: ``"wgmma"`` (the Hopper kernel),
    ``"triton"`` or ``"reference"`` (PyTorch: off CUDA, and float64). ``merge_in_kernel``: the
    Hopper kernel writes the output itself; else ``mla::combine`` runs with ``combine`` tiling
    (``None`` for a bare ``mla::decode``). ``reasons``: ``(decision, why)`` pairs. ``repair``:
    the Triton kernel's repair pass after the decode (``repair_needed``), or ``None``."""

    kernel: str
    num_splits: int
    total_splits: int | None
    causal: bool
    fill_empty: bool
    merge_in_kernel: bool
    combine: tuple[int, int] | None
    wgmma: WgmmaPlan | None
    triton: TritonPlan | None
    reasons: tuple[tuple[str, str], ...] = field(default=())
    repair: TritonPlan | None = None

    def why(self, decision: str) -> str:
        """The reason recorded for ``decision`` (``"kernel"``, ``"loads"``, ``"merge"``, ...)."""
        return dict(self.reasons).get(decision, "")

    @property
    def record(self) -> dict[str, object]:
        """The plan as the runtime reports a launch (``runtime.LAST_LAUNCH``'s keys)."""
        rec: dict[str, object] = {"kernel": self.kernel, "num_splits": self.num_splits,
                                  "total_splits": self.total_splits}  # fmt: skip
        if self.combine is not None or self.merge_in_kernel:
            where = "decode kernel: " if self.merge_in_kernel else "mla::combine: "
            rec["merge"] = where + self.why("merge")
        if self.combine is not None:
            rec["combine_tiling"] = self.combine
        if self.wgmma is not None:
            w = self.wgmma
            rec.update(
                decode_path="wgmma", wgmma_loads=w.loads,
                wgmma_one_scorer=w.loop == "one-scorer", wgmma_rows_on_m=w.loop == "rows-on-m",
                wgmma_producer_warps=w.producer_warps,
                wgmma_query_in_registers=w.query_in_registers,
                wgmma_float8_products=w.float8_products,
                wgmma_order="longest-first" if w.longest_first else "split-major",
            )  # fmt: skip
        elif self.triton is not None:
            rec["decode_path"] = "tma" if self.triton.use_tma else "gather"
        if self.why("repair"):
            rec["repair"] = self.why("repair")
        return rec

    def describe(self) -> str:
        """One line per decision with its reason."""
        lines = [f"mla decode plan: {self.kernel} kernel, {self.num_splits} splits"
                 f" (total_splits={self.total_splits})"]  # fmt: skip
        if self.wgmma is not None:
            w = self.wgmma
            lines.append(
                f"  wgmma: {w.block_m}-row {w.loop} programs, {w.num_warps} warps, ring of "
                f"{w.num_stages}, {w.loads} loads, producer warps {w.producer_warps}, query in "
                f"registers {w.query_in_registers}, float8 products {w.float8_products}, "
                f"{'longest-first' if w.longest_first else 'split-major'} order"
            )
        if self.triton is not None:
            t = self.triton
            lines.append(f"  triton: {t.tiling}, TMA {t.use_tma}, float8 in fp16 {t.kv_f16}")
        if self.combine is not None:
            lines.append(f"  combine tiling (BLOCK_S, BLOCK_L) = {self.combine}")
        if self.repair is not None:
            lines.append(f"  repair pass: {self.repair.tiling}, TMA {self.repair.use_tma}")
        lines += [f"  {decision}: {why}" for decision, why in self.reasons]
        return "\n".join(lines)


def _wgmma_plan(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    attn_mask: torch.Tensor | None,
    loads: str,
    num_splits: int,
    total_splits: int | None,
    options: DecodeOptions,
) -> WgmmaPlan:
    """The Hopper kernel's tiling and loop. An ``attn_mask`` is read by the transposed and
    one-scorer loops, so gathered 64-row programs take the transposed loop with one."""
    kv_len, rope_len = kv_c.shape[-1], k_pe.shape[-1]
    block_m, num_warps = wgmma_tiling(q.shape[1] * q.shape[2])
    float8 = kv_c.dtype == torch.float8_e4m3fn
    gather = loads == "gather"
    masked = attn_mask is not None
    stages = wgmma_stages(block_m, kv_len, rope_len, float8, device.shared_memory_optin(q.device))
    one_scorer = options.one_scorer
    if one_scorer is None:
        one_scorer = default_one_scorer(block_m, float8, gather)
    if one_scorer:
        # num_warps is warpgroup 0's; warpgroup 1 is a partition of its own that also copies.
        # Its pipeline is built for two ring slots, even where a narrower row would fit three.
        num_warps, producer_warps, rows_on_m, stages = 4, 0, False, 2
    else:
        producer_warps = options.producer_warps
        if producer_warps is None:
            producer_warps = default_producer_warps(num_warps, gather)
        rows_on_m = options.rows_on_m
        if rows_on_m is None:
            rows_on_m = default_rows_on_m(block_m, num_warps, float8) and not masked
    query_in_registers = default_query_in_registers(
        one_scorer, kv_len, rope_len, masked, options.query_in_registers
    )
    if query_in_registers:
        stages = 3
    float8_products = options.float8_products
    if float8_products is None:
        float8_products = default_float8_products(block_m, kv_len, float8, gather)
    longest_first = options.longest_first
    if longest_first is None:
        longest_first = default_longest_first(
            q.shape[0], num_splits, total_splits, options.lengths_per_step,
            rows_on_m or one_scorer,
        )  # fmt: skip
    loop = "one-scorer" if one_scorer else "rows-on-m" if rows_on_m else "transposed"
    return WgmmaPlan(
        loads=loads, block_m=block_m, num_warps=num_warps, num_stages=stages,
        producer_warps=producer_warps, loop=loop, query_in_registers=query_in_registers,
        float8_products=float8_products, longest_first=longest_first,
        lengths_per_step=options.lengths_per_step,
    )  # fmt: skip


def repair_needed(
    s_q: int, heads: int, block_m: int, causal: bool, masked: bool
) -> tuple[bool, str]:
    """Whether a decode kernel of ``block_m``-row programs needs the repair pass, and why.

    A program's rows are ``s * H + h`` flattened: with ``S_q > 1`` and heads not a multiple of
    ``block_m``, one program holds several query positions, and under a causal or masked problem
    they see different keys. ``P @ V`` runs over every key that any of its rows sees, so a
    non-finite key seen only by later positions turns the earlier rows into NaN (``0 x inf``).
    The repair pass finds such rows and computes them again with those keys isolated.
    """
    if s_q == 1 or heads % block_m == 0:
        return False, f"not needed: each {block_m}-row program holds one query position"
    if not (causal or masked):
        return False, "not needed: every query position sees the same keys (no causal, no mask)"
    why = "causal" if causal else "masked"
    return True, (
        f"{block_m}-row programs hold several of the {s_q} query positions of a {why} problem: "
        "a pass after the decode recomputes any program whose rows came out non-finite, "
        "isolating keys that only later positions see (one read of the outputs when finite)"
    )


def _triton_plan(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    tiling: TritonTiling,
    lengths_per_step: int,
) -> tuple[TritonPlan, str]:
    """The Triton kernel's loads and float8 handling for ``tiling``, and why."""
    use_tma, why = tma_support(kv_c, k_pe, block_table, tiling.block_n)
    if tiling.use_tma is False and use_tma:
        use_tma, why = False, "the tiling turns TMA off (TritonTiling.use_tma=False)"
    # A float8 kv_c is computed with in fp16 (bf16 and fp16 queries; fp32 keeps fp32 dots).
    kv_f16 = kv_c.dtype == torch.float8_e4m3fn and q.element_size() == 2 and tiling.fp8_in_f16
    ptx_convert = kv_f16 and tiling.fp8_ptx_convert and device.has_e4m3_convert(q.device)
    plan = TritonPlan(tiling, use_tma, kv_f16, ptx_convert, lengths_per_step)
    why = ("TMA: " if use_tma else "per-token loads: ") + why
    if kv_f16:
        how = "inline PTX" if ptx_convert else "Triton's cast (no sm_89+ CUDA device, or off)"
        why += f"; float8 tiles computed in fp16, converted by {how}"
    return plan, why


def plan_decode(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    *,
    causal: bool,
    num_splits: int,
    total_splits: int | None,
    fill_empty: bool = True,
    merge: bool = True,
    options: DecodeOptions = DEFAULT_OPTIONS,
) -> DecodePlan:
    """The plan of one ``mla::attention`` call (``merge=True``: decode and merge) or one bare
    ``mla::decode`` (``merge=False``: partials only), from metadata alone.

    Arguments as ``mla::decode``'s (``q [B, S_q, H, L+R]``, ``kv_c [..., L]``, ``k_pe [..., R]``,
    paged when ``block_table`` is given); ``options``: the overrides (``DecodeOptions``).
    """
    reasons: list[tuple[str, str]] = []
    # Off CUDA the op runs PyTorch; under Triton's interpreter (TRITON_INTERPRET=1, the tests)
    # the runtime's kernels run on CPU tensors, and this plans them.
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if (q.device.type != "cuda" and not interpreted) or q.dtype == torch.float64:
        why = f"{q.device.type} runs the PyTorch implementation"
        if q.dtype == torch.float64:
            why = "float64: Triton passes float scalars as fp32, so float64 runs PyTorch"
        return DecodePlan(
            kernel="reference", num_splits=num_splits, total_splits=total_splits, causal=causal,
            fill_empty=fill_empty, merge_in_kernel=False, combine=None, wgmma=None, triton=None,
            reasons=(("kernel", why),),
        )  # fmt: skip
    tiling = options.triton_tiling
    if tiling is None:
        tiling = triton_tiling(
            q.shape[1] * q.shape[2], kv_c.shape[-1], k_pe.shape[-1], q.element_size(),
            device.shared_memory_optin(q.device), kv_c.dtype == torch.float8_e4m3fn,
        )  # fmt: skip
    loads, why = None, "turned off (DecodeOptions.use_wgmma=False)"
    if options.use_wgmma is not False:
        loads, why = wgmma_path(q, kv_c, k_pe, block_table, attn_mask)
        if loads and kv_c.dtype == torch.float8_e4m3fn and not tiling.fp8_in_f16:
            loads, why = None, "TritonTiling.fp8_in_f16=False (the wgmma kernel uses fp16)"
        if options.use_wgmma and not loads:
            raise ValueError(
                f"DecodeOptions.use_wgmma=True, but the wgmma kernel cannot run: {why}"
            )
    reasons.append(("kernel", why))
    wgmma = triton = None
    if loads:
        wgmma = _wgmma_plan(q, kv_c, k_pe, attn_mask, loads, num_splits, total_splits, options)
    else:
        triton, why_loads = _triton_plan(
            q, kv_c, k_pe, block_table, tiling, options.lengths_per_step
        )
        reasons.append(("loads", why_loads))
    producer_block_m = wgmma.block_m if wgmma is not None else triton.tiling.block_m
    needed, why_repair = repair_needed(
        q.shape[1], q.shape[2], producer_block_m, causal, attn_mask is not None
    )
    if needed and not options.repair_non_finite:
        needed, why_repair = False, "turned off (DecodeOptions.repair_non_finite=False)"
    reasons.append(("repair", why_repair))
    repair = None
    if needed:
        repair = triton or _triton_plan(q, kv_c, k_pe, block_table, tiling,
                                        options.lengths_per_step)[0]  # fmt: skip
    merge_in_kernel, combine = False, None
    if merge:
        merge_in_kernel, why_merge = merge_path(loads, num_splits, options.merge_max_splits)
        reasons.append(("merge", why_merge))
        if not merge_in_kernel:
            batch, s_q, heads = q.shape[:3]
            combine = options.combine_tiling or combine_tiling(
                num_splits,
                kv_c.shape[-1],
                batch * s_q * heads,
                device.multiprocessor_count(q.device) if q.is_cuda else 0,
            )
    plan = DecodePlan(
        kernel="wgmma" if loads else "triton", num_splits=num_splits, total_splits=total_splits,
        causal=causal, fill_empty=fill_empty, merge_in_kernel=merge_in_kernel, combine=combine,
        wgmma=wgmma, triton=triton, reasons=tuple(reasons), repair=repair,
    )  # fmt: skip
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", plan.describe())
    return plan


# Split plans by call signature, for eager calls (traced calls plan at trace time).
_SPLIT_PLANS = PlanCache()


def default_splits(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
) -> SplitPlan:
    """The split plan ``mla_decode`` uses when ``num_splits`` is not given: ``plan_splits`` for
    the kernel the call will run, from shapes, dtypes and the device only (no host sync), kept
    per signature in eager mode. The capacity is the block table's pages (or the cache length)."""
    key = None
    if not torch.compiler.is_compiling():
        bt_shape = None if block_table is None else block_table.shape
        mask_dtype = None if attn_mask is None else attn_mask.dtype
        key = (q.device, q.shape, q.dtype, kv_c.shape, kv_c.dtype, k_pe.shape, k_pe.dtype,
               bt_shape, mask_dtype)  # fmt: skip
        try:
            plan = _SPLIT_PLANS.lookup(key)
        except TypeError:  # symbolic sizes traced outside torch.compile: planned, not kept
            key = plan = None
        if plan is not None:
            return plan
    capacity = kv_c.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    wgmma = q.device.type == "cuda" and wgmma_support(q, kv_c, k_pe, block_table, attn_mask)[0]
    plan = plan_splits(q.shape[0], q.shape[1] * q.shape[2], capacity, q.device, wgmma)
    return plan if key is None else _SPLIT_PLANS.put(key, plan)


def plan_combine(
    out_partial: torch.Tensor, options: DecodeOptions = DEFAULT_OPTIONS
) -> tuple[int, int]:
    """The combine kernel's ``(BLOCK_S, BLOCK_L)`` for partials ``[..., S, L]``."""
    if options.combine_tiling is not None:
        return options.combine_tiling
    num_splits, kv_len = out_partial.shape[-2:]
    rows = math.prod(out_partial.shape[:-2])
    sms = device.multiprocessor_count(out_partial.device) if out_partial.is_cuda else 0
    return combine_tiling(num_splits, kv_len, rows, sms)


__all__ = [
    "DEFAULT_OPTIONS",
    "WGMMA_BLOCK_N",
    "DecodeOptions",
    "DecodePlan",
    "TritonPlan",
    "WgmmaPlan",
    "default_splits",
    "plan_combine",
    "plan_decode",
]
