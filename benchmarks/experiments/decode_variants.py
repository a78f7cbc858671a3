"""Experiment (issue 3): which kernel formulation gets the memory-bound cases near copy bandwidth.

Times, on the same inputs as ``bench_decode.py`` (graph replays, rotated copies, median):
  * ``ours``: the production kernel over tiles, warps, stages, TMA on/off and split counts;
  * ``rows_on_n``: a stripped prototype (no mask, no fp8, no bad-page poisoning) computing
    ``S^T = K Q^T`` and ``O^T = V^T P^T`` so that the KV tile is the wgmma's M=64 operand and the
    16 query rows are its N side; tiles by per-token gather (mode 0), page-contiguous pointers
    (mode 1) or TMA descriptors (mode 2).
Every variant's output is checked against the float32 reference before it is timed.

    python benchmarks/experiments/decode_variants.py --cases a,d --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd

from mla_ops import triton_kernels as tk


@triton.jit
def _program_range(Q, SEQLENS, stride_qb, stride_qh, num_splits, H, BLOCK_M: tl.constexpr):
    """This program's sequence, query-row pointers and token range (64-token split granule)."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    b64 = b.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    seqlen = tl.load(SEQLENS + b)
    chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), 64) * 64
    start = split * chunk
    return b64, split, rows, rows < H, Q + b64 * stride_qb + rows * stride_qh, start, \
        tl.minimum(start + chunk, seqlen)  # fmt: skip


