"""Host time of one eager ``mla_decode`` call (no CUDA graph), and where it goes.

    python benchmarks/experiments/host_overhead.py [--cases small16,a,...] [--calls 200] [--out DIR]

Per case: the host's wall time to enqueue ``--calls`` back-to-back calls (no synchronisation in
between; on the default small cases the GPU's time per call is far below the host's, so it is
not in the figure, while on a benchmark case it can be), the same for
FlashInfer's run where it imports, and each layer under ``mla_decode`` called directly (the
custom op, its CUDA implementation, ``triton_kernels.attention`` with its plan kept and with
every plan dropped before each call, as every call was before NOTES.md item 71) and parts of
them alone (checks, split plan, kernel choice, descriptors, the plan's lookup, the kept decode
launch directly and by Triton's dispatch); then a cProfile of
``triton_kernels.attention`` (top functions by their own time: cProfile misreads the custom op's
dispatch, whose frames run under dynamo's disable wrapper). Each figure also with Python's
cyclic garbage collector off (``_gc_off``), and the collections per call of ``mla_decode``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd

# Calls whose GPU time (a few microseconds) is far below their host time, so that the host's
# figures are never the GPU's: with a long queue of calls a big case's enqueue waits on the GPU.
SMALL_CASES = {
    "small16": bd.Case("small16", 1, 16, 256),
    "small128": bd.Case("small128", 1, 128, 256),
    "small16m": bd.Case("small16m", 1, 16, 256, mask=True),
}


def host_us(fn, calls: int, gc_off: bool = False) -> float:
    """Median over 5 rounds of the host's microseconds per call, enqueueing ``calls`` calls;
    ``gc_off``: with Python's cyclic garbage collector collected, then off, during each round."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        if gc_off:
            gc.collect()
            gc.disable()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        gc.enable()
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def gc_per_call(fn, calls: int) -> list[float]:
    """Collections of each of the cyclic collector's generations per call of ``fn``."""
    before = [g["collections"] for g in gc.get_stats()]
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return [(g["collections"] - b) / calls for g, b in zip(gc.get_stats(), before, strict=True)]


@torch.library.custom_op("host_overhead::noop", mutates_args=())
def noop(x: torch.Tensor) -> torch.Tensor:
    """The floor of a Python custom op's dispatch: allocates its output, launches nothing."""
    return x.new_empty(1)


@noop.register_fake
def _noop_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1)


def layer_fns(case: bd.Case, inp: bd.Inputs) -> dict:
    """Callables of each layer under ``mla_decode`` and of parts of those layers, by name."""
    fns = {}
    # The layers of one call, outermost first: each one's host time less the next one's is
    # what that layer adds.
    from mla_ops import ops, triton_kernels

    kv_c, k_pe = inp.decode_cache()
    plan = bd.planned(case, inp)
    op_args = (inp.q, kv_c, k_pe, inp.cache_seqlens, inp.block_table, bd.SCALE, True,
               plan.num_splits, inp.kv_scale, inp.attn_mask, plan.total_splits)  # fmt: skip
    fns["torch.ops.mla.attention"] = lambda a=op_args: torch.ops.mla.attention(*a)
    fns["ops._attention_cuda"] = lambda a=op_args: ops._attention_cuda(*a)
    fns["triton_kernels.attention"] = lambda a=op_args: triton_kernels.attention(*a)
    fns["torch.empty x3"] = lambda: [torch.empty(64, device="cuda") for _ in range(3)]
    fns["a custom op returning new_empty"] = lambda: torch.ops.host_overhead.noop(inp.q)
    # The first call of a signature: every plan dropped before each call (the choices, the
    # prepared launches and Triton's dispatch of them, as every call made before item 71).
    from mla_ops import plan_cache

    def unplanned(a=op_args):
        plan_cache.clear_plans()
        return triton_kernels.attention(*a)

    fns["triton_kernels.attention, plans dropped each call"] = unplanned
    # Parts of those layers, each alone: the checks, the split plan, the kernel choice, the TMA
    # descriptors, the plan's lookup, and the kept plan's decode launch with one call's data.
    from mla_ops import planner, wgmma_decode

    capacity = inp.block_table.shape[1] * kv_c.shape[1]
    q, bt, mask = inp.q, inp.block_table, inp.attn_mask
    fns["part: check_decode_args"] = lambda a=op_args: ops.check_decode_args(*a)
    fns["part: _takes_wgmma"] = lambda: ops._takes_wgmma(q, kv_c, k_pe, bt, mask)
    fns["part: plan_splits"] = lambda: planner.plan_splits(
        q.shape[0], q.shape[1] * q.shape[2], capacity, q.device, True
    )
    fns["part: _split_plan (kept)"] = lambda: ops._split_plan(q, kv_c, k_pe, bt, mask)
    fns["part: _decode_path"] = lambda: triton_kernels._decode_path(q, kv_c, k_pe, bt, mask, None)
    fns["part: descriptor x2"] = lambda: (
        wgmma_decode.descriptor(kv_c),
        wgmma_decode.descriptor(k_pe),
    )
    signature = (q, kv_c, k_pe, inp.cache_seqlens, bt, True, plan.num_splits, inp.kv_scale, mask,
                 plan.total_splits)  # fmt: skip
    fns["part: call_signature + lookup"] = lambda: triton_kernels._PLANS.lookup(
        triton_kernels.call_signature(*signature)
    )
    triton_kernels.attention(*op_args)
    kept = triton_kernels._PLANS.lookup(triton_kernels.call_signature(*signature))
    prepared = kept.decode.prepared
    captured = {}
    real_launch = prepared.launch

    def capture(data):
        captured["data"] = data
        return real_launch(data)

    prepared.launch = capture
    try:
        triton_kernels.attention(*op_args)
    finally:
        del prepared.launch  # the class's method again
    data = captured["data"]
    fns["part: decode's PreparedLaunch.launch (direct)"] = lambda: prepared.launch(data)
    fns["part: the same launch by Triton's dispatch"] = lambda: prepared.kernel[prepared.grid](
        *prepared.fill(data), **prepared.kwargs
    )
    return fns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="small16,small128,small16m")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name in args.cases.split(","):
        case = SMALL_CASES.get(name) or bd.CASES[name]
        inp = bd.Inputs(case, torch.Generator().manual_seed(0), with_contiguous=False)
        fns = {"mla_decode": bd.impls(case)["mla_decode"](inp)}
        if bd.peer_names(case, ("flashinfer",)):
            fns["flashinfer"] = bd.impls(case)["flashinfer"](inp)
        fns |= layer_fns(case, inp)
        fns["mla_decode, again"] = fns["mla_decode"]  # the first figure of a run can read high
        for fn in fns.values():
            fn()
        row = {"case": name} | {f"{k}_host_us": host_us(fn, args.calls) for k, fn in fns.items()}
        row |= {f"{k}_host_us_gc_off": host_us(fn, args.calls, True) for k, fn in fns.items()}
        row["gc_counts_per_call"] = gc_per_call(fns["mla_decode"], args.calls)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fns["triton_kernels.attention"]()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
        row["profile"] = text.getvalue()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        print(row["profile"][:6000], flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_overhead.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
