"""How fast one multiprocessor moves an epilogue's float32 block to and from L2 while the others do
the same: the open question of NOTES.md items 45-46. There, the in-kernel merges' epilogues took
6-9 us for 160-400 KB per multiprocessor, far slower than the bytes alone suggest. Not measured
yet (written without a device); the next session's first call.

One program per multiprocessor (``--programs``; default the SM count minus 4, as (b)'s and (d)'s
128 decode programs), 4 warps, each on its own ``KB``-kilobyte part of a float32 buffer, in
16 KB tiles of 64 x 64 values (each tile contiguous; the merges' rows are 256-byte runs):
- ``store``: 16-byte stores of every tile, then exit (a decode program's partial store);
- ``release``: the same, then a barrier and one thread's acq_rel atomic (the merges' arrival,
  which cannot complete before the block has drained to L2);
- ``load``: ``.cg`` 16-byte loads of every tile, ``--unroll`` tiles in flight at a time, from
  L2 (the block was stored by the previous replay and the buffer fits in L2);
- ``tma_store`` / ``tma_load``: the same tiles through a tensor descriptor (TMA bulk copies via
  shared memory; loads pipelined ``--unroll`` deep by Triton's pipeliner): whether a bulk copy
  moves a program's block faster than its threads' own 16-byte accesses.

Per program, global-timer stamps: start, stores issued (or loads done), atomic returned, end.
Per variant: the CUDA-graph replay time without L2 eviction (the point is L2-resident data; a
load's graph also holds the store before it, whose time alone is subtracted), the median and the
largest of each phase over the programs, and the implied per-multiprocessor GB/s (block over the
median program's whole time) and summed GB/s (all blocks over the replay time).

    python benchmarks/experiments/epilogue_rate.py --kb 32,64,128,256 --unroll 1,2,4 \\
        --warps 4,8 --out $OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Stamp slots per program: start, stores issued / loads done, atomic returned, end.
STAMPS = tl.constexpr(4)
MODES = ("store", "release", "load", "tma_store", "tma_load")
TILE = tl.constexpr(64)  # a tile is TILE x TILE float32 values (16 KB)


@triton.jit
def _now(TIMED: tl.constexpr):
    if TIMED:
        return tl.extra.cuda.globaltimer()
    return tl.zeros([], tl.int64)


@triton.jit
def _epilogue(
    BUF, DESC, SUMS, COUNTERS, STAMP_BUF, N_TILES: tl.constexpr, MODE: tl.constexpr,
    UNROLL: tl.constexpr, TIMED: tl.constexpr,
):  # fmt: skip
    """MODE 0: store the program's N_TILES tiles; 1: store, barrier, acq_rel atomic; 2: load
    them (UNROLL at a time) and store their sum into SUMS[pid]; 3 / 4: as 0 / 2 through DESC
    (BUF as [rows, TILE] float32, TILE x TILE blocks)."""
    pid = tl.program_id(0)
    start = _now(TIMED)
    base = BUF + pid.to(tl.int64) * N_TILES * TILE * TILE
    offs = tl.arange(0, TILE)[:, None] * TILE + tl.arange(0, TILE)[None, :]
    mid = start
    atomic = start
    if MODE == 3:
        value = (offs + pid).to(tl.float32)
        for i in range(N_TILES):
            DESC.store([(pid * N_TILES + i) * TILE, 0], value + i)
        mid = _now(TIMED)
        atomic = mid
    elif MODE == 4:
        acc = tl.zeros([TILE, TILE], tl.float32)
        for i in tl.range(N_TILES, num_stages=UNROLL + 1):
            acc += DESC.load([(pid * N_TILES + i) * TILE, 0])
        tl.store(SUMS + pid, tl.sum(tl.sum(acc, 1), 0))
        mid = _now(TIMED)
        atomic = mid
    elif MODE < 2:
        value = (offs + pid).to(tl.float32)
        for i in range(N_TILES):
            tl.store(base + i * TILE * TILE + offs, value + i)
        mid = _now(TIMED)
        atomic = mid
        if MODE == 1:
            tl.debug_barrier()
            tl.atomic_add(COUNTERS + pid, 1, sem="acq_rel", scope="gpu")
            atomic = _now(TIMED)
    else:
        acc = tl.zeros([TILE, TILE], tl.float32)
        for i in range(0, N_TILES, UNROLL):
            for u in tl.static_range(UNROLL):
                acc += tl.load(
                    base + (i + u) * TILE * TILE + offs, mask=i + u < N_TILES, other=0.0,
                    cache_modifier=".cg",
                )  # fmt: skip
        tl.store(SUMS + pid, tl.sum(tl.sum(acc, 1), 0))
        mid = _now(TIMED)
        atomic = mid
    if TIMED:
        row = STAMP_BUF + pid * STAMPS
        tl.store(row, start)
        tl.store(row + 1, mid)
        tl.store(row + 2, atomic)
        tl.store(row + 3, _now(TIMED))


def launch(
    buf, sums, counters, stamps, programs: int, kb: int, mode: str, unroll: int = 1, warps: int = 4
):  # fmt: skip
    """One launch of ``_epilogue``: ``programs`` programs of ``kb`` KB each (a multiple of 16),
    ``warps`` warps each."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_tiles = kb * 1024 // (TILE.value * TILE.value * 4)
    # Tile i of program p is rows (p * n_tiles + i) * TILE of this [rows, TILE] view: the same
    # bytes as the pointer modes' contiguous tiles.
    rows = programs * n_tiles * TILE.value
    desc = TensorDescriptor.from_tensor(buf[: rows * TILE.value].view(rows, TILE.value),
                                        [TILE.value, TILE.value])  # fmt: skip
    _epilogue[(programs,)](
        buf, desc, sums, counters, stamps, N_TILES=n_tiles, MODE=MODES.index(mode),
        UNROLL=unroll, TIMED=stamps is not None, num_warps=warps,
    )  # fmt: skip


