"""What any call pays before its first product, timed the way ``bench_decode.py`` times
``mla_decode`` (NOTES.md item 88).

Item 88 sets the pieces that (c)'s 0.80 target must fit against the best measured on Hopper: the
products, the balance and the cheapest merge leave about 0.5 us of the 15.4 us that 0.80 allows
for the launch and the first tile's trip from HBM. This measures those two with nothing else in
the kernel, as CUDA-graph replays with L2 evicted by a read before each call
(``bench_decode.time_rotating``), over (c)'s cache, rotated across copies:

- ``empty``: a grid of ``programs`` programs that do nothing (one never-taken store);
- ``tile``: each program loads its own 64-token tile of (c)'s cache (64 x 576 bf16, 72 KB) and
  stores one float, so the load cannot be dropped;
- ``tile + query``: the same, and also its row block's 64-row query (72 KB; two row blocks, as
  (c)'s 128 heads make), as a decode program does before its first product;
- ``mla_decode (c)``: the op on (c)'s inputs as ``bench_decode.py`` builds them, for scale.

Each is timed with L2 evicted by a read before every call (``clean``, the benchmark's method) and
with the rotated copies alone (``none``), to show what the eviction itself adds.

    python benchmarks/experiments/start_floor.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

TILE = 64  # tokens a tile
ROW = 576  # bf16 values a cache row: 512 latent + 64 RoPE
HEADS = 128  # (c)'s query rows, two row blocks of 64
TOKENS = 32768  # (c)'s context


@triton.jit
def _first_tile(
    CACHE,  # [TOKENS, ROW] bf16
    QUERY,  # [HEADS, ROW] bf16
    OUT,  # [programs] float32
    MODE: tl.constexpr,  # 0: empty, 1: tile, 2: tile + query
    TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, TILE)
    if MODE == 0:
        if pid < 0:  # never taken: the program does nothing
            tl.store(OUT + pid, 0.0)
    else:
        # The whole tile in two loads, 512 + 64 columns, as the decode splits the row.
        base = CACHE + (pid * TILE + rows)[:, None] * 576
        nope = tl.load(base + tl.arange(0, 512)[None, :]).to(tl.float32)
        rope = tl.load(base + 512 + tl.arange(0, 64)[None, :]).to(tl.float32)
        total = tl.sum(tl.sum(nope, 1), 0) + tl.sum(tl.sum(rope, 1), 0)
        if MODE == 2:
            qbase = QUERY + ((pid % 2) * TILE + rows)[:, None] * 576
            q_nope = tl.load(qbase + tl.arange(0, 512)[None, :]).to(tl.float32)
            q_rope = tl.load(qbase + 512 + tl.arange(0, 64)[None, :]).to(tl.float32)
            total += tl.sum(tl.sum(q_nope, 1), 0) + tl.sum(tl.sum(q_rope, 1), 0)
        tl.store(OUT + pid, total)


MODES = {"empty": 0, "tile": 1, "tile + query": 2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", default="1,128,132", help="grid sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--l2", default="clean,none", help="bench_decode.evict_l2 modes")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ceil = bd.ceilings()
    copies = 8  # 8 x 37.7 MB: more than 4x L2, as the benchmark rotates (c)'s inputs
    caches = [torch.randn(TOKENS, ROW, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    queries = [torch.randn(HEADS, ROW, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    outs = [torch.empty(TOKENS // TILE, device="cuda") for _ in range(copies)]
    grids = [int(x) for x in args.programs.split(",")]
    if max(grids) > TOKENS // TILE:
        raise ValueError(f"--programs: at most {TOKENS // TILE}, got {args.programs}")

    def call(mode: str, grid: int, i: int):
        def fn():
            _first_tile[(grid,)](
                caches[i], queries[i], outs[i], MODE=MODES[mode], TILE=TILE, num_warps=8
            )

        return fn

    # Correctness of what is loaded: the largest grid's tile + query sums against torch's.
    call("tile + query", max(grids), 0)()
    ref = caches[0][: max(grids) * TILE].float().view(max(grids), -1).sum(1)
    ref += queries[0].float().view(2, -1).sum(1).repeat(max(grids) // 2 + 1)[: max(grids)]
    err = (outs[0][: max(grids)] - ref).abs().max().item()
    if err > 1e-1:
        raise AssertionError(f"tile + query sums differ from torch's by {err}")

    case = bd.CASES["c"]
    c_inputs = bd.input_copies(case, torch.cuda.get_device_properties(0).L2_cache_size)
    c_graphs = [bd.graphed(lambda inp=inp: bd.decode_out(inp)) for inp in c_inputs]
    variants = [(grid, mode) for grid in grids for mode in MODES] + [(None, "mla_decode (c)")]
    rows = []
    for rnd in range(args.rounds):
        for l2 in args.l2.split(","):
            for grid, mode in variants:
                if grid is None:
                    fns = c_graphs
                else:
                    fns = [bd.graphed(call(mode, grid, i)) for i in range(copies)]
                us = bd.time_rotating(fns, l2=l2) * 1e6
                rows.append(dict(round=rnd, l2=l2, programs=grid, mode=mode, us=us))
                print(rows[-1], flush=True)
    bd.save_experiment(args.out, "start_floor", ceil, rows, copies_c=len(c_inputs))
    print(f"\n{bd.versions_line(ceil)}")
    print(f"{'l2':6}{'programs':>9} {'mode':16} us by round")
    for l2 in args.l2.split(","):
        for grid, mode in variants:
            times = [
                r["us"] for r in rows if (r["l2"], r["programs"], r["mode"]) == (l2, grid, mode)
            ]
            print(f"{l2:6}{grid or '-':>9} {mode:16}" + "".join(f"{t:8.2f}" for t in times))


if __name__ == "__main__":
    main()
