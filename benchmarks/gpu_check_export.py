"""GPU check of export: the rewritten decode step exported on CUDA, run as an ExportedProgram
and as an AOTInductor package in a fresh process (which imports mla_ops), against eager.

    PYTHONPATH=. python3 benchmarks/gpu_check_export.py $OUT
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

import export
from tests.fx_passes.tiny_models import tiny_model

out_dir = sys.argv[1]
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
model = tiny_model("deepseek_v3", dtype=dtype).cuda()
start = time.perf_counter()
program = export.export_decode_step(model)
print(f"export {time.perf_counter() - start:.1f} s {export.mla_op_counts(program)}")
cases = []
for batch, cache_len in [(3, 7), (5, 100)]:
    args = export.decode_inputs(model, batch, cache_len, seed=batch)
    with torch.no_grad():
        want = export.DecodeStep(model)(*args)[0]
        got = program.module()(*args)[0]
    error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    print(f"ExportedProgram B={batch} T={cache_len}: relative error {error:.2e} ({dtype})")
    cases.append((args, want))
start = time.perf_counter()
package = export.aoti.compile_package(program, f"{out_dir}/decode_cuda.pt2")
print(f"AOTInductor package {time.perf_counter() - start:.1f} s")
torch.save(cases, f"{out_dir}/cases.pt")
script = f"""
import torch, export
run = export.aoti.load_package({package!r})
for args, want in torch.load({out_dir + "/cases.pt"!r}):
    with torch.no_grad():
        got = run(*args)[0]
    error = (got.float() - want.float()).abs().max() / want.float().abs().max()
    print("AOTI fresh process", tuple(args[3][0][0].shape), "relative error", float(error))
"""
done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
print(done.stdout, done.stderr[-2000:])