def phases(stamps: torch.Tensor) -> dict[str, float]:
    """Median and largest of each phase over the programs, in us."""
    s = stamps.double().cpu()
    spans = {"issue": s[:, 1] - s[:, 0], "atomic": s[:, 2] - s[:, 1], "whole": s[:, 3] - s[:, 0]}
    out = {}
    for name, v in spans.items():
        values = (v / 1e3).tolist()
        out[f"{name}_med_us"] = statistics.median(values)
        out[f"{name}_max_us"] = max(values)
    return out


def main() -> None:
    import bench_decode as bd

    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", default="32,64,128,256", help="KB per program (multiples of 16)")
    ap.add_argument("--unroll", default="1,2,4", help="tiles in flight per load step")
    ap.add_argument("--warps", default="4,8", help="warps per program")
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {MODES}")
    ap.add_argument("--programs", type=int, default=0, help="0: the SM count minus 4")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    programs = args.programs or props.multi_processor_count - 4
    sizes = [int(k) for k in args.kb.split(",")]
    if any(k % 16 for k in sizes):
        raise ValueError(f"--kb: expected multiples of 16, got {sizes}")
    if programs * max(sizes) * 1024 > props.L2_cache_size // 2:
        print(f"note: {programs} x {max(sizes)} KB is over half of L2; loads may reach DRAM")
    buf = torch.zeros(programs * max(sizes) * 256, device="cuda")
    sums = torch.zeros(programs, device="cuda")
    counters = torch.zeros(programs, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(programs, STAMPS.value, dtype=torch.int64, device="cuda")
    rows = []
    warp_counts = [int(w) for w in args.warps.split(",")]
    for kb, warps, mode in (
        (k, w, m) for k in sizes for w in warp_counts for m in args.modes.split(",")
    ):
        loads = mode.endswith("load")
        for unroll in [int(u) for u in args.unroll.split(",")] if loads else [1]:

            def store(kb=kb, warps=warps):
                launch(buf, sums, counters, None, programs, kb, "store", warps=warps)

            def call(kb=kb, mode=mode, unroll=unroll, warps=warps, loads=loads, stamps_arg=None):
                if loads:  # the block is in L2: stored by the previous call
                    store()
                launch(buf, sums, counters, stamps_arg, programs, kb, mode, unroll, warps)

            us = bd.time_rotating([bd.graphed(call)], warmup=10, rep=100, l2="none") * 1e6
            if loads:  # the store that precedes each load, timed alone
                us -= bd.time_rotating([bd.graphed(store)], warmup=10, rep=100, l2="none") * 1e6
            call(stamps_arg=stamps)
            torch.cuda.synchronize()
            row = dict(mode=mode, kb=kb, warps=warps, unroll=unroll, programs=programs, us=us,
                       **phases(stamps))  # fmt: skip
            moved = kb * 1024
            row["sm_GBps"] = moved / (row["whole_med_us"] * 1e3)
            row["sum_GBps"] = programs * moved / (us * 1e3)
            rows.append(row)
            print(row, flush=True)
    bd.save_experiment(args.out, "epilogue_rate", {}, rows, programs=programs)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; {programs} "
          "programs, one per multiprocessor")  # fmt: skip
    print(f"{'mode':10}{'KB':>5}{'warps':>6}{'unroll':>7}{'us':>8}{'issue':>8}{'atomic':>8}"
          f"{'whole':>8}{'max':>8}{'SM GB/s':>9}{'sum GB/s':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['mode']:10}{r['kb']:5}{r['warps']:6}{r['unroll']:7}{r['us']:8.2f}"
            f"{r['issue_med_us']:8.2f}{r['atomic_med_us']:8.2f}{r['whole_med_us']:8.2f}{r['whole_max_us']:8.2f}"
            f"{r['sm_GBps']:9.1f}{r['sum_GBps']:9.1f}"
        )


if __name__ == "__main__":
    main()
