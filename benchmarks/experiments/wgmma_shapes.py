"""Clocks per product for the MMA shapes of the 64-row tile, each chain alone in shared memory.

NOTES.md item 41 timed the 64-row loop's scores at 0.80 of the matmul rate and P.V at the rate.
This asks why, with nothing else in the program: every multiprocessor runs one program that puts
the operands in shared memory once and then repeats one product ``ITERS`` times (issue, wait), as
the loop does per tile. ``%clock64`` around the repeats gives clocks per product, and
``%globaltimer`` the clock rate. Each shape's two lower bounds (clocks):

* tensor cores: ``2 M N K / 4096`` (H100 SXM: 989.4 dense bf16 TFLOP/s over 132 multiprocessors at
  1830 MHz is 4096 FLOP per clock and multiprocessor);
* shared memory: the bytes the ``wgmma`` reads from it (every instruction reads its A and B tiles;
  A is ``64 x 16``, B ``N_wg x 16``, 2 bytes each) over 128 bytes per clock.

Shapes (bf16, operands in shared memory as the kernel has them):

* ``scores``: the shipped scores, ``S [64, 64] = Q [64, 576] K^T`` with the two warpgroups
  splitting the 64 tokens (``m64n32k16`` each, 36 per tile and warpgroup);
* ``scores_1wg``: the same product by one warpgroup (``m64n64k16``, 36), four warps;
* ``scores_m128``: twice the rows (``m64n64k16`` per warpgroup, each over its own 64 rows): what
  a tile's scores cost per 64 rows when every warpgroup has the whole tile;
* ``pv``: ``O [64, 512] += P [64, 64] V [64, 512]``, the warpgroups splitting the columns
  (``m64n256k16``, 4 per tile and warpgroup; V N-major, as the ring slot is).

Usage (GPU): ``python benchmarks/experiments/wgmma_shapes.py [--iters N] [--out DIR]``; it also
measures the copy and matmul ceilings (``bench_decode.ceilings``) and gives each chain's rate as a
fraction of the matmul's. ``--offline`` (any machine): compile each shape for sm_90 and print its
PTX instructions beside the model, no timing.
"""

from __future__ import annotations

import argparse
import re
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

FLOP_PER_CLOCK = 4096  # dense bf16 per multiprocessor (H100 / H200)
SMEM_BYTES_PER_CLOCK = 128

# name: (M, N, K, K2, warps along M, warps along N, B stored K-major (B^T) or N-major). K + K2:
# the scores' 576 as the kernel has it, 512 (nope) and 64 (RoPE) in buffers of their own.
SHAPES = {
    "scores": (64, 64, 512, 64, 4, 2, True),
    "scores_1wg": (64, 64, 512, 64, 4, 1, True),
    "scores_m128": (128, 64, 512, 64, 8, 1, True),
    "pv": (64, 512, 64, 0, 4, 2, False),
}


@gluon.jit
def _clock():
    return gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _nanoseconds():
    return gl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _operands(A, B, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, B_KMAJOR: gl.constexpr,
              io: gl.constexpr):  # fmt: skip
    """``A [M, K]`` and ``B`` (``[N, K]`` if ``B_KMAJOR`` else ``[K, N]``) into shared memory;
    returns A and B as the wgmma's ``[M, K]`` and ``[K, N]`` operands."""
    a_smem = gl.allocate_shared_memory(
        gl.bfloat16, [M, K], gl.NVMMASharedLayout.get_default_for([M, K], gl.bfloat16)
    )
    offs_m = gl.arange(0, M, layout=gl.SliceLayout(1, io))
    offs_k = gl.arange(0, K, layout=gl.SliceLayout(0, io))
    a_smem.store(gl.load(A + offs_m[:, None] * K + offs_k[None, :]))
    if B_KMAJOR:
        b_smem = gl.allocate_shared_memory(
            gl.bfloat16, [N, K], gl.NVMMASharedLayout.get_default_for([N, K], gl.bfloat16)
        )
        offs_n = gl.arange(0, N, layout=gl.SliceLayout(1, io))
        b_smem.store(gl.load(B + offs_n[:, None] * K + offs_k[None, :]))
        b_op = b_smem.permute((1, 0))
    else:
        b_smem = gl.allocate_shared_memory(
            gl.bfloat16, [K, N], gl.NVMMASharedLayout.get_default_for([K, N], gl.bfloat16)
        )
        offs_kr = gl.arange(0, K, layout=gl.SliceLayout(1, io))
        offs_nc = gl.arange(0, N, layout=gl.SliceLayout(0, io))
        b_smem.store(gl.load(B + offs_kr[:, None] * N + offs_nc[None, :]))
        b_op = b_smem
    return a_smem, b_op


