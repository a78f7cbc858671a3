"""A compute stand-in for splitting (b)'s 64-row programs by output columns instead of by tokens
(NOTES.md item 87).

(b) (32 sequences x 128 heads, 4096 tokens) runs 64 row blocks of 64 query rows. To fill 132
multiprocessors each row block is cut into two token chunks, whose float32 partials (128 KB a
program) ``mla::combine`` then merges: 5-6 us of the call, 6.5-7.4 % (the target is 5 %).

The design measured here cuts each row block by output columns instead. Two programs, a cluster
of two in the real design, each take the whole sequence and 256 of the 512 latent columns. Each
scores only every other tile (its parity) and would receive the other tiles' P (64 x 64 16-bit,
8 KB) and row maxima from its partner through shared memory. Both multiply every tile's P by
their own 256 columns of V. Per program and pair of tiles that is one score product (4.7 MFLOP)
and two half P.V products (2 x 2.1), which is what one program of the shipped split does per
tile (8.9 MFLOP). So the products are the same, and the combine, the partials and the token
split are gone: each program would store its 256 columns of the final output.

The stand-in is the shipped kernel's source with patches (``wgmma_bottleneck.build``), over the
one-scorer, query-in-registers loop:
- both programs of a row block (``split`` 0 and 1 of a 2-split plan) take the whole sequence;
- warpgroup 0 scores the tiles of its program's parity and, for the others, only hands the slot
  on (factor 1, P left as the slot's k_pe). Its P.V keeps its 64 columns;
- warpgroup 1 multiplies 192 columns (128 + 64) instead of 448;
- each program stores its 256 columns as float32 partials (64 KB), not bf16 output (32 KB).

Its outputs are not attention: it times the products, loads and stores of the design, without
the exchange of P. ``cluster`` launches the same stand-in as clusters of two (programs ``2k``
and ``2k + 1``, a row block's two halves), the launch the exchange would need, so that the
block scheduler's placement of clusters is timed too. Against them: the shipped kernel's (b)
as the op plans it (decode alone, and with ``mla::combine``).

    python benchmarks/experiments/pair_columns.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
import wgmma_bottleneck as wb


def between(text: str, first: str, last: str) -> str:
    """The part of ``text`` from ``first`` up to (not including) the next ``last``."""
    a = text.index(first)
    return text[a : text.index(last, a)]


# Both programs of a row block take the whole sequence.
BOUNDS = (
    "    start = split * chunk\n    end = gl.minimum(start + chunk, seqlen)\n",
    "    start = split * chunk * 0\n    end = seqlen\n",
)
# Warpgroup 0 scores every other tile: the loop unrolled by two, the first of each pair scored
# (a branch on the tile's parity inside the loop faulted on the H200 with Triton 3.6: an illegal
# memory access, not investigated). Every program scores the even tiles, which times as the
# design does (each program scores half the tiles); a sequence of an odd number of tiles would
# leave its last tile out, and (b)'s 64 are even.
SCORE_OLD = between(
    wb.SOURCE,
    "    for i in range(n_tiles):\n        slot = i % NUM_STAGES\n        tile_start = start + i "
    "* BLOCK_N\n        # Stale rows past the split's end stay: their scores are masked",
    "    _stamp(STAMP_ROW, STAMP_LOOP_END, STAMPS)\n    sums_smem.store(l_i)",
)
SCORE = (
    SCORE_OLD,
    """    for j in range(n_tiles // 2):
        for u in gl.static_range(2):
            i = 2 * j + u
            slot = i % NUM_STAGES
            tile_start = start + i * BLOCK_N
            kv = _await_tile(
                kv_ring, ready, i, tile_start, end, NUM_STAGES, False, False, s_layout
            )
            pe = pe_ring.index(slot)
            if u == 0:
                s = warpgroup_mma(
                    q_nope, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True
                )
                s = warpgroup_mma(qpe_smem, pe.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                _thread_barrier()
                mbarrier.arrive(s_done.index(slot), count=1)
                p, m_i, l_i, alpha = _online_softmax(
                    s, m_i, l_i, tile_start + offs_tile, end, last_key, scale_log2, 1
                )
                pe.store(p.to(dtype))
            else:
                _thread_barrier()
                mbarrier.arrive(s_done.index(slot), count=1)
                alpha = gl.full([BLOCK_M], 1.0, gl.float32, layout=row_layout)
            alpha_smem.index(slot).store(alpha)
            fence_async_shared()
            _thread_barrier()
            mbarrier.arrive(p_ready.index(slot), count=1)
            o = _pv_part(
                pe, kv, o, 0, tile_start, end,
                gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)),
            )
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            _thread_barrier()
            mbarrier.arrive(free.index(slot), count=1)
""",
)
# Warpgroup 1: 192 columns (128 + 64), not 448.
PV_REST = [
    ("        o_a = _pv_part(p_smem, kv, o_a, COL_A, tile_start, end, alpha)\n", ""),
    (
        "        o_a, o_b, o_c = warpgroup_mma_wait(num_outstanding=0, deps=(o_a, o_b, o_c))\n",
        "        o_b, o_c = warpgroup_mma_wait(num_outstanding=0, deps=(o_b, o_c))\n",
    ),
    (
        """    _store_output_half(
        O_PART, LSE_PART, OUT, LSE_OUT, kv_ring.index(0), o_a, l_i, l_i, poisoned, kv_scale, b64,
        row_block, split, n_real, stride_ob, stride_os, stride_oh, stride_ok, stride_od,
        stride_lb, stride_ls, stride_lh, stride_lk, stride_fb, stride_fs, stride_fh, stride_fd,
        stride_gb, stride_gs, stride_gh, COL_A, S_Q, H, L, BLOCK_M, MERGE, False, 256,
    )  # fmt: skip
