"""Split-KV planning: how a sequence's cache is cut into chunks, and how many chunks to ask for.

Two separate decisions live here, and both the Triton kernel and the PyTorch reference use them so
that ``mla::decode`` returns the same partials on every device:

* ``split_bounds``: given the batch's lengths, ``num_splits`` and optionally ``total_splits``, the
  token range of each split. Chunks are at least ``MIN_CHUNK`` tokens and a multiple of
  ``SPLIT_GRANULE``, so a short sequence uses fewer splits than requested; the rest are empty
  (``lse = -inf``, ``o = 0``). Without ``total_splits`` each sequence is cut into ``num_splits``
  even chunks of its own length. With it, every sequence is cut into chunks of the same length,
  about ``sum(lengths) / total_splits`` (and never so short that a sequence needs more than
  ``num_splits``): a ragged batch then gives every program about the same work, where even
  per-sequence splits make the longest sequence's chunks the whole wave's time. Decided on the
  device, from ``cache_seqlens``, without a host sync.
* ``plan_splits``: the host-side choice of ``num_splits`` and ``total_splits`` from static
  quantities only (batch, query rows per sequence, cache capacity, multiprocessor count), never
  from the lengths' values, so it needs no host synchronisation and does not change with the
  cache length under compile.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from .device import multiprocessor_count

log = logging.getLogger("mla_compile.mla_ops")

# Chunks are cut at this granularity (tokens): a multiple of every KV tile size the kernel uses.
SPLIT_GRANULE = 64
# No split is shorter than this (tokens): below it the combine costs more than the parallelism buys.
MIN_CHUNK = 256
# Upper bound on splits per sequence of a batch; the combine reads this many partials per row at
# most.
MAX_SPLITS = 64
# The same for a batch of one sequence in wgmma programs of at most 32 rows, which has no
# raggedness to leave room for: the chunks of one wave, up to the wgmma kernel's longest-first
# packing limit (``LONGEST_FIRST_MAX_SPLITS``). With 64, 16 heads x S_q 2 over 32k tokens ran 57
# programs on an H100's 132 multiprocessors; 103 took 17 % less time (16 heads x S_q 1: level).
# 64-row programs keep ``MAX_SPLITS``: twice their 128 KB of partials per program measured 2 %
# slower.
SINGLE_SEQUENCE_MAX_SPLITS = 128
# Query rows (heads x S_q) one program handles; more rows are spread over several programs.
MAX_ROWS_PER_PROGRAM = 64

# A planned batch may cut one sequence into this many times its even share of chunks: the room a
# ragged batch's long sequences need to be cut into chunks as short as everyone else's.
RAGGED_HEADROOM = 2

# Batch size assumed when the batch is symbolic (torch.export with a dynamic batch): planning from
# a symbolic value would specialise the program. Pass ``num_splits`` to choose explicitly.
SYMBOLIC_BATCH_ASSUMPTION = 8


def _round_up_to_granule(tokens: torch.Tensor | int) -> torch.Tensor | int:
    return (tokens + SPLIT_GRANULE - 1) // SPLIT_GRANULE * SPLIT_GRANULE


def split_len(
    seqlen: torch.Tensor, num_splits: int, total_splits: int | None = None
) -> torch.Tensor:
    """Tokens per split for each sequence (int tensor, same shape as ``seqlen``).

    seqlen: ``[B]`` lengths of the whole batch (``total_splits`` reads their sum).
    """
    per_split = _round_up_to_granule((seqlen + num_splits - 1) // num_splits)
    if total_splits is not None:
        balanced = _round_up_to_granule((seqlen.sum() + total_splits - 1) // total_splits)
        per_split = torch.maximum(per_split, balanced.to(per_split.dtype))
    return per_split.clamp_min(MIN_CHUNK)


def split_bounds(
    seqlen: torch.Tensor, num_splits: int, total_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` of every split: two ``[B, num_splits]`` tensors, ``end <= seqlen``."""
    chunk = split_len(seqlen, num_splits, total_splits).unsqueeze(-1)
    split_id = torch.arange(num_splits, device=seqlen.device, dtype=seqlen.dtype)
    start = split_id * chunk
    end = torch.minimum(start + chunk, seqlen.unsqueeze(-1))
    return start, end


def longest_first_order(
    seqlen: torch.Tensor, num_splits: int, total_splits: int, chunk_tokens: int = SPLIT_GRANULE
) -> torch.Tensor:
    """The chunk each decode program takes in the wgmma kernel's longest-first order
    (``tiling.default_longest_first``): ``[B * num_splits, 2]`` of ``(sequence, split)``,
    by program (row blocks aside). ``seqlen``: ``[B]`` lengths; chunks as ``split_bounds`` cuts
    them, measured in ``chunk_tokens``-token tiles.

    Equal lengths keep the split-major order (every sequence's first chunk, then every second
    one, ...), which is already longest first. Otherwise: every full chunk, sequence by sequence;
    then the partial last chunks, most tiles first (ties in sequence order); then the empty ones.
    Blocks are dispatched about in program order, so long chunks start in the first wave and the
    programs that start late are the short ones (longest processing time first).
    """
    batch = seqlen.numel()
    seqlen = seqlen.long().cpu()
    seq = torch.arange(batch).repeat(num_splits)
    split = torch.arange(num_splits).repeat_interleave(batch)
    split_major = torch.stack([seq, split], 1)
    if batch == 0 or bool((seqlen == seqlen[0]).all()):
        return split_major
    start, end = split_bounds(seqlen, num_splits, total_splits)
    tokens = (end - start).clamp_min(0)  # [B, splits]
    tiles = (tokens + chunk_tokens - 1) // chunk_tokens
    full = tokens == split_len(seqlen, num_splits, total_splits).unsqueeze(1)
    partial = ~full & (tokens > 0)
    parts = sorted(partial.nonzero().tolist(), key=lambda bs: (-int(tiles[bs[0], bs[1]]), bs[0]))
    # nonzero() walks [B, splits] sequence by sequence.
    order = full.nonzero().tolist() + parts + (~full & ~partial).nonzero().tolist()
    return torch.tensor(order, dtype=torch.long).view(-1, 2)


