"""Run the float8 case (a8) decode kernel a few times for a profiler (ncu) to attach to, from the
package's ``wgmma_decode`` or from another copy of it (benchmarks/NOTES.md item 51).

    ncu --clock-control none -k regex:_mla_decode_wgmma -s 2 -c 1 --section WarpStateStats \
        python benchmarks/experiments/fp8_profile.py [--source old_kernel.py] [--launch alternate=1]

``--source``: a ``wgmma_decode.py`` to load instead (e.g. ``git show 2572a88:mla_ops/
wgmma_decode.py``, the alternate-tile kernel); ``--launch key=int,...``: extra ``launch`` keywords.
The planner's plan, decode only (no combine), bench_decode's inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="a8")
    ap.add_argument("--source", default=None)
    ap.add_argument("--launch", default="", help="launch keywords as key=int,key=int")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    module = None
    if args.source:
        module = bd.load_kernel_source(args.source, "wgmma_source")
    kw = {k: int(v) for k, v in (item.split("=") for item in filter(None, args.launch.split(",")))}
    inp = bd.Inputs(bd.CASES[args.case], torch.Generator().manual_seed(0), with_contiguous=False)
    fn = bd.wgmma_call(inp, *bd.planned(bd.CASES[args.case], inp), False, module, **kw)
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
