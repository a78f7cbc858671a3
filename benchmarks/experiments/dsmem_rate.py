"""How fast one multiprocessor reads another's shared memory (Hopper's distributed shared memory)
when two programs run as a thread-block cluster: the one figure missing for a merge of a
sequence's chunks through a cluster instead of L2 (NOTES.md item 47), set beside what
``epilogue_rate.py`` measured for L2 (a multiprocessor alone loads 80-85 GB/s from L2, 57 when
all 128 load at once).

Each program fills a ``KB``-kilobyte float32 buffer in its own shared memory, the cluster
synchronises (``barrier.cluster``, its time stamped too), and each program reads its partner's
buffer ``--reps`` times with 16-byte ``ld.shared::cluster`` loads (``pull``), reads its own
with ``ld.shared`` (``own``), or writes its values into a second buffer of the partner's with
``st.shared::cluster`` (``push``, complete at the next cluster barrier, whose time is then
counted in), then synchronises again before exiting (its buffer must outlive the partner's
reads). Stamps (global timer) around the reads give the per-program rate;
``--clusters`` sets how many pairs run at once (64: 128 programs, as (b)'s decode).

Gluon exposes neither cluster launches of independent programs nor remote shared memory
(Triton 3.6), so this is built by hand: the kernel is compiled for one block, and its launch
metadata is then set to clusters of 2 (Triton's launcher then passes the cluster dimension);
the buffer is the kernel's only shared-memory allocation, so it starts at ``global_smem``; the
partner's address comes from ``mapa``. An instrument, not a pattern for the op.

    python benchmarks/experiments/dsmem_rate.py --kb 64 --reps 8 --clusters 4,32,64 --out $OUT
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

_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _cluster_sync():
    """Every thread of both programs of the cluster arrives, then waits (release / acquire)."""
    gl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
        "mov.u32 $0, 0;",
        "=r", [], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _stamp_now():
    return gl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _dsmem_read(
    OUT, STAMP_BUF, N: gl.constexpr, REPS: gl.constexpr, MODE: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """MODE 0: read its own buffer; 1: read the partner's (pull); 2: write its values into the
    partner's second buffer (push), complete at the next cluster barrier."""
    pid = gl.program_id(0)
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    # Values [0, N): this program's; [N, 2N): where the partner pushes (MODE 2).
    buf = gl.allocate_shared_memory(
        gl.float32, [2 * N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )  # fmt: skip
    offs = gl.arange(0, N, layout=layout)
    buf.slice(0, N).store((offs + pid * 7).to(gl.float32))
    _thread_barrier()
    t_sync = _stamp_now()
    _cluster_sync()
    t0 = _stamp_now()
    acc = gl.zeros([N], gl.float32, layout=layout)
    for r in range(REPS):
        # Byte offsets of each thread's 4 consecutive values, rotated by r: a pass covers the
        # whole buffer, and its accesses cannot be hoisted out of the loop (ptxas hoisted the 16
        # remote loads of an unrotated first version, so its passes after the first were free).
        rot = (offs + r * 1024) % N
        byte = rot * 4
        if MODE == 2:
            gl.inline_asm_elementwise(
                "{ .reg .u32 a, ra, rank; mov.u32 a, global_smem; add.u32 a, a, $8; "
                "mov.u32 rank, %cluster_ctarank; xor.b32 rank, rank, 1; "
                "mapa.shared::cluster.u32 ra, a, rank; "
                "st.shared::cluster.v4.f32 [ra], {$4, $5, $6, $7}; "
                "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }",
                "=r,=r,=r,=r,f,f,f,f,r,r,r,r", [(rot + pid * 7).to(gl.float32), byte + N * 4],
                dtype=gl.int32, is_pure=False, pack=4,
            )  # fmt: skip
        elif MODE == 1:
            acc += gl.inline_asm_elementwise(
                "{ .reg .u32 a, ra, rank; mov.u32 a, global_smem; add.u32 a, a, $4; "
                "mov.u32 rank, %cluster_ctarank; xor.b32 rank, rank, 1; "
                "mapa.shared::cluster.u32 ra, a, rank; "
                "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [ra]; }",
                "=f,=f,=f,=f,r,r,r,r", [byte], dtype=gl.float32, is_pure=False, pack=4,
            )  # fmt: skip
        else:
            acc += gl.inline_asm_elementwise(
                "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $4; "
                "ld.shared.v4.f32 {$0, $1, $2, $3}, [a]; }",
                "=f,=f,=f,=f,r,r,r,r", [byte], dtype=gl.float32, is_pure=False, pack=4,
            )  # fmt: skip
    if MODE == 2:
        # The pushes are complete (and visible here) once both programs pass the barrier.
        _cluster_sync()
        t1 = gl.zeros([N], gl.int64, layout=layout) + _stamp_now()
        acc = buf.slice(N, N).load(layout)
    else:
        # A stamp per value, each after its sum (so after the last read of it).
        t1 = gl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,f", [acc], dtype=gl.int64, is_pure=False, pack=1
        )  # fmt: skip
        # The partner may still be reading this program's buffer.
        _cluster_sync()
    gl.store(OUT + pid * N + offs, acc)
    # Row pid of STAMP_BUF [programs, 2 + N]: before and after the first cluster barrier, then
    # every value's end stamp.
    gl.store(STAMP_BUF + pid * (N + 2), t_sync)
    gl.store(STAMP_BUF + pid * (N + 2) + 1, t0)
    gl.store(STAMP_BUF + pid * (N + 2) + 2 + offs, t1)


