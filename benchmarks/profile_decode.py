"""Run one benchmark case's decode kernel a few times, for a profiler (ncu) to attach to.

    ncu --clock-control none -k regex:_mla_decode -c 1 --section SpeedOfLight \
        python benchmarks/profile_decode.py --case a
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import CASES, Inputs, decode_out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="a", choices=sorted(CASES))
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    inp = Inputs(CASES[args.case], torch.Generator().manual_seed(0), with_contiguous=False)
    for _ in range(args.calls):
        decode_out(inp)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
