"""Where a decode program's time goes: global-timer stamps at each phase of every program.

Items 30-31 of NOTES.md fit the bandwidth-bound cases with a fixed cost of about 8 us per program
(or per piece of a sequence) that no timing so far took apart. This launches the wgmma kernel
with ``stamps`` (``wgmma_decode.STAMP_FIELDS``: entry, split bounds known, query staged, first
copy issued, first tile's scores, last copy issued, loop end, exit; plus the multiprocessor and
the tile count) under the planner's plan, with L2 evicted by a read before each call
(``bench_decode.evict_l2``), and summarises per case:

* the spread of the programs' entries, and each phase's latency from entry (median, max);
* the steady loop: microseconds per tile, and the copy rate it implies summed over programs;
* the tail: when the programs exit, from the first entry (quantiles), against the whole grid's
  span and the CUDA-event time of the same launch;
* the same launch timed without stamps (``bench_decode`` replays), so the instrument's own cost is
  visible.

Times are ``%globaltimer`` readings (ns, one clock for all multiprocessors). Only the decode
kernel runs (no combine); the partials are checked against a float32 reference through the
combine once.

    python benchmarks/experiments/phase_stamps.py --cases a,d,e,c,b --out $OUT
    python benchmarks/experiments/phase_stamps.py --cases 1x16x32k,1x16x32k_mask --out $OUT
    python benchmarks/experiments/phase_stamps.py --cases d,d@32/-,d@32/128 --out $OUT

A case may name its plan after ``@``: ``num_splits/total_splits`` (``-``: no total).

(NOTES.md item 32 also timed ``--claim``, tiles claimed from per-sequence counters, from a
branch that was not kept.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_decode as bd
from single_sequence import CASES as SINGLE_SEQUENCE_CASES

from mla_ops import wgmma_decode as wd

# The benchmark's cases and the batch-1 shapes of ``single_sequence.py``.
CASES = {**bd.CASES, **{case.name: case for case in SINGLE_SEQUENCE_CASES}}

FIELD = {name: i for i, name in enumerate(wd.STAMP_FIELDS)}


def quantiles(xs: list[float]) -> dict:
    """min, p10, p50, p90 and max of ``xs`` (NaNs dropped; {} if none is left)."""
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return {}

    def pick(q: float) -> float:
        return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]

    return dict(min=xs[0], p10=pick(0.1), p50=pick(0.5), p90=pick(0.9), max=xs[-1])


def summarise(stamps: torch.Tensor, tile_bytes: int) -> dict:
    """One launch's stamps ``[programs, STAMP_SLOTS]`` as phase latencies in us."""
    s = stamps.double()
    # A phase a program does not have (no producer partition in 64-row programs) stays 0.
    times = [FIELD[k] for k in wd.STAMP_FIELDS if k not in ("sm", "tiles")]
    s[:, times] = s[:, times].masked_fill(stamps[:, times] == 0, float("nan"))
    t0 = s[:, FIELD["entry"]].min()
    rel = (s - t0) / 1e3  # us from the first entry
    tiles = stamps[:, FIELD["tiles"]]
    real = tiles > 0
    r = rel[real]
    n = tiles[real].double()

    def col(name):
        return r[:, FIELD[name]]

    def since_entry(name):
        return quantiles((col(name) - col("entry")).tolist())

    loop = col("loop_end") - col("first_tile")
    per_tile = (loop / (n - 1).clamp_min(1))[n > 1]
    steady_rate = (tile_bytes * (n - 1)[n > 1] / (loop[n > 1] * 1e-6)).sum().item() / 1e9
    sm = stamps[:, FIELD["sm"]]
    sm_last_exit = torch.full((int(sm.max()) + 1,), float("nan"), dtype=torch.float64)
    sm_last_exit.scatter_reduce_(0, sm, rel[:, FIELD["exit"]], "amax", include_self=False)
    used = torch.bincount(sm) > 0
    return dict(
        programs=int(stamps.shape[0]),
        real_programs=int(real.sum()),
        programs_per_sm=quantiles(torch.bincount(sm)[used].double().tolist()),
        sm_last_exit=quantiles(sm_last_exit[used].tolist()),
        span_us=(rel[:, FIELD["exit"]].max()).item(),
        entry=quantiles(rel[:, FIELD["entry"]].tolist()),
        bounds=since_entry("bounds"),
        query=since_entry("query"),
        first_copy=since_entry("first_copy"),
        first_tile=since_entry("first_tile"),
        first_tile_after_copy=quantiles((col("first_tile") - col("first_copy")).tolist()),
        loop_us=quantiles(loop.tolist()),
        us_per_tile=quantiles(per_tile.tolist()),
        steady_copy_rate_gbs=steady_rate,
        drain=quantiles((col("loop_end") - col("last_copy")).tolist()),
        epilogue=quantiles((col("exit") - col("loop_end")).tolist()),
        # One-scorer programs' epilogue in steps, each from the loop's end (warpgroup 0's).
        **{
            f"{name}_after_loop": quantiles((col(name) - col("loop_end")).tolist())
            for name in ("assist_end", "sums_handed", "assist_stored")
        },
        exit=quantiles(rel[:, FIELD["exit"]].tolist()),
        tiles=quantiles(n.tolist()),
    )


