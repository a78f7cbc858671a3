"""export: ``torch.export`` / AOTInductor / ONNX for Hugging Face MLA models with the ``mla`` ops.

One function per target; every program is a rewritten decode step (or a prefill step) with a
dynamic batch and cache length:

* ``export_decode_step(model)`` / ``export_prefill_step(model)`` -> ``ExportedProgram``;
  ``save_program`` / ``load_program`` (``load_program`` registers the ops first).
* ``aoti.compile_package(program, "step.pt2")`` / ``aoti.load_package(path)``;
  ``python_free=True``: the ops compiled into the package (``decompositions``), which then runs
  from C++ with no Python (``examples/cpp``).
* ``onnx.export_onnx(program, "step.onnx", translation="standard" | "custom")``.

A process that runs a program with ``mla`` nodes needs ``import mla_compile.mla_ops`` (the ops
are Python ``torch.library`` custom ops); the ONNX "standard" translation needs nothing of ours.
"""

from mla_compile._legacy import hand_over

hand_over(__name__)  # imported by its deprecated bare name: becomes mla_compile.export

from . import aoti, archive, decompositions, onnx
from .archive import UnsafeArchiveError
from .program import (
    export_decode_step,
    export_prefill_step,
    load_program,
    mla_op_counts,
    registration_hint,
    save_program,
)
from .steps import DecodeStep, PrefillStep, decode_inputs, prompt_inputs

__all__ = [
    "DecodeStep",
    "PrefillStep",
    "UnsafeArchiveError",
    "aoti",
    "archive",
    "decode_inputs",
    "decompositions",
    "export_decode_step",
    "export_prefill_step",
    "load_program",
    "mla_op_counts",
    "onnx",
    "prompt_inputs",
    "registration_hint",
    "save_program",
]
