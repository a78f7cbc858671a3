"""AOTInductor: a package built from the exported, rewritten decode step runs in a fresh process
that has `import mla_compile.mla_ops` (and only fails, by name, in one that has not)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mla_compile import export
from mla_compile.export import decode_inputs
from tests.export.helpers import EXPORT_FAMILIES, SHAPES, eager_decode, float32_model

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
@pytest.mark.parametrize("family", EXPORT_FAMILIES)
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
