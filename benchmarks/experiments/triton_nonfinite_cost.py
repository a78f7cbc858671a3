# ruff: noqa: E501, SIM115
"""Cost of the Triton kernel's non-finite isolation (programs of several query positions,
causal): the kernel with the check against the same kernel without it, same run.

Run on the GPU machine from the repository root with the checked kernel in place
(``mla_ops/triton_kernels.py`` of commit 8837407) and the kernel before it copied to
``scratch_gpu/tk_ungated.py``; results to ``$OUT/triton_gate_cost.json``."""

import importlib.util
import json
import os

import torch

from mla_compile.mla_ops import runtime
from mla_compile.mla_ops.planner import DecodeOptions

spec = importlib.util.spec_from_file_location("tk_ungated", "scratch_gpu/tk_ungated.py")
tk_old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tk_old)
shipped = runtime._mla_decode_kernel
opts = DecodeOptions(use_wgmma=False)


def case(B, H, S_q, T, page=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    L, R = 512, 64
    pages = B * (T // page)
    q = torch.randn(B, S_q, H, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(pages, page, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(pages, device="cuda", generator=g).int().view(B, -1)
    sl = torch.full((B,), T, device="cuda", dtype=torch.int32)
    return q, kv[..., :L], kv[..., L:], sl, bt


def time_it(kernel, args, splits):
    runtime._mla_decode_kernel = kernel
    runtime._LAUNCHES.clear() if hasattr(runtime._LAUNCHES, "clear") else None
    runtime._LAUNCHES = type(runtime._LAUNCHES)()
    f = lambda: runtime.decode(*args, 0.07, True, splits, options=opts)
    out = f()
    torch.cuda.synchronize()
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    times = []
    for _ in range(30):
        st.record()
        [graph.replay() for _ in range(20)]
        en.record()
        torch.cuda.synchronize()
        times.append(st.elapsed_time(en) / 20 * 1000)
    times.sort()
    return times[len(times) // 2], out


rows = []
for B, H, S_q, T, splits in [
    (32, 4, 4, 4096, 4),
    (64, 8, 2, 8192, 2),
    (16, 1, 8, 8192, 8),
    (32, 3, 4, 4096, 4),
]:
    args = case(B, H, S_q, T)
    t_new, o_new = time_it(shipped, args, splits)
    t_old, o_old = time_it(tk_old._mla_decode_kernel, args, splits)
    same = torch.equal(o_new[0], o_old[0])
    rows.append(
        dict(
            B=B,
            H=H,
            S_q=S_q,
            T=T,
            splits=splits,
            gated_us=t_new,
            ungated_us=t_old,
            ratio=t_new / t_old,
            identical=same,
        )
    )
    print(rows[-1], flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(
    dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
    open(f"{out}/triton_gate_cost.json", "w"),
    indent=1,
)
print("| B | H | S_q | T | gated us | ungated us | ratio |")
for r in rows:
    print(
        f"| {r['B']} | {r['H']} | {r['S_q']} | {r['T']} | {r['gated_us']:.1f} | {r['ungated_us']:.1f} | {r['ratio']:.3f} |"
    )
