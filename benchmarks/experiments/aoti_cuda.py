"""CUDA AOTInductor packages of the rewritten decode step (tiny DeepSeek-V3 / V2): build, load in
the building process and in a fresh one, compare with eager, time against the Python path."""

import json
import os
import subprocess
import sys
import time
import traceback

import torch

from mla_compile import export
from mla_compile.export import decode_inputs
from tests.fx_passes.tiny_models import tiny_model

OUT = os.environ.get("OUT", ".")
results = []

FRESH = """
import sys, torch
from mla_compile import export
run = export.aoti.load_package(sys.argv[1])
args, want = torch.load(sys.argv[2])
with torch.no_grad():
    got = run(*args)[0]
print("fresh_err", float((got - want).abs().max() / want.abs().max()))
"""


def timed(fn, args, reps=50):
    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


for family, dtype, experts in [
    ("deepseek_v3", torch.float32, None),
    ("deepseek_v3", torch.bfloat16, "batched_mm"),
    ("deepseek_v3", torch.bfloat16, None),
]:
    for python_free in (False, True) if experts or dtype == torch.float32 else (False,):
        row = dict(
            family=family, dtype=str(dtype), experts=experts or "default", python_free=python_free
        )
        try:
            model = tiny_model(family, dtype=dtype)
            if experts:
                model = (
                    type(model)
                    ._from_config(model.config, dtype=dtype, experts_implementation=experts)
                    .eval()
                )
            model = model.cuda()
            program = export.export_decode_step(model)
            args = decode_inputs(model, 4, 40, seed=1)
            with torch.no_grad():
                want = program.module()(*args)[0]
            start = time.perf_counter()
            path = f"{OUT}/{family}_{row['dtype'][6:]}_{row['experts']}_{python_free}.pt2"
            export.aoti.compile_package(program, path, python_free=python_free)
            row["build_s"] = time.perf_counter() - start
            run = export.aoti.load_package(path)
            with torch.no_grad():
                got = run(*args)[0]
            row["same_process_err"] = float((got - want).abs().max() / want.abs().max())
            torch.save((args, want), f"{OUT}/case.pt")
            done = subprocess.run(
                [sys.executable, "-c", FRESH, path, f"{OUT}/case.pt"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            row["fresh"] = done.stdout.strip()[-200:] or done.stderr.strip()[-600:]
            row["rc_fresh"] = done.returncode
            module = program.module()
            row["python_path_us"] = timed(module, args)
            row["package_us"] = timed(run, args)
            os.remove(path)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {str(error)[:800]}"
            row["trace"] = traceback.format_exc()[-2500:]
        results.append(row)
        print({k: v for k, v in row.items() if k != "trace"}, flush=True)
with open(f"{OUT}/aoti_cuda.json", "w") as f:
    json.dump(
        dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), rows=results), f, indent=1
    )
