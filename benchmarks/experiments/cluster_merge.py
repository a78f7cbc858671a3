"""A prototype of NOTES.md item 47's cluster pair merge, timed against ``mla::combine`` and the
in-kernel merge by the last to arrive: one-scorer programs of a sequence in two chunks run as a
cluster of 2 and merge through each other's shared memory instead of L2.

The variant is the shipped kernel's source with patches (``wgmma_bottleneck.build``):
- programs ``2k`` and ``2k + 1`` are chunks 0 and 1 of one row block (split fastest); with
  ``--ctas 4``, clusters of 4 also hold both row blocks of a pair of row blocks;
- 512 bytes past Triton's allocation (found through ``%dynamic_smem_size``) hold two mbarriers
  (ready, done; one arrival each, after a cluster-scope fence in every thread and a barrier)
  and the partner's lse; they are initialised before the warp-specialized region, and both
  partitions execute ``barrier.cluster`` at their start;
- a sequence in two chunks: each program stages its output halves, scaled, in shared memory
  (warpgroup 0's in ring slot 1, warpgroup 1's where it already is), signals ready, pushes the
  half its partner keeps into the partner's ring slot 0 (``st.shared::cluster``) with its lse,
  signals done, then merges its own half with the pushed one and stores the final rows;
- the launch compiles the kernel, finds ring slot 0's offset by running Triton's own allocation
  pass on its TTGIR (``ring_offset``; a run whose ``--land-off`` differs stops and says which to
  pass), asks for the 512 bytes more and launches clusters.

Only for even plans of exactly two chunks per sequence (case (b) at ``num_splits = 2``); a
sequence in one chunk and ragged plans are not handled. An instrument, not the op. ``--stamps``
also times stamped builds and reports their last replay's phases (slots 10-13 of the stamp row:
staged, ready, pushed, landed).

It patches the kernel as it was at commit 4c39e6d (NOTES.md item 47). Item 48 replaced the
one-scorer epilogue that the patches edit, so pass that commit's source with ``--source``:

    git show 4c39e6d:mla_ops/wgmma_decode.py > /tmp/wgmma_decode_4c39e6d.py
    python benchmarks/experiments/cluster_merge.py --cases b --stamps --ctas 2,4 --out $OUT \
        --source /tmp/wgmma_decode_4c39e6d.py
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
import wgmma_bottleneck as wb

from mla_ops import triton_kernels as tk
from mla_ops import wgmma_decode

HELPERS = r'''

# ---- cluster pair merge (benchmarks/experiments/cluster_merge.py) ----
LAND_OFF = gl.constexpr(__LAND_OFF__)  # ring slot 0's byte offset in the dynamic shared memory
CL_EXTRA = 512
_X = ("mov.u32 a, global_smem; mov.u32 sz, %dynamic_smem_size; add.u32 a, a, sz; "
      "sub.u32 a, a, 512; ")
_CL_INIT = gl.constexpr(
    "{ .reg .u32 a, sz, t; .reg .pred p; " + _X + "mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
    "@p mbarrier.init.shared::cta.b64 [a], 1; add.u32 a, a, 8; "
    "@p mbarrier.init.shared::cta.b64 [a], 1; fence.mbarrier_init.release.cluster; "
    "mov.u32 $0, 0; }"
)
CL_CTAS = __CTAS__  # programs per cluster: 2 (the pair) or 4 (both row blocks of the pair)
_PARTNER = ("mov.u32 rank, %cluster_ctarank; xor.b32 rank, rank, " + str(CL_CTAS // 2) + "; "
            "mapa.shared::cluster.u32 ra, a, rank; ")
_CL_ARRIVE = gl.constexpr(
    "{ .reg .u32 a, sz, ra, rank, t; .reg .pred p; " + _X + "add.u32 a, a, $1; " + _PARTNER
    + "mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
    "@p mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra]; mov.u32 $0, 0; }"
)
_CL_FENCE = gl.constexpr("fence.acq_rel.cluster; mov.u32 $0, 0;")
_CL_TRY_WAIT = gl.constexpr(
    "{ .reg .u32 a, sz; .reg .pred p; " + _X + "add.u32 a, a, $1; "
    "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [a], 0; "
    "selp.u32 $0, 1, 0, p; }"
)
_CL_SYNC = gl.constexpr(
    "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
    "mov.u32 $0, 0;"
)
_CL_PUSH4 = gl.constexpr(
    "{ .reg .u32 a, ra, rank; mov.u32 a, global_smem; add.u32 a, a, $8; " + _PARTNER
    + "st.shared::cluster.v4.f32 [ra], {$4, $5, $6, $7}; "
    "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }"
)
_CL_LOAD4 = gl.constexpr(
    "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $4; "
    "ld.shared.v4.f32 {$0, $1, $2, $3}, [a]; }"
)
_CL_PUSH_X = gl.constexpr(
    "{ .reg .u32 a, sz, ra, rank; " + _X + "add.u32 a, a, $2; " + _PARTNER
    + "st.shared::cluster.f32 [ra], $1; mov.u32 $0, 0; }"
)
_CL_LOAD_X = gl.constexpr(
    "{ .reg .u32 a, sz; " + _X + "add.u32 a, a, $1; ld.shared.f32 $0, [a]; }"
)


@gluon.jit
def _cl_sync():
    gl.inline_asm_elementwise(_CL_SYNC, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _cl_init():
    gl.inline_asm_elementwise(_CL_INIT, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _cl_handoff(which):
    """Every thread's shared-memory accesses so far fenced at cluster scope, then one arrival
    (thread 0's) on the partner's mbarrier ``which`` (0: ready, 8: done); every thread then
    waits for its own. (One arrival per thread, 128 on one mbarrier, took about 40 us.)"""
    gl.inline_asm_elementwise(_CL_FENCE, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    _thread_barrier()
    gl.inline_asm_elementwise(_CL_ARRIVE, "=r,r", [which], dtype=gl.int32, is_pure=False, pack=1)
    done = 0
    while done == 0:
        done = gl.inline_asm_elementwise(
            _CL_TRY_WAIT, "=r,r", [which], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _cl_block(split, for_chunk_0, for_chunk_1, k: gl.constexpr, CH: gl.constexpr,
              layout: gl.constexpr):
    """Column block ``k`` (``CH`` columns) of ``for_chunk_0`` in chunk 0's program, else of
    ``for_chunk_1``: both float32 ``[BLOCK_M, L/2]`` halves in shared memory."""
    if split == 0:
        x = for_chunk_0.slice(k * CH, CH, dim=1).load(layout)
    else:
        x = for_chunk_1.slice(k * CH, CH, dim=1).load(layout)
    return x


@gluon.jit
def _cl_epilogue(
    o_t, q_smem, kv_ring, OUT, LSE_OUT, lse, scale, bad, split, b64, rows, row_ok, stride_fb,
    stride_fs, stride_fh, stride_fd, stride_gb, stride_gs, stride_gh, STAMP_ROW,
    H: gl.constexpr, L: gl.constexpr, BLOCK_M: gl.constexpr, STAMPS: gl.constexpr,
    num_warps: gl.constexpr,
):
    HALF: gl.constexpr = L // 2
    CH: gl.constexpr = 64
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    # A 64 x 64 block with no value held twice (rows_layout's 128 columns would repeat it).
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    # Everything that needs Triton's shared memory (layout conversions) before "ready".
    r = gl.convert_layout(rows, row_l)
    ok = gl.convert_layout(row_ok, row_l)
    sc = gl.convert_layout(scale, row_l)
    sc_rows = gl.convert_layout(scale, gl.SliceLayout(1, rows_layout))
    my_lse = gl.convert_layout(lse, row_l)
    o = gl.convert_layout(gl.permute(o_t, (1, 0)), rows_layout)
    stage = _output_half(kv_ring.index(1), BLOCK_M, L)  # warpgroup 0's half, scaled
    stage.store(gl.where(bad, float("nan"), o * sc_rows[:, None]))
    wg1 = _output_half(q_smem, BLOCK_M, L)  # warpgroup 1's half, scaled in place
    for k in gl.static_range(HALF // CH):
        part = wg1.slice(k * CH, CH, dim=1)
        part.store(gl.where(bad, float("nan"), part.load(layout) * sc[:, None]))
    _thread_barrier()
    m = gl.arange(0, BLOCK_M, layout=row_l)
    lcol = gl.arange(0, CH, layout=col_l)
    _stamp(STAMP_ROW, 10, STAMPS)  # halves staged
    _cl_handoff(0)
    _stamp(STAMP_ROW, 11, STAMPS)  # the partner is ready
    # Push the half the partner keeps (chunk 0 keeps columns [0, L/2), chunk 1 the rest).
    for k in gl.static_range(HALF // CH):
        x = _cl_block(split, wg1, stage, k, CH, layout)
        byte = LAND_OFF + (m[:, None] * HALF + k * CH + lcol[None, :]) * 4
        gl.inline_asm_elementwise(
            _CL_PUSH4, "=r,=r,=r,=r,f,f,f,f,r,r,r,r", [x, byte], dtype=gl.int32, is_pure=False,
            pack=4,
        )
    gl.inline_asm_elementwise(
        _CL_PUSH_X, "=r,f,r", [my_lse, 256 + m * 4], dtype=gl.int32, is_pure=False, pack=1
    )
    _stamp(STAMP_ROW, 12, STAMPS)  # pushes issued
    _cl_handoff(8)
    _stamp(STAMP_ROW, 13, STAMPS)  # the partner's half is here
    p_lse = gl.inline_asm_elementwise(
        _CL_LOAD_X, "=f,r", [256 + m * 4], dtype=gl.float32, is_pure=False, pack=1
    )
    lse0 = gl.where(split == 0, my_lse, p_lse)
    lse1 = gl.where(split == 0, p_lse, my_lse)
    poisoned = (lse0 != lse0) | (lse1 != lse1)
    lse_max = gl.maximum(lse0, lse1)
    shift = gl.where(lse_max == float("-inf"), 0.0, lse_max)
    w0 = gl.exp(lse0 - shift)
    w1 = gl.exp(lse1 - shift)
    total = w0 + w1
    total_safe = gl.where(total == 0.0, 1.0, total)
    w_own = gl.where(split == 0, w0, w1) / total_safe
    w_partner = gl.where(split == 0, w1, w0) / total_safe
    out_row = OUT + b64 * stride_fb + (r // H) * stride_fs + (r % H) * stride_fh
    for k in gl.static_range(HALF // CH):
        own = _cl_block(split, stage, wg1, k, CH, layout)
        byte = LAND_OFF + (m[:, None] * HALF + k * CH + lcol[None, :]) * 4
        partner = gl.inline_asm_elementwise(
            _CL_LOAD4, "=f,=f,=f,=f,r,r,r,r", [byte], dtype=gl.float32, is_pure=False, pack=4
        )
        y = gl.where(w_partner[:, None] > 0.0, partner * w_partner[:, None], 0.0)
        y = own * w_own[:, None] + y
        y = gl.where(poisoned[:, None], float("nan"), y)
        cols = split * HALF + k * CH + lcol
        gl.store(out_row[:, None] + cols[None, :] * stride_fd, y.to(OUT.dtype.element_ty),
                 mask=ok[:, None])
    if split == 0:
        lse_f = gl.where(total == 0.0, float("-inf"), shift + gl.log(total_safe))
        lse_out = LSE_OUT + b64 * stride_gb + (r // H) * stride_gs + (r % H) * stride_gh
        gl.store(lse_out, gl.where(poisoned, float("nan"), lse_f), mask=ok)


class LandOffset(Exception):
    pass


_PATCHED = set()


def _cl_launch(grid):
    def call(*args, **kwargs):
        kernel = _mla_decode_wgmma_kernel.warmup(*args, grid=grid, **kwargs)
        if id(kernel) not in _PATCHED:
            from cluster_merge import ring_offset

            found = ring_offset(kernel)
            if found != LAND_OFF.value:
                raise LandOffset(found)
            shared = -(-kernel.metadata.shared // 16) * 16 + CL_EXTRA
            if shared > 232448:
                raise RuntimeError(f"{shared} bytes of shared memory: over 232448")
            kernel.metadata = kernel.metadata._replace(shared=shared)
            kernel.packed_metadata = (kernel.metadata.num_warps, CL_CTAS, shared)
            _PATCHED.add(id(kernel))
        return _mla_decode_wgmma_kernel[(grid[0] // CL_CTAS,)](*args, **kwargs)
    return call
'''

PID_ORIGINAL = (
    "    work = pid // num_row_blocks\n    row_block = pid % num_row_blocks\n"
    "    split = work // batch\n    b = work % batch\n"
)
# Clusters of 2: programs 2k, 2k + 1 are chunks 0 and 1 of one row block.
PID_PAIR = (
    "    work = pid // 2\n    row_block = work % num_row_blocks\n"
    "    split = pid % 2\n    b = work // num_row_blocks\n"
)
# Clusters of 4: row blocks 2j, 2j + 1 (fastest) x chunks 0, 1 (an even number of row blocks).
PID_QUAD = (
    "    work = pid // 4\n    row_block = (work % (num_row_blocks // 2)) * 2 + pid % 2\n"
    "    split = (pid // 2) % 2\n    b = work // (num_row_blocks // 2)\n"
)
PATCHES = [
    (
        "            mbarrier.init(done, count=1)\n",
        "            mbarrier.init(done, count=1)\n            _cl_init()\n",
    ),
    (
        "    BLOCK_N: gl.constexpr = kv_ring.shape[1]\n    dtype: gl.constexpr = q_smem.dtype\n"
        "    s_layout: gl.constexpr = gl.NVMMADistributedLayout(\n"
        "        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]\n",
        "    _cl_sync()\n"
        "    BLOCK_N: gl.constexpr = kv_ring.shape[1]\n    dtype: gl.constexpr = q_smem.dtype\n"
        "    s_layout: gl.constexpr = gl.NVMMADistributedLayout(\n"
        "        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]\n",
    ),
    (
        "    BLOCK_N: gl.constexpr = kv_ring.shape[1]\n"
        "    BLOCK_M: gl.constexpr = p_smem.shape[0]\n",
        "    _cl_sync()\n"
        "    BLOCK_N: gl.constexpr = kv_ring.shape[1]\n"
        "    BLOCK_M: gl.constexpr = p_smem.shape[0]\n",
    ),
    (
        "    n_real = gl.cdiv(seqlen, chunk)\n",
        "    n_real = gl.cdiv(seqlen, chunk)\n"
        "    if n_real == 2:\n"
        "        _cl_epilogue(\n"
        "            o_t, q_smem, kv_ring, OUT, LSE_OUT, lse, kv_scale / l_safe, n_bad > 0,\n"
        "            split, b64, rows_st, row_ok_st, stride_fb, stride_fs, stride_fh, stride_fd,\n"
        "            stride_gb, stride_gs, stride_gh, STAMP_ROW, H, L, BLOCK_M, STAMPS,\n"
        "            num_warps,\n"
        "        )\n"
        "        _stamp(STAMP_ROW, STAMP_EXIT, STAMPS)\n"
        "        return\n",
    ),
    ("    return _mla_decode_wgmma_kernel[grid](\n", "    return _cl_launch(grid)(\n"),
]


def ring_offset(kernel) -> int:
    """Byte offset of ``kv_ring`` in a compiled kernel's shared memory: the TTGIR Triton keeps is
    from before its allocation pass, so that pass (and the ones before it in ``make_llir``) is
    run again on it (sm_90)."""
    from triton._C.libtriton import ir, nvidia, passes

    context = ir.context()
    ir.load_dialects(context)
    nvidia.load_dialects(context)
    path = Path(tempfile.mkdtemp()) / "kernel.ttgir"
    path.write_text(kernel.asm["ttgir"])
    module = ir.parse_mlir_module(str(path), context)
    module.context = context
    pm = ir.pass_manager(context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 86)
    pm.run(module, "allocate")
    found = re.findall(
        r"%kv_ring = ttg\.local_alloc \{allocation\.offset = (\d+) : i32\}", str(module)
    )
    if len(found) != 1:
        raise RuntimeError(f"kv_ring's allocation: expected one, found {found}")
    return int(found[0])


def build(land_off: int, ctas: int = 2, kernel_source: str | None = None):
    """The variant's module, with ring slot 0 at ``land_off``, in clusters of ``ctas``, patched
    into ``kernel_source`` (default: the checked-out kernel's)."""
    name = f"cluster_merge_{land_off}_{ctas}"
    wb.VARIANTS[name] = [(PID_ORIGINAL, PID_PAIR if ctas == 2 else PID_QUAD), *PATCHES]
    source = wb.SOURCE
    base = kernel_source if kernel_source is not None else source
    if "def _output_half(" not in base:
        raise SystemExit(
            "cluster_merge patches the one-scorer epilogue of commit 4c39e6d, which this kernel "
            "no longer has (NOTES.md item 48): pass --source with that commit's "
            "mla_ops/wgmma_decode.py (see this file's docstring)"
        )
    wb.SOURCE = base.replace("\nimport torch\n", "\nimport re\n\nimport torch\n", 1) + (
        HELPERS.replace("__LAND_OFF__", str(land_off)).replace("__CTAS__", str(ctas))
    )
    try:
        return wb.build(name, Path(tempfile.mkdtemp()))
    finally:
        wb.SOURCE = source


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="b")
    ap.add_argument("--land-off", type=int, default=0, help="first guess of ring slot 0's offset")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--stamps", action="store_true",
        help="also time stamped builds and report their last replay's phases",
    )  # fmt: skip
    ap.add_argument("--ctas", default="2", help="cluster sizes to time: 2 and/or 4")
    ap.add_argument("--source", help="the kernel source to patch (commit 4c39e6d's)")
    args = ap.parse_args()
    kernel_source = Path(args.source).read_text() if args.source else None
    shipped_launch, shipped_max = wgmma_decode.launch, tk.MERGE_MAX_SPLITS
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    variants = {
        int(c): build(args.land_off, int(c), kernel_source) for c in args.ctas.split(",")
    }  # fmt: skip
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        ref = bd.reference(copies[0], case)
        floor = bd.floor_seconds(case, dict(ceil))
        programs = case.batch * 2 * 2  # sequences x row blocks x splits
        stamp_buf = torch.zeros(programs, wgmma_decode.STAMP_SLOTS.value, dtype=torch.int64,
                                device="cuda")  # fmt: skip
        mergers = ["combine", "kernel", *(f"cluster{c}" for c in variants)]
        if args.stamps:
            mergers += [f"{m}_stamped" for m in mergers[1:]]
        for merger in mergers:
            tk.MERGE_MAX_SPLITS = 0 if merger == "combine" else 2
            ctas = int(merger[7]) if merger.startswith("cluster") else 0
            launch = variants[ctas].launch if ctas else shipped_launch
            if merger.endswith("_stamped"):
                launch = functools.partial(launch, stamps=stamp_buf)
            wgmma_decode.launch = launch
            fns = [lambda inp=inp: torch.ops.mla.attention(*inp.op_args(2, None))[0]
                   for inp in copies]  # fmt: skip
            if ctas:
                try:
                    fns[0]()
                except variants[ctas].LandOffset as e:
                    raise SystemExit(
                        f"ring slot 0 at {e.args[0]}: rerun with --land-off {e.args[0]}"
                    ) from e
                torch.cuda.synchronize()
            t, err = bd.time_call(fns, ref)
            wgmma_decode.launch, tk.MERGE_MAX_SPLITS = shipped_launch, shipped_max
            row = dict(case=name, merger=merger, num_splits=2, us=t * 1e6,
                       roofline_fraction=floor / t, rel_err=err)  # fmt: skip
            if merger.endswith("_stamped"):  # the last replay's span, first entry to last exit
                st = stamp_buf.double().cpu()
                fields = wgmma_decode.STAMP_FIELDS
                t0 = st[:, fields.index("entry")].min()
                row["span_us"] = (st[:, fields.index("exit")].max() - t0).item() / 1e3
                slots = {f: fields.index(f) for f in ("entry", "loop_end", "exit")}
                slots.update(staged=10, ready=11, pushed=12, landed=13)
                for what, slot in slots.items():
                    v = sorted(((st[:, slot] - t0) / 1e3).tolist())
                    row[what] = [round(v[int(f * (len(v) - 1))], 1) for f in (0, 0.5, 0.9, 1)]
            rows.append(row)
            print(row, flush=True)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "cluster_merge", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {bd.triton.__version__}; {ceil}")
    for r in rows:
        print(f"{r['case']:5}{r['merger']:>16}{r['us']:9.1f}{r['roofline_fraction']:9.3f}"
              f"  {r['rel_err']:.1e}  span {r.get('span_us', float('nan')):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
