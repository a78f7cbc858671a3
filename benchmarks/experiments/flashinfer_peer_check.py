"""FlashInfer as bench_decode's peer: build its MLA kernels once, check its outputs, time the build.

    source benchmarks/flashinfer_offline.sh unpack
    python benchmarks/experiments/flashinfer_peer_check.py [--out DIR]

Runs ``bench_decode``'s ``flashinfer`` peer (the same wrapper, plan and call the benchmark times)
on small shapes of every case kind (16 and 128 heads, S_q 2, ragged lengths, page size 1, the
whole row in e4m3) and compares each output with a float64 reference, beside ``mla_decode``'s.
The first plan of each dtype compiles FlashInfer's kernels (JIT); their wall time is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd

SHAPES = [  # small versions of the benchmark's case kinds
    bd.Case("a_small", 4, 16, 1000),
    bd.Case("b_small", 2, 128, 777),
    bd.Case("f_small", 3, 128, 500, s_q=2),
    bd.Case("e_small", 5, 16, 900, ragged=True),
    bd.Case("g_small", 3, 16, 300, page_size=1),
    bd.Case("a8e_small", 4, 16, 1000, fp8=True, fp8_rope=True),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(f"flashinfer {bd.flashinfer_version()}, torch {torch.__version__}")
    rows = []
    for case in SHAPES:
        inp = bd.Inputs(case, torch.Generator().manual_seed(0), with_contiguous=False)
        ref = bd.reference(inp, case, dtype=torch.float64)
        t0 = time.time()
        fn = bd.impls(case)["flashinfer"](inp)
        plan_s = time.time() - t0
        out = fn()
        torch.cuda.synchronize()
        row = {
            "case": case.name,
            "plan_s": plan_s,  # includes the JIT build the first time a module is needed
            "backend": bd.FLASHINFER_BACKENDS.get(case.name),
            "flashinfer_rel_err": bd.rel_err(out, ref.float()),
            "mla_decode_rel_err": bd.rel_err(bd.decode_out(inp), ref.float()),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "flashinfer_peer_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
