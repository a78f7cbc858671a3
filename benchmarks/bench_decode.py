"""MLA decode kernel benchmark: mla_decode vs peers vs the hardware roofline, on one GPU.

    python benchmarks/bench_decode.py [--cases a,b,...] [--out benchmarks/results] [--no-peers]
    python benchmarks/bench_decode.py --peers flashinfer    # mla_decode beside FlashInfer only
    python benchmarks/bench_decode.py --split-sweep --cases e,a   # even vs balanced split plans

Method
- Ceilings measured first in the same run: device-to-device copy bandwidth (bytes read + written,
  1 GiB) and a bf16 8192^3 matmul rate (the best of five 200 ms windows after a second of
  warm-up), both on random data, timed as the cases are.
- Each case: bf16, paged cache (page size 64 unless said), random data (never zeros), pages of
  different sequences interleaved. Inputs are rotated among copies whenever one copy is under
  4x the L2 size. Each call is captured in a CUDA graph (one per input copy) and the replays are
  timed, so the figure is GPU time, not Python dispatch. Times are medians over CUDA events
  around each call, repeated as ``triton.testing.do_bench`` repeats (``time_rotating``), with L2
  evicted before every call by reading a 256 MB buffer. do_bench evicts it by zeroing that
  buffer instead, which leaves all of L2 dirty: every timed kernel then also writes about the L2
  size back to DRAM (9.5-9.9 us on an H100 for the bandwidth-bound cases and a plain 302 MB
  ``torch.sum`` alike). ``mla_decode`` is also
  timed that way (``time_us_dirty_l2``, the "dirty" column), the L2 state under which FlashMLA's
  ``tests/test_flash_mla.py`` times (``triton.testing.do_bench``). The ceilings are timed like
  the cases (clean L2). Eager (un-graphed) time is reported beside the graph time.
- roofline fraction = max(bytes / copy_bw, flops / matmul_rate) / time, with
  bytes = cache rows read + q + out and flops = 2 * H * S_q * T * (2L + R) summed over the batch.
- Cases are named by shape: ``h{heads}_b{batch}_{context}``, bf16, S_q = 1, page size 64, unless
  a suffix says otherwise: ``ragged`` (lengths spread over the batch), ``sq2`` (two query
  positions), ``page1`` (page size 1), ``fp8`` (a float8 ``kv_c`` with a bf16 ``k_pe``,
  FlashMLA's 640-byte rows), ``fp8row`` (the whole row in float8 under one scale, 576 bytes,
  vLLM's ``fp8`` MLA cache), ``mask`` (an all-visible bf16 ``attn_mask``, what every decode step
  of a rewritten Hugging Face model passes; peers skip these).
- Every implementation's output is checked against a float32 torch reference before timing.
- Peers run in the same process on the same data: torch eager absorbed einsum (contiguous cache),
  SDPA over an expanded MQA, FlexAttention (where it compiles), and FlashInfer's planned MLA wrapper
  (``BatchMLAPagedAttentionWrapper``, backend ``auto``: fa3 on Hopper) over the same paged cache,
  planned outside the timed call, with the whole-row e4m3 cache on ``h16_b128_4k_fp8row``.
  FlashInfer is reported as not installed when it cannot be imported;
  ``benchmarks/flashinfer_offline.sh`` carries it to a GPU machine with no network.
Writes JSON + CSV (+ PNG) named by device and date under --out; prints a table last.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mla_compile import mla_ops
from mla_compile.mla_ops import planner, runtime, tiling
from mla_compile.mla_ops.splits import SplitPlan

L, R = 512, 64
SCALE = 0.1352337788608801


@dataclass
class Case:
    name: str
    batch: int
    heads: int
    context: int  # tokens per sequence (max for ragged)
    s_q: int = 1
    page_size: int = 64
    ragged: bool = False
    fp8: bool = False  # kv_c in float8 e4m3 (per-tensor scale), k_pe kept in bf16
    # With fp8: k_pe in e4m3 too, the whole [.., L+R] row quantised under one scale (576 bytes a
    # token: vLLM's fp8 MLA cache) instead of FlashMLA's 640-byte rows with a bf16 RoPE part.
    fp8_rope: bool = False
    # An all-visible bf16 attn_mask (zeros), as the rewritten Hugging Face decode step passes.
    mask: bool = False


CASES = {
    "h16_b128_4k": Case("h16_b128_4k", 128, 16, 4096),
    "h128_b32_4k": Case("h128_b32_4k", 32, 128, 4096),
    "h128_b1_32k": Case("h128_b1_32k", 1, 128, 32768),
    "h16_b4_64k": Case("h16_b4_64k", 4, 16, 65536),
    "h16_b64_8k_ragged": Case("h16_b64_8k_ragged", 64, 16, 8192, ragged=True),
    "h128_b64_4k_sq2": Case("h128_b64_4k_sq2", 64, 128, 4096, s_q=2),
    "h16_b128_4k_page1": Case("h16_b128_4k_page1", 128, 16, 4096, page_size=1),
    "h16_b128_4k_fp8": Case("h16_b128_4k_fp8", 128, 16, 4096, fp8=True),
    "h16_b128_4k_fp8row": Case("h16_b128_4k_fp8row", 128, 16, 4096, fp8=True, fp8_rope=True),
    "h16_b128_4k_mask": Case("h16_b128_4k_mask", 128, 16, 4096, mask=True),
    "h128_b32_4k_mask": Case("h128_b32_4k_mask", 32, 128, 4096, mask=True),
}


# FlexAttention compiles for a minute per case; it is timed where the shared anchors have it.
FLEX_CASES = ("h16_b128_4k", "h128_b32_4k")
PEERS = ("eager_einsum", "sdpa_mqa", "flex", "flashinfer")


@dataclass
class Row:
    case: str
    impl: str
    time_us: float | None
    gbps: float | None = None
    tflops: float | None = None
    roofline_fraction: float | None = None
    rel_err: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB, random bf16)."""
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = time_rotating([lambda: y.copy_(x)], warmup=50, rep=300)
    return 2 * x.numel() * x.element_size() / t


