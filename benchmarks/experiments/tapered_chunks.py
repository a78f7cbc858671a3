"""Tapered chunks for (d): long chunks first, short ones last, so that the multiprocessors that
finish early take the tail (NOTES.md item 60).

(d) (4 x 65536 tokens, 16 heads) runs as 128 programs of 32 tiles, one per multiprocessor, and
its multiprocessors finish over about 14 us (item 38: a fast tier of 24 exits near 91 us, the
rest at 99-105). Guided self-scheduling would give the tail to whoever is free: a first wave of
long chunks, then waves of shorter ones that the block scheduler hands to the multiprocessors as
they free. This measures that with the shipped kernel, unchanged: the same 4096 tiles of cache
cut into *pieces*, each piece a sequence of its own in a virtual batch (its own query rows, one
chunk, num_splits=1), ordered longest first so that programs are dispatched in that order. The
bytes read are (d)'s. The decode alone is timed (graph replays, clean L2) against (d)'s planned
decode alone; a real tapered plan would add the merge of more chunks per sequence, which is
timed separately as ``mla::combine`` over (d)'s 64 rows with that many splits.

    python benchmarks/experiments/tapered_chunks.py --out $OUT
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
from chunk_rounding import FIELD, stamp_launch

TILE = 64
TOTAL_TILES = 4 * 65536 // TILE  # (d)


def waves(spec: str) -> list[int]:
    """``"132x28,132x3,rest1"`` -> piece lengths in tiles (longest first), summing to (d)'s."""
    pieces: list[int] = []
    for item in spec.split(","):
        if item.startswith("rest"):
            size = int(item[4:])
            left = TOTAL_TILES - sum(pieces)
            pieces += [size] * (left // size) + ([left % size] if left % size else [])
        else:
            n, size = map(int, item.split("x"))
            pieces += [size] * n
    if sum(pieces) != TOTAL_TILES:
        raise ValueError(f"{spec}: {sum(pieces)} tiles, expected {TOTAL_TILES}")
    return sorted(pieces, reverse=True)


def virtual_batch(pieces: list[int], gen: torch.Generator) -> SimpleNamespace:
    """Inputs (``bench_decode.Inputs``' attributes) of a batch whose sequences are the pieces."""
    dev, dt = "cuda", torch.bfloat16
    b = len(pieces)
    lengths = torch.tensor(pieces) * TILE
    pages_per_seq = max(pieces)
    num_pages = TOTAL_TILES
    kv_cache = torch.randn(num_pages, TILE, bd.L + bd.R, generator=gen).to(dev, dt)
    # Piece i owns pages_of[i]; the rest of its block-table row points at page 0, never read.
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(b, pages_per_seq, dtype=torch.int32)
    at = 0
    for i, n in enumerate(pieces):
        table[i, :n] = perm[at : at + n].int()
        at += n
    # One query shared by every piece (stride 0): (d) reads its 4 queries' 74 KB once each, and
    # 400 distinct ones would add 7 MB of reads to the pieces.
    q = torch.randn(1, 1, 16, bd.L + bd.R, generator=gen).to(dev, dt).expand(b, -1, -1, -1)
    ns = SimpleNamespace(
        kv_cache=kv_cache, block_table=table.to(dev), cache_seqlens=lengths.to(dev, torch.int32),
        q=q, lengths=lengths, kv_scale=None, attn_mask=None,
    )  # fmt: skip
    ns.decode_cache = lambda: (kv_cache[..., : bd.L], kv_cache[..., bd.L :])
    return ns


def stamped(inp, num_splits: int, total_splits: int | None) -> dict:
    """One clean-L2 stamped launch: span and per-multiprocessor last exits (us)."""
    s = stamp_launch(inp, num_splits, total_splits)
    real = s[:, FIELD["tiles"]] > 0
    t0 = s[real, FIELD["entry"]].min()
    exit_us = (s[:, FIELD["exit"]] - t0).double() / 1e3
    last: dict[int, float] = {}
    count: dict[int, int] = {}
    for i in real.nonzero().flatten().tolist():
        sm = int(s[i, FIELD["sm"]])
        last[sm] = max(last.get(sm, 0.0), float(exit_us[i]))
        count[sm] = count.get(sm, 0) + int(s[i, FIELD["tiles"]])
    exits = sorted(last.values())
    tiles = sorted(count.values())
    return dict(
        span_us=float(exit_us[real].max()), sms=len(last), exit_p10=exits[len(exits) // 10],
        exit_p50=exits[len(exits) // 2], exit_min=exits[0], tiles_min=tiles[0],
        tiles_max=tiles[-1], sm_last_exit=last, sm_tiles=count,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--variants",
        default="4x32;128x31,132x28;rest3,132x26;132x4;rest1,132x24;132x6;rest2,132x30;rest1,"
        "132x29;rest2,128x30;rest2",
        help="';'-separated waves per variant, ','-separated variants",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ceil = bd.ceilings()
    gen = torch.Generator().manual_seed(0)
    case = bd.CASES["d"]
    d_inp = bd.Inputs(case, gen, False)
    plan = bd.planned(case, d_inp)
    floor = bd.floor_seconds(case, dict(ceil))
    variants = {"d planned": (d_inp, tuple(plan))}
    for v in args.variants.split(","):
        pieces = waves(v.replace(";", ","))
        variants[f"{v} ({len(pieces)})"] = (virtual_batch(pieces, gen), (1, None))
    # Each virtual batch checked against its float32 reference (pieces merged by the combine).
    errs = {}
    for name, (inp, p) in variants.items():
        c = SimpleNamespace(batch=inp.q.shape[0], s_q=1)
        ref = bd.reference(inp, c)
        errs[name] = bd.rel_err(bd.wgmma_call(inp, *p)(), ref)
    rows = []
    stamps = {name: stamped(inp, *p) for name, (inp, p) in variants.items()}
    for rnd in range(args.rounds):
        for name, (inp, p) in variants.items():
            fn = bd.wgmma_call(inp, *p, with_combine=False)
            t = bd.time_rotating([bd.graphed(fn)], warmup=10, rep=100)
            rows.append(dict(variant=name, round=rnd, us=t * 1e6, roofline=floor / t))
            print(rows[-1], flush=True)
        # The merge of s splits for (d)'s 64 rows, in the call after its decode.
        for splits in (32, 64):
            o = torch.randn(4, 1, 16, splits, bd.L, device="cuda")
            lse = torch.randn(4, 1, 16, splits, device="cuda")
            t = bd.time_rotating(
                [bd.graphed(lambda o=o, lse=lse: torch.ops.mla.combine(o, lse, torch.bfloat16))]
            )
            rows.append(dict(variant=f"combine alone, {splits} splits", round=rnd, us=t * 1e6))
            print(rows[-1], flush=True)
    bd.save_experiment(args.out, "tapered_chunks", ceil, rows, errors=errs, stamps=stamps)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"triton {bd.triton.__version__}; {ceil}")  # fmt: skip
    print(f"{'variant':34}{'us':>16}{'roof':>6}{'span':>7}{'p10':>7}{'p50':>7}{'min':>7}"
          f"{'tiles/SM':>10}  err")  # fmt: skip
    for name in variants:
        us = [r["us"] for r in rows if r["variant"] == name]
        st = stamps[name]
        print(
            f"{name:34}{' '.join(f'{u:.1f}' for u in us):>16}{floor * 1e6 / min(us):6.3f}"
            f"{st['span_us']:7.1f}{st['exit_p10']:7.1f}{st['exit_p50']:7.1f}{st['exit_min']:7.1f}"
            f"{st['tiles_min']:>5}-{st['tiles_max']:<4}  {errs[name]:.1e}"
        )
    for r in rows:
        if r["variant"].startswith("combine"):
            print(f"{r['variant']:34}{r['us']:16.1f}")


if __name__ == "__main__":
    main()
