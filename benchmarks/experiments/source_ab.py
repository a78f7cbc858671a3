"""A/B of a change to the wgmma kernel: the package's ``mla_ops/wgmma_decode.py`` against other
copies of it, on bench_decode's cases, alternating in rounds on one machine (benchmarks/NOTES.md
item 53 on).

Each variant's output is checked against float64 attention (over the dequantised cache for a
float8 case) before it is timed; timing is bench_decode's: the planner's plan, the wgmma kernel
launched directly with the op's tiling, then ``mla::combine``; CUDA-graph replays of rotated
input copies (clean L2), median.

    git show HEAD:mla_ops/wgmma_decode.py > /tmp/base.py
    python benchmarks/experiments/source_ab.py --sources base=/tmp/base.py --cases a8,d8,e8 \
        --out $OUT

Cases are bench_decode's (``a`` ... ``g``) or ``X8``: case ``X`` over a float8 cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from fp8_layout import case_named, dequantised_reference


def load_source(name: str, path: str):
    """A ``wgmma_decode`` module built from the file at ``path`` (its kernels compile apart from
    the package's: Triton keys its cache on the source)."""
    spec = importlib.util.spec_from_file_location(f"wgmma_decode_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sources", required=True, help="name=path,...: the copies to compare")
    ap.add_argument("--cases", default="a8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="source_ab", help="the JSON's file name under --out")
    args = ap.parse_args()
    modules = {"package": None}
    for item in args.sources.split(","):
        name, _, path = item.partition("=")
        if not path:
            ap.error(f"--sources: expected name=path, got {item!r}")
        modules[name] = load_source(name, path)
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for case_name in args.cases.split(","):
        case = case_named(case_name)
        copies = bd.input_copies(case, props.L2_cache_size)
        plan = bd.planned(case, copies[0])
        ref = (
            dequantised_reference(copies[0], case)
            if case.fp8
            else bd.reference(copies[0], case, dtype=torch.float64)
        )
        row = dict(case=case_name, num_splits=plan[0], total_splits=plan[1])
        row["floor_us"] = bd.floor_seconds(case, ceil) * 1e6
        for r in range(args.rounds):
            for name, module in modules.items():
                fns = [bd.wgmma_call(inp, *plan, module=module) for inp in copies]
                seconds, err = bd.time_call(fns, ref)
                entry = row.setdefault(name, dict(us=[], rel_err=err))
                entry["us"].append(seconds * 1e6)
                print(case_name, name, f"round {r}", f"{seconds * 1e6:.1f} us", f"err {err:.1e}",
                      flush=True)  # fmt: skip
                del fns
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, args.name, ceil, rows, sources=args.sources)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; {ceil}")
    for row in rows:
        print(f"{row['case']}: plan {row['num_splits']}/{row['total_splits']}")
        for name in modules:
            us = row[name]["us"]
            print(
                f"  {name:12} {', '.join(f'{u:.1f}' for u in us):>16} us  "
                f"{row['floor_us'] / min(us):.2f} of its roofline  err {row[name]['rel_err']:.1e}"
            )


if __name__ == "__main__":
    main()
