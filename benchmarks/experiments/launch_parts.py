"""Where Triton's launch of the Gluon decode kernel spends its host time, taken apart.

    python benchmarks/experiments/launch_parts.py [--cases small16,small128] [--out DIR]

``wgmma_decode.launch`` calls ``JITFunction.run`` (Triton 3.6: bind and specialise the 60
arguments, the compiled-kernel cache key, a check that the kernel's globals have not changed,
the launch metadata) and then the compiled kernel's launcher (Python: each TMA descriptor encoded
by ``fill_tma_descriptor``; C: the arguments unpacked and ``cuLaunchKernelEx``). Each part is
timed alone with the arguments one real call passed, on shapes whose GPU time is far below the
host's (``host_overhead.SMALL_CASES``), as host microseconds per call (median of 5 rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd
from host_overhead import SMALL_CASES, host_us, layer_fns


def captured_run(inp: bd.Inputs, case: bd.Case) -> tuple[tuple, dict]:
    """The positional and keyword arguments ``JITFunction.run`` got from one op call."""
    from mla_ops import plan_cache, wgmma_decode

    kernel = wgmma_decode._mla_decode_wgmma_kernel
    plan_cache.clear_plans()  # a kept plan launches without JITFunction.run
    captured = {}
    real_run = kernel.run

    def capture(*a, **k):
        captured.update(args=a, kwargs=k)
        return real_run(*a, **k)

    kernel.run = capture
    try:
        bd.impls(case)["mla_decode"](inp)()
    finally:
        del kernel.run  # the class's method again
    torch.cuda.synchronize()
    return captured["args"], captured["kwargs"]


def part_fns(case: bd.Case, inp: bd.Inputs) -> dict:
    """Callables of each part of ``JITFunction.run`` and of the launcher, by name."""
    from triton import knobs
    from triton.backends.nvidia import driver as nvidia_driver
    from triton.runtime import driver
    from triton.runtime.jit import compute_cache_key

    from mla_ops import wgmma_decode

    jit = wgmma_decode._mla_decode_wgmma_kernel
    args, kwargs = captured_run(inp, case)
    grid = kwargs.pop("grid")
    kwargs.pop("warmup")
    device = driver.active.get_current_device()
    kernel_cache, key_cache, _, _, binder = jit.device_caches[device]
    mode = knobs.compilation.instrumentation_mode
    run_kwargs = dict(kwargs, debug=False, instrumentation_mode=mode)
    bound, specialization, options = binder(*args, **run_kwargs)
    key = compute_cache_key(key_cache, specialization, options)
    compiled = kernel_cache[key]
    stream = driver.active.get_current_stream(device)
    values = list(bound.values())
    g0 = grid[0]
    fns = {}
    fns["JITFunction.run (kernel[grid](...))"] = lambda: jit.run(
        *args, grid=grid, warmup=False, **kwargs
    )
    fns["binder (specialise 60 arguments)"] = lambda: binder(*args, **run_kwargs)
    fns["compute_cache_key"] = lambda: compute_cache_key(key_cache, specialization, options)

    def globals_check():
        missing = object()
        for (name, _), (val, globals_dict) in jit.used_global_vals.items():
            if globals_dict.get(name, missing) != val:
                raise RuntimeError(name)

    fns[f"globals check ({len(jit.used_global_vals)} globals)"] = globals_check
    fns["current device + stream"] = lambda: driver.active.get_current_stream(
        driver.active.get_current_device()
    )
    fns["CompiledKernel.run (launcher, all arguments)"] = lambda: compiled.run(
        g0, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values
    )
    # The launcher's Python wrapper encodes each TMA descriptor; the C launch gets the result.
    inner = compiled.run.launch
    cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))
    raw_launch, meta = cells["launcher"], cells["tensordesc_meta"]
    desc_at = sorted(cells["tensordesc_indices"])
    descs = [values[i] for i in desc_at]
    fns["make_tensordesc_arg x2 (fill_tma_descriptor)"] = lambda: [
        nvidia_driver.make_tensordesc_arg(d, m) for d, m in zip(descs, meta)
    ]
    flat = []
    for i, v in enumerate(values):
        if i in desc_at:
            flat.extend(nvidia_driver.make_tensordesc_arg(v, meta[desc_at.index(i)]))
        else:
            flat.append(v)
    pdl, coop = compiled.run.launch_pdl, compiled.run.launch_cooperative_grid
    fns["C launch alone (descriptors encoded)"] = lambda: raw_launch(
        g0, 1, 1, stream, compiled.function, coop, pdl, None, None,
        compiled.packed_metadata, None, None, None, *flat,
    )  # fmt: skip
    kv_c, k_pe = inp.decode_cache()
    tensors = (inp.q, kv_c, k_pe, inp.cache_seqlens, inp.block_table)

    def shape_key():
        # What a per-shape cache of the launch would hash: shapes, strides, dtypes, alignment.
        return tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in tensors)

    table = {shape_key(): 1}
    fns["a shape key of 5 tensors + dict lookup"] = lambda: table[shape_key()]
    fns["descriptor x2 (TensorDescriptor + layout)"] = lambda: (
        wgmma_decode.descriptor(kv_c),
        wgmma_decode.descriptor(k_pe),
    )
    return fns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="small16,small128")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name in args.cases.split(","):
        case = SMALL_CASES.get(name) or bd.CASES[name]
        inp = bd.Inputs(case, torch.Generator().manual_seed(0), with_contiguous=False)
        fns = {"mla_decode": bd.impls(case)["mla_decode"](inp)}
        fns |= {k: v for k, v in layer_fns(case, inp).items() if "launch" in k or "attention" in k}
        fns |= part_fns(case, inp)
        for fn in fns.values():
            fn()
        row = {"case": name} | {k: host_us(fn, args.calls) for k, fn in fns.items()}
        rows.append(row)
        for k, v in row.items():
            print(f"{name:9s} {k:55s} {v if isinstance(v, str) else f'{v:8.1f} us'}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "launch_parts.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