# Timed windows of the matmul ceiling: its rate moves between windows on one machine (clocks under
# the power limit; H100 626-752, H200 657-730 TFLOP/s), so the ceiling is the
# best of several, the strictest denominator for the compute-bound cases.
MATMUL_WINDOWS = 5


def ceilings() -> dict:
    """The two ceilings: ``copy_bw_Bps`` (bytes read + written per second) and
    ``bf16_matmul_flops`` (the best of ``MATMUL_WINDOWS`` windows after a second of warm-up: a
    cold GPU boosts past its sustained rate), with every window's rate."""
    copy_bw = copy_bandwidth()
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    time_rotating([lambda: a @ b], warmup=1000, rep=1)  # a second of warm-up; its time unused
    windows = [
        2 * n**3 / time_rotating([lambda: a @ b], warmup=0, rep=200) for _ in range(MATMUL_WINDOWS)
    ]
    return {"copy_bw_Bps": copy_bw, "bf16_matmul_flops": max(windows), "matmul_windows": windows}


class Inputs:
    """One copy of a case's inputs: paged cache + block table, and a contiguous view for peers."""

    def __init__(self, case: Case, gen: torch.Generator, with_contiguous: bool) -> None:
        dev, dt = "cuda", torch.bfloat16
        b, t, ps = case.batch, case.context, case.page_size
        if case.ragged:
            lengths = torch.randint(1, t + 1, (b,), generator=gen)
        else:
            lengths = torch.full((b,), t)
        lengths = lengths.clamp_min(case.s_q)
        pages_per_seq = -(-int(lengths.max()) // ps)
        num_pages = b * pages_per_seq
        self.kv_cache = torch.randn(num_pages, ps, L + R, generator=gen).to(dev, dt)
        self.block_table = (
            torch.randperm(num_pages, generator=gen).view(b, pages_per_seq).to(dev, torch.int32)
        )
        self.cache_seqlens = lengths.to(dev, torch.int32)
        self.q = torch.randn(b, case.s_q, case.heads, L + R, generator=gen).to(dev, dt)
        self.lengths = lengths
        # fp8: the decode reads (kv_c_fp8, k_pe bf16), or with fp8_rope both halves of one
        # e4m3 tensor [pages, page_size, L+R]; the bf16 cache stays the reference.
        self.kv_c_fp8, self.k_pe_fp8, self.kv_scale = None, None, None
        self.kv_fp8 = None  # with fp8_rope: the whole e4m3 row [pages, page_size, L+R]
        if case.fp8 and case.fp8_rope:
            self.kv_fp8, self.kv_scale = mla_ops.quantize_kv_fp8(self.kv_cache)
            self.kv_c_fp8, self.k_pe_fp8 = self.kv_fp8[..., :L], self.kv_fp8[..., L:]
        elif case.fp8:
            self.kv_c_fp8, self.kv_scale = mla_ops.quantize_kv_fp8(self.kv_cache[..., :L])
        self.attn_mask = None  # [B, S_q, capacity] bf16 zeros: every key visible
        if case.mask:
            self.attn_mask = torch.zeros(b, case.s_q, pages_per_seq * ps, device=dev, dtype=dt)
        self.contiguous = None
        if with_contiguous:  # [B, T, L+R], rows past each length are never attended
            self.contiguous = self.kv_cache[self.block_table.long()].view(b, -1, L + R)

    def op_args(self, num_splits: int, total_splits: int | None = None) -> tuple:
        """Arguments of ``torch.ops.mla.decode`` for this copy (causal, DeepSeek-V3 scale)."""
        kv_c, k_pe = self.decode_cache()
        return (
            self.q, kv_c, k_pe, self.cache_seqlens, self.block_table, SCALE, True, num_splits,
            self.kv_scale, self.attn_mask, total_splits,
        )  # fmt: skip

    def decode_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(kv_c, k_pe)`` pair the decode reads (kv_c in fp8 for fp8 cases, k_pe too with
        ``fp8_rope``)."""
        if self.k_pe_fp8 is not None:
            return self.kv_c_fp8, self.k_pe_fp8
        if self.kv_c_fp8 is not None:
            return self.kv_c_fp8, self.kv_cache[..., L:]
        return self.kv_cache[..., :L], self.kv_cache[..., L:]


def decode_out(inp: Inputs) -> torch.Tensor:
    """``mla_decode`` on one input copy, with the planner's defaults: ``[B, S_q, H, L]``."""
    return mla_ops.mla_decode(
        inp.q, inp.decode_cache(), inp.cache_seqlens, block_table=inp.block_table,
        head_dim_v=L, softmax_scale=SCALE, kv_scale=inp.kv_scale, attn_mask=inp.attn_mask,
    )[0]  # fmt: skip


def reference(
    inp: Inputs, case: Case, kv_cache: torch.Tensor | None = None, dtype=torch.float32
) -> torch.Tensor:
    """Causal attention in ``dtype`` (float32 by default), one sequence at a time (keeps memory
    small), over ``kv_cache [pages, page_size, L+R]`` (default: the copy's bf16 cache)."""
    cache = inp.kv_cache if kv_cache is None else kv_cache
    outs = []
    for b in range(case.batch):
        n = int(inp.lengths[b])
        rows = cache[inp.block_table[b].long()].view(-1, L + R)[:n].to(dtype)
        q = inp.q[b].to(dtype)  # [S_q, H, L+R]
        s = torch.einsum("shd,td->sht", q, rows) * SCALE
        last = n - case.s_q + torch.arange(case.s_q, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= last[:, None]
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        outs.append(torch.einsum("sht,tl->shl", s.softmax(-1), rows[:, :L]))
    return torch.stack(outs)


def graphed(fn):
    """Capture ``fn`` in a CUDA graph (after a warm-up on a side stream); returns replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# Bytes read (or zeroed) before each timed call to evict L2: triton.testing.do_bench's size.
L2_EVICT_BYTES = 256 * 2**20
_evict_buffers: list[torch.Tensor] = []


def evict_l2(mode: str = "clean") -> None:
    """Evict L2 before a timed call. ``clean``: read a 256 MB buffer (L2 left holding clean lines
    of it, none of the inputs); ``dirty``: zero it, as ``triton.testing.do_bench`` does (L2 left
    full of dirty lines that the next kernel writes back); ``none``: nothing (experiments only:
    the rotated inputs alone)."""
    if not _evict_buffers:
        buf = torch.empty(L2_EVICT_BYTES // 4, device="cuda", dtype=torch.int32)
        _evict_buffers.extend([buf, torch.empty((), device="cuda", dtype=torch.int64)])
    buf, total = _evict_buffers
    if mode == "clean":
        torch.sum(buf, 0, dtype=torch.int64, out=total)
    elif mode == "dirty":
        buf.zero_()
    elif mode != "none":
        raise ValueError(f"evict_l2: mode must be 'clean', 'dirty' or 'none', got {mode!r}")


def time_rotating(fns, warmup: int = 25, rep: int = 200, l2: str = "clean") -> float:
    """Median seconds of one call, cycling through ``fns`` (one per input copy).

    ``triton.testing.do_bench``'s procedure (a 5-call estimate, then ``warmup`` and ``rep``
    milliseconds of calls, CUDA events around each timed one), with L2 evicted before every
    timed call by ``evict_l2(l2)``.
    """
    counter = [0]

    def call():
        counter[0] += 1
        fns[counter[0] % len(fns)]()

    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        evict_l2(l2)
        call()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup / estimate_ms))):
        call()
    n = max(1, int(rep / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        evict_l2(l2)
        starts[i].record()
        call()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def impls(case: Case):
    """name -> (make_fn(inp) -> callable returning out [B, S_q, H, L], note)."""

    def ours(inp: Inputs):
        return lambda: decode_out(inp)

    def eager_einsum(inp: Inputs):
        kv, q = inp.contiguous, inp.q
        t = kv.shape[1]
        last = inp.cache_seqlens[:, None] - case.s_q + torch.arange(case.s_q, device="cuda")
        mask = torch.arange(t, device="cuda")[None, None, :] <= last[:, :, None]  # [B, S_q, T]
        bias = torch.zeros(mask.shape, device="cuda", dtype=torch.float32).masked_fill(
            ~mask, float("-inf")
        )[:, :, None, :]

        def fn():
            s = torch.einsum("bshd,btd->bsht", q, kv).float() * SCALE + bias
            return torch.einsum("bsht,btl->bshl", s.softmax(-1).to(kv.dtype), kv[..., :L])

        return fn

    def sdpa_mqa(inp: Inputs):
        kv, q = inp.contiguous, inp.q
        b, t = kv.shape[:2]
        last = inp.cache_seqlens[:, None] - case.s_q + torch.arange(case.s_q, device="cuda")
        mask = torch.arange(t, device="cuda")[None, None, :] <= last[:, :, None]
        mask = mask[:, None]  # [B, 1, S_q, T]
        k = kv[:, None].expand(b, case.heads, t, L + R)
        v = kv[:, None, :, :L].expand(b, case.heads, t, L)

        def fn():
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=mask, scale=SCALE
            )
            return o.transpose(1, 2)

        return fn

    def flex(inp: Inputs):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        kv, q = inp.contiguous, inp.q
        b, t = kv.shape[:2]
        seqlens = inp.cache_seqlens

        def mask_mod(bi, h, qi, ki):
            return ki <= seqlens[bi] - case.s_q + qi

        bm = create_block_mask(mask_mod, b, None, case.s_q, t, device="cuda")
        fa = torch.compile(flex_attention, fullgraph=True)
        k = kv[:, None]
        v = kv[:, None, :, :L]

        def fn():
            o = fa(q.transpose(1, 2), k, v, block_mask=bm, scale=SCALE, enable_gqa=True)
            return o.transpose(1, 2)

        return fn

    workspace = []  # FlashInfer's float workspace, one per case: its runs never overlap

    def flashinfer_mla(inp: Inputs):
        # FlashInfer's planned MLA wrapper (``backend="auto"``: fa3 on Hopper, JIT-compiled at the
        # first plan) on this copy's own paged cache and query, both passed packed as ours are
        # ([pages, page_size, L+R] and [B * S_q, H, L+R]). The plan is made here, outside the
        # timed call, as an engine plans once per step for all its layers.
        import flashinfer
        from flashinfer.mla import MLAPlanMetadata

        if not workspace:
            workspace.append(torch.empty(128 * 2**20, device="cuda", dtype=torch.uint8))
        pages = (-(-inp.cache_seqlens.long() // case.page_size)).tolist()  # pages per sequence
        kv_indices = torch.cat([inp.block_table[b, :n] for b, n in enumerate(pages)])
        kv_indptr = torch.tensor([0, *pages], device="cuda").cumsum(0).to(torch.int32)
        qo_indptr = torch.arange(case.batch + 1, device="cuda", dtype=torch.int32) * case.s_q
        kv, scales = inp.kv_cache, {}
        # FlashInfer takes the whole row in e4m3 under one scale (h16_b128_4k_fp8row), not a bf16
        # k_pe beside a float8 kv_c (h16_b128_4k_fp8).
        if case.fp8:
            if not case.fp8_rope:
                raise NotImplementedError("FlashInfer's float8 MLA takes the whole row in e4m3")
            kv, scale = inp.kv_fp8, float(inp.kv_scale)
            scales = {"ckv_scale": scale, "kpe_scale": scale}
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace[0], backend="auto")
        wrapper.plan(
            metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, inp.cache_seqlens),
            num_heads=case.heads, head_dim_ckv=L, head_dim_kpe=R, page_size=case.page_size,
            causal=True, sm_scale=SCALE, q_data_type=inp.q.dtype, kv_data_type=kv.dtype,
            scale_mode="kv-per-tensor" if case.fp8 else "default",
        )  # fmt: skip
        # A private attribute of this FlashInfer release: reported where it exists.
        FLASHINFER_BACKENDS[case.name] = getattr(wrapper, "_planned_backend_name", "auto")
        q = inp.q.view(case.batch * case.s_q, case.heads, L + R)

        def fn():
            out = wrapper.run(query=q, kv_cache=kv, **scales)  # [B * S_q, H, L]
            return out.view(case.batch, case.s_q, case.heads, L)

        return fn

    return {
        "mla_decode": ours,
        "eager_einsum": eager_einsum,
        "sdpa_mqa": sdpa_mqa,
        "flex": flex,
        "flashinfer": flashinfer_mla,
    }


# The concrete backend FlashInfer's ``auto`` planned, per case (reported in each row's note).
FLASHINFER_BACKENDS: dict[str, str] = {}


def flashinfer_version() -> str | None:
    """FlashInfer's version where it imports, else None."""
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer.__version__


def peer_names(case: Case, peers: tuple[str, ...]) -> list[str]:
    """The peers of ``peers`` that take this case: the torch peers only 16-bit unmasked caches
    (FlexAttention only where the anchors have it), FlashInfer unmasked 16-bit or all-e4m3 rows."""
    names = []
    for name in peers:
        if name == "flashinfer":
            if flashinfer_version() and not case.mask and (not case.fp8 or case.fp8_rope):
                names.append(name)
        elif not case.fp8 and not case.mask and (name != "flex" or case.name in FLEX_CASES):
            names.append(name)
    return names


def case_cost(case: Case, inp: Inputs) -> tuple[float, float]:
    """Bytes (cache rows read + q + out, + the mask where there is one) and flops of one call."""
    tokens = float(inp.lengths.sum())
    elt = 2
    q_bytes = case.batch * case.s_q * case.heads * (L + R) * elt
    o_bytes = case.batch * case.s_q * case.heads * L * elt
    row_bytes = (L + R * (1 if case.fp8_rope else elt)) if case.fp8 else (L + R) * elt
    nbytes = tokens * row_bytes + q_bytes + o_bytes
    if inp.attn_mask is not None:
        nbytes += inp.attn_mask.numel() * inp.attn_mask.element_size()
    flops = 2 * case.heads * case.s_q * tokens * (2 * L + R)
    return nbytes, flops


def planned(case: Case, inp: Inputs) -> SplitPlan:
    """The planner's ``(num_splits, total_splits)`` for this case, for the kernel it will run
    (as ``mla_decode`` asks: the capacity is the block table's pages)."""

    kv_c, k_pe = inp.decode_cache()
    return planner.default_splits(inp.q, kv_c, k_pe, inp.block_table, inp.attn_mask)


def input_copies(case: Case, l2_bytes: int, with_contiguous: bool = False) -> list[Inputs]:
    """Copies of a case's inputs (seed 0) to rotate through: enough to cover 4x the L2 cache,
    at most 8, so that no timed call finds its cache in L2."""
    gen = torch.Generator().manual_seed(0)
    first = Inputs(case, gen, with_contiguous)
    n = min(8, math.ceil(4 * l2_bytes / (first.kv_cache.numel() * 2)))
    return [first] + [Inputs(case, gen, with_contiguous) for _ in range(n - 1)]


def run_case(case: Case, ceil: dict, peers: tuple[str, ...], l2_bytes: int, progress) -> list[Row]:
    names = ["mla_decode", *peer_names(case, peers)]
    contiguous = any(n in ("eager_einsum", "sdpa_mqa", "flex") for n in names)
    copies = input_copies(case, l2_bytes, with_contiguous=contiguous)
    first = copies[0]
    nbytes, flops = case_cost(case, first)
    floor = max(nbytes / ceil["copy_bw_Bps"], flops / ceil["bf16_matmul_flops"])
    ref = reference(first, case)
    rows = []
    for name in names:
        progress(f"{case.name}:{name}")
        try:
            make = impls(case)[name]  # one per case: FlashInfer's workspace is shared
            fns = [make(inp) for inp in copies]
            err = rel_err(fns[0](), ref)
            t_eager = time_rotating(fns)
            extra = {"copies": len(copies), "eager_us": t_eager * 1e6}
            try:
                graphs = [graphed(f) for f in fns]
                t = time_rotating(graphs)
                note = ""
                if name == "mla_decode":  # do_bench's dirty L2 as well (FlashMLA's figures)
                    t_dirty = time_rotating(graphs, l2="dirty")
                    extra.update(
                        time_us_dirty_l2=t_dirty * 1e6, roofline_fraction_dirty_l2=floor / t_dirty
                    )
            except Exception as exc:  # not capturable: report eager time, say so
                t, note = t_eager, f"eager only (graph capture failed: {type(exc).__name__})"
            if name == "flashinfer":
                note = f"backend {FLASHINFER_BACKENDS.get(case.name)}; {note}".rstrip("; ")
            rows.append(
                Row(
                    case.name,
                    name,
                    t * 1e6,
                    nbytes / t / 1e9,
                    flops / t / 1e12,
                    floor / t,
                    err,
                    note=note,
                    extra=extra,
                )
            )
        except Exception as exc:  # a peer that does not run here is reported, not hidden
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            rows.append(Row(case.name, name, None, note=msg))
        torch.cuda.empty_cache()

    # Split into decode and combine: the combine's share of the total is what it adds to the
    # call, mla_decode minus its decode alone (the same plan, no zeros for empty splits, graph
    # replays of the same rotated inputs). The combine timed alone in a graph of its own is
    # reported too; that figure carries a lone graph's launch. Where the
    # decode kernel merges the splits itself (``merge``: no combine kernel),
    # the share is what writing the output and merging add to a decode writing float32
    # partials, and can be negative.

    decode_out(first)
    merge = runtime.LAST_LAUNCH.get("merge", "")

    plan = planned(case, first)
    args = [i.op_args(*plan) for i in copies]
    t_decode = time_rotating(
        [graphed(lambda a=a: torch.ops.mla.decode(*a, fill_empty=False)) for a in args]
    )
    o_p, l_p = torch.ops.mla.decode(*first.op_args(*plan))
    kernel = runtime.LAST_LAUNCH["decode_path"]
    loop = None  # the wgmma kernel's loop (docs/kernels.md)
    if kernel == "wgmma":
        one_scorer = runtime.LAST_LAUNCH["wgmma_one_scorer"]
        on_m = runtime.LAST_LAUNCH["wgmma_rows_on_m"]
        loop = "one-scorer" if one_scorer else "rows-on-M" if on_m else "transposed"
    t_alone = time_rotating([graphed(lambda: torch.ops.mla.combine(o_p, l_p, torch.bfloat16))])
    ours = rows[0]
    if ours.time_us:
        in_call_us = ours.time_us - t_decode * 1e6
        ours.extra.update(
            num_splits=plan.num_splits,
            total_splits=plan.total_splits,
            decode_only_us=t_decode * 1e6,
            combine_us=in_call_us,
            combine_share=in_call_us / ours.time_us,
            combine_alone_us=t_alone * 1e6,
            kernel=kernel,  # wgmma (Gluon), tma or gather (Triton)
            wgmma_loop=loop,
            merge=merge,  # who merges the splits, and why
        )
    return rows


def cuda_graph_replay(case: Case) -> dict:
    """mla_decode captured in a CUDA graph: replay time and equality with an eager call."""
    inp = Inputs(case, torch.Generator().manual_seed(1), with_contiguous=False)
    result = {}

    def fn():
        result["out"] = decode_out(inp)

    replay = graphed(fn)
    graph_out = result["out"]
    replay()
    fn()
    ok = torch.equal(graph_out, result["out"])
    t = time_rotating([replay]) * 1e6
    return {"case": case.name, "graph_replay_us": t, "matches_eager": ok}


SWEEP_CONFIGS = [
    (bm, bn, w, st, False)
    for bm in (16, 32, 64)
    for bn in (16, 32, 64)
    for w in (2, 4, 8)
    for st in (1, 2)
]


def sweep(case: Case, l2_bytes: int) -> list[dict]:
    """Time the decode kernel + combine for every tiling and a few split counts (graph replays)."""

    gen = torch.Generator().manual_seed(0)
    first = Inputs(case, gen, with_contiguous=False)
    n_copies = min(8, math.ceil(4 * l2_bytes / (first.kv_cache.numel() * 2)))
    copies = [first] + [Inputs(case, gen, False) for _ in range(n_copies - 1)]
    ref = reference(first, case)
    rows_q = case.heads * case.s_q
    planner_splits = even_splits(case, first)
    results = []
    for bm, bn, w, st, tma in SWEEP_CONFIGS:
        if bm > max(16, rows_q):
            continue
        if (
            tma
            and not tiling.tma_support(
                first.kv_cache[..., :L], first.kv_cache[..., L:], first.block_table, bn
            )[0]
        ):
            continue
        cfg = tiling.TritonTiling(bm, bn, w, st, tma)
        for splits in sorted({max(1, planner_splits // 2), planner_splits, planner_splits * 2}):

            def make(inp, cfg=cfg, splits=splits):
                def fn():
                    o, lse = runtime.decode(*inp.op_args(splits), config=cfg)
                    return runtime.combine(o, lse, torch.bfloat16)[0]

                return fn

            try:
                fns = [make(inp) for inp in copies]
                err = rel_err(fns[0](), ref)
                t = time_rotating([graphed(f) for f in fns], warmup=10, rep=60)
                results.append(
                    dict(
                        case=case.name,
                        cfg=[bm, bn, w, st, tma],
                        splits=splits,
                        us=t * 1e6,
                        rel_err=err,
                    )
                )
            except Exception as exc:
                results.append(
                    dict(
                        case=case.name,
                        cfg=[bm, bn, w, st, tma],
                        splits=splits,
                        us=None,
                        error=f"{type(exc).__name__}: {str(exc)[:100]}",
                    )
                )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--no-peers", action="store_true", help="time mla_decode only")
    p.add_argument(
        "--peers", default=",".join(PEERS), help=f"peers to time beside mla_decode (of {PEERS})"
    )
    p.add_argument("--tag", default="", help="suffix for the result files")
    p.add_argument("--sweep", action="store_true", help="tiling/split sweep of our kernel only")
    p.add_argument("--diagnose", action="store_true", help="registers/spills/PTX of our kernel")
    p.add_argument(
        "--split-sweep", action="store_true", help="split plans (even vs balanced), default tiling"
    )
    args = p.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    props = torch.cuda.get_device_properties(0)
    meta = {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    peers = () if args.no_peers else tuple(n for n in args.peers.split(",") if n)
    unknown = set(peers) - set(PEERS)
    if unknown:
        p.error(f"--peers: unknown {sorted(unknown)}; expected names from {PEERS}")
    meta["flashinfer"] = flashinfer_version() or (
        "not installed on this machine: not measured (benchmarks/flashinfer_offline.sh carries "
        "it to a GPU machine with no network)"
    )
    ceil = ceilings()
    meta.update(ceil)
    selected = [CASES[c] for c in args.cases.split(",")]
    if args.diagnose:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        diagnose(selected, Path(args.out))
    if args.sweep:
        run_sweep(selected, meta, Path(args.out))
    if args.split_sweep:
        run_split_sweep(selected, meta, Path(args.out))
    if args.sweep or args.diagnose or args.split_sweep:
        return
    bar = tqdm(total=len(selected), desc="cases", file=sys.stderr) if tqdm else None
    rows: list[Row] = []
    t0 = time.time()
    for case in selected:
        progress = (lambda s: bar.set_postfix_str(s)) if bar else (lambda s: None)
        rows += run_case(case, ceil, peers, props.L2_cache_size, progress)
        if bar:
            bar.update()
    if bar:
        bar.close()
    graph = cuda_graph_replay(CASES["h16_b128_4k"])
    meta["wall_s"] = time.time() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decode_{meta['device'].replace(' ', '_')}_{meta['date'][:10]}{args.tag}"
    (out / f"{stem}.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "cases": {c.name: asdict(c) for c in selected},
                "rows": [asdict(r) for r in rows],
                "cuda_graph": graph,
            },
            indent=1,
        )
    )
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    try:
        plot(rows, meta, out / f"{stem}.png")
    except Exception as exc:
        print(f"plot skipped: {exc}")

    print(
        f"\n{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
        f"copy {ceil['copy_bw_Bps'] / 1e9:.0f} GB/s  "
        f"bf16 mm {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s  flashinfer: {meta['flashinfer']}"
    )
    print(
        f"{'case':<19}{'impl':<14}{'us':>10}{'GB/s':>8}{'TFLOP/s':>9}{'roofline':>9}{'rel_err':>9}"
        f"{'dirty':>7}{'splits':>7}{'comb%':>7}{'merge':>8}  note"
    )
    for r in rows:
        t = f"{r.time_us:10.1f}" if r.time_us else f"{'-':>10}"
        g = f"{r.gbps:8.0f}" if r.gbps else f"{'-':>8}"
        fl = f"{r.tflops:9.1f}" if r.tflops else f"{'-':>9}"
        rf = f"{r.roofline_fraction:9.2f}" if r.roofline_fraction else f"{'-':>9}"
        e = f"{r.rel_err:9.1e}" if r.rel_err is not None else f"{'-':>9}"
        dirty = r.extra.get("roofline_fraction_dirty_l2")
        dl = f"{dirty:7.2f}" if dirty else f"{'':>7}"
        sp = f"{r.extra.get('num_splits', ''):>7}"
        cs = f"{100 * r.extra['combine_share']:6.1f}%" if "combine_share" in r.extra else f"{'':>7}"
        merge = r.extra.get("merge", "").split(":")[0].replace("decode kernel", "kernel")
        mg = f"{merge.replace('mla::combine', 'combine'):>8}"
        print(f"{r.case:<19}{r.impl:<14}{t}{g}{fl}{rf}{e}{dl}{sp}{cs}{mg}  {r.note[:60]}")
    print(
        f"CUDA graph replay, h16_b128_4k: {graph['graph_replay_us']:.1f} us, "
        f"matches eager: {graph['matches_eager']}"
    )
    ours = {r.case: r for r in rows if r.impl == "mla_decode" and r.time_us}
    for name, what in (
        ("h16_b128_4k_fp8", "e4m3 kv_c, bf16 k_pe"),
        ("h16_b128_4k_fp8row", "all e4m3"),
    ):
        if "h16_b128_4k" in ours and name in ours:
            print(
                f"fp8 cache ({name}: {what}) vs bf16 (h16_b128_4k): "
                f"{ours['h16_b128_4k'].time_us / ours[name].time_us:.2f}x faster, "
                f"rel_err vs the bf16-cache reference {ours[name].rel_err:.1e}"
            )
    for masked, base in (("h16_b128_4k_mask", "h16_b128_4k"), ("h128_b32_4k_mask", "h128_b32_4k")):
        if base in ours and masked in ours:
            print(
                f"all-visible bf16 mask ({masked}) vs none ({base}): "
                f"{ours[masked].time_us / ours[base].time_us:.2f}x the time"
            )


PTX_MARKERS = {
    "wgmma": "wgmma.mma_async",
    "mma.sync": "mma.sync",
    "ldmatrix": "ldmatrix",
    "cp.async": "cp.async.cg",
    "cp.async.bulk(TMA)": "cp.async.bulk",
    "ld.global.v4": "ld.global.v4",
    "ld.global(all)": "ld.global",
    "st.shared": "st.shared",
}


def diagnose(selected: list[Case], out: Path) -> None:
    """Registers, spills, shared memory and instruction mix of the compiled decode kernel."""

    print(f"{'case':<19}{'cfg':<18}{'regs':>5}{'spill':>6}{'smem':>8}  ptx instruction counts")
    for case in selected:
        inp = Inputs(case, torch.Generator().manual_seed(0), with_contiguous=False)
        rows_q = case.heads * case.s_q
        default = tiling.triton_tiling(rows_q, L, float8_cache=case.fp8)
        for cfg in (default, tiling.TritonTiling(default.block_m, 64, 8, 3, False)):
            runtime.decode(*inp.op_args(2), config=cfg)
            k = runtime.LAST_LAUNCH["decode"]
            ptx = k.asm["ptx"]
            counts = {n: ptx.count(m) for n, m in PTX_MARKERS.items()}
            if cfg is default:
                (out / f"decode_{case.name}.ptx").write_text(ptx)
            path = runtime.LAST_LAUNCH["decode_path"]
            c = f"{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages},{path}"
            print(
                f"{case.name:<19}{c:<18}{k.n_regs:>5}{k.n_spills:>6}{k.metadata.shared:>8}  "
                + " ".join(f"{n}={v}" for n, v in counts.items())
            )
        del inp
        torch.cuda.empty_cache()


def floor_seconds(case: Case, meta: dict) -> float:
    """The case's roofline time, ``max(bytes / copy_bw, flops / matmul_rate)``, in seconds."""
    inp = Inputs(case, torch.Generator().manual_seed(0), with_contiguous=False)
    nbytes, flops = case_cost(case, inp)
    return max(nbytes / meta["copy_bw_Bps"], flops / meta["bf16_matmul_flops"])


def even_splits(case: Case, inp: Inputs) -> int:
    """The planner's chunks per sequence for a uniform batch of this shape (one wave)."""
    plan = planned(case, inp)
    return plan.total_splits // case.batch if plan.total_splits else plan.num_splits


def split_sweep(case: Case, l2_bytes: int) -> list[dict]:
    """The default tiling under several split plans (graph replays of decode + combine).

    Even plans cut every sequence into ``n`` chunks of its own length (no ``total_splits``);
    balanced plans give every chunk of the batch one length, from ``total_splits`` chunks over
    the batch's tokens, with ``num_splits`` = headroom x the even count.
    """
    from mla_compile.mla_ops.splits import MAX_SPLITS, split_bounds

    gen = torch.Generator().manual_seed(0)
    first = Inputs(case, gen, with_contiguous=False)
    n_copies = min(8, math.ceil(4 * l2_bytes / (first.kv_cache.numel() * 2)))
    copies = [first] + [Inputs(case, gen, False) for _ in range(n_copies - 1)]
    ref = reference(first, case)
    even = even_splits(case, first)
    plans = [(min(MAX_SPLITS, k * even), None) for k in (1, 2, 4)]
    plans += [
        (min(MAX_SPLITS, headroom * even), waves * case.batch * even)
        for headroom in (1, 2, 4)
        for waves in (1, 2)
    ]
    plan = planned(case, first)
    results = []
    for num_splits, total_splits in dict.fromkeys(plans):
        start, end = split_bounds(first.lengths, num_splits, total_splits)
        chunks = (end > start).sum(-1)  # [B] non-empty chunks per sequence

        def make(inp, num_splits=num_splits, total_splits=total_splits):
            def fn():
                o, lse = torch.ops.mla.decode(*inp.op_args(num_splits, total_splits))
                return torch.ops.mla.combine(o, lse, torch.bfloat16)[0]

            return fn

        fns = [make(inp) for inp in copies]
        err = rel_err(fns[0](), ref)
        t = time_rotating([graphed(f) for f in fns], warmup=10, rep=100)
        results.append(
            dict(
                case=case.name,
                num_splits=num_splits,
                total_splits=total_splits,
                planner=(num_splits, total_splits) == tuple(plan),
                chunks=int(chunks.sum()),
                max_chunk_tokens=int((end - start).max()),
                us=t * 1e6,
                rel_err=err,
            )
        )
    return results


def sweep_cases(name: str, sweep_one, selected: list[Case], meta: dict, out: Path) -> list[dict]:
    """``sweep_one(case, l2_bytes)`` over the cases, written to ``{name}_<device>_<date>.json``."""
    results = []
    for case in selected:
        results += sweep_one(case, meta["l2_bytes"])
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{meta['device'].replace(' ', '_')}_{meta['date'][:10]}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return results


def run_split_sweep(selected: list[Case], meta: dict, out: Path) -> None:
    results = sweep_cases("splits", split_sweep, selected, meta, out)
    print(
        f"{'case':<19}{'num_splits':>11}{'total_splits':>13}{'chunks':>7}{'max chunk':>10}"
        f"{'us':>9}{'roofline':>9}{'rel_err':>9}  planner"
    )
    for case in selected:
        floor = floor_seconds(case, meta)
        for r in (r for r in results if r["case"] == case.name):
            print(
                f"{case.name:<19}{r['num_splits']:>11}{r['total_splits']!s:>13}{r['chunks']:>7}"
                f"{r['max_chunk_tokens']:>10}{r['us']:>9.1f}{floor / (r['us'] * 1e-6):>9.2f}"
                f"{r['rel_err']:>9.1e}  {'<-' if r['planner'] else ''}"
            )


def run_sweep(selected: list[Case], meta: dict, out: Path) -> None:
    results = sweep_cases("sweep", sweep, selected, meta, out)
    print(
        f"{'case':<19}{'best cfg (bm,bn,warps,stages,tma)':<34}{'splits':>7}{'us':>9}"
        f"{'roofline':>9}"
    )
    for case in selected:
        ok = [r for r in results if r["case"] == case.name and r.get("us")]
        best = sorted(ok, key=lambda r: r["us"])[:3]
        floor = floor_seconds(case, meta)
        for r in best:
            frac = floor / (r["us"] * 1e-6)
            print(f"{case.name:<19}{r['cfg']!s:<34}{r['splits']:>7}{r['us']:>9.1f}{frac:>9.2f}")


def plot(rows: list[Row], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impl_names = sorted({r.impl for r in rows}, key=lambda n: n != "mla_decode")
    cases = list(dict.fromkeys(r.case for r in rows))  # in the order they ran
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(impl_names)
    for i, name in enumerate(impl_names):
        vals = [
            next((r.roofline_fraction or 0 for r in rows if r.case == c and r.impl == name), 0)
            for c in cases
        ]
        ax.bar([j + i * width for j in range(len(cases))], vals, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, rotation=35, ha="right")
    ax.set_ylabel("fraction of roofline")
    ax.set_title(
        f"MLA decode, bf16 - {meta['device']}, torch {meta['torch']}, triton {meta['triton']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
