"""Device facts the planner reads: compute capability features, shared memory, multiprocessors.

Each is a plain function of a ``torch.device``. Tests that emulate a Hopper device in Triton's
interpreter replace them (they are facts about the machine, not choices; choices are
``planner.DecodeOptions``).
"""

from __future__ import annotations

import os

import torch

# Shared memory one program may use when the device cannot be asked (the interpreter): H100/H200.
DEFAULT_SHARED_MEMORY = 232448


def has_copy_engine(device: torch.device) -> bool:
    """Tensor-memory-accelerator (bulk tensor copy) hardware: Hopper and later.

    Tests replace this to run the TMA path in Triton's interpreter, which emulates descriptors.
    """
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): CUDA (not ROCm), compute capability
    >= 9, compiled kernels. The decode kernels let the combine launch while their last programs
    run, and the combine waits for their writes on the device: its launch latency leaves the
    critical path (inside CUDA graphs too, as a programmatic edge)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def has_e4m3_convert(device: torch.device) -> bool:
    """The PTX float8 e4m3 -> fp16 conversion: CUDA (not ROCm), compute capability >= 8.9, and
    compiled kernels (Triton's interpreter runs no inline PTX)."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def has_wgmma(device: torch.device) -> bool:
    """Warpgroup MMA (``wgmma``): CUDA compute capability 9.0 exactly (Hopper; Blackwell has
    other tensor-core instructions), compiled kernels, and Triton's Gluon frontend importable."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from . import hopper  # noqa: F401
    except ImportError:  # a Triton without Gluon's Hopper module
        return False
    return True


def shared_memory_optin(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (``DEFAULT_SHARED_MEMORY`` off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SHARED_MEMORY
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Not functools.cache: dynamo traces this when the planner asks under torch.compile.
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (no index: the current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    # torch caches device properties; no functools.cache here, which dynamo would warn about.
    return torch.cuda.get_device_properties(index).multi_processor_count
