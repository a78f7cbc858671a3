"""The one-scorer hand-off with the kernel's layouts, for racecheck (``racecheck_handoff.py``
is the same hand-off with one thread per element, which racecheck reports clean).

    compute-sanitizer --tool racecheck python benchmarks/racecheck_handoff_replicated.py 1

VARIANT 1: a [64] factor stored and loaded in slices of wgmma accumulator layouts (each element
held by several threads), as alpha_smem is. VARIANT 2: that, plus a [64, 64] bf16 P written by the
writer (fence_async_shared) and read by the reader's warpgroup_mma, as p_smem is."""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
ROUNDS = 8
M = 64


@gluon.jit
def _writer(
    alpha_smem, p_smem, ready, free, ROUNDS: gl.constexpr, M: gl.constexpr, VARIANT: gl.constexpr
):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M, 16]
    )
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, M, layout=gl.SliceLayout(0, s_layout))
    for i in range(ROUNDS):
        mbarrier.wait(free, (i & 1) ^ 1)
        if VARIANT == 2:
            p = gl.zeros([M, M], gl.float32, layout=s_layout) + (
                rows[:, None] * 0 + cols[None, :] * 0 + i + 1
            ).to(gl.float32)
            p_smem.store(p.to(gl.bfloat16))
        alpha_smem.store((rows + i * M).to(gl.float32))
        fence_async_shared()
        _thread_barrier()
        mbarrier.arrive(ready, count=1)


@gluon.jit
def _reader(
    alpha_smem,
    p_smem,
    v_smem,
    ready,
    free,
    OUT,
    POUT,
    ROUNDS: gl.constexpr,
    M: gl.constexpr,
    VARIANT: gl.constexpr,
):
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M, 16]
    )
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, o_layout))
    for i in range(ROUNDS):
        mbarrier.wait(ready, i & 1)
        alpha = alpha_smem.load(gl.SliceLayout(1, o_layout))
        gl.store(OUT + i * M + rows, alpha)
        if VARIANT == 2:
            o = gl.zeros([M, M], gl.float32, layout=o_layout)
            o = warpgroup_mma(p_smem, v_smem, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            gl.store(POUT + i * M + rows, gl.max(o, 1))
        _thread_barrier()
        mbarrier.arrive(free, count=1)


@gluon.jit
def _kernel(OUT, POUT, ROUNDS: gl.constexpr, M: gl.constexpr, VARIANT: gl.constexpr):
    alpha_smem = gl.allocate_shared_memory(
        gl.float32, [M], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    p_smem = gl.allocate_shared_memory(
        gl.bfloat16, [M, M], gl.NVMMASharedLayout.get_default_for([M, M], gl.bfloat16)
    )
    v_smem = gl.allocate_shared_memory(
        gl.bfloat16, [M, M], gl.NVMMASharedLayout.get_default_for([M, M], gl.bfloat16)
    )
    init_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v_smem.store(gl.full([M, M], 1.0, gl.bfloat16, layout=init_layout))
    fence_async_shared()
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    _thread_barrier()
    gl.warp_specialize(
        [
            (_writer, (alpha_smem, p_smem, ready, free, ROUNDS, M, VARIANT)),
            (_reader, (alpha_smem, p_smem, v_smem, ready, free, OUT, POUT, ROUNDS, M, VARIANT)),
        ],
        [4],
        [232],
    )


def main():
    variant = int(sys.argv[1])
    out = torch.full((ROUNDS * M,), -1.0, device="cuda")
    pout = torch.full((ROUNDS * M,), -1.0, device="cuda")
    _kernel[(1,)](out, pout, ROUNDS, M, variant, num_warps=4)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.arange(ROUNDS * M, device="cuda", dtype=torch.float32)), out
    if variant == 2:
        want = (torch.arange(ROUNDS, device="cuda").float() + 1).repeat_interleave(M) * M
        assert torch.equal(pout, want), (pout, want)
    print(f"variant {variant}: delivered what was written")


if __name__ == "__main__":
    main()
