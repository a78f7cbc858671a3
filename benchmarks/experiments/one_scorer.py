"""64-row programs: both warpgroups scoring half of each tile's tokens (the rows-on-M loop,
``wgmma_decode._consume_rows_on_m``, the op's choice until NOTES.md item 44) against warpgroup 0
scoring whole tiles and handing P to warpgroup 1 (``launch(one_scorer=True)``: ``_score_tiles``,
``_assist_tiles``, the op's choice since), A/B on one machine in one process.

Times decode + combine and the decode alone (CUDA-graph replays, rotated inputs) under the
planner's plan and checks each variant's combined output against the float32 reference of
``bench_decode``. Rounds alternate the variants' order. ``--op`` times the whole ``mla_decode``
call instead (the planner's plan, the in-kernel merge where it takes the call), with
``wgmma_decode.default_one_scorer`` patched off for the rows-on-M variant.

    python benchmarks/experiments/one_scorer.py --cases b,c,f --rounds 2 --out $OUT [--op]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

VARIANTS = {
    "rows_on_m": dict(rows_on_m=True, one_scorer=False, num_warps=8),
    "one_scorer": dict(one_scorer=True, num_warps=4),
}


def op_calls(ex: bd.ExperimentCase, variant: str) -> list:
    """``mla_decode`` on each input copy, with the op's one-scorer choice as is (``one_scorer``)
    or turned off (``rows_on_m``). The op chooses on every call, so each closure patches the
    choice for its own call only; ``time_call`` captures the calls in CUDA graphs, which keep the
    kernel each launched."""
    from mla_ops import wgmma_decode as wd

    chosen = wd.default_one_scorer

    def patched(*args):
        return chosen(*args) and variant == "one_scorer"

    def call(inp):
        wd.default_one_scorer = patched
        try:
            return bd.decode_out(inp)
        finally:
            wd.default_one_scorer = chosen

    return [lambda inp=inp: call(inp) for inp in ex.copies]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="b,c,f")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--op", action="store_true", help="time the whole mla_decode call")
    args = ap.parse_args()
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        ex = bd.experiment_case(name, ceil)
        ns, ts = ex.plan.num_splits, ex.plan.total_splits
        for rnd in range(args.rounds):
            order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                for with_combine in (True,) if args.op else (True, False):
                    fns = op_calls(ex, variant) if args.op else [
                        bd.wgmma_call(inp, ns, ts, with_combine, **VARIANTS[variant])
                        for inp in ex.copies
                    ]  # fmt: skip
                    t, err = bd.time_call(fns, ex.ref if with_combine else None)
                    row = dict(
                        case=name, variant=variant, round=rnd, combine=with_combine,
                        num_splits=ns, total_splits=ts, us=t * 1e6,
                        roofline_fraction=ex.floor_s / t, rel_err=err,
                    )  # fmt: skip
                    rows.append(row)
                    print(row, flush=True)
        del ex
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "one_scorer_op" if args.op else "one_scorer", ceil, rows)
    versions = f"torch {torch.__version__}, triton {bd.triton.__version__}"
    print(f"\n{torch.cuda.get_device_name()}; {versions}; {ceil}")
    print(
        f"{'case':5}{'variant':>12}{'round':>6}{'combine':>8}{'splits':>8}{'us':>9}{'roofline':>9}"
    )
    for r in rows:
        splits = f"{r['num_splits']}/{r['total_splits']}"
        print(
            f"{r['case']:5}{r['variant']:>12}{r['round']:>6}{r['combine']!s:>8}{splits:>8}"
            f"{r['us']:9.1f}{r['roofline_fraction']:9.3f}  {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
