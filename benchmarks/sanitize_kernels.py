"""Run every decode kernel path once on small shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/sanitize_kernels.py            # every path
    compute-sanitizer --tool racecheck python benchmarks/sanitize_kernels.py --paths one_scorer_qreg

Each path is one ``mla_decode`` call (or the combine alone) whose plan the script checks before
launching, so a path the planner no longer takes is an error, not a silent skip; every output is
compared with the float64 reference afterwards. ``benchmarks/gpu_sanitize.sh`` runs the three tools
over every path on a GPU machine and keeps the logs. Needs a Hopper GPU for the Hopper kernel's
paths (the Triton path runs on any CUDA GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mla_compile.mla_ops import planner, runtime
from tests.mla_ops.cases import assert_matches, make_case

FP8 = torch.float8_e4m3fn

# name: (make_case keywords, the plan it must get: kernel, Hopper loop or None, merged in kernel)
PATHS = {
    "transposed_16_tma": (
        dict(heads=16, s_q=1, page_size=64, dims=(512, 64), lengths=[300, 64, 1], num_splits=3),
        ("wgmma", "transposed", False),
    ),
    "transposed_16_gather_page1": (
        dict(heads=16, s_q=1, page_size=1, dims=(512, 64), lengths=[70, 5], num_splits=2),
        ("wgmma", "transposed", True),
    ),
    "transposed_32_masked": (
        dict(heads=16, s_q=2, page_size=64, dims=(512, 64), lengths=[200, 3], num_splits=3,
             mask="bool"),
        ("wgmma", "transposed", False),
    ),
    "one_scorer_qreg": (
        dict(heads=128, s_q=1, page_size=64, dims=(512, 64), lengths=[300, 90], num_splits=3),
        ("wgmma", "one-scorer", False),
    ),
    "one_scorer_qreg_merge": (
        dict(heads=128, s_q=1, page_size=64, dims=(512, 64), lengths=[130, 0], num_splits=2),
        ("wgmma", "one-scorer", True),
    ),
    "one_scorer_masked": (
        dict(heads=128, s_q=1, page_size=64, dims=(512, 64), lengths=[300, 90], num_splits=3,
             mask="float"),
        ("wgmma", "one-scorer", False),
    ),
    "rows_on_m_gather": (
        dict(heads=128, s_q=1, page_size=16, dims=(512, 64), lengths=[200, 40], num_splits=3),
        ("wgmma", "rows-on-m", False),
    ),
    "float8_products": (
        dict(heads=16, s_q=1, page_size=64, dims=(512, 64), lengths=[300, 64], num_splits=3,
             cache_dtype=FP8, pair=True),
        ("wgmma", "transposed", False),
    ),
    "float8_staged_32": (
        dict(heads=16, s_q=2, page_size=64, dims=(512, 64), lengths=[300, 64], num_splits=3,
             cache_dtype=FP8, pair=True),
        ("wgmma", "transposed", False),
    ),
    # The repair pass, triggered: each sequence's last key NaN, seen by the last position only.
    "repair_after_wgmma": (
        dict(heads=16, s_q=2, page_size=64, dims=(512, 64), lengths=[300, 64], num_splits=3,
             poison_last_key=True),
        ("wgmma", "transposed", False),
    ),
    "repair_after_wgmma_merge_gather": (
        dict(heads=3, s_q=4, page_size=16, dims=(512, 64), lengths=[70, 5], num_splits=2,
             poison_last_key=True),
        ("wgmma", "transposed", True),
    ),
    "triton_fallback_l1024": (
        dict(heads=16, s_q=1, page_size=64, dims=(1024, 64), lengths=[200, 30], num_splits=3),
        ("triton", None, False),
    ),
}  # fmt: skip


def run_path(name: str) -> None:
    kw, (kernel, loop, merged) = PATHS[name]
    kw = dict(kw)
    poison = kw.pop("poison_last_key", False)
    case = make_case(7, dtype=torch.bfloat16, device="cuda", causal=kw.get("s_q", 1) > 1, **kw)
    if poison:
        page = case.kv_c.shape[1]
        for b, n in enumerate(case.cache_seqlens.tolist()):
            case.kv_c[case.block_table[b, (n - 1) // page], (n - 1) % page, 5] = float("nan")
    args = case.op_args()
    plan = planner.plan_decode(
        *args[:3], args[4], args[9], causal=case.causal, num_splits=case.num_splits,
        total_splits=case.total_splits,
    )  # fmt: skip
    got = (plan.kernel, plan.wgmma.loop if plan.wgmma else None, plan.merge_in_kernel)
    if got != (kernel, loop, merged):
        raise SystemExit(f"{name}: planned {got}, expected {(kernel, loop, merged)}")
    if poison and plan.repair is None:
        raise SystemExit(f"{name}: no repair pass planned ({plan.why('repair')})")
    out, lse = runtime.attention(*args)
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    if poison:  # the last position sees the NaN key; the others must be as without it
        if not torch.isnan(out[:, -1]).any(-1).all():
            raise SystemExit(f"{name}: a row that sees the NaN key came out finite")
        out, lse, ref_out, ref_lse = out[:, :-1], lse[:, :-1], ref_out[:, :-1], ref_lse[:, :-1]
    tolerance = (6e-2, 6e-2) if case.kv_c.dtype == FP8 else None
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16, f"{name}: {case.describe()}",
                   tolerance=tolerance, lse_tolerance=6e-2 if tolerance else None)  # fmt: skip
    print(f"{name}: ok ({plan.kernel}, {got[1]}, merged={merged})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of {list(PATHS)}")
    parser.add_argument("--list", action="store_true", help="print the path names and exit")
    options = parser.parse_args()
    if options.list:
        print("\n".join(PATHS))
        return
    names = [n for n in options.paths.split(",") if n]
    unknown = set(names) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}")
    for name in names:
        run_path(name)


if __name__ == "__main__":
    main()
