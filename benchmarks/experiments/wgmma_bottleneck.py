"""Where the wgmma decode kernel's time goes: the kernel with parts of its loop taken out.

Variants are built from ``mla_ops/wgmma_decode.py``'s own source by text substitution (so they
stay in step with the kernel) and timed on the issue-3 cases:

* ``full``: the kernel as shipped;
* ``no_load``: tiles 0 and 1 are copied once and reused (no copy waits): tensor cores, softmax
  and shared memory only;
* ``no_softmax``: ``P^T`` is the raw scores (no max, exp2, sums, rescale);
* ``no_mma``: neither wgmma runs (the scores are zeros): the copy ring, softmax and ``P^T`` stores;
* ``load_only``: ``no_mma`` and ``no_softmax``: the copy ring alone;
* ``no_convert`` (float8 cache): tiles are not converted to fp16 (the products read a stale
  staging tile);
* ``convert_only``: ``no_load``, ``no_mma`` and ``no_softmax``: a float8 tile's conversion
  and the ``P^T`` stores alone (for a 16-bit cache: the loop's bookkeeping).
* ``mma_only``, ``scores_only``, ``pv_only`` (64-row programs with the rows on M): ``no_load``
  and ``no_softmax``, with both products, only the scores ``S = Q K^T`` or only ``P V``.

Results are garbage except for ``full``; only the times matter. Per-tile time is the kernel time
over the tiles one program walks (every program walks the same number here). Timing: CUDA-graph
replays with L2 evicted by a read before each (``bench_decode.time_rotating``, NOTES.md item 30);
the runs before 2026-11-23 used ``triton.testing.do_bench``, whose zeroing leaves L2 dirty.

    python benchmarks/experiments/wgmma_bottleneck.py --cases a,b --out $OUT
    python benchmarks/experiments/wgmma_bottleneck.py --cases a,a8,d --variants full,load_only
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import triton_kernels as tk
from mla_ops.planner import MIN_CHUNK, SPLIT_GRANULE

ROOT = Path(__file__).resolve().parents[2]
SOURCE = (ROOT / "mla_ops/wgmma_decode.py").read_text()

NO_LOAD = [
    (
        "mbarrier.wait(ready.index(slot), (pos // NUM_STAGES) & 1)",
        "mbarrier.wait(ready.index(slot), 0)",
    ),
    # The math warps' own refills (no producer partition)...
    (r"re:elif i \+ NUM_STAGES < n_tiles:", "elif i < 0:"),
    # ... and the producer partition's: the first NUM_STAGES tiles only, never waiting for a
    # free slot (the math warps' arrivals on the free barriers then go unanswered).
    (
        "    for i in range(n_tiles):\n        slot = i % NUM_STAGES\n"
        "        tile_start = start + i * BLOCK_N\n        # Located before the wait",
        "    for i in range(gl.minimum(n_tiles, NUM_STAGES)):\n        slot = i % NUM_STAGES\n"
        "        tile_start = start + i * BLOCK_N\n        # Located before the wait",
    ),
]
# (Both loops: the transposed one and the 64-row rows-on-M one, which passes TOKENS=1.)
NO_SOFTMAX = [
    (r"re:(\w+), m_i, (\w+), alpha = _online_softmax\(", r"\1, m_i, \2, alpha = _raw_scores("),
    (
        "@gluon.jit\ndef _online_softmax(",
        "@gluon.jit\ndef _raw_scores(s, m_i, l_i, offs_n, end, last_key, scale_log2, TOKENS=0):\n"
        "    return s, m_i, l_i, gl.full_like(m_i, 1.0)\n\n\n@gluon.jit\ndef _online_softmax(",
    ),
]
# Every wgmma returns its accumulator untouched and every wait its dependencies (regex).
NO_MMA = [
    (
        "@gluon.jit\ndef _online_softmax(",
        "@gluon.jit\ndef _fake_mma(a, b, acc, use_acc=True, is_async=True):\n    return acc\n\n\n"
        "@gluon.jit\ndef _online_softmax(",
    ),
    (r"re:\bwarpgroup_mma\(", "_fake_mma("),
    (r"re:warpgroup_mma_wait\(num_outstanding=0, deps=\((\w+),\)\)", r"\1"),
    (r"re:warpgroup_mma_wait\(num_outstanding=0, deps=\((\w+), (\w+)\)\)", r"(\1, \2)"),
]
# A float8 tile is not converted: the scores and P.V read a stale fp16 staging tile.
NO_CONVERT = [
    (
        "_convert_chunk(kv_ring.index(slot), stage, c, tile_start, end, CHUNK, conv_layout)",
        "pass",
    )
]
# 64-row programs with the rows on M (``_consume_rows_on_m``) only: one of the two chains left out.
NO_PV = [
    (
        "        o = warpgroup_mma(p_smem, kv, o, is_async=True)\n"
        "        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))\n",
        "",
    )
]
# (``_scores_on_m``, which one-scorer programs share.)
NO_SCORES = [
    (
        r"re:    s = warpgroup_mma\(q_smem, kv\.permute.*\n(?:.*\n){3}"
        r"    s = warpgroup_mma_wait\(num_outstanding=0, deps=\(s,\)\)\n",
        "    s = s_zero\n",
    )
]
ROWS_ON_M_ONLY = ("mma_only", "scores_only", "pv_only")
VARIANTS = {
    "full": [],
    "no_load": NO_LOAD,
    "no_softmax": NO_SOFTMAX,
    "no_mma": NO_MMA,
    "load_only": NO_MMA + NO_SOFTMAX,
    "no_convert": NO_CONVERT,
    "convert_only": NO_MMA + NO_SOFTMAX + NO_LOAD,
    # Rows on M: both products, or one of them, with no copies and no softmax.
    "mma_only": NO_LOAD + NO_SOFTMAX,
    "scores_only": NO_LOAD + NO_SOFTMAX + NO_PV,
    "pv_only": NO_LOAD + NO_SOFTMAX + NO_SCORES,
}


def build(name: str, folder: Path):
    src = SOURCE
    for old, new in VARIANTS[name]:
        if old.startswith("re:"):
            src, n = re.subn(old[3:], new, src)
            assert n > 0, (name, old)
            continue
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    path = folder / f"wgmma_{name}.py"
    path.write_text(src)
    return bd.load_kernel_source(path, f"wgmma_{name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,b")
    ap.add_argument("--splits", default="a:1,a8:1,b:2,f:1,d:33")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    splits = dict(kv.split(":") for kv in args.splits.split(","))
    folder = Path(tempfile.mkdtemp())
    modules = {name: build(name, folder) for name in args.variants.split(",")}
    ceil = bd.ceilings()
    props = torch.cuda.get_device_properties(0)
    report = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__}
    report["ceilings"] = ceil
    rows = []
    for case_name in args.cases.split(","):
        case = bd.CASES[case_name]
        inp = bd.Inputs(case, torch.Generator().manual_seed(0), with_contiguous=False)
        kv_c, k_pe = inp.decode_cache()
        ns = int(splits[case_name])
        b, s_q, h, _ = inp.q.shape
        block_m, warps = tk.wgmma_tiling(s_q * h)
        smem = tk.shared_memory_optin(torch.device("cuda"))
        stages = tk.wgmma_stages(block_m, 512, 64, case.fp8, smem)
        out = torch.empty((b, s_q, h, ns, 512), device="cuda")
        lse = torch.empty((b, s_q, h, ns), device="cuda")
        programs = b * triton.cdiv(s_q * h, block_m) * ns
        tiles = triton.cdiv(triton.cdiv(case.context, ns), 64)
        floor = bd.floor_seconds(case, dict(ceil))
        for name, module in modules.items():
            if name == "no_convert" and not case.fp8:
                continue
            # The single-product variants edit the rows-on-M loop only; another loop would run
            # unchanged under their name.
            rows_on_m = module.default_rows_on_m(block_m, warps, case.fp8)
            if name in ROWS_ON_M_ONLY and not rows_on_m:
                continue
            launch_args = (inp.q, kv_c, k_pe, inp.cache_seqlens, inp.block_table, out, lse)
            kwargs = dict(
                block_m=block_m, num_warps=warps, num_stages=stages, min_chunk=MIN_CHUNK,
                granule=SPLIT_GRANULE, lengths_per_step=128,
            )  # fmt: skip

            def fn(module=module, launch_args=launch_args, kwargs=kwargs, ns=ns, sc=inp.kv_scale):
                module.launch(*launch_args, bd.SCALE, sc, True, ns, None, **kwargs)

            fn()
            torch.cuda.synchronize()
            us = bd.time_rotating([bd.graphed(fn)], warmup=10, rep=100) * 1e6
            row = dict(
                case=case_name, variant=name, num_splits=ns, programs=programs,
                tiles_per_program=tiles, us=us, us_per_tile=us / tiles,
                roofline_fraction=floor / (us * 1e-6),
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
        torch.cuda.empty_cache()
    report["rows"] = rows
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "wgmma_bottleneck.json").write_text(json.dumps(report, indent=1))
    print(f"\n{props.name}; {ceil}")
    head = ("case", "variant", "programs", "tiles", "us", "us/tile", "roofline")
    print("{:4} {:10} {:>8} {:>5} {:>8} {:>8} {:>8}".format(*head))
    for r in rows:
        print(
            f"{r['case']:4} {r['variant']:10} {r['programs']:8} {r['tiles_per_program']:5} "
            f"{r['us']:8.1f} {r['us_per_tile']:8.2f} {r['roofline_fraction']:8.3f}"
        )


if __name__ == "__main__":
    main()
