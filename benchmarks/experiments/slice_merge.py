"""Could (d)'s 32 chunks per sequence be merged inside the decode kernel within the 1.9 us that
its 0.90 target leaves (NOTES.md items 35, 40, 47)? A stand-in for the decode's epilogue on (d)'s
shapes: 4 sequences x 32 chunks, 16 rows, 512 float32 columns, one program per chunk (128), each
storing its partial and lse as the decode does. Then, per mode:

- ``exit``: nothing more (the decode writing partials for ``mla::combine``); timed alone and
  followed by ``triton_kernels.combine`` (the op's merge, launched as the op launches it);
- ``slices``: every program counts its arrival on its sequence's counter (acq_rel, after a
  barrier), waits until all of the sequence's chunks have arrived, then merges one 16-column
  slice of the sequence's 16 rows from all 32 partials (32 KB of reads) and stores it. This is
  the in-kernel merge that NOTES.md item 40 left unbuilt; it is safe only where every program of
  a sequence is resident at once, as in (d), and the op would need a fallback elsewhere.

``--spread-us``: each program first idles for a pseudo-random 0 .. spread microseconds, as (d)'s
programs end across about 14 us on an H100 (item 32). Per mode: the CUDA-graph replay time (no
L2 eviction: every byte here was just written), and from global-timer stamps per sequence the
time from its last arrival (partial stored) to its last program's end. The slice merge's output
is checked against the combine's on the same partials.

    python benchmarks/experiments/slice_merge.py --spread-us 0,10 --out $OUT
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODES = ("exit", "slices", "slices_epoch")
STAMPS = 3  # per program: start (after the idle), arrival (partial stored), end


@triton.jit
def _epilogue(
    PART,  # [B, H, CHUNKS, L] float32: mla::decode's partial layout for S_q = 1
    LSE,  # [B, H, CHUNKS] float32
    OUT,  # [B, H, L] bfloat16
    LSE_OUT,  # [B, H] float32
    ARRIVED,  # [B] int32, zero before and after
    DONE,  # [B] int32, zero before and after
    STAMP_BUF,  # [programs, 3] int64
    spread_ns,
    CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    L: tl.constexpr,
    MODE: tl.constexpr,
):
    pid = tl.program_id(0)
    seq = pid // CHUNKS
    chunk = pid % CHUNKS
    t0 = tl.extra.cuda.globaltimer()
    if spread_ns > 0:  # idle a pseudo-random 0 .. spread_ns
        delay = (pid.to(tl.int64) * 2654435761) % 1000003 * spread_ns // 1000003
        now = t0
        while now < t0 + delay:
            now = tl.extra.cuda.globaltimer()
        t0 = now
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, L)
    # A partial and lse that differ per chunk, row and column (values of order 1).
    part = ((rows[:, None] * 131 + cols[None, :] * 7 + pid * 17) % 101).to(tl.float32) * 0.01
    lse = ((rows * 5 + pid * 3) % 23).to(tl.float32) * 0.25
    row_base = (seq * ROWS + rows) * CHUNKS + chunk  # [ROWS]
    tl.store(PART + row_base[:, None] * L + cols[None, :], part)
    tl.store(LSE + row_base, lse)
    t1 = tl.extra.cuda.globaltimer()
    if MODE == 1:
        tl.debug_barrier()
        seen = tl.atomic_add(ARRIVED + seq, 1, sem="acq_rel", scope="gpu") + 1
        t1 = tl.extra.cuda.globaltimer()
        while seen < CHUNKS:
            seen = tl.atomic_add(ARRIVED + seq, 0, sem="acquire", scope="gpu")
        SLICE: tl.constexpr = L // CHUNKS
        k = tl.arange(0, CHUNKS)
        sc = chunk * SLICE + tl.arange(0, SLICE)
        all_rows = (seq * ROWS + rows[None, :]) * CHUNKS + k[:, None]  # [CHUNKS, ROWS]
        lse_all = tl.load(LSE + all_rows, cache_modifier=".cg")
        lse_max = tl.max(lse_all, 0)
        w = tl.exp(lse_all - lse_max[None, :])
        total = tl.sum(w, 0)
        p = tl.load(PART + all_rows[:, :, None] * L + sc[None, None, :], cache_modifier=".cg")
        o = tl.sum(p * w[:, :, None], 0) / total[:, None]  # [ROWS, SLICE]
        tl.store(OUT + (seq * ROWS + rows[:, None]) * L + sc[None, :], o.to(tl.bfloat16))
        if chunk == 0:
            tl.store(LSE_OUT + seq * ROWS + rows, lse_max + tl.log(total))
        # The last program past the wait puts both counters back to 0 for the next launch.
        if tl.atomic_add(DONE + seq, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
            tl.store(ARRIVED + seq, 0)
            tl.store(DONE + seq, 0)
    if MODE == 2:
        tl.debug_barrier()
        ticket = tl.atomic_add(ARRIVED + seq, 1, sem="acq_rel", scope="gpu")
        t1 = tl.extra.cuda.globaltimer()
        goal = (ticket // CHUNKS + 1) * CHUNKS  # this launch's arrivals all in
        seen = ticket + 1
        while seen < goal:
            seen = tl.atomic_add(ARRIVED + seq, 0, sem="acquire", scope="gpu")
        SLICE_E: tl.constexpr = L // CHUNKS
        kr = tl.arange(0, CHUNKS * ROWS)  # chunk-major: k = kr // ROWS, row = kr % ROWS
        src_row = (seq * ROWS + kr % ROWS) * CHUNKS + kr // ROWS  # [CHUNKS * ROWS]
        c0 = tl.multiple_of(chunk * SLICE_E, SLICE_E)
        sc_e = tl.arange(0, SLICE_E)
        p = tl.load(PART + src_row[:, None] * L + c0 + sc_e[None, :], cache_modifier=".cg")
        lse_kr = tl.load(LSE + src_row, cache_modifier=".cg")
        lse_all = tl.reshape(lse_kr, [CHUNKS, ROWS])
        lse_max = tl.max(lse_all, 0)
        w = tl.exp(lse_all - lse_max[None, :])
        total = tl.sum(w, 0)
        o = tl.sum(tl.reshape(p, [CHUNKS, ROWS, SLICE_E]) * w[:, :, None], 0) / total[:, None]
        tl.store(OUT + (seq * ROWS + rows[:, None]) * L + c0 + sc_e[None, :], o.to(tl.bfloat16))
        if chunk == 0:
            tl.store(LSE_OUT + seq * ROWS + rows, lse_max + tl.log(total))
    t2 = tl.extra.cuda.globaltimer()
    tl.store(STAMP_BUF + pid * 3, t0)
    tl.store(STAMP_BUF + pid * 3 + 1, t1)
    tl.store(STAMP_BUF + pid * 3 + 2, t2)


class Buffers:
    """(d)'s partials and the slice merge's outputs, counters and stamps."""

    def __init__(self, batch: int, rows: int, chunks: int, kv_len: int) -> None:
        dev = "cuda"
        self.shape = (batch, rows, chunks, kv_len)
        self.part = torch.zeros(batch, 1, rows, chunks, kv_len, device=dev)
        self.lse = torch.zeros(batch, 1, rows, chunks, device=dev)
        self.out = torch.zeros(batch, 1, rows, kv_len, device=dev, dtype=torch.bfloat16)
        self.lse_out = torch.zeros(batch, 1, rows, device=dev)
        self.arrived = torch.zeros(batch, device=dev, dtype=torch.int32)
        self.done = torch.zeros(batch, device=dev, dtype=torch.int32)
        self.stamps = torch.zeros(batch * chunks, STAMPS, device=dev, dtype=torch.int64)

    def launch(self, mode: str, spread_us: float) -> None:
        batch, rows, chunks, kv_len = self.shape
        _epilogue[(batch * chunks,)](
            self.part, self.lse, self.out, self.lse_out, self.arrived, self.done, self.stamps,
            int(spread_us * 1000), CHUNKS=chunks, ROWS=rows, L=kv_len, MODE=MODES.index(mode),
            num_warps=4,
        )  # fmt: skip


def tail_us(stamps: torch.Tensor, chunks: int) -> dict[str, float]:
    """Per sequence, its last program's end minus its last arrival; median and largest (us)."""
    s = stamps.double().cpu().view(-1, chunks, STAMPS)
    tails = ((s[:, :, 2].max(1).values - s[:, :, 1].max(1).values) / 1e3).tolist()
    span = ((s[:, :, 2].max() - s[:, :, 0].min()) / 1e3).item()
    return {"tail_med_us": statistics.median(tails), "tail_max_us": max(tails), "span_us": span}


