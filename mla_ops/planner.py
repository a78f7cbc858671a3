"""Split-KV planning: how a sequence's cache is cut into chunks, and how many chunks to ask for.

Two separate decisions live here, and both the Triton kernel and the PyTorch reference use them so
that ``mla::decode`` returns the same partials on every device:

* ``split_bounds``: given a sequence's length and the requested ``num_splits``, the token range of
  each split. Chunks are at least ``MIN_CHUNK`` tokens and a multiple of ``SPLIT_GRANULE``, so a
  short sequence uses fewer splits than requested; the rest are empty (``lse = -inf``, ``o = 0``).
  This is decided per sequence on the device, from ``cache_seqlens``, without a host sync.
* ``plan_num_splits``: the host-side choice of ``num_splits`` from static quantities only (batch,
  query rows per sequence, cache capacity, multiprocessor count), never from the lengths' values,
  so it needs no host synchronisation and does not change with the cache length under compile.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("mla_ops")

# Chunks are cut at this granularity (tokens): a multiple of every KV tile size the kernel uses.
SPLIT_GRANULE = 64
# No split is shorter than this (tokens): below it the combine costs more than the parallelism buys.
MIN_CHUNK = 256
# Upper bound on splits per sequence; the combine reads this many partials per row at most.
MAX_SPLITS = 64
# Query rows (heads x S_q) one program handles; more rows are spread over several programs.
MAX_ROWS_PER_PROGRAM = 64

# Batch size assumed when the batch is symbolic (torch.export with a dynamic batch): planning from
# a symbolic value would specialise the program. Pass ``num_splits`` to choose explicitly.
SYMBOLIC_BATCH_ASSUMPTION = 8


def split_len(seqlen: torch.Tensor, num_splits: int) -> torch.Tensor:
    """Tokens per split for each sequence (int tensor, same shape as ``seqlen``)."""
    per_split = (seqlen + num_splits - 1) // num_splits
    per_split = (per_split + SPLIT_GRANULE - 1) // SPLIT_GRANULE * SPLIT_GRANULE
    return per_split.clamp_min(MIN_CHUNK)


def split_bounds(seqlen: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` of every split: two ``[..., num_splits]`` tensors, ``end <= seqlen``."""
    chunk = split_len(seqlen, num_splits).unsqueeze(-1)
    split_id = torch.arange(num_splits, device=seqlen.device, dtype=seqlen.dtype)
    start = split_id * chunk
    end = torch.minimum(start + chunk, seqlen.unsqueeze(-1))
    return start, end


def _multiprocessor_count(device_index: int) -> int:
    # torch caches device properties; no functools.cache here, which dynamo would warn about.
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def rows_per_program(query_rows: int) -> int:
    """Query rows (heads x S_q) one decode program handles: a power of two in [16, 64]."""
    return max(16, min(MAX_ROWS_PER_PROGRAM, 1 << max(0, (query_rows - 1).bit_length())))


def programs_per_sm(query_rows: int) -> int:
    """Decode programs resident on one multiprocessor at once with the default tiling (L=512).

    Measured with ncu on an H200 (benchmarks/NOTES.md): 16-row programs use 243 registers per
    thread and 92 KB of shared memory (2 fit); 64-row programs use 255 registers x 8 warps (1 fits).
    """
    return 2 if rows_per_program(query_rows) <= 16 else 1


def plan_num_splits(
    batch_size: int | torch.SymInt,
    query_rows: int,
    capacity: int | torch.SymInt | None,
    device: torch.device,
) -> int:
    """Choose ``num_splits`` for ``mla_decode`` without looking at tensor values.

    batch_size: sequences in the batch; query_rows: heads x S_q; capacity: the most tokens one
    sequence can hold (cache length or pages x page size), used only when it is a plain int.
    Returns 1 off CUDA (the reference gains nothing from splitting).
    """
    if device.type != "cuda":
        return 1
    # Logging is skipped while dynamo traces (it cannot trace logger calls).
    tracing = torch.compiler.is_compiling()
    if not isinstance(batch_size, int):
        if not tracing:
            log.info(
                "mla_decode planner: batch size is symbolic, planning for %d sequences "
                "(pass num_splits= to override)",
                SYMBOLIC_BATCH_ASSUMPTION,
            )
        batch_size = SYMBOLIC_BATCH_ASSUMPTION
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _multiprocessor_count(index)
    programs_per_split = max(1, batch_size) * math.ceil(query_rows / rows_per_program(query_rows))
    # As many splits as fill one wave of resident programs, and no more: a partial second wave
    # costs up to a whole wave's time (ncu measured a 1.45-wave grid losing that tail).
    wanted = max(1, sms * programs_per_sm(query_rows) // programs_per_split)
    limit = MAX_SPLITS
    if isinstance(capacity, int):
        limit = min(limit, max(1, math.ceil(capacity / MIN_CHUNK)))
    num_splits = max(1, min(wanted, limit))
    if not tracing:
        log.debug(
            "mla_decode planner: batch=%d rows=%d capacity=%s sms=%d -> num_splits=%d",
            batch_size,
            query_rows,
            capacity,
            sms,
            num_splits,
        )
    return num_splits
