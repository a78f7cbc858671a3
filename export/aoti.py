"""AOTInductor packages of exported programs that call the ``mla`` ops.

Two kinds of package:

* Default: the ``mla`` nodes stay calls of the ``torch.library.custom_op`` operators, defined in
  Python (the Triton and Hopper kernels on CUDA, PyTorch on CPU); AOTInductor compiles the rest of
  the program to C++ and calls them back through the dispatcher. A process that runs the package
  needs Python with ``import mla_compile.mla_ops``; without it the loader fails with "Could not
  find schema for mla::attention", which ``load_package`` turns into a message naming the fix.
* ``python_free=True``: the ``mla`` ops (and transformers' Python experts op) are decomposed into
  ATen ops first (``export.decompositions``), so Inductor generates their code into the package;
  it loads in a process with no Python at all, e.g. the C++ runner in ``examples/cpp``. Their
  code is then Inductor's, not our kernels: on CPU the same PyTorch implementation compiled.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from . import decompositions
from .archive import check_package_archive
from .program import register_transformers_ops, registration_hint


def compile_package(
    program: torch.export.ExportedProgram,
    path: str | os.PathLike,
    *,
    inductor_configs: dict | None = None,
    python_free: bool = False,
) -> str:
    """Compile ``program`` with AOTInductor into the package file ``path`` (``.pt2``); returns the
    path. The package runs on the device the program was exported on. ``python_free``: decompose
    every op that would call back into Python first (see the module docstring), so the package
    runs from C++ alone."""
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(
            f"program must be a torch.export.ExportedProgram, got {type(program).__name__}"
        )
    if not str(path).endswith(".pt2"):
        raise ValueError(f"path must end in .pt2 (AOTInductor's package format), got {path!r}")
    if not isinstance(python_free, bool):
        raise TypeError(f"python_free must be a bool, got {python_free!r}")
    _check_cuda_shims(program)
    with warnings.catch_warnings():
        # Said on every compile of these models, by torch, about torch: a pytree deprecation,
        # and complex RoPE (DeepSeek-V2's) running as eager ops.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`")
        warnings.filterwarnings(
            "ignore", message="Torchinductor does not support code generation for complex"
        )
        # A copy to edit either way (weights shared).
        if python_free:
            program = decompositions.python_free(program)
        else:
            program = program.run_decompositions({})
        _drop_metadata_asserts(program)
        return torch._inductor.aoti_compile_and_package(
            program, package_path=os.fspath(path), inductor_configs=inductor_configs
        )


def _drop_metadata_asserts(program: torch.export.ExportedProgram) -> None:
    """Remove the ``aten._assert_tensor_metadata`` nodes that ``torch.export`` puts after dtype
    conversions. They check the traced graph's own dtypes and compute nothing; torch 2.11's
    Inductor on CUDA fails one of them in the DeepSeek-V3 MoE gate (at its ``masked_fill``:
    "Tensor dtype mismatch! Expected: torch.float32, Got: torch.int64"), so the whole Hugging
    Face decode step could not be compiled there. The CPU packages' outputs are checked against
    eager PyTorch in the tests; on CUDA this has not run yet."""
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target == torch.ops.aten._assert_tensor_metadata.default
        ):
            graph.erase_node(node)
    program.graph_module.recompile()


def _check_cuda_shims(program: torch.export.ExportedProgram) -> None:
    """Refuse, before a long compile, a CUDA program with ``aten._grouped_mm`` (the experts of a
    bfloat16 model built the default way) where this torch's AOTInductor has no C function for
    it: its generated code would not compile ("'aoti_torch_cuda__grouped_mm' was not declared",
    torch 2.11)."""
    uses = any(
        n.op == "call_function" and n.target == torch.ops.aten._grouped_mm.default
        for n in program.graph.nodes
    )
    on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in program.state_dict.values())
    if not (uses and on_cuda):
        return
    header = (
        Path(torch.__file__).parent
        / "include/torch/csrc/inductor/aoti_torch/generated/c_shim_cuda.h"
    )
    if header.is_file() and "aoti_torch_cuda__grouped_mm(" not in header.read_text():
        raise RuntimeError(
            f"AOTInductor in torch {torch.__version__} has no CUDA function for aten._grouped_mm "
            "(the experts' grouped product of a bfloat16 model built the default way), so this "
            "package would not compile: build the model with "
            "experts_implementation='batched_mm', or use a torch whose AOTInductor has it"
        )


def load_package(path: str | os.PathLike) -> Callable:
    """Load an AOTInductor package; returns a callable taking the program's inputs.

    A package is native code: its shared library runs when it loads, so load only packages you
    built or trust. What is checked first (``export.archive.check_package_archive``): no member
    name that would be extracted outside the package's folder, and no symbolic link.

    Tensor inputs are passed contiguous: the compiled code indexes inputs with the strides of
    the example inputs (contiguous for ``export.decode_inputs``) and does not check them.
    """
    try:
        from mla_compile import mla_ops  # noqa: F401  (registers torch.ops.mla.*)
    except ImportError as error:
        raise ImportError(registration_hint()) from error
    check_package_archive(path)  # no member may be written outside the extraction folder
    try:
        runner = torch._inductor.aoti_load_package(os.fspath(path))
    except RuntimeError as error:
        if "mla::" in str(error):
            raise RuntimeError(registration_hint()) from error
        if "transformers::" not in str(error):
            raise
        # A model built the default way: its experts call transformers' own op back.
        register_transformers_ops()
        runner = torch._inductor.aoti_load_package(os.fspath(path))

    def run(*args, **kwargs):
        args, kwargs = pytree.tree_map_only(torch.Tensor, _contiguous, (args, kwargs))
        return runner(*args, **kwargs)

    return run


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous()


__all__ = ["compile_package", "load_package"]
