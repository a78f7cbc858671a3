"""Compile the decode kernel for sm_90 without a GPU: registers, spills, shared memory, PTX mix.

Triton's wheel carries ptxas and cuobjdump, so register pressure and the instruction mix of any
tiling can be read on a CPU-only machine (no device time). The launch's own specialisations are
reproduced: unit strides are compile-time 1, pointers and other strides 16-divisible. Figures come
from the local Triton, which may differ from the GPU machine's.

    python benchmarks/offline_compile.py                       # the default 16- and 64-row tilings
    python benchmarks/offline_compile.py --rows 16 --block-n 64 --warps 8 --stages 3 --dump /tmp/k
    python benchmarks/offline_compile.py --rows 16 --tma --mask bf16   # TMA loads, float mask
    python benchmarks/offline_compile.py --tma --balanced              # one chunk length per batch
    python benchmarks/offline_compile.py --wgmma --stages 1            # the Gluon wgmma kernel
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mla_compile.mla_ops import tiling
from mla_compile.mla_ops import triton_kernels as tk
from mla_compile.mla_ops.reference import MASK_HIDDEN
from mla_compile.mla_ops.splits import MIN_CHUNK, SPLIT_GRANULE

POINTERS = ("Q", "KV_C", "K_PE", "SEQLENS", "BLOCK_TABLE", "O_PART", "LSE_PART")
UNIT_STRIDES = ("stride_qd", "stride_cd", "stride_pd", "stride_od", "stride_btp", "stride_lk")
FLOATS = ("scale_log2", "nope_scale", "pe_scale")


def compile_decode(
    cfg: tiling.TritonTiling, heads: int, s_q: int, page_size: int, dtype: str, kv_len: int = 512,
    rope_len: int = 64, kv_dtype: str | None = None, kv_f16: bool = False,
    ptx_convert: bool = False, tma: bool = False, mask: str | None = None,
    balanced: bool = False, one_position: bool = True, repair: bool = False,
):  # fmt: skip
    """The compiled kernel (``triton.compile`` result) for one configuration, target sm_90
    (``repair``: the repair pass's variant)."""
    kernel = tk._mla_decode_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    element = {
        "Q": dtype,
        "KV_C": kv_dtype or dtype,
        "K_PE": dtype,
        "SEQLENS": "i32",
        "BLOCK_TABLE": "i32",
        "MASK": mask,
    }
    const = dict(
        S_Q=s_q, H=heads, L=kv_len, R=rope_len, PAGE_SIZE=page_size, MIN_CHUNK=MIN_CHUNK,
        GRANULE=SPLIT_GRANULE, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_L=kv_len,
        BLOCK_R=rope_len, PAGED=True, CAUSAL=True, HAS_PE=rope_len > 0,
        DOT_PRECISION="tf32", USE_TMA=tma, HAS_MASK=mask is not None, LAUNCH_DEPENDENTS=True,
        MASK_IS_BOOL=mask == "i1", MASK_HIDDEN=MASK_HIDDEN,
        KV_F16=kv_f16, PTX_CONVERT=ptx_convert, BALANCED=balanced, BLOCK_B=128, FILL_EMPTY=False,
        ONE_POSITION=one_position, REPAIR=repair, WAIT_PRIMARY=repair,
    )  # fmt: skip
    if not tma:
        const.update(KV_DESC=None, PE_DESC=None)
    if mask is None:
        const.update(MASK=None)
    const.update(dict.fromkeys(UNIT_STRIDES, 1))
    # TMA descriptors of the paged views, one KV tile per load (as _descriptor builds them).
    descriptors = {
        "KV_DESC": f"tensordesc<{kv_dtype or dtype}[{cfg.block_n}, {kv_len}]>",
        "PE_DESC": f"tensordesc<{dtype}[{cfg.block_n}, {rope_len}]>",
    }
    signature, attrs = {}, {}
    for i, name in enumerate(params):
        if name in const:
            signature[name] = "constexpr"
        elif name in descriptors:
            signature[name] = descriptors[name]
        elif name in POINTERS or name == "MASK":
            signature[name] = "*" + element.get(name, "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(
        kernel,
        signature,
        constexprs={(params.index(k),): v for k, v in const.items() if k in params},
        attrs=attrs,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_wgmma(
    rows: int = 16, stages: int = 2, dtype: str = "bf16", kv_len: int = 512, rope_len: int = 64,
    causal: bool = True, balanced: bool = False, warps: int = 4, kv_dtype: str | None = None,
    page_size: int = 64, gather: bool = False, producer_warps: int | None = None,
    rows_on_m: bool | None = None, merge: bool = False,
    longest_first: bool = False, one_scorer: bool = False, float8_products: bool | None = None,
    pe_dtype: str | None = None, mask: str | None = None, s_q: int = 1,
    query_in_registers: bool = False, pv_regs: int | None = None,
):  # fmt: skip
    """The Gluon wgmma kernel (``mla_ops/hopper``) for sm_90, ``rows // s_q`` heads x
    ``s_q``;
    ``kv_dtype="fp8e4nv"``: a float8 kv_c (k_pe stays in ``dtype``); ``gather``: tiles copied row
    by row by cp.async (as for ``page_size`` not a multiple of 64) instead of by TMA;
    ``float8_products``: a float8 kv_c multiplied in float8 (None: the op's choice);
    ``pe_dtype="fp8e4nv"``: k_pe in float8 too (multiplied in float8, or converted).
    ``mask``: an attention mask, ``"bool"`` or a float dtype (``"bf16"``).
    """
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_compile.mla_ops import hopper as wd
    from mla_compile.mla_ops.hopper import host as hopper_host

    kernel = wd._mla_decode_wgmma_kernel
    if one_scorer:
        rows_on_m, producer_warps = False, 0
    if rows_on_m is None:
        rows_on_m = tiling.default_rows_on_m(rows, warps, kv_dtype == "fp8e4nv")
    params = list(inspect.signature(kernel.fn).parameters)
    gl_dtype = gl.bfloat16 if dtype == "bf16" else gl.float16
    const = dict(
        S_Q=s_q, H=rows // s_q, L=kv_len, R=rope_len, PAGE_SIZE=page_size, MIN_CHUNK=MIN_CHUNK,
        GRANULE=SPLIT_GRANULE, BLOCK_M=rows, BLOCK_N=wd.BLOCK_N, NUM_STAGES=stages,
        CAUSAL=causal, HAS_PE=rope_len > 0, BALANCED=balanced, BLOCK_B=tiling.LENGTHS_PER_STEP,
        KV_FP8=kv_dtype == "fp8e4nv", CHUNK=min(kv_len, wd.GATHER_CHUNK), GATHER=gather,
        FLOAT8_PRODUCTS=(
            tiling.default_float8_products(rows, kv_len, kv_dtype == "fp8e4nv", gather)
            if float8_products is None else float8_products
        ),
        PE_FP8=pe_dtype == "fp8e4nv",
        FILL_EMPTY=False,
        PRODUCER_WARPS=(
            tiling.default_producer_warps(warps, gather)
            if producer_warps is None
            else producer_warps
        ),
        PRODUCER_REGS=hopper_host.PRODUCER_REGS[gather],
        ROWS_ON_M=rows_on_m, ONE_SCORER=one_scorer, ASSIST_REGS=hopper_host.ASSIST_REGS,
        MERGE=merge,
        MERGE_SPLITS=4 if merge else 1, LONGEST_FIRST=longest_first,
        HAS_MASK=mask is not None, MASK_IS_BOOL=mask == "bool",
        QUERY_IN_REGISTERS=query_in_registers, PV_REGS=pv_regs or hopper_host.PV_REGS,
        num_warps=warps,
        stride_qd=1, stride_btp=1, stride_od=1, stride_lk=1, stride_fd=1,
    )  # fmt: skip
    if gather:
        const.update(KV_DESC=None, PE_DESC=None)
    signature, attrs = {}, {}
    for i, name in enumerate(params):
        # As Triton's launcher specialises them: 16-byte aligned pointers, strides divisible by 16.
        if name in (
            "Q",
            "KV",
            "PE",
            "SEQLENS",
            "BLOCK_TABLE",
            "O_PART",
            "LSE_PART",
            "OUT",
            "LSE_OUT",
            "ARRIVALS",
            "MASK",
        ) or (
            # A mask's strides follow its length (any T_m): no divisibility is assumed for them.
            name.startswith("stride_") and name not in const and not name.startswith("stride_m")
        ):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if name in const:
            signature[name] = "constexpr"
        elif name in ("KV_DESC", "PE_DESC"):
            width = kv_len if name == "KV_DESC" else max(rope_len, 16)
            name_dtype = {"KV_DESC": kv_dtype, "PE_DESC": pe_dtype}[name] or dtype
            el = gl.float8e4nv if name_dtype == "fp8e4nv" else gl_dtype
            layout = gl.NVMMASharedLayout.get_default_for([wd.BLOCK_N, width], el)
            signature[name] = f"tensordesc<{name_dtype}[{wd.BLOCK_N}, {width}],{layout!r}>"
        elif name in ("Q", "OUT"):
            signature[name] = f"*{dtype}"
        elif name == "PE":
            signature[name] = f"*{pe_dtype or dtype}"
        elif name == "KV":
            signature[name] = f"*{kv_dtype or dtype}"
        elif name in ("SEQLENS", "BLOCK_TABLE", "ARRIVALS"):
            signature[name] = "*i32"
        elif name == "MASK":  # the launch passes ARRIVALS when there is no mask
            signature[name] = {None: "*i32", "bool": "*u8"}.get(mask, f"*{mask}")
        elif name in ("O_PART", "LSE_PART", "LSE_OUT"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name in ("scale_log2", "kv_scale") else "i32"
    constexprs = {(params.index(k),): v for k, v in const.items()}
    source = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128), options={"num_warps": warps})


def conversion_bank_conflicts(num_warps: int, kv_len: int) -> dict:
    """Bank conflicts of the float8 tile's conversion (``hopper.layouts._conversion_layout`` over a
    ``[64, kv_len]`` tile): its float8 loads from the ring slot and fp16 stores to the staging
    tile, and the same for the 16-bit ``io`` layout. Triton's
    count for one instruction (``gl.bank_conflicts``: 0 is none, 1 a two-way replay), from the
    layouts alone, as an sm_90 compile of a kernel that only asks."""
    import contextlib
    import io as io_module

    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_compile.mla_ops.hopper import layouts as hopper_layouts

    @gluon.jit
    def ask(X, W: gl.constexpr, L: gl.constexpr):
        # The whole width in the conversion's pattern: each chunk of it is that pattern's part.
        conv: gl.constexpr = hopper_layouts._conversion_layout(W, L)
        io: gl.constexpr = hopper_layouts._copy_layouts(W, False)[0]
        fp8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, L], gl.float8e4nv)
        fp16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, L], gl.float16)
        fp8_ty: gl.constexpr = gl.shared_memory_descriptor_type(
            gl.float8e4nv, [64, L], fp8, [64, L]
        )
        fp16_ty: gl.constexpr = gl.shared_memory_descriptor_type(gl.float16, [64, L], fp16, [64, L])
        gl.static_print(
            "BANKS", gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, L], conv), fp8_ty),
            gl.bank_conflicts(gl.distributed_type(gl.float16, [64, L], conv), fp16_ty),
            gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, L], io), fp8_ty),
            gl.bank_conflicts(gl.distributed_type(gl.float16, [64, L], io), fp16_ty),
        )  # fmt: skip

    source = GluonASTSource(
        ask, {"X": "*fp32", "W": "constexpr", "L": "constexpr"}, {(1,): num_warps, (2,): kv_len}, {}
    )  # fmt: skip
    printed = io_module.StringIO()
    # The counts are printed while the kernel is built, so it must be built: a cached one would
    # print nothing.
    with triton.knobs.compilation.scope(), contextlib.redirect_stdout(printed):
        triton.knobs.compilation.always_compile = True
        triton.compile(source, target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps})
    line = next(x for x in printed.getvalue().splitlines() if "BANKS" in x)
    counts = [int(v) for v in re.findall(r"-?\d+", line.split("BANKS", 1)[1])]
    return dict(zip(("conv_load", "conv_store", "io_load", "io_store"), counts))


