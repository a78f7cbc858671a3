"""Test configuration shared by the whole suite.

Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter; it must be switched
on before any kernel is defined, i.e. before ``mla_ops.triton_kernels`` is imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