@gluon.jit
def _chain_kernel(
    A,  # [M, K] bf16
    B,  # [N, K] (B_KMAJOR) or [K, N] bf16
    A2,  # [M, K2] bf16 (K2 > 0): a second product into the same accumulator (the RoPE part)
    B2,  # [N, K2] bf16
    CLOCKS,  # [programs, 3] int64: clocks, nanoseconds, the result's sum (keeps it live)
    ITERS: gl.constexpr,
    M: gl.constexpr,
    N: gl.constexpr,
    K: gl.constexpr,
    K2: gl.constexpr,
    WARPS_M: gl.constexpr,
    WARPS_N: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    num_warps: gl.constexpr,
):
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    a_op, b_op = _operands(A, B, M, N, K, B_KMAJOR, io)
    if K2 > 0:
        a2_op, b2_op = _operands(A2, B2, M, N, K2, B_KMAJOR, io)
    fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, N // WARPS_N, 16]
    )
    acc = gl.zeros([M, N], gl.float32, layout=acc_layout)
    t0 = _nanoseconds()
    c0 = _clock()
    for _ in range(ITERS):
        # Issue and wait, as the decode loop does per tile; accumulating keeps every product live.
        acc = warpgroup_mma(a_op, b_op, acc, is_async=True)
        if K2 > 0:
            acc = warpgroup_mma(a2_op, b2_op, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    c1 = _clock()
    t1 = _nanoseconds()
    row = CLOCKS + gl.program_id(0) * 3
    gl.store(row, c1 - c0)
    gl.store(row + 1, t1 - t0)
    gl.store(row + 2, gl.sum(gl.sum(acc, 1), 0).to(gl.int64))


def bounds(m: int, n: int, k: int, warps_m: int, warps_n: int) -> dict:
    """Clocks per product from the tensor cores' rate and from shared memory's bandwidth, with
    the instruction each warpgroup issues (warpgroups split M in 64-row blocks and N evenly)."""
    n_wg = n // warps_n
    warpgroups = (warps_m // 4) * warps_n
    instructions = warpgroups * (k // 16)
    smem_bytes = instructions * (64 + n_wg) * 16 * 2  # A [64, 16] + B [n_wg, 16], 2 bytes each
    return {
        "instruction": f"m64n{n_wg}k16",
        "warpgroups": warpgroups,
        "instructions": instructions,
        "tensor_clocks": 2 * m * n * k / FLOP_PER_CLOCK,
        "smem_bytes": smem_bytes,
        "smem_clocks": smem_bytes / SMEM_BYTES_PER_CLOCK,
    }


def run(name: str, iters: int, programs: int) -> dict:
    m, n, k1, k2, warps_m, warps_n, b_kmajor = SHAPES[name]
    k = k1 + k2
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)

    a, a2 = rand(m, k1), rand(m, max(k2, 1))
    b = rand(n, k1) if b_kmajor else rand(k1, n)
    b2 = rand(n, max(k2, 1))
    clocks = torch.zeros(programs, 3, dtype=torch.int64, device="cuda")
    args = (a, b, a2, b2, clocks, iters, m, n, k1, k2, warps_m, warps_n, b_kmajor)
    num_warps = warps_m * warps_n
    _chain_kernel[(programs,)](*args, num_warps=num_warps)  # compile, warm up
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _chain_kernel[(programs,)](*args, num_warps=num_warps)
    stop.record()
    torch.cuda.synchronize()
    c = clocks[:, 0].double() / iters
    ns = clocks[:, 1].double() / iters
    model = bounds(m, n, k, warps_m, warps_n)
    flop = 2 * m * n * k
    clocks_med = c.median().item()
    return {
        "shape": name,
        "m_n_k": [m, n, k],
        "num_warps": num_warps,
        **model,
        "clocks_per_product_p50": clocks_med,
        "clocks_per_product_max": c.max().item(),
        "ns_per_product_p50": ns.median().item(),
        "clock_ghz": (clocks[:, 0].double() / clocks[:, 1].double()).median().item(),
        "tflops_event": flop * iters * programs / (start.elapsed_time(stop) * 1e-3) / 1e12,
        "of_tensor_bound": model["tensor_clocks"] / clocks_med,
        "bound": "shared memory" if model["smem_clocks"] > model["tensor_clocks"] else "tensor",
        "of_max_bound": max(model["tensor_clocks"], model["smem_clocks"]) / clocks_med,
    }


def compile_offline(name: str, iters: int = 100):
    """``name``'s kernel compiled for sm_90 on any machine (``triton.compile``; no GPU)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    m, n, k1, k2, warps_m, warps_n, b_kmajor = SHAPES[name]
    const = dict(
        ITERS=iters, M=m, N=n, K=k1, K2=k2, WARPS_M=warps_m, WARPS_N=warps_n, B_KMAJOR=b_kmajor,
        num_warps=warps_m * warps_n,
    )  # fmt: skip
    params = list(inspect.signature(_chain_kernel.fn).parameters)
    signature = {p: "*i64" if p == "CLOCKS" else "*bf16" for p in ("A", "B", "A2", "B2", "CLOCKS")}
    signature.update({c: "constexpr" for c in const})
    constexprs = {(params.index(c),): v for c, v in const.items()}
    source = GluonASTSource(_chain_kernel, signature, constexprs, {})
    target = GPUTarget("cuda", 90, 128)
    return triton.compile(source, target=target, options={"num_warps": const["num_warps"]})


def offline() -> list[dict]:
    """Each shape's PTX (instruction shapes and count per product) beside its model."""
    rows = []
    for name, (m, n, k1, k2, warps_m, warps_n, _) in SHAPES.items():
        ptx = compile_offline(name).asm["ptx"]
        shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
        model = bounds(m, n, k1 + k2, warps_m, warps_n)
        count = ptx.count("wgmma.mma_async")
        rows.append(dict(shape=name, ptx_instructions=shapes, ptx_count=count, **model))
    return rows


def print_rows(rows: list[dict]) -> None:
    print(
        "shape        instr       wg  per wg  tensor clk  smem KB  smem clk  measured clk  /bound"
    )
    for r in rows:
        measured = r.get("clocks_per_product_p50")
        tail = f"{measured:>12.0f}  {r['of_max_bound']:.2f}" if measured else "           -     -"
        print(
            f"{r['shape']:<12} {r['instruction']:<11} {r['warpgroups']:>2} "
            f"{r['instructions'] // r['warpgroups']:>6} {r['tensor_clocks']:>11.0f} "
            f"{r['smem_bytes'] / 1024:>8.0f} {r['smem_clocks']:>9.0f}  {tail}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--offline", action="store_true", help="compile for sm_90 and print the model")
    args = ap.parse_args()
    if args.offline:
        rows = offline()
        print(f"triton {triton.__version__}, sm_90 PTX; per product: ptx instructions")
        for r in rows:
            print(f"  {r['shape']}: {r['ptx_instructions']} x {r['ptx_count']}")
        print_rows(rows)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import bench_decode as bd

    ceil = bd.ceilings()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [run(name, args.iters, programs) for name in SHAPES]
    for r in rows:
        r["of_matmul_rate"] = r["tflops_event"] * 1e12 / ceil["bf16_matmul_flops"]
    device = torch.cuda.get_device_name()
    print(f"{device}  torch {torch.__version__}  triton {triton.__version__}  {programs} programs")
    print(f"bf16 matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    print_rows(rows)
    for r in rows:
        print(
            f"  {r['shape']}: {r['clock_ghz']:.2f} GHz, {r['ns_per_product_p50']:.0f} ns, "
            f"{r['tflops_event']:.0f} TFLOP/s = {r['of_matmul_rate']:.2f} of the matmul rate"
        )
    bd.save_experiment(args.out, f"wgmma_shapes_{device.split()[1]}", ceil, rows, iters=args.iters)


if __name__ == "__main__":
    main()
