"""Partial outputs in float32 against q's 16-bit dtype (``triton_kernels.partial_dtype``), A/B
on one machine in one process, through ``mla_decode`` as a user calls it.

The partials are the only traffic of a split call besides the cache, paid twice: stored by the
decode at each multiprocessor's L2 store rate, read again by the merge (NOTES.md items 32, 47).
Each closure sets ``PARTIALS_IN_Q_DTYPE`` for its own call only; ``time_call`` captures the
calls in CUDA graphs, which keep the buffers each allocated. Rounds alternate the order. Errors
are against a float64 reference of the first input copy: norm-relative and the largest absolute
difference, next to the bf16 output's own rounding (the reference rounded to bf16).

``--parts`` also times the two kernels apart under the planner's plan: the decode alone into
partials of each dtype (``bench_decode.wgmma_call``), and the combine alone on them.

    python benchmarks/experiments/partial_dtype.py --cases b,c,d,e --rounds 2 --out $OUT [--parts]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

VARIANTS = {"float32": False, "q_dtype": True}


def op_calls(ex: bd.ExperimentCase, variant: str) -> list:
    """``mla_decode`` on each input copy with the partials in ``variant``'s dtype."""
    from mla_ops import triton_kernels as tk

    def call(inp):
        kept = tk.PARTIALS_IN_Q_DTYPE
        tk.PARTIALS_IN_Q_DTYPE = VARIANTS[variant]
        try:
            return bd.decode_out(inp)
        finally:
            tk.PARTIALS_IN_Q_DTYPE = kept

    return [lambda inp=inp: call(inp) for inp in ex.copies]


def part_rows(name: str, ex: bd.ExperimentCase, rnd: int) -> list[dict]:
    """The decode alone and the combine alone, with float32 and bf16 partials."""
    from mla_ops import triton_kernels as tk

    rows = []
    ns, ts = ex.plan.num_splits, ex.plan.total_splits
    for dtype in (torch.float32, torch.bfloat16):
        fns = [bd.wgmma_call(inp, ns, ts, False, out_dtype=dtype) for inp in ex.copies]
        t_decode, _ = bd.time_call(fns)
        partials = [fn() for fn in fns]
        combines = [
            lambda o=o, lse=lse: tk.combine(o, lse, torch.bfloat16)[0] for o, lse in partials
        ]  # fmt: skip
        t_combine, err = bd.time_call(combines, ex.ref)
        rows.append(dict(
            case=name, round=rnd, partials=str(dtype), num_splits=ns, total_splits=ts,
            decode_us=t_decode * 1e6, combine_us=t_combine * 1e6, rel_err=err,
        ))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    from mla_ops import triton_kernels as tk

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="b,c,d,e")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--parts", action="store_true", help="also time decode and combine apart")
    args = ap.parse_args()
    ceil = bd.ceilings()
    rows, parts = [], []
    for name in args.cases.split(","):
        ex = bd.experiment_case(name, ceil)
        ref64 = bd.reference(ex.copies[0], bd.CASES[name], dtype=torch.float64)
        rounding = (ref64.to(torch.bfloat16).double() - ref64).abs().max().item()
        for rnd in range(args.rounds):
            order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                fns = op_calls(ex, variant)
                out = fns[0]().double()
                merged_by = tk.LAST_LAUNCH.get("merge")
                t, err = bd.time_call(fns, ex.ref)
                row = dict(
                    case=name, variant=variant, round=rnd, num_splits=ex.plan.num_splits,
                    total_splits=ex.plan.total_splits, us=t * 1e6,
                    roofline_fraction=ex.floor_s / t, rel_err_f32_ref=err,
                    rel_err_f64=((out - ref64).norm() / ref64.norm()).item(),
                    max_abs_err_f64=(out - ref64).abs().max().item(),
                    bf16_rounding_max_abs=rounding, merge=merged_by,
                    partial_dtype=str(tk.partial_dtype(torch.bfloat16)) if VARIANTS[variant]
                    else "torch.float32",
                )  # fmt: skip
                rows.append(row)
                print(row, flush=True)
            if args.parts:
                parts += part_rows(name, ex, rnd)
        del ex
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "partial_dtype", ceil, rows, parts=parts)
    versions = f"torch {torch.__version__}, triton {bd.triton.__version__}"
    print(f"\n{torch.cuda.get_device_name()}; {versions}; {ceil}")
    print(f"{'case':5}{'variant':>9}{'round':>6}{'splits':>8}{'us':>9}{'roofline':>9}"
          f"{'rel f64':>10}{'max abs':>10}{'bf16 rnd':>10}")  # fmt: skip
    for r in rows:
        splits = f"{r['num_splits']}/{r['total_splits']}"
        print(
            f"{r['case']:5}{r['variant']:>9}{r['round']:>6}{splits:>8}{r['us']:9.1f}"
            f"{r['roofline_fraction']:9.3f}{r['rel_err_f64']:10.1e}{r['max_abs_err_f64']:10.1e}"
            f"{r['bf16_rounding_max_abs']:10.1e}"
        )
    for r in parts:
        print(
            f"{r['case']:5}{r['partials']:>16}{r['round']:>3} decode {r['decode_us']:7.1f} us"
            f"  combine {r['combine_us']:6.1f} us  {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