def main() -> None:
    import bench_decode as bd

    from mla_ops import triton_kernels as tk

    ap = argparse.ArgumentParser()
    ap.add_argument("--spread-us", default="0,10", help="programs' idle spread before the store")
    ap.add_argument("--shape", default="4,16,32,512", help="batch,rows,chunks,kv_len ((d)'s)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    batch, rows, chunks, kv_len = (int(x) for x in args.shape.split(","))
    if kv_len % chunks:
        raise ValueError(f"--shape: kv_len must be a multiple of chunks, got {args.shape}")
    buf = Buffers(batch, rows, chunks, kv_len)
    results = []
    for spread in [float(x) for x in args.spread_us.split(",")]:
        variants = {
            "exit": lambda spread=spread: buf.launch("exit", spread),
            "exit + mla::combine": lambda spread=spread: (
                buf.launch("exit", spread),
                tk.combine(buf.part, buf.lse, torch.bfloat16),
            ),
            "slices": lambda spread=spread: buf.launch("slices", spread),
            "slices_epoch": lambda spread=spread: buf.launch("slices_epoch", spread),
        }
        # Correctness: each slice merge against the combine on the same partials.
        errs = {}
        for mode in ("slices", "slices_epoch"):
            buf.out.zero_()
            buf.lse_out.zero_()
            buf.launch(mode, spread)
            ref_out, ref_lse = tk.combine(buf.part, buf.lse, torch.bfloat16)
            torch.cuda.synchronize()
            out_err = (buf.out.float() - ref_out.float()).abs().max().item()
            lse_err = (buf.lse_out - ref_lse).abs().max().item()
            if out_err > 1e-2 or lse_err > 1e-4 or (mode == "slices" and buf.done.any()):
                raise AssertionError(f"{mode}: out {out_err}, lse {lse_err}, counters "
                                     f"{buf.arrived.tolist()} {buf.done.tolist()}")  # fmt: skip
            errs[mode] = (out_err, lse_err)
        for name, fn in variants.items():
            us = bd.time_rotating([bd.graphed(fn)], warmup=10, rep=100, l2="none") * 1e6
            fn()
            torch.cuda.synchronize()
            out_err, lse_err = errs.get(name, (0.0, 0.0))
            row = dict(spread_us=spread, variant=name, us=us, out_err=out_err, lse_err=lse_err)
            row.update(tail_us(buf.stamps, chunks))
            results.append(row)
            print(row, flush=True)
    bd.save_experiment(args.out, "slice_merge", {}, results, shape=args.shape)
    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name}; torch {torch.__version__}, triton {triton.__version__}; "
          f"shape {args.shape} (batch, rows, chunks, kv_len)")  # fmt: skip
    print(f"{'spread':>7} {'variant':22}{'us':>8}{'tail':>8}{'tail max':>9}{'span':>8}")
    for r in results:
        print(f"{r['spread_us']:7.1f} {r['variant']:22}{r['us']:8.2f}{r['tail_med_us']:8.2f}"
              f"{r['tail_max_us']:9.2f}{r['span_us']:8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
