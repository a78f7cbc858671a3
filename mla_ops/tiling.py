"""Kernel capabilities and tilings: which kernel can take a call, with which tile shapes.

Per kernel, what it can run (``wgmma_support``, ``tma_support``, ``gather_support``) and the
tiling rules (``triton_tiling``, ``wgmma_tiling``, ``wgmma_stages``, ``combine_tiling``), each a
pure function of shapes, dtypes and device facts (``device``). The planner (``planner.plan_decode``)
combines them into one frozen plan per call signature; nothing here is read at launch time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import device
from .splits import rows_per_program

# Tokens per KV tile of the Hopper kernel: the M of every wgmma (64 is the instruction's M for
# one warpgroup).
WGMMA_BLOCK_N = 64
# Most splits per sequence that the Hopper kernel's longest-first order ranks: a program's
# (sequence, split) is packed as sequence * this + split, and its per-sequence chunk counts sum
# to 16 bits apiece.
LONGEST_FIRST_MAX_SPLITS = 128


def next_pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two >= ``n``, at least ``floor``."""
    return max(floor, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True)
class TritonTiling:
    """Tiling of the Triton decode kernel: rows per program, tokens per KV tile, warps, pipeline
    depth, and how its loads and float8 products run."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool | None = None  # None: whenever tma_support() allows it
    # float8 kv_c, 16-bit query: nope dots and P @ V in fp16 (False: Triton kernel, bf16 dots)
    fp8_in_f16: bool = True
    fp8_ptx_convert: bool = True  # ... converted by inline PTX where it compiles (sm_89+ CUDA)


def shared_memory_bytes(cfg: TritonTiling, row_width: int, element_size: int, kv_width: int) -> int:
    """Shared memory of the decode kernel, bounded from above.

    row_width: padded row width (power-of-two L block plus power-of-two R block); kv_width: the
    power-of-two L block.

    The query block plus two or more KV tiles: pipelined, Triton keeps ``num_stages`` of them; with
    one stage it stages the tile through shared memory for the dots, which took as much as a second
    stage or less in every tiling compiled. The epilogue converts the float32 ``[block_m, L]``
    accumulator through shared memory too, which bounds 64-row programs at L = 1024 (256 KB).
    Plus 1 KB for barriers. Checked against ``metadata.shared`` of offline sm_90 compiles.
    """
    tiles = max(cfg.num_stages, 2) * cfg.block_n
    loop = (cfg.block_m + tiles) * row_width * element_size
    epilogue = cfg.block_m * kv_width * 4
    return max(loop, epilogue) + 1024


def triton_tiling(
    query_rows: int,
    kv_len: int,
    rope_len: int = 64,
    element_size: int = 2,
    shared_memory: int = device.DEFAULT_SHARED_MEMORY,
    float8_cache: bool = False,
) -> TritonTiling:
    """The tiling used when none is given, shrunk until it fits ``shared_memory`` bytes.

    Measured on an H200 with L=512: 16-row programs are
    fastest with 32-token tiles and 4 warps, 64-row programs with 64-token tiles and 8 warps; two
    pipeline stages beat three or four in both. On an H100, 64-row programs are 30-46 % slower
    with TMA loads than with per-token loads, so they use per-token loads;
    16-row programs keep TMA (3 % faster there). Over a float8 cache (tiles converted to fp16 in
    registers and stored to shared memory as fp16), 16-row programs are fastest with 64-token
    tiles and no pipelining on the H100. fp32 needs smaller tiles to fit.
    """
    block_m = rows_per_program(query_rows)
    if next_pow2(kv_len) <= 128:  # small test dims: registers are no concern
        cfg = TritonTiling(block_m=block_m, block_n=64, num_warps=4, num_stages=2)
    elif block_m <= 16 and float8_cache:
        cfg = TritonTiling(block_m=block_m, block_n=64, num_warps=4, num_stages=1)
    elif block_m <= 16:
        cfg = TritonTiling(block_m=block_m, block_n=32, num_warps=4, num_stages=2)
    else:
        tma = False if block_m >= 64 else None
        cfg = TritonTiling(block_m=block_m, block_n=64, num_warps=8, num_stages=2, use_tma=tma)
    kv_width = next_pow2(kv_len)
    row = kv_width + (next_pow2(rope_len) if rope_len else 0)
    # Stages past two first (one stage needs no less than two, shared_memory_bytes), then rows
    # down to 32, then tokens: at L=1024 (64 heads, bf16, H200) 32 x 32 tiles took 445 us where
    # 32 x 16 took 685 and 16 x 16 559.
    while (need := shared_memory_bytes(cfg, row, element_size, kv_width)) > shared_memory:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_m > 32:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        elif cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > 16:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        else:
            raise ValueError(
                f"the decode kernel's smallest tiling needs {need} bytes of shared memory for "
                f"kv_c width {kv_len} and k_pe width {rope_len} at {element_size}-byte elements; "
                f"this GPU gives a program {shared_memory}"
            )
    return cfg


def tma_support(
    kv_c: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor | None, block_n: int
) -> tuple[bool, str]:
    """Whether KV tiles can be fetched by the copy engine (TMA) and, if not, why."""
    if not device.has_copy_engine(kv_c.device):
        return False, "needs a CUDA device of compute capability >= 9 (Hopper)"
    if block_table is None:
        return False, "cache is not paged"
    page_size = kv_c.shape[1]
    if page_size % block_n:
        return False, f"page_size {page_size} is not a multiple of the {block_n}-token tile"
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[-1] == 0:
            continue
        width = t.shape[-1]
        if width & (width - 1) or width * t.element_size() < 16:
            return False, f"{name} width {width} is not a power of two of >= 16 bytes"
        if t.stride(2) != 1 or t.stride(0) != page_size * t.stride(1):
            return False, f"{name} rows are not a 2-D [tokens, width] view (strides {t.stride()})"
        if (t.stride(1) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False, f"{name} rows or base are not 16-byte aligned"
    return True, "paged, page-aligned tiles, 16-byte aligned rows"


def gather_support(
    kv_c: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor | None
) -> tuple[bool, str]:
    """Whether the wgmma kernel can gather a paged cache row by row with 16-byte ``cp.async``
    copies (any page size) and, if not, why: contiguous rows, page and token strides of whole
    16-byte units, a 16-byte aligned base."""
    if block_table is None:
        return False, "cache is not paged"
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[-1] == 0:
            continue
        unit = 16 // t.element_size()
        if t.stride(2) != 1 or t.stride(0) % unit or t.stride(1) % unit:
            return False, f"{name} rows are not contiguous 16-byte units (strides {t.stride()})"
        if t.data_ptr() % 16:
            return False, f"{name} base is not 16-byte aligned"
    return True, "rows gathered by cp.async"


def wgmma_tiling(query_rows: int) -> tuple[int, int]:
    """``(block_m, num_warps)`` of the wgmma kernel for ``query_rows`` (heads x S_q) per sequence.

    Rows per program as the Triton kernel (``planner.rows_per_program``: 16, 32 or 64, the wgmma's
    N). 16-row programs are one warpgroup (O^T is 64 float32 registers per thread); 32 and 64 rows
    take two warpgroups, which split the scores' rows (64 rows over a 16-bit cache: tokens, with
    the rows on M, ``default_rows_on_m``) and the output's latent columns, so the
    output stays at 64 or 128 registers per thread (offline sm_90 compile: 165 / 228 registers,
    no spills). 64-row programs whose 16-bit tiles arrive by TMA are one-scorer programs instead
    (``default_one_scorer``): the launch's ``num_warps`` is then 4, warpgroup 0's,
    and warpgroup 1 is a partition of its own.
    """
    block_m = rows_per_program(query_rows)
    return block_m, 4 if block_m <= 16 else 8


def wgmma_shared_memory(
    block_m: int, kv_len: int, rope_len: int, num_stages: int = 2, float8: bool = False
) -> int:
    """Upper bound on the wgmma kernel's shared memory in bytes: the 16-bit query block, the KV
    ring and ``P^T``, plus 2 KB for alignment padding and the ring's barriers. ``float8``: kv_c
    in e4m3 (one byte per value in the ring) plus the fp16 tile it is converted into (16-row
    programs that multiply in float8, ``default_float8_products``, need no such
    tile and take less: 101,932 bytes at two slots, offline sm_90). 64 rows,
    L=512, R=64, 16-bit: 231424 (the offline sm_90 compile allocates 230416; an H100 allows
    232448)."""
    ring_row = kv_len * (1 if float8 else 2) + 2 * rope_len
    staging = 2 * WGMMA_BLOCK_N * kv_len if float8 else 0
    query = 2 * block_m * (kv_len + rope_len)
    return (
        query + num_stages * WGMMA_BLOCK_N * ring_row + staging + 2 * WGMMA_BLOCK_N * block_m + 2048
    )


def wgmma_stages(block_m: int, kv_len: int, rope_len: int, float8: bool, shared_memory: int) -> int:
    """Ring slots of the wgmma kernel: three where they fit in ``shared_memory`` (a float8 cache
    at 32 rows), else two (the fewest its pipeline takes). 16-row programs take two: over a float8
    cache three were 1-2.5 % slower on four H100 machines (the float8 forms of h16_b128_4k,
    h16_b4_64k and h16_b64_8k_ragged), their loop being bound by its one math warpgroup's chain of
    work per tile (its shared-memory traffic), not by the bytes in flight; a float8 query's loop,
    nearer its copies, was 2-5 % slower with three too, and float8 products (their first build) with
    three to five slots 2.3-8 % slower on the H100, where the copies alone ran as fast with two as
    with
    five."""
    if block_m <= 16:
        return 2
    fits = wgmma_shared_memory(block_m, kv_len, rope_len, 3, float8) <= shared_memory
    return 3 if fits else 2


def wgmma_support(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
) -> tuple[bool, str]:
    """Whether ``mla::decode`` runs the Hopper kernel (``hopper``) and, if not, why,
    from shapes, dtypes and the device only (so the planner can ask under tracing too)."""
    if not device.has_wgmma(q.device):
        return False, "needs Hopper (compute capability 9.0), compiled kernels and Triton's Gluon"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"q is {q.dtype}, the wgmma kernel takes bf16/fp16"
    float8 = kv_c.dtype == torch.float8_e4m3fn
    pe_fp8 = bool(k_pe.shape[-1]) and k_pe.dtype == torch.float8_e4m3fn
    if (kv_c.dtype != q.dtype and not float8) or (
        k_pe.shape[-1] and k_pe.dtype != q.dtype and not (float8 and pe_fp8)
    ):
        return False, (
            f"cache dtypes ({kv_c.dtype}, {k_pe.dtype}) are neither q's ({q.dtype}) nor a "
            "float8_e4m3fn kv_c with k_pe in q's dtype or in float8_e4m3fn"
        )
    if pe_fp8:
        why = _float8_pe_refusal(k_pe)
        if why:
            return False, why
    if block_table is None:
        return False, "cache is not paged"
    # Widths the kernel was checked at on the GPU (L 64..512, R 0 or 16..64); wider rows need more
    # shared memory than two ring slots leave.
    widths = (("kv_c", kv_c.shape[-1], 64, 512), ("k_pe", k_pe.shape[-1], 16, 64))
    for name, width, lo, hi in widths:
        if (width or name == "kv_c") and (width & (width - 1) or not lo <= width <= hi):
            return False, f"{name} width {width} is not a power of two in [{lo}, {hi}]"
    block_m, _ = wgmma_tiling(q.shape[1] * q.shape[2])
    need = wgmma_shared_memory(block_m, kv_c.shape[-1], k_pe.shape[-1], 2, float8)
    have = device.shared_memory_optin(q.device)
    if need > have:
        return False, f"{block_m}-row programs need {need} bytes of shared memory, GPU has {have}"
    what = ("float8 kv_c and k_pe" if pe_fp8 else "float8 kv_c") if float8 else "bf16/fp16"
    mask = "no mask" if attn_mask is None else f"a {attn_mask.dtype} attn_mask"
    return True, f"Hopper, {what}, paged, {mask}"


def _float8_pe_refusal(k_pe: torch.Tensor) -> str | None:
    """Why the wgmma kernel cannot take a float8 ``k_pe`` (None if it can): it reads one at
    DeepSeek's RoPE width of 64, the width the GPU tests cover; 16-row programs of width 512 over
    whole 64-token pages multiply it in float8, every other program converts it to fp16 as it
    does a float8 ``kv_c``. Elsewhere the Triton kernel takes the
    call."""
    if k_pe.shape[-1] != 64:
        return (
            "a float8_e4m3fn k_pe is read by the wgmma kernel at a width of 64; got k_pe width "
            f"{k_pe.shape[-1]}"
        )
    return None


def wgmma_loads(
    kv_c: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor | None
) -> tuple[str | None, str]:
    """How the wgmma kernel fetches KV tiles: ``"tma"`` (the copy engine, pages of whole 64-token
    tiles), ``"gather"`` (``cp.async`` row by row, any page size), or ``None``; and why."""
    tma, why_tma = tma_support(kv_c, k_pe, block_table, WGMMA_BLOCK_N)
    if tma:
        return "tma", why_tma
    gather, why_gather = gather_support(kv_c, k_pe, block_table)
    if gather:
        return "gather", f"{why_gather} (no TMA: {why_tma})"
    return None, f"no TMA ({why_tma}) and no gather ({why_gather})"


def wgmma_path(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    block_table: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
) -> tuple[str | None, str]:
    """``wgmma_support`` plus what only real tensors show: how the kernel fetches the cache's
    tiles (``wgmma_loads``: ``"tma"`` or ``"gather"``), or ``None`` if it cannot run; and why."""
    ok, why = wgmma_support(q, kv_c, k_pe, block_table, attn_mask)
    if not ok:
        return None, why
    loads, why_loads = wgmma_loads(kv_c, k_pe, block_table)
    return loads, f"{why}; {why_loads}"


# Sequence lengths one decode program sums per step for a balanced split (``total_splits``).
# Fixed, not the batch's power of two: one compiled kernel for every batch size, and on an H100
# a 32-wide block left the 64-row kernel with 168 spilled registers instead of 22 (h128_b32_4k 1.57x
# slower); 128- and 1024-wide blocks ran as fast as the unbalanced kernel.
LENGTHS_PER_STEP = 128


# Programs per multiprocessor that the combine keeps when it widens its column blocks
# (combine_tiling): (h128_b32_4k)'s 4096 wide programs on 132 multiprocessors (31 each) gained,
# (h16_b64_8k_ragged)'s 1024 (7.8 each) lost.
COMBINE_WIDE_PROGRAMS_PER_SM = 16


def combine_tiling(
    num_splits: int, kv_len: int, rows: int = 0, multiprocessors: int = 0
) -> tuple[int, int]:
    """The combine kernel's ``(BLOCK_S, BLOCK_L)``: every split of a ``BLOCK_L``-column block of
    one row per program (2 warps), about 4096 partial values. Measured on an H100 against the
    former fixed 128 columns x 4 warps: 11-18 % faster with 64 splits and 2x with 1 split.

    Where the 256-column cap, not the 4096 values, set the width (up to 8 splits), twice the
    columns (at most 512) if ``rows`` leave every one of ``multiprocessors`` at least
    ``COMBINE_WIDE_PROGRAMS_PER_SM`` programs even so: inside a call, where the combine follows
    the decode's last programs, (h128_b32_4k)'s 4096 rows of 4 splits took 1.4 us less in 512-column
    programs than in 256, while (h16_b64_8k_ragged)'s 1024 rows took 0.4 us more."""
    block_s = next_pow2(num_splits, floor=2)
    block_l = min(next_pow2(kv_len), max(32, min(256, 4096 // block_s)))
    wide = min(2 * block_l, 512, next_pow2(kv_len))
    programs = rows * -(-kv_len // wide)
    if (
        wide > block_l
        and block_s * wide <= 4096
        and multiprocessors > 0
        and programs >= COMBINE_WIDE_PROGRAMS_PER_SM * multiprocessors
    ):
        block_l = wide
    return block_s, block_l


# Splits per sequence up to which the wgmma kernel writes the output itself (``merge_path``): a
# sequence in one chunk directly, one in several merged by the chunk's program that finishes last
# (reading the others' float32 partials from L2). Measured on an H100 and H200: a batch of one
# chunk per sequence gains 1.4-7 % (no float32 partials, no combine launch); a sequence in two
# chunks merges about as fast as ``mla::combine``, and at four or more slower, since the merge then
# runs after the last chunk on one multiprocessor per row block instead of across the machine.
# The plan reads no lengths, so it cannot tell which sequences have one chunk: the limit is on
# the split count (``DecodeOptions.merge_max_splits``).
MERGE_MAX_SPLITS = 2


def merge_path(
    loads: str | None, num_splits: int, max_splits: int = MERGE_MAX_SPLITS
) -> tuple[bool, str]:
    """Whether ``attention`` merges splits inside the decode kernel (no ``mla::combine`` launch)
    and, if not, why; ``max_splits``: the most splits merged in the kernel."""
    if not loads:
        return False, "the Triton decode kernel writes partials only"
    if num_splits > max_splits:
        return False, (
            f"num_splits={num_splits} > {max_splits}: mla::combine spreads the merge over "
            "the machine"
        )
    return True, f"wgmma kernel, num_splits={num_splits} <= {max_splits}"


def default_producer_warps(num_warps: int, gather: bool) -> int:
    """Warps of the producer partition for a kernel of ``num_warps`` math warps: a warpgroup
    of four for gathers (144 16-byte copies per tile and thread for one warp), one warp for the
    copy engine; 0 (the math warps copy) for 8 math warps, whose 241 registers per thread at 64
    rows leave nothing to give a producer (registers are allotted per warpgroup)."""
    if num_warps > 4:
        return 0
    return 4 if gather else 1


def default_rows_on_m(block_m: int, num_warps: int, float8: bool) -> bool:
    """Whether a program puts its query rows on the MMA's M side (``_consume_rows_on_m``):
    64-row programs of two warpgroups over a 16-bit cache (a float8 cache keeps the transposed
    loop, which converts each tile once for both products). The op asks only where
    ``default_one_scorer`` declines: gathered tiles."""
    return block_m == 64 and num_warps == 8 and not float8


def default_query_in_registers(
    one_scorer: bool, kv_len: int, rope_len: int, masked: bool, allowed: bool = True
) -> bool:
    """Whether a one-scorer program keeps the nope query in registers and a ring of three
    (``_score_tiles_qreg``): ``QUERY_IN_REGISTERS``, for DeepSeek's row (``kv_len`` 512, whose
    output the two warpgroups split 64 + 448; ``rope_len`` 64, a k_pe slot that P fits), no
    mask."""
    return allowed and one_scorer and kv_len == 512 and rope_len == WGMMA_BLOCK_N and not masked


def default_one_scorer(block_m: int, float8: bool, gather: bool) -> bool:
    """Whether a program is a one-scorer program (``launch(one_scorer=True)``: warpgroup 0 scores
    whole tiles, warpgroup 1 is a partition of its own that copies and takes half of P.V): 64 rows
    over a 16-bit cache whose tiles arrive by TMA (warpgroup 1 issues bulk copies only). A
    gathered cache keeps the rows-on-M loop, a float8 cache the transposed loop (it converts each
    tile once for both products)."""
    return block_m == 64 and not float8 and not gather


def default_float8_products(block_m: int, kv_len: int, float8: bool, gather: bool) -> bool:
    """Whether a float8 ``kv_c`` is multiplied in float8 (``launch(float8_products=True)``,
    ``_float8_tile``): 16-row programs (one math warpgroup, whose staged fp16 tile was bound by its
    shared-memory traffic) of DeepSeek's width L = 512 (the ``V^T`` register operand's row
    permutation is built for it) over copy-engine tiles. On an H200 20 % faster than the fp16
    products on (h16_b128_4k_fp8) (100 against 125 us), 17 % on the float8 form of h16_b4_64k, 14 %
    on h16_b64_8k_ragged's; on an H100, whose float8 loop runs at its copies' rate either way, level
    to 0.6 % slower. 32- and 64-row programs (two math warpgroups) and gathered tiles keep the
    fp16 staging tile."""
    return float8 and block_m == 16 and kv_len == 512 and not gather


def default_longest_first(
    batch: int, num_splits: int, total_splits: int | None, lengths_per_step: int, rows_on_m: bool
) -> bool:
    """Whether programs take the batch's chunks longest first (``_longest_first``): for a
    balanced plan (``total_splits``) of at most ``lengths_per_step`` sequences (one block of
    lanes ranks them) and ``LONGEST_FIRST_MAX_SPLITS`` splits. Programs with the rows on M keep
    the split-major order: with the chunk held in registers across their loop, ptxas spilled
    168-176 bytes (offline sm_90 compile, Triton 3.6)."""
    return _can_rank(batch, num_splits, total_splits, lengths_per_step) and not rows_on_m


def _can_rank(batch: int, num_splits: int, total_splits: int | None, lengths_per_step: int):
    return (
        total_splits is not None
        and batch <= lengths_per_step
        and num_splits <= LONGEST_FIRST_MAX_SPLITS
    )
