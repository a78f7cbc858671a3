"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_plans():
    """Every test plans afresh: tests emulate device facts (``device.has_copy_engine``, ...),
    which plans kept from another test's signature would not see."""
    from mla_compile.mla_ops.plan_cache import clear_plans

    clear_plans()
    yield
    clear_plans()


@pytest.fixture
def kernels(monkeypatch):
    """``mla_ops.runtime`` with every kernel output allocated poisoned (NaN), to prove that the
    kernels write every element they return."""
    from mla_compile.mla_ops import runtime

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(runtime, "new_output", poisoned)
    return runtime
