"""Does a deeper copy ring stream a paged cache faster? A copies-only stand-in (NOTES.md item 83).

A 16-row program of the wgmma kernel keeps two 72 KB ring slots in flight; a third does not fit
beside its query. Before building a kernel around three slots, this times the ring alone: each
program streams its chunk of the cache through ``NUM_STAGES`` slots by TMA (the kernel's own
``_locate_tile`` and copy-engine boxes, the lookup made before the wait as its producer does),
holding each landed slot ``hold`` clock cycles before refilling it (a stand-in for the math that
keeps a slot busy), and reads nothing. Chunks are the planner's for the case. Timing as the
benchmark's: CUDA-graph replays of rotated input copies, L2 evicted by a read before each.

    python benchmarks/experiments/ring_depth.py --cases d,a --stages 1,2,3 --holds 0,1000,2000 \
        --out $OUT
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import wgmma_decode as wd


@gluon.jit
def _hold(cycles):
    """Spin for ``cycles`` SM clock cycles (``%clock64``)."""
    t0 = gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
    )
    now = t0
    while now - t0 < cycles:
        now = gl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
        )


@gluon.jit
def _issue(KV_DESC, PE_DESC, kv_ring, pe_ring, ready, slot, where):
    bar = ready.index(slot)
    mbarrier.expect(bar, KV_DESC.block_type.nbytes + PE_DESC.block_type.nbytes)
    wd._tma_load(KV_DESC, [where, 0], bar, kv_ring.index(slot))
    wd._tma_load(PE_DESC, [where, 0], bar, pe_ring.index(slot))


@gluon.jit
def _stream_kernel(
    KV_DESC, PE_DESC, BLOCK_TABLE, stride_btb, NUM_PAGES, MAX_PAGES, seqlen, chunk_tiles,
    programs_per_seq, hold, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, PAGE_SIZE: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    b64 = (pid // programs_per_seq).to(gl.int64)
    start = (pid % programs_per_seq) * chunk_tiles * BLOCK_N
    end = gl.minimum(start + chunk_tiles * BLOCK_N, seqlen)
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    kv_ring = gl.allocate_shared_memory(KV_DESC.dtype, [NUM_STAGES, BLOCK_N, L], KV_DESC.layout)
    pe_ring = gl.allocate_shared_memory(PE_DESC.dtype, [NUM_STAGES, BLOCK_N, R], PE_DESC.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])
    for i in gl.static_range(NUM_STAGES):
        if i < n_tiles:
            where, _bad = wd._locate_tile(
                BLOCK_TABLE, b64, start + i * BLOCK_N, end, stride_btb, 1, NUM_PAGES, MAX_PAGES,
                PAGE_SIZE, BLOCK_N, False, layout,
            )  # fmt: skip
            _issue(KV_DESC, PE_DESC, kv_ring, pe_ring, ready, i, where)
    for i in range(n_tiles):
        slot = i % NUM_STAGES
        # Looked up before the wait, as the kernel's producer does.
        where, _bad = wd._locate_tile(
            BLOCK_TABLE, b64, start + (i + NUM_STAGES) * BLOCK_N, end, stride_btb, 1, NUM_PAGES,
            MAX_PAGES, PAGE_SIZE, BLOCK_N, False, layout,
        )  # fmt: skip
        mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
        _hold(hold)
        if i + NUM_STAGES < n_tiles:
            _issue(KV_DESC, PE_DESC, kv_ring, pe_ring, ready, slot, where)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))


def stream_call(inp: bd.Inputs, chunk_tiles: int, stages: int, hold: int):
    """A closure launching the copies-only stream on ``inp`` (uniform lengths)."""
    kv_c, k_pe = inp.decode_cache()
    seqlen = int(inp.lengths.max())
    programs_per_seq = math.ceil(seqlen / (chunk_tiles * wd.BLOCK_N))
    grid = (inp.q.shape[0] * programs_per_seq,)
    kv_desc, pe_desc = wd.descriptor(kv_c), wd.descriptor(k_pe)
    bt = inp.block_table

    def fn():
        _stream_kernel[grid](
            kv_desc, pe_desc, bt, bt.stride(0), kv_c.shape[0], bt.shape[1], seqlen, chunk_tiles,
            programs_per_seq, hold, NUM_STAGES=stages, BLOCK_N=wd.BLOCK_N, L=kv_c.shape[-1],
            R=k_pe.shape[-1], PAGE_SIZE=kv_c.shape[1], num_warps=4,
        )  # fmt: skip

    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="d,a")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--holds", default="0,1000,2000", help="clock cycles a landed slot is held")
    ap.add_argument(
        "--programs-per-sm", default="1",
        help="chunks cut for this many programs a multiprocessor (1: the planner's chunk); more "
        "run side by side where the slots' shared memory lets them",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="ring_depth")
    args = ap.parse_args()
    ceil = bd.ceilings()
    stages = [int(s) for s in args.stages.split(",")]
    holds = [int(h) for h in args.holds.split(",")]
    rows = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        if case.ragged or case.page_size % wd.BLOCK_N or case.fp8:
            raise SystemExit(f"{name}: uniform lengths, 64-token pages and a bf16 cache only")
        copies = bd.input_copies(case, torch.cuda.get_device_properties(0).L2_cache_size)
        plan = bd.planned(case, copies[0])
        tokens = case.batch * case.context
        chunk_tiles = math.ceil(tokens / (plan[1] or plan[0] * case.batch) / wd.BLOCK_N)
        floor_us = bd.floor_seconds(case, ceil) * 1e6
        row = dict(case=name, plan=list(plan), chunk_tiles=chunk_tiles, floor_us=floor_us)
        per_sm = [int(p) for p in args.programs_per_sm.split(",")]
        for r in range(args.rounds):
            shipped = [bd.wgmma_call(inp, *plan, with_combine=False) for inp in copies]
            us = bd.time_rotating([bd.graphed(f) for f in shipped], warmup=10, rep=100) * 1e6
            row.setdefault("shipped_decode_us", []).append(us)
            print(name, "shipped decode", f"round {r}", f"{us:.1f} us", flush=True)
            for p in per_sm:
                tiles = math.ceil(chunk_tiles / p)
                for s in stages:
                    for h in holds:
                        fns = [stream_call(inp, tiles, s, h) for inp in copies]
                        us = bd.time_rotating([bd.graphed(f) for f in fns], warmup=10, rep=100)
                        key = f"stages{s}_hold{h}" + (f"_per_sm{p}" if p > 1 else "")
                        row.setdefault(f"{key}_us", []).append(us * 1e6)
                        print(name, key, f"round {r}", f"{us * 1e6:.1f} us", flush=True)
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, args.name, ceil, rows)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
          f"{triton.__version__}; {ceil}")  # fmt: skip
    for row in rows:
        print(f"{row['case']}: plan {row['plan']}, {row['chunk_tiles']} tiles a program, "
              f"floor {row['floor_us']:.1f} us")  # fmt: skip
        for key, us in row.items():
            if key.endswith("_us") and isinstance(us, list):
                print(f"  {key:22} {', '.join(f'{u:.1f}' for u in us):>14} us  "
                      f"{row['floor_us'] / min(us):.2f} of the roofline")  # fmt: skip


if __name__ == "__main__":
    main()
