"""How long the 16-row wgmma loop's products take by themselves (benchmarks/NOTES.md item 54).

One warpgroup per program runs, per 64-token tile, what a 16-row program's tile asks of the
tensor cores and nothing else: the scores ``S^T [64, 16] = K [64, 576] Q^T`` (36 ``m64n16k16``)
and ``O^T [512, 16] += V^T [512, 64] P^T`` (32 ``m64n16k16``), each waited for as the decode
kernel waits for it; operand A from shared memory (as the staged loop) or from registers (as the
register-fed one). Every operand is zeros (the rate does not depend on the values). One program
per multiprocessor (132) or two; us per tile = time / tiles per program.

``--convert`` (NOTES.md item 55) adds the float8 tile's conversion as the decode kernel does it
(``wgmma_decode._conversion_layout``, 256 columns at a time, a fence and a barrier after it) from
a float8 tile to an fp16 tile of its own, alone, after P.V has been waited for (serial), or while
P.V is in flight (overlapped): whether the warps' conversion and the tensor cores' products slow
each other down when they run at once. One program per multiprocessor.

    python benchmarks/experiments/hgmma_n16_rate.py --out $OUT [--convert]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mla_ops.wgmma_decode import _conversion_layout, _convert_chunk, _thread_barrier

# CONVERT: no float8 conversion, one after the products (serial), one while P.V is in flight.
NO_CONVERSION = gl.constexpr(0)
CONVERT_SERIAL = gl.constexpr(1)
CONVERT_UNDER_PV = gl.constexpr(2)


@gluon.jit
def _convert_tile(src8, dst16, CHUNK: gl.constexpr, conv: gl.constexpr):
    """The decode kernel's conversion of a float8 tile to fp16 (``_convert_chunk``, a whole tile:
    no stale rows), then the fence and barrier that precede a wgmma reading it."""
    BN: gl.constexpr = src8.shape[0]
    WIDTH: gl.constexpr = src8.shape[1]
    for c in gl.static_range(0, WIDTH, CHUNK):
        _convert_chunk(src8, dst16, c, 0, BN, CHUNK, conv)
    fence_async_shared()
    _thread_barrier()


@gluon.jit
def _rate_kernel(
    OUT, n_tiles, SCORES: gl.constexpr, PV: gl.constexpr, A_REGS: gl.constexpr,
    SMEM_PAD: gl.constexpr, CONVERT: gl.constexpr = 0,
):  # fmt: skip
    L: gl.constexpr = 512
    R: gl.constexpr = 64
    BN: gl.constexpr = 64
    BM: gl.constexpr = 16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(0, acc_layout, 2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    kv = gl.allocate_shared_memory(
        gl.float16, [BN, L], gl.NVMMASharedLayout.get_default_for([BN, L], gl.float16)
    )
    pe = gl.allocate_shared_memory(
        gl.float16, [BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16)
    )
    q = gl.allocate_shared_memory(
        gl.float16, [BM, L], gl.NVMMASharedLayout.get_default_for([BM, L], gl.float16)
    )
    qpe = gl.allocate_shared_memory(
        gl.float16, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], gl.float16)
    )
    p = gl.allocate_shared_memory(
        gl.float16, [BN, BM], gl.NVMMASharedLayout.get_default_for([BN, BM], gl.float16)
    )
    # Unused: more shared memory per program, so that one program at most fits per SM.
    pad = gl.allocate_shared_memory(
        gl.float16, [SMEM_PAD, 64], gl.NVMMASharedLayout.get_default_for([SMEM_PAD, 64], gl.float16)
    )
    for c in gl.static_range(0, L, 64):
        kv.slice(c, 64, dim=1).store(gl.zeros([BN, 64], gl.float16, layout=io))
        q.slice(c, 64, dim=1).store(gl.zeros([BM, 64], gl.float16, layout=io))
    pe.store(gl.zeros([BN, R], gl.float16, layout=io))
    qpe.store(gl.zeros([BM, R], gl.float16, layout=io))
    p.store(gl.zeros([BN, BM], gl.float16, layout=io))
    pad.slice(0, 16, dim=0).store(gl.zeros([16, 64], gl.float16, layout=io))
    CHUNK: gl.constexpr = 256
    conv: gl.constexpr = _conversion_layout(4, CHUNK)
    if CONVERT != NO_CONVERSION:
        src8 = gl.allocate_shared_memory(
            gl.float8e4nv, [BN, L], gl.NVMMASharedLayout.get_default_for([BN, L], gl.float8e4nv)
        )
        dst16 = gl.allocate_shared_memory(
            gl.float16, [BN, L], gl.NVMMASharedLayout.get_default_for([BN, L], gl.float16)
        )
        for c in gl.static_range(0, L, CHUNK):
            src8.slice(c, CHUNK, dim=1).store(gl.zeros([BN, CHUNK], gl.float8e4nv, layout=conv))
    fence_async_shared()
    s_zero = gl.zeros([BN, BM], gl.float32, layout=acc_layout)
    s_sum = gl.zeros([BN, BM], gl.float32, layout=acc_layout)
    o_t = gl.zeros([L, BM], gl.float32, layout=acc_layout)
    # Register operands, built from a program-dependent value so that nothing folds them.
    base = (gl.program_id(0) * 0).to(gl.float16)
    a_s = gl.zeros([BN, 64], gl.float16, layout=a_layout) + base
    a_v = gl.zeros([L, 16], gl.float16, layout=a_layout) + base
    for _tile in range(n_tiles):
        if SCORES:
            if A_REGS:
                s_pe = warpgroup_mma(pe, qpe.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s_t = s_zero
                for c in gl.static_range(0, L, 64):
                    s_t = warpgroup_mma(
                        a_s, q.slice(c, 64, dim=1).permute((1, 0)), s_t, use_acc=c > 0,
                        is_async=True,
                    )  # fmt: skip
                s_t, s_pe = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, s_pe))
                s_t += s_pe
            else:
                s_t = warpgroup_mma(kv, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s_t = warpgroup_mma(pe, qpe.permute((1, 0)), s_t, is_async=True)
                s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            s_sum += s_t
        if PV:
            if A_REGS:
                for j in gl.static_range(0, BN, 16):
                    o_t = warpgroup_mma(a_v, p.slice(j, 16, dim=0), o_t, is_async=True)
                o_t = warpgroup_mma_wait(num_outstanding=0, deps=(o_t,))
            else:
                o_t = warpgroup_mma(kv.permute((1, 0)), p, o_t, is_async=True)
                if CONVERT == CONVERT_UNDER_PV:
                    _convert_tile(src8, dst16, CHUNK, conv)
                o_t = warpgroup_mma_wait(num_outstanding=0, deps=(o_t,))
        if CONVERT == CONVERT_SERIAL or (CONVERT == CONVERT_UNDER_PV and not PV):
            _convert_tile(src8, dst16, CHUNK, conv)
    total = gl.sum(gl.sum(s_sum, 1), 0) + gl.sum(gl.sum(o_t, 1), 0)
    gl.store(OUT + gl.program_id(0), total)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--convert", action="store_true", help="the float8 conversion's runs only")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    out = torch.zeros(2 * sms, device="cuda")
    if args.convert:
        # 92 KB of operands, the conversion's two tiles (96 KB) where it runs, and a 32 KB pad
        # whose space Triton reuses once it is dead: 127-193 KB per program (offline sm_90
        # compile), one per SM.
        configs = [
            (1, 256, name, scores, pv, False, convert)
            for name, scores, pv, convert in (
                ("conversion", False, False, CONVERT_SERIAL),
                ("pv", False, True, NO_CONVERSION),
                ("pv, then conversion", False, True, CONVERT_SERIAL),
                ("pv over conversion", False, True, CONVERT_UNDER_PV),
                ("both", True, True, NO_CONVERSION),
                ("both, then conversion", True, True, CONVERT_SERIAL),
                ("both, pv over conversion", True, True, CONVERT_UNDER_PV),
            )
        ]
    else:
        # 92 KB of operands; the pad takes a program to 220 KB (one per SM) or 94 KB (two fit).
        configs = [
            (per_sm, 1024 if per_sm == 1 else 16, name, scores, pv, a_regs, NO_CONVERSION)
            for per_sm in (1, 2)
            for name, scores, pv in (
                ("scores", True, False),
                ("pv", False, True),
                ("both", True, True),
            )
            for a_regs in (False, True)
        ]
    rows = []
    for per_sm, pad, name, scores, pv, a_regs, convert in configs:
        run = functools.partial(
            _rate_kernel[(per_sm * sms,)], out, args.tiles, scores, pv, a_regs, pad, convert,
            num_warps=4,
        )  # fmt: skip
        run()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(run, warmup=5, rep=50)
        us_tile = ms * 1e3 / args.tiles
        n_mma = 36 * scores + 32 * pv
        row = dict(
            programs_per_sm=per_sm,
            products=name,
            a_from="registers" if a_regs else "shared",
            us_per_tile=us_tile,
            us_per_tile_per_sm=us_tile / per_sm,
            hgmma_per_tile=n_mma,
            ns_per_hgmma=us_tile * 1e3 / n_mma / per_sm if n_mma else float("nan"),
        )
        rows.append(row)
        print(row, flush=True)
    ceil = bd.ceilings()
    info = dict(
        device=props.name, torch=torch.__version__, triton=triton.__version__, ceilings=ceil
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = f"hgmma_n16_rate_{props.name.split()[1]}" + ("_convert" if args.convert else "")
    (Path(args.out) / f"{stem}.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}")
    # us/tile: one program's tile; per SM: that over the programs sharing a multiprocessor.
    print(
        f"{'per SM':>6} {'products':>24} {'A from':>9} {'us/tile':>8} {'per SM':>7} {'ns/HGMMA':>9}"
    )
    for r in rows:
        print(
            f"{r['programs_per_sm']:>6} {r['products']:>24} {r['a_from']:>9} "
            f"{r['us_per_tile']:>8.3f} {r['us_per_tile_per_sm']:>7.3f} {r['ns_per_hgmma']:>9.2f}"
        )


if __name__ == "__main__":
    main()
