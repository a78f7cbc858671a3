"""Experiment (issue 3, NOTES.md item 79): ``mla_decode`` with one-scorer programs' partials in
fp16 (``triton_kernels.HALF_PARTIALS``, rows out of fp16's range escaping to float32) against
float32 partials, in alternating rounds on one machine.

Per case and variant: the whole call (bench_decode's clean-L2 graph replays of rotated input
copies, median) with its error against the float32 reference, the call's decode alone
(``triton_kernels.attention_decode_only``: partials in the variant's dtype) and the merge's
share, the call minus its decode alone; and the combine alone on that decode's partials (a graph
of its own, so with a lone launch's cost): as the op runs it, and for fp16 partials without the
escape's reads and with float32's column blocks.

Variants: ``fp32`` and ``fp16`` (the package, ``HALF_PARTIALS`` off and on), ``fp16_direct``
(``--direct``: a copy of ``wgmma_decode`` whose fp16 partials go out from the accumulator, 4
bytes a store, instead of staged through shared memory, 16 bytes a store) and
``fp16_no_escape`` (``--no-escape``: no row escapes and the combine reads no escape buffer;
values past fp16's range become inf, so a measurement only).

    python benchmarks/experiments/half_partials.py --cases b,c,bm --rounds 2 --direct --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

import mla_ops
from mla_ops import plan_cache
from mla_ops import triton_kernels as tk
from mla_ops import wgmma_decode as package_kernel

STAGED = """            part_rows_w = O_PART + b64 * stride_ob + split * stride_ok
            part_rows_w += ((rows_w // H) * stride_os + (rows_w % H) * stride_oh)[:, None]
            _store_staged(
                part_rows_w + cols_w[None, :] * stride_od, half, q_smem.slice(COL0, PART, dim=1),
                rows_w < S_Q * H, wide,
            )  # fmt: skip
"""
DIRECT = """            gl.store(O_PART + part_offs, half, mask=row_ok[:, None])
"""
# --no-escape: no row escapes (values past 65504 become inf; not safe, a measurement only).
ESCAPING = """            # NaN propagates through the maximum: NaN rows escape too.
            row_max = gl.reduce(gl.abs(out), 1, _max_propagating_nan)
            escape = ~(row_max <= HALF_MAX) | ((row_max < HALF_MIN_ROW_MAX) & (row_max > 0.0))
            # A branch, not predicated stores: those cost every program 2-4 us (item 79).
            if gl.max(escape.to(gl.int32), 0) > 0:
                gl.store(OUT + part_offs, out, mask=(row_ok & escape)[:, None])
                out = gl.where(escape[:, None], float("nan"), out)
"""
NOT_ESCAPING = ""
# --reduce-only: the rows' maxima computed and folded into the values (0 * max), no escape:
# what the reduction alone costs.
REDUCE_ONLY = """            row_max = gl.reduce(gl.abs(out), 1, _max_propagating_nan)
            out = out + 0.0 * row_max[:, None]
"""


def patched_module(name: str, old: str, new: str):
    """``wgmma_decode`` with ``old`` replaced by ``new`` in its source."""
    source = Path(package_kernel.__file__).read_text()
    assert old in source, f"{name}: the code it patches moved"
    path = Path(tempfile.mkdtemp()) / f"wgmma_decode_{name}.py"
    path.write_text(source.replace(old, new))
    return bd.load_kernel_source(path, f"wgmma_decode_{name}")


def use_kernel(module) -> None:
    """The op's wgmma kernel module from now on (plans chosen again)."""
    mla_ops.wgmma_decode = module
    sys.modules["mla_ops.wgmma_decode"] = module
    plan_cache.clear_plans()


def combine_alone(o_p, l_p, escape, narrow: bool = False) -> float:
    """Microseconds of ``mla::combine`` alone on these partials (its own graph)."""
    shipped = tk.combine_tiling
    if narrow:  # fp16 partials in float32's column blocks
        tk.combine_tiling = lambda *a, **kw: shipped(*a[:4])
    try:
        fn = bd.graphed(lambda: tk.combine(o_p, l_p, torch.bfloat16, escape=escape))
        return bd.time_rotating([fn]) * 1e6
    finally:
        tk.combine_tiling = shipped


def measure(ex, name: str, modules: dict) -> dict:
    """One variant's call, decode alone, merge share and combine alone on ``ex``."""
    use_kernel(modules[name])
    tk.HALF_PARTIALS = name != "fp32"
    shipped_combine = tk.combine
    if name in ("fp16_no_escape", "fp16_reduce_only"):  # the combine reads no escape buffer
        tk.combine = lambda *a, escape=None, **kw: shipped_combine(*a, **kw)
    try:
        seconds, err = bd.time_call([lambda inp=inp: bd.decode_out(inp) for inp in ex.copies],
                                    ex.ref)  # fmt: skip
        partials = tk.LAST_LAUNCH.get("partials")
        args = [inp.op_args(*ex.plan) for inp in ex.copies]
        decode_s, _ = bd.time_call([lambda a=a: tk.attention_decode_only(*a)[0] for a in args])
        o_p, l_p, *escape = tk.attention_decode_only(*args[0])
        if name in ("fp16_no_escape", "fp16_reduce_only"):
            escape = []
        combine = {"combine_alone_us": combine_alone(o_p, l_p, (escape or [None])[0])}
        if escape:
            combine["combine_alone_no_escape_us"] = combine_alone(o_p, l_p, None)
            combine["combine_alone_narrow_us"] = combine_alone(o_p, l_p, escape[0], narrow=True)
    finally:
        tk.HALF_PARTIALS = True
        tk.combine = shipped_combine
        use_kernel(package_kernel)
    return dict(
        variant=name, partials=partials, us=seconds * 1e6, decode_us=decode_s * 1e6,
        merge_share=(seconds - decode_s) / seconds, roofline_fraction=ex.floor_s / seconds,
        rel_err=err, **combine,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="b,c,bm")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--direct", action="store_true", help="also the fp16_direct variant")
    ap.add_argument("--no-escape", action="store_true", help="also fp16_no_escape (unsafe)")
    ap.add_argument("--reduce-only", action="store_true", help="also fp16_reduce_only (unsafe)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    modules = {"fp32": package_kernel, "fp16": package_kernel}
    if args.direct:
        modules["fp16_direct"] = patched_module("direct", STAGED, DIRECT)
    if args.no_escape:
        modules["fp16_no_escape"] = patched_module("no_escape", ESCAPING, NOT_ESCAPING)
    if args.reduce_only:
        modules["fp16_reduce_only"] = patched_module("reduce_only", ESCAPING, REDUCE_ONLY)
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        ex = bd.experiment_case(name, ceil)
        for rnd in range(args.rounds):
            order = list(modules) if rnd % 2 == 0 else list(modules)[::-1]
            for variant in order:
                rows.append(dict(case=name, round=rnd, **measure(ex, variant, modules)))
                print(rows[-1], flush=True)
        del ex
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "half_partials", ceil, rows)
    print(f"\n{torch.cuda.get_device_name()}; {ceil}")
    print("case round variant us decode_us merge_share roofline rel_err combine_alone(us)")
    for r in rows:
        alone = [r.get(k) for k in ("combine_alone_us", "combine_alone_no_escape_us",
                                    "combine_alone_narrow_us")]  # fmt: skip
        alone = " / ".join(f"{a:.1f}" for a in alone if a is not None)
        share, frac = r["merge_share"], r["roofline_fraction"]
        print(f"{r['case']} {r['round']} {r['variant']} {r['us']:.1f} {r['decode_us']:.1f} "
              f"{share:.3f} {frac:.3f} {r['rel_err']:.2e} {alone}")  # fmt: skip


if __name__ == "__main__":
    main()