@triton.jit
def _rows_on_n_kernel(
    Q, KV_C, K_PE, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART, KV_DESC, PE_DESC,
    stride_qb, stride_qh, stride_cp, stride_ct, stride_pp, stride_pt, stride_btb,
    stride_ob, stride_oh, stride_ok, stride_lb, stride_lh, stride_lk, scale_log2, num_splits,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    b64, split, rows, row_ok, q_row, start, end = _program_range(
        Q, SEQLENS, stride_qb, stride_qh, num_splits, H, BLOCK_M
    )
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    offs_t = tl.arange(0, BLOCK_N)
    q_t = tl.load(q_row[None, :] + offs_l[:, None], mask=row_ok[None, :], other=0.0)  # [L, BM]
    qpe_t = tl.load(q_row[None, :] + L + offs_r[:, None], mask=row_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([L, BLOCK_M], dtype=tl.float32)  # O^T
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + offs_t
        tok_ok = offs_n < end
        if MODE == 0:  # per-token gather
            page = tl.load(
                BLOCK_TABLE + b64 * stride_btb + offs_n // PAGE_SIZE, mask=tok_ok, other=0
            )
            slot = offs_n % PAGE_SIZE
            row = page.to(tl.int64) * stride_cp + slot * stride_ct
            prow = page.to(tl.int64) * stride_pp + slot * stride_pt
            kv = tl.load(KV_C + row[:, None] + offs_l[None, :], mask=tok_ok[:, None], other=0.0)
            kpe = tl.load(K_PE + prow[:, None] + offs_r[None, :], mask=tok_ok[:, None], other=0.0)
        elif MODE == 1:  # the tile is rows of one page: one page id, affine addresses
            page = tl.load(BLOCK_TABLE + b64 * stride_btb + tile_start // PAGE_SIZE).to(tl.int64)
            slot = tile_start % PAGE_SIZE + offs_t
            kv = tl.load(KV_C + page * stride_cp + slot[:, None] * stride_ct + offs_l[None, :])
            kpe = tl.load(K_PE + page * stride_pp + slot[:, None] * stride_pt + offs_r[None, :])
        else:  # TMA
            page = tl.load(BLOCK_TABLE + b64 * stride_btb + tile_start // PAGE_SIZE)
            row0 = page * PAGE_SIZE + tile_start % PAGE_SIZE
            kv = KV_DESC.load([row0, 0])
            kpe = PE_DESC.load([row0, 0])
        kv = tl.where(tok_ok[:, None], kv, 0.0)
        s_t = tl.dot(kv, q_t) + tl.dot(kpe, qpe_t)  # [BN, BM]
        s_t = tl.where(tok_ok[:, None], s_t * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p_t = tl.exp2(s_t - m_shift[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(kv), p_t.to(kv.dtype))
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[None, :]
    o_row = O_PART + b64 * stride_ob + rows * stride_oh + split * stride_ok
    tl.store(o_row[None, :] + offs_l[:, None], out, mask=row_ok[None, :])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE_PART + b64 * stride_lb + rows * stride_lh + split * stride_lk, lse, mask=row_ok)


def prototype(inp: bd.Inputs, splits: int, kernel, bn: int, warps: int, stages: int, **const):
    """A prototype kernel + our combine on one input copy; ``MODE=2`` passes TMA descriptors."""
    kv_c, k_pe = inp.decode_cache()
    q = inp.q
    b, _, h, _ = q.shape
    out = torch.empty(b, 1, h, splits, bd.L, device=q.device, dtype=torch.float32)
    lse = torch.empty(b, 1, h, splits, device=q.device, dtype=torch.float32)
    tma = const.get("MODE") == 2
    kd = tk._descriptor(kv_c, bn) if tma else None
    pd = tk._descriptor(k_pe, bn) if tma else None

    def fn():
        kernel[(b, splits)](
            q, kv_c, k_pe, inp.cache_seqlens, inp.block_table, out, lse, kd, pd,
            q.stride(0), q.stride(2), kv_c.stride(0), kv_c.stride(1), k_pe.stride(0),
            k_pe.stride(1), inp.block_table.stride(0), out.stride(0), out.stride(2),
            out.stride(3), lse.stride(0), lse.stride(2), lse.stride(3),
            bd.SCALE * 1.4426950408889634, splits, H=h, L=bd.L, R=bd.R,
            PAGE_SIZE=kv_c.shape[1], BLOCK_M=16, BLOCK_N=bn, **const,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return tk.combine(out, lse, torch.bfloat16)[0]

    return fn


# Two more prototypes, same stripped semantics, both splitting the 512 latent columns into
# NC = L / LC chunks over a batched (3-D) dot whose batch dimension Triton spreads over the warps
# (warpsPerCTA = [4, 1, 1]). VARIANT 0, "latent_chunks": per-chunk partial scores summed (one
# cross-warp reduction per tile). VARIANT 1 and 2, "redundant_scores": every warp computes the
# whole BLOCK_M x BLOCK_N score tile (4x the QK work, no cross-warp traffic in the loop) and P @ V
# for its own 128 columns, the value chunks loaded again (1) or reshaped from the tile (2).
@triton.jit
def _latent_chunks_kernel(
    Q, KV_C, K_PE, SEQLENS, BLOCK_TABLE, O_PART, LSE_PART, KV_DESC, PE_DESC,
    stride_qb, stride_qh, stride_cp, stride_ct, stride_pp, stride_pt, stride_btb,
    stride_ob, stride_oh, stride_ok, stride_lb, stride_lh, stride_lk, scale_log2, num_splits,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LC: tl.constexpr, VARIANT: tl.constexpr,
):  # fmt: skip
    NC: tl.constexpr = L // LC
    b64, split, rows, row_ok, q_row, start, end = _program_range(
        Q, SEQLENS, stride_qb, stride_qh, num_splits, H, BLOCK_M
    )
    offs_c = tl.arange(0, NC)
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    col3 = offs_c[:, None, None] * LC + tl.arange(0, LC)[None, None, :]  # [NC, 1, LC]
    q_pe = tl.load(q_row[:, None] + L + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    if VARIANT == 0:
        q3 = tl.load(q_row[None, :, None] + col3, mask=row_ok[None, :, None], other=0.0)
        m_i = tl.full([1, BLOCK_M], float("-inf"), dtype=tl.float32)
    else:
        q = tl.load(q_row[:, None] + offs_l[None, :], mask=row_ok[:, None], other=0.0)
        q3 = tl.broadcast_to(q[None], (NC, BLOCK_M, L))
        qpe3 = tl.broadcast_to(q_pe[None], (NC, BLOCK_M, R))
        m_i = tl.full([NC, BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros_like(m_i)
    acc = tl.zeros([NC, BLOCK_M, LC], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < end
        page = tl.load(BLOCK_TABLE + b64 * stride_btb + offs_n // PAGE_SIZE, mask=tok_ok, other=0)
        row = page.to(tl.int64) * stride_cp + (offs_n % PAGE_SIZE) * stride_ct
        prow = page.to(tl.int64) * stride_pp + (offs_n % PAGE_SIZE) * stride_pt
        kpe = tl.load(K_PE + prow[:, None] + offs_r[None, :], mask=tok_ok[:, None], other=0.0)
        v_ptr = KV_C + row[None, :, None] + col3  # [NC, BN, LC]: the value tile in chunks
        if VARIANT == 0:
            v3 = tl.load(v_ptr, mask=tok_ok[None, :, None], other=0.0)
            s3 = tl.sum(tl.dot(q3, tl.permute(v3, (0, 2, 1))), 0) + tl.dot(q_pe, tl.trans(kpe))
            s3 = s3[None]  # [1, BM, BN]
        else:
            kv = tl.load(KV_C + row[:, None] + offs_l[None, :], mask=tok_ok[:, None], other=0.0)
            s3 = tl.dot(q3, tl.broadcast_to(tl.trans(kv)[None], (NC, L, BLOCK_N)))
            s3 += tl.dot(qpe3, tl.broadcast_to(tl.trans(kpe)[None], (NC, R, BLOCK_N)))
            if VARIANT == 1:
                v3 = tl.load(v_ptr, mask=tok_ok[None, :, None], other=0.0)
            else:
                v3 = tl.permute(tl.reshape(kv, (BLOCK_N, NC, LC)), (1, 0, 2))
        s3 = tl.where(tok_ok[None, None, :], s3 * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s3, 2))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p3 = tl.exp2(s3 - m_shift[:, :, None])
        l_i = l_i * alpha + tl.sum(p3, 2)
        p3 = tl.broadcast_to(p3.to(v3.dtype), (NC, BLOCK_M, BLOCK_N))
        acc = acc * alpha[:, :, None] + tl.dot(p3, v3)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, :, None]
    o_row = O_PART + b64 * stride_ob + rows * stride_oh + split * stride_ok
    tl.store(o_row[None, :, None] + col3, out, mask=row_ok[None, :, None])
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # [1 or NC, BM], equal along dim 0
    lse_ptr = LSE_PART + b64 * stride_lb + rows[None, :] * stride_lh + split * stride_lk
    first = tl.arange(0, lse.shape[0])[:, None] == 0
    tl.store(lse_ptr + first * 0, lse, mask=row_ok[None, :] & first)


def ours(inp: bd.Inputs, splits: int, cfg: tk.DecodeConfig):
    def fn():
        o, lse = tk.decode(*inp.op_args(splits), config=cfg)
        return tk.combine(o, lse, torch.bfloat16)[0]

    return fn


def variants(case: bd.Case):
    split_sets = {
        "a": (1, 2, 4), "a8": (1, 2), "g": (2, 3, 4), "d": (16, 33, 66), "e": (4, 8, 16, 32),
        "c": (16, 32, 64),
    }  # fmt: skip
    rows = case.heads * case.s_q
    tilings = [(16, 32, 4, 2), (16, 32, 4, 3), (16, 32, 4, 4), (16, 64, 4, 2), (16, 64, 8, 2)]
    # without pipelining (st1) and deeper (n64 st3)
    tilings += [(16, 32, 4, 1), (16, 64, 4, 1), (16, 64, 8, 1), (16, 64, 4, 3)]
    if rows > 16:
        tilings = [(64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2)]
        # 16 warps: a quarter of the 64 x 512 accumulator per warpgroup, 128 registers each
        tilings += [(64, 64, 16, 2), (64, 32, 16, 2), (64, 128, 16, 1)]
    # float8 tiles: fp16 compute converted by inline PTX or by Triton's cast, or bf16 compute
    fp8_modes = [(" f16asm", True, True), (" f16", True, False), (" bf16", False, False)]
    if not case.fp8:
        fp8_modes = [("", True, True)]
    for splits in split_sets.get(case.name, (1, 2)):
        for bm, bn, w, st in tilings:
            for tma in (False, True):
                if tma and case.page_size % bn:
                    continue
                for suffix, in_f16, ptx in fp8_modes:
                    cfg = tk.DecodeConfig(
                        bm, bn, w, st, tma, fp8_in_f16=in_f16, fp8_ptx_convert=ptx
                    )
                    yield (
                        f"ours m{bm} n{bn} w{w} st{st} {'tma' if tma else 'gather'}{suffix}",
                        splits,
                        (lambda inp, s=splits, c=cfg: ours(inp, s, c)),
                    )
        # Prototype, best of the first run only (num_stages=1 gave wrong results and then an
        # illegal address: not pursued).
        if rows == 16 and case.page_size % 64 == 0:
            yield (
                "rows_on_n tma n64 w8 st2",
                splits,
                (lambda inp, s=splits: prototype(inp, s, _rows_on_n_kernel, 64, 8, 2, MODE=2)),
            )
            for kname, variant in (
                ("latent_chunks", 0),
                ("redundant_scores", 1),
                ("redundant_scores reshape", 2),
            ):
                for st in (2, 3):
                    yield (
                        f"{kname} n32 w4 st{st}",
                        splits,
                        lambda inp, s=splits, v=variant, st=st: prototype(
                            inp, s, _latent_chunks_kernel, 32, 4, st, LC=128, VARIANT=v
                        ),
                    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="a,d")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--match", default="", help="comma-separated substrings of variant names")
    args = p.parse_args()
    torch.manual_seed(0)
    ceil = bd.ceilings()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copy, mm = ceil["copy_bw_Bps"] / 1e9, ceil["bf16_matmul_flops"] / 1e12
    print(f"copy {copy:.0f} GB/s, matmul {mm:.0f} TF/s")
    results = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "decode_variants.jsonl").open("w")
    for name in args.cases.split(","):
        case = bd.CASES[name]
        gen = torch.Generator().manual_seed(0)
        first = bd.Inputs(case, gen, with_contiguous=False)
        n_copies = min(8, -(-4 * l2 // (first.kv_cache.numel() * 2)))
        copies = [first] + [bd.Inputs(case, gen, False) for _ in range(n_copies - 1)]
        ref = bd.reference(first, case)
        nbytes, flops = bd.case_cost(case, first)
        floor = max(nbytes / ceil["copy_bw_Bps"], flops / ceil["bf16_matmul_flops"])
        for label, splits, make in variants(case):
            if args.match and not any(m in label for m in args.match.split(",")):
                continue
            row = dict(case=name, variant=label, splits=splits)
            try:
                fns = [make(inp) for inp in copies]
                log.write(f"# {name} {label} {splits}\n")
                log.flush()
                result = fns[0]()
                torch.cuda.synchronize()
                row["rel_err"] = bd.rel_err(result, ref)
                if row["rel_err"] > (8e-2 if case.fp8 else 2e-2):  # e4m3: 3 mantissa bits
                    raise RuntimeError(f"wrong result, rel_err {row['rel_err']:.3g}")
                t = bd.time_rotating([bd.graphed(f) for f in fns], warmup=10, rep=60)
                row.update(us=t * 1e6, roofline=floor / t)
            except Exception as exc:  # a failing variant is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            results.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, **ceil)  # fmt: skip
    (out / "decode_variants.json").write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    print("\nbest per case:")
    for name in args.cases.split(","):
        ok = [r for r in results if r["case"] == name and "us" in r]
        for fam in ("ours", "rows_on_n", "latent_chunks", "redundant_scores"):
            fam_rows = [r for r in ok if r["variant"].startswith(fam)]
            for r in sorted(fam_rows, key=lambda r: r["us"])[:3]:
                print(
                    f"{name} {r['variant']:<32} splits={r['splits']:<3} {r['us']:8.1f} us"
                    f"  roofline {r['roofline']:.2f}"
                )


if __name__ == "__main__":
    main()
