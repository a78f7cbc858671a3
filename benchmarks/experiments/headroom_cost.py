"""What the planner's empty headroom splits cost the wgmma kernel, and which launch order hides it.

The planner asks for up to twice a sequence's even share of splits (``RAGGED_HEADROOM``) so that a
ragged batch can balance; in a uniform batch those splits are empty. Timed for the kernel as
shipped (splits vary slowest in its 1-D grid) and a variant built by text substitution (as
``wgmma_bottleneck.py`` does) where splits vary fastest, each with ``fill_empty`` on (an empty
split writes the contract's zero ``out``) and off (only its ``-inf`` LSE, what ``mla_decode``
asks for).

Times decode + combine (CUDA-graph replays, rotated inputs) with the planner's plan and with one
split per sequence (no headroom), and the shipped kernel without the combine (``decode_only``).
(Session 12 ran a first version of this on the previous kernel: splits fastest, zeros always
written, with a substitution that skipped them; NOTES.md item 26.)

    python benchmarks/experiments/headroom_cost.py --cases a,d,e,g --out $OUT
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

SPLIT_FASTEST = [
    (
        "    split = pid // (batch * num_row_blocks)\n"
        "    pid_bm = pid % (batch * num_row_blocks)\n",
        "    split = pid % num_splits\n    pid_bm = pid // num_splits\n",
    )
]
VARIANTS = {"split_slowest": [], "split_fastest": SPLIT_FASTEST}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,d,e,g")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    wb.VARIANTS.update(VARIANTS)
    folder = Path(tempfile.mkdtemp())
    modules = {name: wb.build(name, folder) for name in VARIANTS}
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        case = bd.CASES[name]
        copies = bd.input_copies(case, props.L2_cache_size)
        first = copies[0]
        ref = bd.reference(first, case)
        floor = bd.floor_seconds(case, dict(ceil))
        plan = bd.planned(case, first)
        for ns, ts in [(plan.num_splits, plan.total_splits), (1, None)]:
            runs = [(f"{v}{'' if fill else '_no_fill'}", m, fill) for v, m in modules.items()
                    for fill in (True, False)]  # fmt: skip
            runs.append(("decode_only_no_fill", modules["split_slowest"], False))
            for variant, module, fill in runs:
                if ns == 1 and variant not in ("split_slowest_no_fill", "decode_only_no_fill"):
                    continue
                with_combine = not variant.startswith("decode_only")

                def make(inp, module=module, ns=ns, ts=ts, with_combine=with_combine, fill=fill):
                    return bd.wgmma_call(inp, ns, ts, with_combine, module, fill_empty=fill)

                fns = [make(inp) for inp in copies]
                err = bd.rel_err(fns[0](), ref) if with_combine else float("nan")
                t = bd.time_rotating([bd.graphed(f) for f in fns], warmup=10, rep=100)
                row = dict(
                    case=name, variant=variant, num_splits=ns, total_splits=ts, us=t * 1e6,
                    roofline_fraction=floor / t, rel_err=err,
                )  # fmt: skip
                rows.append(row)
                print(row, flush=True)
        del copies, first
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "headroom_cost", ceil, rows)
    print(f"\n{props.name}; {ceil}")
    print(f"{'case':5}{'variant':24}{'splits':>9}{'us':>9}{'roofline':>9}{'err':>9}")
    for r in rows:
        sp = f"{r['num_splits']}/{r['total_splits']}"
        print(
            f"{r['case']:5}{r['variant']:24}{sp:>9}{r['us']:9.1f}"
            f"{r['roofline_fraction']:9.3f}{r['rel_err']:9.1e}"
        )


if __name__ == "__main__":
    main()
