"""Is the CUDA AOTInductor failure ours? AOTI of the *unrewritten* decode step (plain
torch.export), and of the rewritten one with export's dtype assertions removed.

    PYTHONPATH=. python3 benchmarks/gpu_check_aoti_cuda.py $OUT
"""

from __future__ import annotations

import sys

import torch

import export
from tests.fx_passes.tiny_models import tiny_model

out_dir = sys.argv[1]
model = tiny_model("deepseek_v3", dtype=torch.float32).cuda()
args = export.decode_inputs(model, 2, 16)
with torch.no_grad():
    plain = torch.export.export(export.DecodeStep(model), args)
    want = export.DecodeStep(model)(*args)[0]
rewritten = export.export_decode_step(model)


def without_asserts(program):
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.target == torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    program.graph_module.recompile()
    return program


for label, program in [
    ("unrewritten", plain),
    ("rewritten", rewritten),
    ("rewritten, no _assert_tensor_metadata", without_asserts(rewritten)),
]:
    try:
        path = export.aoti.compile_package(program, f"{out_dir}/{label.split(',')[0]}.pt2")
        got = export.aoti.load_package(path)(*args)[0]
        error = float((got - want).abs().max() / want.abs().max())
        print(f"AOTI CUDA {label}: runs, relative error {error:.2e}")
    except Exception as error:  # report and go on
        print(
            f"AOTI CUDA {label}: FAILS {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        )
