"""Why is batch-1 decode not faster? One step of bench_e2e's variants under the profiler:
graphs captured, kernels launched, device time vs wall time.

    PYTHONPATH=. python3 benchmarks/profile_e2e_step.py --batch 1 --context 8192
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_e2e import fill, make_cache, step_function  # benchmarks/ is the script's directory
from torch._dynamo.utils import counters
from v2_lite import v2_lite

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--context", type=int, default=8192)
parser.add_argument("--layers", type=int, default=4)
args = parser.parse_args()
model = v2_lite(args.layers)
for variant in ("hf_compile", "mla_graphs", "mla"):
    torch._dynamo.reset()
    counters.clear()
    cache = make_cache(variant, model, args.batch, args.context + 20)
    fill(cache, model, args.batch, args.context)
    step = step_function(variant, model)
    ids = torch.randint(3, 1000, (args.batch, 1), device="cuda")
    with torch.no_grad():
        for _ in range(4):
            ids = (
                step(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            )
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            step(input_ids=ids, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(
        f"{variant}: graphs {counters['stats']['unique_graphs']}, graph breaks "
        f"{sum(counters['graph_break'].values())}, kernels {len(events)}, device "
        f"{sum(e.device_time for e in events) / 1e3:.2f} ms, wall (profiled) {wall * 1e3:.2f} ms"
    )
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)
    )
    del cache, step
