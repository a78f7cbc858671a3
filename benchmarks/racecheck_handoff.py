"""The Hopper kernel's shared-memory hand-off between warp-specialised partitions, alone, for
compute-sanitizer's racecheck.

    compute-sanitizer --tool racecheck python benchmarks/racecheck_handoff.py

Two partitions of four warps pass a ``[128]`` float32 buffer back and forth ``ROUNDS`` times,
exactly as the decode kernel's one-scorer and query-in-registers loops pass ``alpha``, ``P`` and
the row sums: the writer stores, every writer thread passes its partition's barrier, one arrival
on an mbarrier releases the buffer; the reader waits on that mbarrier (acquire), reads, passes its
own barrier and arrives on a second mbarrier that gives the buffer back. Every value the reader
sees is checked, so the program shows that the hand-off delivers what was written; any hazard
racecheck reports here is between accesses this ordering separates. ``--single`` runs the same
writes and reads in one partition ordered by its barrier alone (racecheck's reference case).
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

ROUNDS = 8
WIDTH = 128


@gluon.jit
def _writer(buf, ready, free, ROUNDS: gl.constexpr, WIDTH: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, WIDTH, layout=layout)
    for i in range(ROUNDS):
        mbarrier.wait(free, (i & 1) ^ 1)  # the reader is done with round i - 1
        buf.store((offs + i * WIDTH).to(gl.float32))
        _thread_barrier()  # every writer thread's store precedes the one arrival
        mbarrier.arrive(ready, count=1)


@gluon.jit
def _reader(buf, ready, free, OUT, ROUNDS: gl.constexpr, WIDTH: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, WIDTH, layout=layout)
    for i in range(ROUNDS):
        mbarrier.wait(ready, i & 1)
        got = buf.load(layout)
        gl.store(OUT + i * WIDTH + offs, got)
        _thread_barrier()  # every reader thread's load precedes the one arrival
        mbarrier.arrive(free, count=1)


@gluon.jit
def _handoff_kernel(OUT, ROUNDS: gl.constexpr, WIDTH: gl.constexpr, SINGLE: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [WIDTH], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if SINGLE:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs = gl.arange(0, WIDTH, layout=layout)
        for i in range(ROUNDS):
            buf.store((offs + i * WIDTH).to(gl.float32))
            _thread_barrier()
            gl.store(OUT + i * WIDTH + offs, buf.load(layout))
            _thread_barrier()
    else:
        ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(ready, count=1)
        mbarrier.init(free, count=1)
        gl.warp_specialize(
            [
                (_writer, (buf, ready, free, ROUNDS, WIDTH)),
                (_reader, (buf, ready, free, OUT, ROUNDS, WIDTH)),
            ],
            [4],
            [96],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true", help="one partition, barriers only")
    single = parser.parse_args().single
    out = torch.full((ROUNDS * WIDTH,), -1.0, device="cuda")
    _handoff_kernel[(1,)](out, ROUNDS, WIDTH, single, num_warps=4)
    torch.cuda.synchronize()
    want = torch.arange(ROUNDS * WIDTH, device="cuda", dtype=torch.float32)
    assert torch.equal(out, want), (out - want).abs().max()
    print(f"handoff ({'one partition' if single else 'two partitions, mbarriers'}): "
          f"{ROUNDS} rounds delivered what was written")  # fmt: skip


if __name__ == "__main__":
    main()
