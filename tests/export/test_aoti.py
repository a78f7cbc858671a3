"""AOTInductor: a package built from the exported, rewritten decode step runs in a fresh process
that has `import mla_compile.mla_ops` (and only fails, by name, in one that has not)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mla_compile import export
from mla_compile.export import decode_inputs
from tests.export.helpers import SHAPES, eager_decode, float32_model

RUN_PACKAGE = """
import sys, torch
from mla_compile import export  # export.aoti.load_package registers the mla ops
package, cases = sys.argv[1], torch.load(sys.argv[2])
run = export.aoti.load_package(package)
errors = []
for args, want in cases:
    with torch.no_grad():
        logits = run(*args)[0]
    errors.append(float((logits - want).abs().max() / want.abs().max()))
print("errors", errors)
"""

WITHOUT_REGISTRATION = """
import sys, torch
try:
    torch._inductor.aoti_load_package(sys.argv[1])
except RuntimeError as error:
    print("refused:", str(error).splitlines()[0])
"""


@pytest.mark.slow
# DeepSeek-V2's packages (python_free) run from C++ in test_cpp_runner.py.
@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_aoti_package_runs_in_fresh_process(tmp_path, family: str) -> None:
    model = float32_model(family)
    program = export.export_decode_step(model)
    package = export.aoti.compile_package(program, tmp_path / "decode.pt2")
    cases = []
    for batch, cache_len in SHAPES:
        args = decode_inputs(model, batch, cache_len, seed=batch)
        cases.append((args, eager_decode(model, args)[0]))
    torch.save(cases, tmp_path / "cases.pt")

    done = subprocess.run(
        [sys.executable, "-c", RUN_PACKAGE, package, str(tmp_path / "cases.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    errors = eval(done.stdout.split("errors", 1)[1])
    assert len(errors) == len(SHAPES) and max(errors) <= 1e-4, errors

    # What a process needs: the mla ops' Python registration, and nothing else of ours.
    bare = subprocess.run(
        [sys.executable, "-c", WITHOUT_REGISTRATION, package],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "refused:" in bare.stdout and "mla::attention" in bare.stdout, bare.stdout + bare.stderr


def test_aoti_errors(tmp_path) -> None:
    with pytest.raises(TypeError, match="ExportedProgram"):
        export.aoti.compile_package(float32_model("deepseek_v3"), tmp_path / "x.pt2")
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(ValueError, match=r"must end in \.pt2"):
        export.aoti.compile_package(program, tmp_path / "x.so")
    with pytest.raises(TypeError, match="python_free must be a bool"):
        export.aoti.compile_package(program, tmp_path / "x.pt2", python_free="yes")


class Converts(torch.nn.Module):
    def forward(self, x):
        return (x.to(torch.float64) * 2).to(torch.float32)


# torch.export of a plain module says it, about torch's own pytree use
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning")
def test_metadata_asserts_leave_the_compiled_copy_only() -> None:
    """``compile_package`` compiles a copy without ``torch.export``'s dtype assertions (torch
    2.11's Inductor on CUDA fails one in the DeepSeek-V3 gate); the copy computes the same, and
    the caller's program keeps them."""
    from mla_compile.export.aoti import _drop_metadata_asserts

    x = torch.randn(3, 4)
    program = torch.export.export(Converts(), (x,))
    check = torch.ops.aten._assert_tensor_metadata.default
    copy = program.run_decompositions({})
    _drop_metadata_asserts(copy)
    assert any(n.target == check for n in program.graph.nodes)
    assert not any(n.target == check for n in copy.graph.nodes)
    assert torch.equal(copy.module()(x), program.module()(x))