""",
        "",
    ),
]
# ``halfload``: the tiles a program does not score are not copied at all (their slot keeps an
# older tile; its ready barrier is arrived on instead), so that the loop's products and
# hand-offs are timed without the second tile's bytes. A bound for a design whose unscored tiles
# would bring only V's 256 columns (32 KB) or come by TMA multicast from the partner's copy.
COPY_EVEN_TILE = """

@gluon.jit
def _copy_even_tile(
    KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, slot, tile_start, where,
    stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE: gl.constexpr,
    HAS_PE: gl.constexpr, GATHER: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    CHUNK: gl.constexpr, kv_layout: gl.constexpr, pe_layout: gl.constexpr,
):  # fmt: skip
    # pair_columns.py's halfload: an odd tile (of a split starting at 0) is not copied.
    if (tile_start // kv_ring.shape[1]) % 2 == 0:
        _copy_tile(
            KV_DESC, PE_DESC, KV, PE, kv_ring, pe_ring, ready, slot, tile_start, where,
            stride_kvp, stride_kvt, stride_pep, stride_pet, PAGE_SIZE, HAS_PE, GATHER, L, R,
            CHUNK, kv_layout, pe_layout,
        )
    else:
        mbarrier.arrive(ready.index(slot), count=1)
"""
# Every copy renamed, then the helper appended (after the renaming, which would rename its call).
HALF_LOAD = [
    ("re:(?<!def )_copy_tile\\(", "_copy_even_tile("),
    ("\nfollow(__name__)\n", COPY_EVEN_TILE + "\nfollow(__name__)\n"),
]


# Clusters of 2: programs 2k and 2k + 1 are the two halves of one row block.
PID_PAIR = (
    "    work = pid // num_row_blocks\n    row_block = pid % num_row_blocks\n"
    "    split = work // batch\n    b = work % batch\n",
    "    work = pid // 2\n    row_block = work % num_row_blocks\n"
    "    split = pid % 2\n    b = work // num_row_blocks\n",
)


class Launcher:
    """A variant module's ``launch``, optionally as clusters of 2: the first call compiles and
    runs the kernel as usual (a warm-up), then its compiled launch metadata is set to clusters
    of 2 and later calls launch half the grid, which Triton's launcher doubles (NOTES.md item 47,
    part 4)."""

    def __init__(self, module, cluster: bool) -> None:
        self.module, self.cluster, self.compiled = module, cluster, None

    def launch(self, *args, **options):
        prepared, data = self.module.prepared_call(*args, **options)
        if self.cluster and self.compiled is not None:
            prepared.grid = (prepared.grid[0] // 2, 1, 1)
        compiled = prepared.launch(data)
        if self.cluster and self.compiled is None:
            meta = compiled.metadata
            compiled.packed_metadata = (meta.num_warps, 2, meta.shared)
            self.compiled = compiled
        return compiled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    wb.VARIANTS["pair_columns"] = [BOUNDS, SCORE, *PV_REST]
    wb.VARIANTS["pair_columns_cluster"] = [BOUNDS, SCORE, *PV_REST, PID_PAIR]
    pair = wb.build("pair_columns", folder)
    pair_cluster = wb.build("pair_columns_cluster", folder)
    wb.VARIANTS["pair_columns_halfload"] = [BOUNDS, SCORE, *PV_REST, *HALF_LOAD]
    pair_half = wb.build("pair_columns_halfload", folder)
    ceil = bd.ceilings()
    case = bd.CASES["b"]
    inp = bd.Inputs(case, torch.Generator().manual_seed(0), False)
    plan = tuple(bd.planned(case, inp))
    print("planned:", plan, flush=True)
    ref = bd.reference(inp, case)
    shipped_err = bd.rel_err(bd.wgmma_call(inp, *plan)(), ref)
    calls = {
        f"shipped {plan[0]}/{plan[1]}": tuple(
            bd.wgmma_call(inp, *plan, with_combine=c) for c in (False, True)
        ),
        # The design has no combine: its decode alone is its call (timed twice).
        "pair columns": (bd.wgmma_call(inp, 2, None, with_combine=False, module=pair),) * 2,
        "pair columns, clusters": (
            bd.wgmma_call(
                inp, 2, None, with_combine=False, module=Launcher(pair_cluster, cluster=True)
            ),
        )
        * 2,
    }
    calls["pair columns, halfload"] = (
        bd.wgmma_call(inp, 2, None, with_combine=False, module=pair_half),
    ) * 2
    for fn, _ in calls.values():
        fn()  # compile (and for clusters, set the launch to clusters)
    torch.cuda.synchronize()
    rows = bd.time_decode_rounds(calls, args.rounds)
    floor = bd.floor_seconds(case, dict(ceil))
    bd.save_experiment(args.out, "pair_columns", ceil, rows, shipped_err=shipped_err)
    print("\n" + bd.versions_line(ceil))
    print(f"shipped error {shipped_err:.1e}; (b)'s floor {floor * 1e6:.1f} us")
    print(f"{'variant':24}{'decode us':>22}{'call us':>22}")
    for name in calls:
        dec, com = bd.decode_round_text(rows, name)
        print(f"{name:24}{dec:>22}{com:>22}")


if __name__ == "__main__":
    main()
