"""A/B of a change to the Triton decode kernel (``mla_ops/triton_kernels.py``, the path off
Hopper's wgmma kernel: Blackwell and later, unpaged caches, shapes the wgmma kernel refuses),
timed on Hopper with the wgmma kernel turned off (NOTES.md item 85).

Each copy's ``decode`` runs under the Triton kernel's own plan (``plan_splits(wgmma=False)``)
and default tiling, then the package's ``mla::combine``; outputs are checked against float32
attention; timing is bench_decode's (CUDA-graph replays of rotated input copies, clean L2,
median), rounds alternating the copies.

    git show HEAD:mla_ops/triton_kernels.py > /tmp/base.py
    python benchmarks/experiments/triton_source_ab.py --sources base=/tmp/base.py --cases d,b \
        --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd

from mla_ops import planner
from mla_ops import triton_kernels as tk


def call(module, inp, plan):
    """A closure: ``module.decode`` (the Triton kernel) on ``inp``, then ``mla::combine``."""
    kv_c, k_pe = inp.decode_cache()
    _, s_q, h, _ = inp.q.shape
    config = module.default_config(
        s_q * h, kv_c.shape[-1], k_pe.shape[-1], inp.q.element_size(),
        tk.shared_memory_optin(inp.q.device), kv_c.dtype == torch.float8_e4m3fn,
    )  # fmt: skip
    config = replace(config, use_wgmma=False)
    kernel = module._DecodeKernel(
        module._decode_path(inp.q, kv_c, k_pe, inp.block_table, None, config), True, plan[0],
        plan[1], False,
    )  # fmt: skip

    def fn():
        out, lse = module.decode(
            inp.q, kv_c, k_pe, inp.cache_seqlens, inp.block_table, bd.SCALE, True, plan[0],
            inp.kv_scale, None, plan[1], fill_empty=False, kernel=kernel,
        )  # fmt: skip
        return torch.ops.mla.combine(out, lse, inp.q.dtype)[0]

    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sources", required=True, help="name=path,...; the path 'package': ours")
    ap.add_argument("--cases", default="d,b,c,e")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    modules = {}
    for item in args.sources.split(","):
        name, _, path = item.partition("=")
        modules[name] = tk if path == "package" else bd.load_kernel_source(path, f"tk_{name}")
    ceil = bd.ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, summary = [], []
    for case_name in args.cases.split(","):
        case = bd.CASES[case_name]
        copies = bd.input_copies(case, l2)
        capacity = copies[0].block_table.shape[1] * case.page_size
        plan = planner.plan_splits(
            case.batch, case.heads * case.s_q, capacity, torch.device("cuda"), False
        )
        plan = (plan.num_splits, plan.total_splits)
        floor = bd.floor_seconds(case, dict(ceil))
        ref = bd.reference(copies[0], case)
        fns = {name: [call(m, inp, plan) for inp in copies] for name, m in modules.items()}
        errs = {name: bd.rel_err(f[0](), ref) for name, f in fns.items()}
        times: dict[str, list[float]] = {name: [] for name in modules}
        for rnd in range(args.rounds):
            order = list(modules) if rnd % 2 == 0 else list(modules)[::-1]
            for name in order:
                t = bd.time_rotating([bd.graphed(f) for f in fns[name]], warmup=10, rep=100)
                times[name].append(t * 1e6)
                rows.append(dict(case=case_name, source=name, round=rnd, us=t * 1e6))
        summary.append((case_name, plan, floor, times, errs))
        del copies, fns
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "triton_source_ab", ceil, rows)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"triton {triton.__version__}; {ceil}")  # fmt: skip
    for case_name, plan, floor, times, errs in summary:
        print(f"{case_name}: plan {plan[0]}/{plan[1]}, floor {floor * 1e6:.1f} us")
        for name, ts in times.items():
            print(f"  {name:10} {', '.join(f'{t:.1f}' for t in ts)} us  err {errs[name]:.1e}")


if __name__ == "__main__":
    main()
