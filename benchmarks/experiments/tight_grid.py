"""A decode grid of the plan's possible chunks only, instead of every (sequence, split) slot
(NOTES.md item 86).

The wgmma kernel's grid is ``batch x row blocks x num_splits``. A balanced plan (``total_splits``)
cuts every sequence into chunks of at least ``sum(lengths) / total_splits`` tokens, so it makes
at most ``total_splits + batch - 1`` non-empty chunks, whatever the lengths; with the
longest-first ranking those come first, and the rest of the grid is empty programs. Item 85
found that (d)'s 128 empty programs (any number of them from 4 up) cost its decode 0.6-1.2 us:
in a grid of 132 or more the block scheduler places the real programs otherwise than in a grid
of 128. This launches the shipped kernel, unchanged, over grids cut to ``G`` programs
(``case@n/t#G``; ``#-``: the full grid) and times the decode alone and with ``mla::combine``.
The slots of the programs cut away are empty; their ``-inf`` LSEs are written once before
timing (the op would need the kernel to write them), and each variant's combined output is
checked against the float32 reference, so a grid that cut a real chunk shows as an error.

    python benchmarks/experiments/tight_grid.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import triton_kernels as tk
from mla_ops import wgmma_decode as wd
from mla_ops.planner import split_bounds


class GridCut:
    """``wgmma_decode``'s ``launch`` with the grid cut to ``programs`` (None: as prepared)."""

    def __init__(self, programs: int | None) -> None:
        self.programs = programs

    def launch(self, *args, **options):
        prepared, data = wd.prepared_call(*args, **options)
        if self.programs is not None:
            if self.programs > prepared.grid[0]:
                raise ValueError(f"grid {self.programs} > the full {prepared.grid[0]}")
            prepared.grid = (self.programs, 1, 1)
        return prepared.launch(data)


def placement(inp, n: int, t: int | None, grid: int | None) -> dict:
    """One stamped, clean-L2 launch of the cut grid: which multiprocessors ran a real program,
    which an empty one, and the real programs' span and median exit (us from the first entry)."""
    b, s_q, h, _ = inp.q.shape
    full = b * -(-s_q * h // tk.wgmma_tiling(s_q * h)[0]) * n
    stamps = torch.zeros(full, wd.STAMP_SLOTS.value, dtype=torch.int64, device="cuda")
    fn = bd.wgmma_call(inp, n, t, with_combine=False, module=GridCut(grid), stamps=stamps)
    fn()
    stamps.zero_()
    bd.evict_l2("clean")
    fn()
    torch.cuda.synchronize()
    s = stamps.cpu()
    field = {name: i for i, name in enumerate(wd.STAMP_FIELDS)}
    ran = s[:, field["entry"]] > 0
    real = ran & (s[:, field["tiles"]] > 0)
    t0 = s[real, field["entry"]].min()
    exits = ((s[real, field["exit"]] - t0).double() / 1e3).sort().values
    real_sms = set(s[real, field["sm"]].tolist())
    count = torch.cuda.get_device_properties(0).multi_processor_count
    return dict(
        span_us=float(exits[-1]), exit_p50=float(exits[len(exits) // 2]),
        idle=sorted(set(range(count)) - real_sms),
        empty_sms=sorted(set(s[ran & ~real, field["sm"]].tolist())),
    )  # fmt: skip


def parse(spec: str) -> tuple[str, int, int | None, int | None]:
    """``"d@64/132#131"`` -> ``("d", 64, 132, 131)``; ``-`` for no total or the full grid."""
    name, rest = spec.split("@")
    plan, grid = rest.split("#")
    n, t = plan.split("/")
    return name, int(n), None if t == "-" else int(t), None if grid == "-" else int(grid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--variants",
        default="d@64/132#-,d@64/132#135,d@64/128#131,d@64/128#129,d@64/128#128,d@32/-#-,"
        "b@4/64#-,b@4/64#190,b@4/64#128,e@4/128#-,e@4/128#191",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stamps", type=int, default=0, help="stamped launches per variant")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ceil = bd.ceilings()
    gen = torch.Generator().manual_seed(0)
    specs = args.variants.split(",")
    inputs = {name: bd.Inputs(bd.CASES[name], gen, False) for name in {parse(s)[0] for s in specs}}
    refs, calls, errs = {}, {}, {}
    for name, inp in inputs.items():
        case = bd.CASES[name]
        print(name, "planned:", tuple(bd.planned(case, inp)), flush=True)
        refs[name] = bd.reference(inp, SimpleNamespace(batch=case.batch, s_q=case.s_q))
    for spec in specs:
        name, n, t, grid = parse(spec)
        inp = inputs[name]
        partials = bd.wgmma_call(inp, n, t, with_combine=False, module=GridCut(grid))
        _, lse = partials()  # the same two tensors on every call
        start, end = split_bounds(inp.cache_seqlens, n, t)  # [B, n]
        empty = (start >= end)[:, None, None, :].expand_as(lse)
        lse.masked_fill_(empty, float("-inf"))
        combined = lambda p=partials, dt=inp.q.dtype: torch.ops.mla.combine(*p(), dt)[0]
        errs[spec] = bd.rel_err(combined(), refs[name])
        calls[spec] = (partials, combined)
        print(spec, f"err {errs[spec]:.1e}", flush=True)
    placements = {
        spec: [placement(inputs[parse(spec)[0]], *parse(spec)[1:]) for _ in range(args.stamps)]
        for spec in specs
    }
    rows = bd.time_decode_rounds(calls, args.rounds)
    bd.save_experiment(args.out, "tight_grid", ceil, rows, errors=errs, placements=placements)
    print("\n" + bd.versions_line(ceil))
    print(f"{'variant':16}{'decode us':>22}{'+combine us':>22}  err")
    for spec in calls:
        dec, com = bd.decode_round_text(rows, spec)
        print(f"{spec:16}{dec:>22}{com:>22}  {errs[spec]:.1e}")
    for spec, launches in placements.items():
        for p in launches:
            print(f"{spec:16} span {p['span_us']:.1f} us, exits p50 {p['exit_p50']:.1f}; "
                  f"multiprocessors without a real program {p['idle']}, "
                  f"with an empty one {p['empty_sms']}")  # fmt: skip


if __name__ == "__main__":
    main()
