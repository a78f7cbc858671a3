"""Where a float8 cache's ``k_pe`` lies, and what it costs the decode (benchmarks/NOTES.md item 36).

``bench_decode``'s case ``a8`` reads ``kv_c`` from its own contiguous float8 tensor and ``k_pe`` as
a view into the bf16 rows it was quantised from: 128 bytes out of every 1152. A cache built for
float8 stores ``k_pe`` either contiguously, or per token beside ``kv_c`` (one 640-byte row: 512
e4m3 bytes, then 64 bf16 values, as FlashMLA's float8 rows keep the RoPE part beside the latent
part). The same values in the three layouts, the op's tiling, the planner's plan, then
``mla::combine``; CUDA-graph replays of rotated inputs, ``bench_decode``'s clean-L2 timer. Every
float8 output is checked against float64 attention over the dequantised cache first.

    python benchmarks/experiments/fp8_layout.py --out $OUT [--cases a8,b8]

It also serves as the A/B harness of NOTES.md item 37: ``--cases`` takes ``X8`` (case ``X`` over
a float8 cache, e.g. ``b8``: 128 heads) and plain 16-bit cases (``d``; with ``--layouts bf16``),
``--layouts`` a subset, ``--stages`` the float8 kernel's ring slots, ``--sources`` other copies of
the kernel's source in every float8 layout (``source_ab.py``'s syntax; NOTES.md item 57).
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


def dequantised_reference(inp: bd.Inputs, case: bd.Case) -> torch.Tensor:
    """float64 causal attention over the dequantised float8 cache, one sequence at a time (what
    the kernel must reproduce; ``bench_decode.reference`` with the cache the kernel reads)."""
    kv_c, k_pe = inp.decode_cache()
    pe_scale = inp.kv_scale if k_pe.dtype == torch.float8_e4m3fn else 1.0
    kv = torch.cat([kv_c.double() * inp.kv_scale, k_pe.double() * pe_scale], -1)
    return bd.reference(inp, case, kv_cache=kv, dtype=torch.float64)


class CacheView:
    """An ``Inputs`` copy whose decode reads ``(kv_c, k_pe)`` in another layout (same values)."""

    def __init__(self, inp: bd.Inputs, layout: str) -> None:
        self.__dict__.update(inp.__dict__)
        k_pe = inp.kv_cache[..., bd.L :]  # [pages, page_size, R] bf16, a strided view
        if layout == "bf16":  # the bf16 cache the float8 one was quantised from
            self.kv_c_fp8, self.kv_scale = None, None
            self.pair = (inp.kv_cache[..., : bd.L], k_pe)
        elif layout == "strided k_pe":  # bench_decode's a8
            self.pair = (inp.kv_c_fp8, k_pe)
        elif layout == "contiguous k_pe":
            self.pair = (inp.kv_c_fp8, k_pe.contiguous())
        elif layout == "640-byte rows":
            pages, page_size, _ = k_pe.shape
            rows = torch.empty(pages, page_size, bd.L + 2 * bd.R, dtype=torch.uint8, device="cuda")
            rows[..., : bd.L] = inp.kv_c_fp8.view(torch.uint8)
            rows[..., bd.L :] = k_pe.contiguous().view(torch.uint8)
            self.pair = (
                rows[..., : bd.L].view(inp.kv_c_fp8.dtype),
                rows[..., bd.L :].view(k_pe.dtype),
            )
        else:
            raise ValueError(f"layout: unknown {layout!r}")

    def decode_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pair

    op_args = bd.Inputs.op_args


LAYOUTS = ("bf16", "strided k_pe", "contiguous k_pe", "640-byte rows")


def case_named(name: str) -> bd.Case:
    """A ``bench_decode`` case, ``X8``: case ``X`` over a float8 cache (``b8``: 128 heads), or
    ``X8e``: the same with ``k_pe`` in float8 too (``Case.fp8_rope``)."""
    if name in bd.CASES:
        return bd.CASES[name]
    if name.endswith("8") and name[:-1] in bd.CASES:
        return replace(bd.CASES[name[:-1]], name=name, fp8=True)
    if name.endswith("8e") and name[:-2] in bd.CASES:
        return replace(bd.CASES[name[:-2]], name=name, fp8=True, fp8_rope=True)
    raise ValueError(
        f"--cases: unknown case {name!r}; expected one of {sorted(bd.CASES)}, X8 or X8e"
    )


def case_inputs(name: str, ceil: dict, float64_reference: bool = False):
    """An A/B run's set-up of case ``name`` (``case_named``): ``(case, copies, plan, ref, row)``,
    the rotated input copies, the planner's plan, the reference (float8: ``dequantised_reference``;
    16-bit: float64 attention with ``float64_reference``, else None) and the result row with the
    case's roofline floor."""
    case = case_named(name)
    copies = bd.input_copies(case, torch.cuda.get_device_properties(0).L2_cache_size)
    plan = bd.planned(case, copies[0])
    if case.fp8:
        ref = dequantised_reference(copies[0], case)
    elif float64_reference:
        ref = bd.reference(copies[0], case, dtype=torch.float64)
    else:
        ref = None
    row = dict(case=name, num_splits=plan[0], total_splits=plan[1])
    row["floor_us"] = bd.floor_seconds(case, ceil) * 1e6
    return case, copies, plan, ref, row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a8")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="a subset of " + ",".join(LAYOUTS))
    ap.add_argument(
        "--stages", type=int, default=None,
        help="ring slots of the float8 layouts' kernel (default: the op's wgmma_stages)",
    )  # fmt: skip
    ap.add_argument(
        "--sources", default=None,
        help="name=path[+key=int...],...: kernel source copies also run in each float8 layout",
    )  # fmt: skip
    args = ap.parse_args()
    try:
        modules, launch_kw = bd.parse_sources(args.sources) if args.sources else ({}, {})
    except ValueError as e:
        ap.error(str(e))
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        ap.error(f"--layouts: unknown {sorted(unknown)}; expected some of {LAYOUTS}")
    props = torch.cuda.get_device_properties(0)
    ceil = bd.ceilings()
    rows = []
    for name in args.cases.split(","):
        case, copies, plan, ref, row = case_inputs(name, ceil)
        # Roofline floors of the bytes each reads: float8 rows, and the bf16 rows of the reference.
        floor = row["floor_us"] / 1e6
        floor_bf16 = bd.floor_seconds(replace(case, fp8=False), ceil)
        for layout in layouts:
            views = [CacheView(inp, layout) for inp in copies]
            ring = {} if args.stages is None or layout == "bf16" else {"num_stages": args.stages}
            variants = {layout: dict(ring)}
            if layout != "bf16":
                for src, module in modules.items():
                    variants[f"{layout} / {src}"] = dict(module=module, **launch_kw[src])
            for key, kw in variants.items():
                fns = [bd.wgmma_call(v, *plan, **kw) for v in views]
                seconds, err = bd.time_call(fns, None if layout == "bf16" else ref)
                own_floor = floor_bf16 if layout == "bf16" else floor
                row[key] = dict(us=seconds * 1e6, rel_err=err, roofline=own_floor / seconds)
                print(name, key, f"{seconds * 1e6:.1f} us", f"err {err:.1e}", flush=True)
                del fns
            del views
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    bd.save_experiment(args.out, "fp8_layout", ceil, rows)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; {ceil}")
    for r in rows:
        base = r["bf16"]["us"] if "bf16" in r else float("nan")
        for key in [k for k in r if isinstance(r[k], dict)]:
            v = r[key]
            print(
                f"{r['case']:4} {key:28} {v['us']:8.1f} us  {base / v['us']:5.2f}x of bf16  "
                f"{v['roofline']:.2f} of its roofline  err {v['rel_err']:.1e}"
            )


if __name__ == "__main__":
    main()
