"""AOTInductor packages of exported programs that call the ``mla`` ops.

What a process that runs the package needs: the ``mla`` ops registered, i.e. Python with
``import mla_compile.mla_ops``. They are ``torch.library.custom_op`` operators defined in Python
(Triton kernels on CUDA, PyTorch on CPU); AOTInductor compiles the rest of the program to C++ and
calls them back through the dispatcher. Without the registration the loader fails with "Could not
find schema for mla::attention": ``load_package`` turns that into a message naming the fix.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from .archive import check_package_archive
from .program import register_transformers_ops, registration_hint


def compile_package(
    program: torch.export.ExportedProgram,
    path: str | os.PathLike,
    *,
    inductor_configs: dict | None = None,
) -> str:
    """Compile ``program`` with AOTInductor into the package file ``path`` (``.pt2``); returns the
    path. The package runs on the device the program was exported on."""
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(
            f"program must be a torch.export.ExportedProgram, got {type(program).__name__}"
        )
    if not str(path).endswith(".pt2"):
        raise ValueError(f"path must end in .pt2 (AOTInductor's package format), got {path!r}")
    with warnings.catch_warnings():
        # Said on every compile of these models, by torch, about torch: a pytree deprecation,
        # and complex RoPE (DeepSeek-V2's) running as eager ops.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`")
        warnings.filterwarnings(
            "ignore", message="Torchinductor does not support code generation for complex"
        )
        return torch._inductor.aoti_compile_and_package(
            program, package_path=os.fspath(path), inductor_configs=inductor_configs
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
