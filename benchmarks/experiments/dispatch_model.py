"""A model of how the decode's programs land on multiprocessors (no GPU): the prediction of
NOTES.md item 39.

Programs are dispatched in order to whichever multiprocessor frees first (one program each, as
the wgmma kernel runs). A real program takes ``start + tiles * tile + epilogue`` us, an empty one
``empty`` us; the figures are item 32's stamps on an H100. Prints the last exit for case (e)'s
chunks (the benchmark's lengths, the planner's plan) in the split-major and the longest-first
order, and for (d)'s 128 chunks of 32 tiles.

    python benchmarks/experiments/dispatch_model.py
"""

from __future__ import annotations

import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mla_ops import planner

SMS, TILE_US, START_US, EPILOGUE_US, EMPTY_US = 132, 3.0, 4.5, 1.5, 0.8


def last_exit(tiles: list[int]) -> float:
    """The last program's exit (us) when ``tiles[i]`` is program i's tile count."""
    free = [0.0] * SMS
    for t in tiles:
        begin = heapq.heappop(free)
        heapq.heappush(free, begin + (START_US + t * TILE_US + EPILOGUE_US if t else EMPTY_US))
    return max(free)


def main() -> None:
    gen = torch.Generator().manual_seed(0)  # bench_decode.Inputs' first draw for (e)
    lengths = torch.randint(1, 8192 + 1, (64,), generator=gen)
    num_splits, total_splits = 4, 128  # planner.plan_splits(64, 16, ...) on 132 multiprocessors
    start, end = planner.split_bounds(lengths, num_splits, total_splits)
    tiles = ((end - start).clamp_min(0) + 63) // 64  # [B, splits]
    split_major = tiles.T.flatten().tolist()
    order = planner.longest_first_order(lengths, num_splits, total_splits)
    longest = tiles[order[:, 0], order[:, 1]].tolist()
    real = [t for t in split_major if t]
    print(f"(e): {len(real)} real chunks, {sum(real)} tiles, {sum(real) / SMS:.1f} per SM")
    print(f"  split-major last exit {last_exit(split_major):.1f} us")
    print(f"  longest-first last exit {last_exit(longest):.1f} us")
    print(f"(d): 128 chunks of 32 tiles, last exit {last_exit([32] * 128):.1f} us")


if __name__ == "__main__":
    main()
