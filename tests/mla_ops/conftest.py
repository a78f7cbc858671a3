"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def kernels(monkeypatch):
    """``mla_ops.triton_kernels`` with every kernel output allocated poisoned (NaN), to prove that
    the kernels write every element they return."""
    from mla_compile.mla_ops import triton_kernels

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_kernels, "new_output", poisoned)
    return triton_kernels