MODES = ("own", "pull", "push")


def run(clusters: int, kb: int, reps: int, mode: str, warps: int = 8, cluster: bool = True):
    """One cluster launch of ``_dsmem_read``: returns (out, stamps) and the compiled kernel."""
    n = kb * 256
    programs = 2 * clusters
    out = torch.empty(programs, n, device="cuda")
    stamps = torch.zeros(programs, 2 + n, dtype=torch.int64, device="cuda")
    kernel = _dsmem_read.warmup(
        out, stamps, N=n, REPS=reps, MODE=MODES.index(mode), num_warps=warps, grid=(programs,)
    )
    num_warps, _, shared = kernel.packed_metadata
    if cluster:
        kernel.packed_metadata = (num_warps, 2, shared)  # clusters of 2 programs
        kernel[(clusters, 1, 1)](out, stamps, n, reps, MODES.index(mode), warps)
    else:  # each program a cluster of its own (MODE "own" only: no partner to reach)
        kernel.packed_metadata = (num_warps, 1, shared)
        kernel[(2 * clusters, 1, 1)](out, stamps, n, reps, MODES.index(mode), warps)
    return out, stamps


def main() -> None:
    import bench_decode as bd

    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", type=int, default=64, help="KB of float32 per program (<= 128)")
    ap.add_argument("--reps", type=int, default=8, help="reads of the whole buffer")
    ap.add_argument("--clusters", default="4,32,64", help="pairs at once")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--launch", action="store_true",
        help="only the launch: CUDA-graph replay time of mode own, 1 rep, clusters of 2 or not",
    )  # fmt: skip
    args = ap.parse_args()
    n = args.kb * 256
    if args.launch:
        for clusters in [int(c) for c in args.clusters.split(",")]:
            for cluster in (False, True):

                def call(c=cluster, k=clusters):
                    run(k, args.kb, 1, "own", cluster=c)

                us = bd.time_rotating([bd.graphed(call)], warmup=10, rep=100, l2="none") * 1e6
                print(dict(programs=2 * clusters, cluster=cluster, replay_us=us), flush=True)
        return
    rows = []
    for clusters in [int(c) for c in args.clusters.split(",")]:
        for mode in MODES:
            out, stamps = run(clusters, args.kb, args.reps, mode)
            torch.cuda.synchronize()
            # Expected: the sum over reps of the partner's values (pull) or its own (own); the
            # partner's values once (push).
            pid = torch.arange(2 * clusters, device="cuda")
            src = pid if mode == "own" else pid ^ 1
            idx = torch.arange(n, device="cuda")
            rotated = [idx] if mode == "push" else [(idx + r * 1024) % n for r in range(args.reps)]
            ref = sum((j[None, :] + src[:, None] * 7).float() for j in rotated)
            err = (out - ref).abs().max().item()
            spans, syncs = [], []
            for _ in range(5):
                _, stamps = run(clusters, args.kb, args.reps, mode)
                torch.cuda.synchronize()
                ends = stamps[:, 2:].max(1).values
                spans += ((ends - stamps[:, 1]).double() / 1e3).tolist()
                syncs += ((stamps[:, 1] - stamps[:, 0]).double() / 1e3).tolist()
            med = statistics.median(spans)
            moved = args.kb * 1024 * args.reps
            row = dict(clusters=clusters, programs=2 * clusters, mode=mode, kb=args.kb,
                       reps=args.reps, read_med_us=med, read_max_us=max(spans),
                       sync_med_us=statistics.median(syncs), sync_max_us=max(syncs),
                       sm_GBps=moved / (med * 1e3), max_err=err)  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    bd.save_experiment(args.out, "dsmem_rate", {}, rows)
    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.kb} KB x {args.reps} reads per program")  # fmt: skip
    print(f"{'programs':>9} {'source':8}{'us p50':>8}{'us max':>8}{'GB/s':>8}{'sync':>7}{'err':>8}")
    for r in rows:
        print(f"{r['programs']:9} {r['mode']:8}{r['read_med_us']:8.2f}"
              f"{r['read_max_us']:8.2f}{r['sm_GBps']:8.1f}{r['sync_med_us']:7.2f}"
              f"{r['max_err']:8.1g}")  # fmt: skip


if __name__ == "__main__":
    main()
