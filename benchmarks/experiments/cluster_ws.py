"""Can the decode kernel's shape of program, warp-specialized (a default partition and a worker
partition of 4 warps each, as one-scorer programs), run as a cluster of 2 and hand data to its
partner (NOTES.md item 47)? A check of the three pieces a cluster merge would need, none of
which Gluon (Triton 3.6) offers:

- a cluster barrier: outside the warp-specialized region the worker warps sit parked, and
  ``barrier.cluster`` waits for every thread that has not exited, so it must be executed by
  every partition inside the region;
- shared memory at an address the program knows without Triton's allocator: the launch asks
  for 32 bytes more than Triton's allocation, and the program finds them at
  ``global_smem + %dynamic_smem_size - 32`` (two mbarriers there);
- a hand-off: each program's default partition arrives on its partner's mbarrier
  (``mbarrier.arrive.release.cluster`` on a ``mapa`` address) and waits on its own (acquire at
  cluster scope), ``--rounds`` times, timed by the global timer. Rounds alternate between two
  mbarriers: with one, a partner a round ahead could complete two phases before the wait for
  the first, and a parity wait would then hang.

    python benchmarks/experiments/cluster_ws.py --clusters 4,64 --rounds 8 --out $OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsmem_rate import _cluster_sync, _stamp_now

# The last 32 bytes of the dynamic shared memory (the launch's extra 32): two mbarriers, the
# second at +16; $1 of each asm below picks one (0 or 16).
_MBAR_ADDR = (
    "mov.u32 a, global_smem; mov.u32 sz, %dynamic_smem_size; add.u32 a, a, sz; sub.u32 a, a, 32; "
    "add.u32 a, a, $1; "
)
# Thread 0 initialises the mbarrier (one arrival per phase), fenced for the cluster.
_ASM_INIT = gl.constexpr(
    "{ .reg .u32 a, sz, t; .reg .pred p; " + _MBAR_ADDR + "mov.u32 t, %tid.x; "
    "setp.eq.u32 p, t, 0; @p mbarrier.init.shared::cta.b64 [a], 1; "
    "fence.mbarrier_init.release.cluster; mov.u32 $0, 0; }"
)
# Thread 0 arrives on the partner's mbarrier (release at cluster scope).
_ASM_ARRIVE = gl.constexpr(
    "{ .reg .u32 a, sz, t, ra, rank; .reg .pred p; "
    + _MBAR_ADDR
    + "mov.u32 rank, %cluster_ctarank; xor.b32 rank, rank, 1; "
    "mapa.shared::cluster.u32 ra, a, rank; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
    "@p mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra]; mov.u32 $0, 0; }"
)
# 1 once the phase of parity $2 of its own mbarrier has completed (acquire at cluster scope).
_ASM_TRY_WAIT = gl.constexpr(
    "{ .reg .u32 a, sz; .reg .pred p; "
    + _MBAR_ADDR
    + "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [a], $2; "
    "selp.u32 $0, 1, 0, p; }"
)
EXTRA_SHARED = 32


@gluon.jit
def _init_mbarrier(which):
    """Thread 0 initialises mbarrier ``which`` (one arrival per phase) and fences the
    initialisation for the cluster; the cluster barrier that follows orders it before any
    remote arrival."""
    gl.inline_asm_elementwise(
        _ASM_INIT, "=r,r", [which * 16], dtype=gl.int32, is_pure=False, pack=1
    )  # fmt: skip


@gluon.jit
def _handshake_rounds(ROUNDS: gl.constexpr):
    """The default partition: per round, one arrival on the partner's mbarrier ``r % 2``, then a
    wait for that mbarrier's phase ``r // 2`` of its own. Returns each round's time (ns)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    times = gl.zeros([ROUNDS], gl.int64, layout=layout)
    idx = gl.arange(0, ROUNDS, layout=layout)
    _cluster_sync()
    for r in range(ROUNDS):
        t0 = _stamp_now()
        gl.inline_asm_elementwise(
            _ASM_ARRIVE, "=r,r", [(r % 2) * 16], dtype=gl.int32, is_pure=False, pack=1
        )  # fmt: skip
        done = 0
        while done == 0:
            done = gl.inline_asm_elementwise(
                _ASM_TRY_WAIT, "=r,r,r", [(r % 2) * 16, (r // 2) % 2], dtype=gl.int32,
                is_pure=False, pack=1,
            )  # fmt: skip
        t1 = _stamp_now()
        times = gl.where(idx == r, t1 - t0, times)
    return (times,)


@gluon.jit
def _worker_sync():
    """The worker partition: only its part of the cluster barrier."""
    _cluster_sync()


@gluon.jit
def _cluster_ws(OUT, ROUNDS: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    _init_mbarrier(0)
    _init_mbarrier(1)
    (times,) = gl.warp_specialize(
        [(_handshake_rounds, (ROUNDS,)), (_worker_sync, ())], [4], [24]
    )  # fmt: skip
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    gl.store(OUT + pid * ROUNDS + gl.arange(0, ROUNDS, layout=layout), times)


def run(clusters: int, rounds: int) -> torch.Tensor:
    """One launch as clusters of 2 with 32 bytes of shared memory past Triton's allocation;
    returns each program's round times (ns)."""
    out = torch.zeros(2 * clusters, rounds, dtype=torch.int64, device="cuda")
    kernel = _cluster_ws.warmup(out, ROUNDS=rounds, num_warps=4, grid=(2 * clusters,))
    # Before the kernel is loaded: the launch's shared memory (and the limit set at load) must
    # include the extra bytes, and the launch makes clusters of 2.
    # Rounded up to 16 first: the mbarriers (8-byte objects) start at the size minus 32.
    shared = -(-kernel.metadata.shared // 16) * 16 + EXTRA_SHARED
    kernel.metadata = kernel.metadata._replace(shared=shared)
    kernel.packed_metadata = (kernel.metadata.num_warps, 2, shared)
    kernel[(clusters, 1, 1)](out, rounds, 4)
    return out


def main() -> None:
    import bench_decode as bd

    ap = argparse.ArgumentParser()
    ap.add_argument("--clusters", default="4,64")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = []
    for clusters in [int(c) for c in args.clusters.split(",")]:
        times = []
        for _ in range(5):
            out = run(clusters, args.rounds)
            torch.cuda.synchronize()
            times += (out.double() / 1e3).flatten().tolist()
        row = dict(clusters=clusters, programs=2 * clusters, rounds=args.rounds,
                   round_med_us=statistics.median(times), round_max_us=max(times))  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    bd.save_experiment(args.out, "cluster_ws", {}, rows)
    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'programs':>9}{'round p50 us':>14}{'max':>8}")
    for r in rows:
        print(f"{r['programs']:9}{r['round_med_us']:14.2f}{r['round_max_us']:8.2f}")


if __name__ == "__main__":
    main()
