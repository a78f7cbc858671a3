"""Two math warpgroups for a 16-row float8 program (benchmarks/NOTES.md item 51).

A 16-row program over a float8 cache runs one math warpgroup whose serial chain per tile
(convert 64 x 512 e4m3 to fp16, scores, softmax, P.V) is the loop's time on the H200 (item 40).
This times, on bench_decode's float8 cases (the planner's plan, then ``mla::combine``, CUDA-graph
replays of rotated inputs), after checking each output against float64 attention over the
dequantised cache:
  * ``op``: the op's tiling (alternate tiles: two warpgroups take every other tile, each with its
    own ring slot and staging tile, ``wgmma_decode.default_alternate``);
  * ``transposed``: one math warpgroup and a producer warp, three or two ring slots (``-s2``);
  * ``w8-*``: 8 math warps splitting each tile's conversion, rows and P.V columns (with or
    without a producer warp, three or two slots);
  * ``alt-*``: the alternate-tile kernel with parts taken out, timing only (their output is
    wrong): ``alt-no-pe-loads`` (k_pe from registers never loaded after the first tile),
    ``alt-no-copies`` (each warpgroup's first tile reused: no copy or wait after it).
It also times the bf16 cache the float8 one was quantised from.

    python benchmarks/experiments/fp8_alternate.py --out $OUT [--cases a8,d8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from fp8_layout import case_named, dequantised_reference

SOURCE = (Path(__file__).resolve().parents[2] / "mla_ops" / "wgmma_decode.py").read_text()
# name -> (regex, replacement) patches of the kernel's source (timing only).
PATCHES = {
    "alt-no-pe-loads": [
        (r"k_pe_next = _pe_tile\(\n(?:.*\n){2}.*\)  # fmt: skip\n", "k_pe_next = k_pe\n"),
    ],
    "alt-no-copies": [
        (
            r"        mbarrier\.wait\(ready\.index\(W\), \(i // 2\) & 1\)\n",
            "        if i < 2:\n            mbarrier.wait(ready.index(W), 0)\n",
        ),
        (
            r"        if i \+ 2 < n_tiles:\n            _copy_kv_tile",
            "        if False:\n            _copy_kv_tile",
        ),
    ],
}


def patched_module(name: str, folder: Path):
    """``mla_ops.wgmma_decode`` built from its source with ``PATCHES[name]`` applied."""
    src = SOURCE
    for old, new in PATCHES[name]:
        src, n = re.subn(old, new, src)
        assert n == 1, (name, old, n)
    path = folder / f"wgmma_{name.replace('-', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# name -> wgmma_decode.launch keywords ({} is the op's own tiling): 8 math warps (w8), with or
# without a producer warp, 3 or 2 ring slots (s3, s2).
VARIANTS = {
    "op": {},
    "transposed": dict(alternate=False, num_stages=3, producer_warps=1),
    "transposed-s2": dict(alternate=False, num_stages=2, producer_warps=1),
    "w8-s3": dict(num_warps=8, producer_warps=0, num_stages=3, alternate=False),
    "w8-producer-s3": dict(num_warps=8, producer_warps=1, num_stages=3, alternate=False),
    "w8-s2": dict(num_warps=8, producer_warps=0, num_stages=2, alternate=False),
    "w8-producer-s2": dict(num_warps=8, producer_warps=1, num_stages=2, alternate=False),
    "alt-no-pe-loads": {},
    "alt-no-copies": {},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a8")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset of the names")
    args = ap.parse_args()
    names = args.variants.split(",")
    if unknown := set(names) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(unknown)}; expected some of {list(VARIANTS)}")
    folder = Path(tempfile.mkdtemp())
    modules = {name: patched_module(name, folder) for name in names if name in PATCHES}
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for case_name in args.cases.split(","):
        case = case_named(case_name)
        copies = bd.input_copies(case, props.L2_cache_size)
        plan = bd.planned(case, copies[0])
        ref = dequantised_reference(copies[0], case) if case.fp8 else None
        row = dict(case=case_name, num_splits=plan[0], total_splits=plan[1])
        row["floor_us"] = bd.floor_seconds(case, ceil) * 1e6
        if case.fp8:
            # The bf16 cache the float8 one was quantised from: what "Nx of bf16" compares with.
            bf16 = bd.input_copies(replace(case, fp8=False), props.L2_cache_size)
            fns = [bd.wgmma_call(inp, *bd.planned(replace(case, fp8=False), inp)) for inp in bf16]
            seconds, _ = bd.time_call(fns)
            row["bf16_us"] = seconds * 1e6
            print(case_name, "bf16 cache", f"{seconds * 1e6:.1f} us", flush=True)
            del bf16, fns
        for r in range(args.rounds):
            for name in names:
                module = modules.get(name)
                fns = [bd.wgmma_call(inp, *plan, module=module, **VARIANTS[name]) for inp in copies]
                seconds, err = bd.time_call(fns, ref)
                entry = row.setdefault(name, dict(us=[], rel_err=err))
                entry["us"].append(seconds * 1e6)
                print(case_name, name, f"round {r}", f"{seconds * 1e6:.1f} us", f"err {err:.1e}",
                      flush=True)  # fmt: skip
                del fns
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "fp8_alternate", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; {ceil}")
    for row in rows:
        base = row.get("bf16_us", float("nan"))
        print(f"{row['case']}: plan {row['num_splits']}/{row['total_splits']}, bf16 {base:.1f} us")
        for name in names:
            us = row[name]["us"]
            best = min(us)
            print(
                f"  {name:28} {', '.join(f'{u:.1f}' for u in us):>16} us  "
                f"{base / best:5.2f}x of bf16  {row['floor_us'] / best:.2f} of its roofline  "
                f"err {row[name]['rel_err']:.1e}"
            )


if __name__ == "__main__":
    main()