def stamp_case(name: str, ceil: dict, runs: int) -> tuple[dict, list]:
    """One case under the planner's plan: the decode timed without and with stamps, then
    ``runs`` stamped launches summarised (and their raw stamps)."""
    from mla_ops import triton_kernels as tk

    name, _, plan_spec = name.partition("@")  # "d@32/-": case d under num_splits 32, no total
    case = CASES[name]
    copies = bd.input_copies(case, torch.cuda.get_device_properties(0).L2_cache_size)
    plan = bd.planned(case, copies[0])
    if plan_spec:
        n, t = plan_spec.split("/")
        plan = (int(n), None if t == "-" else int(t))
    kv_c, k_pe = copies[0].decode_cache()
    tile_bytes = wd.BLOCK_N * (kv_c.shape[-1] * kv_c.element_size() + k_pe.shape[-1] * 2)
    block_m, _ = tk.wgmma_tiling(case.heads * case.s_q)
    row_blocks = case.batch * -(-case.heads * case.s_q // block_m)
    programs = row_blocks * plan[0]
    stamps = torch.zeros(programs, wd.STAMP_SLOTS.value, dtype=torch.int64, device="cuda")
    plain = [bd.wgmma_call(inp, *plan, with_combine=False) for inp in copies]
    marked = [bd.wgmma_call(inp, *plan, with_combine=False, stamps=stamps) for inp in copies]
    t_plain = bd.time_rotating([bd.graphed(f) for f in plain], warmup=10, rep=100)
    t_marked = bd.time_rotating([bd.graphed(f) for f in marked], warmup=10, rep=100)
    ref = bd.reference(copies[0], case)
    err = bd.rel_err(torch.ops.mla.combine(*marked[0](), copies[0].q.dtype)[0], ref)
    summaries, raw = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(runs):
        stamps.zero_()
        bd.evict_l2("clean")
        start.record()
        marked[(r + 1) % len(marked)]()
        end.record()
        torch.cuda.synchronize()
        summary = summarise(stamps.cpu(), tile_bytes)
        summary["event_us"] = start.elapsed_time(end) * 1e3
        summaries.append(summary)
        raw.append(stamps.cpu().tolist())
    row = dict(
        case=name + (f"@{plan_spec}" if plan_spec else ""), plan=list(plan), programs=programs,
        block_m=block_m,
        decode_us=t_plain * 1e6, stamped_decode_us=t_marked * 1e6, rel_err=err,
        floor_us=bd.floor_seconds(case, dict(ceil)) * 1e6, runs=summaries,
    )  # fmt: skip
    del copies, plain, marked
    torch.cuda.empty_cache()
    return row, raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,d,e,c,b")
    ap.add_argument("--runs", type=int, default=5, help="stamped launches per case")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ceil = bd.ceilings()
    rows, raw = [], {}
    for name in filter(None, args.cases.split(",")):
        row, stamps = stamp_case(name, ceil, args.runs)
        rows.append(row)
        raw[name] = stamps
        print_case(row)
    bd.save_experiment(args.out, "phase_stamps", ceil, rows, fields=list(wd.STAMP_FIELDS), raw=raw)


def print_case(row: dict) -> None:
    """The median run's phases (us; p50 / max over programs unless said)."""
    runs = sorted(row["runs"], key=lambda r: r["span_us"])
    r = runs[len(runs) // 2]

    def pm(q):
        return f"{q.get('p50', float('nan')):6.2f} / {q.get('max', float('nan')):6.2f}"

    print(
        f"\n== {row['case']}: plan {row['plan']}, "
        f"{row['programs']} programs ({row['block_m']} rows), floor {row['floor_us']:.1f} us, "
        f"decode {row['decode_us']:.1f} us (stamped {row['stamped_decode_us']:.1f}), "
        f"err {row['rel_err']:.1e}"
    )
    print(
        f"  span {r['span_us']:.1f} us (events around the eager launch, host included: "
        f"{r['event_us']:.1f}); entries p50/max "
        f"{pm(r['entry'])}; programs/SM {r['programs_per_sm']}; tiles {pm(r['tiles'])}"
    )
    for key in (
        "bounds", "query", "first_copy", "first_tile", "first_tile_after_copy", "loop_us",
        "us_per_tile", "drain", "epilogue", "assist_end_after_loop", "sums_handed_after_loop",
        "assist_stored_after_loop", "exit", "sm_last_exit",
    ):  # fmt: skip
        q = r[key]
        print(
            f"  {key:<22} p10 {q.get('p10', 0):7.2f}  p50 {q.get('p50', 0):7.2f}  "
            f"p90 {q.get('p90', 0):7.2f}  max {q.get('max', 0):7.2f}"
        )
    print(f"  steady copy rate summed over programs: {r['steady_copy_rate_gbs']:.0f} GB/s")


if __name__ == "__main__":
    main()