def rows_per_program(query_rows: int) -> int:
    """Query rows (heads x S_q) one decode program handles: a power of two in [16, 64]."""
    return max(16, min(MAX_ROWS_PER_PROGRAM, 1 << max(0, (query_rows - 1).bit_length())))


def programs_per_sm(query_rows: int, wgmma: bool = False) -> int:
    """Decode programs resident on one multiprocessor at once with the default tiling (L=512).

    Triton kernel, measured with ncu on an H200: 16-row programs use 243
    registers per thread and 92 KB of shared memory (2 fit); 64-row programs use 255 registers x
    8 warps (1 fits). The Gluon wgmma kernel (``wgmma=True``) holds two or three 64-token KV tiles
    in flight, 164 KB (16 rows) to 225 KB (64 rows) of shared memory: 1 fits.
    16-row programs that multiply a float8 cache in float8 take 102 KB, but 255 registers x 160
    threads: 1 fits there too.
    """
    if wgmma:
        return 1
    return 2 if rows_per_program(query_rows) <= 16 else 1


class SplitPlan(NamedTuple):
    """``num_splits`` and ``total_splits`` for ``mla::decode`` (see ``split_bounds``)."""

    num_splits: int
    total_splits: int | None


def plan_splits(
    batch_size: int | torch.SymInt,
    query_rows: int,
    capacity: int | torch.SymInt | None,
    device: torch.device,
    wgmma: bool = False,
) -> SplitPlan:
    """Choose ``num_splits`` and ``total_splits`` for ``mla_decode`` without reading tensor values.

    batch_size: sequences in the batch; query_rows: heads x S_q; capacity: the most tokens one
    sequence can hold (cache length or pages x page size), used only when it is a plain int.
    The chunks of one wave of resident programs are spread over the batch's tokens
    (``total_splits``), and one sequence may take up to ``RAGGED_HEADROOM`` times its even share
    (``num_splits``). A uniform batch gets exactly the even per-sequence split; a symbolic batch
    gets even per-sequence splits (no ``total_splits``). A single sequence of at most 32 query
    rows on the wgmma kernel, of a known capacity, gets no headroom: as many splits as one
    wave's chunks of its capacity (up to ``SINGLE_SEQUENCE_MAX_SPLITS``). ``wgmma``: the call
    runs the Gluon wgmma kernel (``triton_kernels.wgmma_plan_path``), which keeps one program
    per multiprocessor.
    Returns ``(1, None)`` off CUDA (the reference gains nothing from splitting).
    """
    if device.type != "cuda":
        return SplitPlan(1, None)
    # Logging is skipped while dynamo traces (it cannot trace logger calls).
    tracing = torch.compiler.is_compiling()
    symbolic = not isinstance(batch_size, int)
    if symbolic:
        if not tracing:
            log.info(
                "mla_decode planner: batch size is symbolic, planning for %d sequences "
                "(pass num_splits= to override)",
                SYMBOLIC_BATCH_ASSUMPTION,
            )
        batch_size = SYMBOLIC_BATCH_ASSUMPTION
    batch_size = max(1, batch_size)
    sms = multiprocessor_count(device)
    programs_per_split = batch_size * math.ceil(query_rows / rows_per_program(query_rows))
    # As many chunks as fill one wave of resident programs, and no more: a partial second wave
    # costs up to a whole wave's time (ncu measured a 1.45-wave grid losing that tail).
    even = max(1, sms * programs_per_sm(query_rows, wgmma) // programs_per_split)
    # (The Triton kernel, two programs per multiprocessor, keeps MAX_SPLITS: not measured. So
    # does an unknown capacity: a short sequence would leave most of 128 splits empty.)
    single = (
        batch_size == 1
        and not symbolic
        and wgmma
        and rows_per_program(query_rows) <= 32
        and isinstance(capacity, int)
    )
    limit = SINGLE_SEQUENCE_MAX_SPLITS if single else MAX_SPLITS
    if isinstance(capacity, int):
        limit = min(limit, max(1, math.ceil(capacity / MIN_CHUNK)))
    if symbolic:
        plan = SplitPlan(max(1, min(even, limit)), None)
    elif single:
        # The chunks a full cache is cut into for one wave (split_len's rounding), so that a
        # split count past them (an emptier combine) is not asked for.
        chunks = -(-capacity // _round_up_to_granule(-(-capacity // even)))
        plan = SplitPlan(max(1, min(chunks, limit)), even)
    else:
        plan = SplitPlan(max(1, min(RAGGED_HEADROOM * even, limit)), batch_size * even)
    if not tracing:
        log.debug(
            "mla_decode planner: batch=%d rows=%d capacity=%s sms=%d wgmma=%s -> %s",
            batch_size,
            query_rows,
            capacity,
            sms,
            wgmma,
            plan,
        )
    return plan
