"""Why is batch-1 decode not faster? One step of bench_e2e's variants under the profiler:
graphs captured, kernels launched, device time vs wall time; host-side launches (CUDA-graph
launches vs kernels launched outside a graph); and the step timed three ways: synchronised after
every step (what bench_e2e reports), back to back without a sync (host and GPU overlap), and the
host time of the call alone.

    PYTHONPATH=. python3 benchmarks/profile_e2e_step.py --batch 1 --context 8192
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_e2e import fill, make_cache, step_function  # benchmarks/ is the script's directory
from torch._dynamo.utils import counters
from v2_lite import v2_lite

from mla_ops.hf_cache import cache_kwargs

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--context", type=int, default=8192)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--rows", type=int, default=8, help="kernels listed per variant, by CUDA time")
parser.add_argument("--variants", default="hf_compile,mla_graphs,mla")
args = parser.parse_args()
model = v2_lite(args.layers)
for variant in args.variants.split(","):
    torch._dynamo.reset()
    counters.clear()
    cache = make_cache(variant, model, args.batch, args.context + 64)  # room for every step below
    fill(cache, model, args.batch, args.context)
    step = step_function(variant, model)
    ids = torch.randint(3, 1000, (args.batch, 1), device="cuda")
    with torch.no_grad():
        for _ in range(4):
            ids = (
                step(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
                .logits[:, -1:]
                .argmax(-1)
            )
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            step(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        # Synchronised steps, back-to-back steps, and the host time of one call.
        synced, host = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = step(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            synced.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            out = step(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        torch.cuda.synchronize()
        back_to_back = (time.perf_counter() - t0) / 20
        del out
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu_names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    graph_launches = sum(n == "cudaGraphLaunch" for n in cpu_names)
    kernel_launches = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
                          for n in cpu_names)  # fmt: skip
    print(
        f"{variant}: graphs {counters['stats']['unique_graphs']}, graph breaks "
        f"{sum(counters['graph_break'].values())}, kernels {len(events)}, device "
        f"{sum(e.device_time for e in events) / 1e3:.2f} ms, wall (profiled) {wall * 1e3:.2f} ms"
    )
    print(
        f"  host launches: {graph_launches} CUDA graph(s), {kernel_launches} kernel(s) outside "
        f"graphs; step synchronised {sorted(synced)[10] * 1e3:.3f} ms, back to back "
        f"{back_to_back * 1e3:.3f} ms, host time of the call {sorted(host)[10] * 1e3:.3f} ms"
    )
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90
        )
    )
    del cache, step