def resources(compiled) -> dict:
    """Registers, spills and shared memory, read from the cubin by cuobjdump.

    Spilled registers show up as a per-thread stack frame (``STACK``; ``LOCAL`` counts only
    local arrays), so ``spill_bytes`` is the two together. ``hgmma`` and ``wgmma_waits`` count
    the SASS's warpgroup MMAs and ``WARPGROUP.DEPBAR`` waits: when ptxas lacks the registers to
    keep a chain of them in flight it serialises them, a wait after every one (its "wgmma ...
    serialized" notice, which Triton does not pass on).
    """
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [str(cuobjdump), "-sass", f.name], capture_output=True, text=True
        ).stdout
    finally:
        os.unlink(f.name)
    match = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", text, re.S)
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    return {
        "regs": int(match.group(1)),
        "spill_bytes": int(match.group(2)) + int(match.group(3)),
        "shared_bytes": compiled.metadata.shared,
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "mma.sync": ptx.count("mma.sync"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "cp.async": ptx.count("cp.async.cg"),
        "cp.async_16B": len(
            re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
        ),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "ptx_lines": ptx.count("\n"),
        "hgmma": sass.count("HGMMA."),
        "wgmma_waits": sass.count("WARPGROUP.DEPBAR"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, help="block_m; default: the 16- and 64-row defaults")
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--kv-dtype", default=None, choices=["fp8e4nv"], help="latent cache dtype")
    p.add_argument("--kv-f16", action="store_true", help="KV_F16: fp16 dots for a float8 cache")
    p.add_argument("--ptx-convert", action="store_true", help="float8 tiles by inline PTX")
    p.add_argument("--tma", action="store_true", help="KV tiles by TMA descriptors")
    p.add_argument("--mask", choices=["bool", "bf16"], help="attn_mask dtype (default: none)")
    p.add_argument("--balanced", action="store_true", help="chunks from total_splits")
    p.add_argument(
        "--per-row-positions", action="store_true", help="ONE_POSITION off (as for S_q > 1)"
    )
    p.add_argument("--wgmma", action="store_true", help="the Gluon wgmma kernel (16 rows)")
    p.add_argument(
        "--producer-warps", type=int, default=None, help="wgmma: producer partition (0: none)"
    )
    p.add_argument(
        "--rows-on-m", type=int, choices=[0, 1], default=None,
        help="wgmma: query rows on the MMA's M side (default: default_rows_on_m)",
    )  # fmt: skip
    p.add_argument(
        "--merge", action="store_true", help="wgmma: final output and in-kernel split merge"
    )
    p.add_argument(
        "--one-scorer", action="store_true",
        help="wgmma: 64 rows, warpgroup 0 scores whole tiles (launch(one_scorer=True); 4 warps)",
    )  # fmt: skip
    p.add_argument("--dump", help="folder for the TTGIR and PTX")
    args = p.parse_args()
    if args.wgmma:
        rows = args.rows or (64 if args.one_scorer else 16)
        warps = args.warps or (4 if rows <= 16 or args.one_scorer else 8)
        compiled = compile_wgmma(
            rows, args.stages or 2, args.dtype, balanced=args.balanced, warps=warps,
            kv_dtype=args.kv_dtype, page_size=args.page_size, gather=args.page_size % 64 != 0,
            producer_warps=args.producer_warps,
            rows_on_m=None if args.rows_on_m is None else bool(args.rows_on_m), merge=args.merge,
            one_scorer=args.one_scorer,
        )  # fmt: skip
        print(
            f"triton {triton.__version__}, target sm_90, wgmma kernel {rows} rows {warps} warps "
            f"kv {args.kv_dtype or args.dtype} page size {args.page_size} producer warps "
            f"{args.producer_warps if args.producer_warps is not None else 'default'} rows on M "
            f"{args.rows_on_m if args.rows_on_m is not None else 'default'} merge {args.merge} "
            f"one scorer {args.one_scorer}: "
            f"{resources(compiled)}"
        )
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                (Path(args.dump) / f"wgmma.{ext}").write_text(compiled.asm[ext])
        return
    heads_for = {16: 16, 32: 32, 64: 128}
    rows = [args.rows] if args.rows else [16, 64]
    print(f"triton {triton.__version__}, target sm_90")
    for block_m in rows:
        cfg = tiling.triton_tiling(heads_for.get(block_m, block_m), 512)
        cfg = tiling.TritonTiling(
            block_m,
            args.block_n or cfg.block_n,
            args.warps or cfg.num_warps,
            args.stages or cfg.num_stages,
        )
        compiled = compile_decode(
            cfg,
            heads_for.get(block_m, block_m),
            1,
            args.page_size,
            args.dtype,
            kv_dtype=args.kv_dtype,
            kv_f16=args.kv_f16,
            ptx_convert=args.ptx_convert,
            tma=args.tma,
            mask={"bool": "i1", "bf16": "bf16", None: None}[args.mask],
            balanced=args.balanced,
            one_position=not args.per_row_positions,
        )
        print(cfg, resources(compiled))
        if args.dump:
            out = Path(args.dump)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"decode_m{block_m}.ttgir").write_text(compiled.asm["ttgir"])
            (out / f"decode_m{block_m}.ptx").write_text(compiled.asm["ptx"])


if __name__ == "__main__":
    main()
