"""Prepared kernel launches: a Triton kernel's grid and arguments fixed once, each call's data
filled in at launch, the compiled kernel launched without re-binding its arguments.

Why: ``JITFunction.run`` binds and specialises every argument on every launch. For the wgmma decode
kernel's 60 arguments that is about 60 us of host time per call under Triton 3.6, of which the
compiled kernel's own launcher takes 17 (H100 host);
with the op's own decisions, an eager decode step was host-bound.

A ``PreparedLaunch`` is exact only while every argument Triton specialises on (integer values,
pointer alignment, dtypes, constexprs, launch options) is the one it was prepared with: it must be
kept per call signature (``runtime``'s launches, keyed by shapes, strides, dtypes,
data alignment, device and scalar arguments: ``runtime.call_signature``). With
``MLA_OPS_CHECK_LAUNCH=1`` every direct launch also asks Triton's own cache which compiled kernel
these arguments select, and raises if it is another one.

Under Triton's interpreter (``TRITON_INTERPRET=1``) every launch goes through the kernel's normal
call; ``LAST_LAUNCH``-style records say which way each launch went (``PreparedLaunch.how``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction


class Data:
    """A slot in a prepared launch's arguments, filled from each call's data by ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Data({self.name!r})"


def check_launches() -> bool:
    """``MLA_OPS_CHECK_LAUNCH=1``: check every direct launch against Triton's own dispatch."""
    return os.environ.get("MLA_OPS_CHECK_LAUNCH", "0") == "1"


class PreparedLaunch:
    """One kernel launch with its grid, constexprs and options fixed and its data left as slots.

    Args:
        kernel: the ``@triton.jit`` / ``@gluon.jit`` function (or the interpreter's stand-in).
        grid: the launch grid, a tuple of 1-3 ints.
        args: the kernel's positional arguments, in order; ``Data(name)`` where each call's data
            goes (tensors, descriptors, float scalars), plain values elsewhere.
        kwargs: constexprs by name and launch options (``num_warps``, ``launch_pdl``, ...).

    ``launch(data)`` fills the slots from ``data`` (a mapping of slot name to value) and launches,
    returning the compiled kernel. ``how`` says how the latest launch went.
    """

    def __init__(
        self, kernel: Any, grid: Sequence[int], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.args = list(args)
        self.slots = tuple((i, a.name) for i, a in enumerate(args) if isinstance(a, Data))
        self.kwargs = dict(kwargs)
        self.name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        self.compiled = None
        self.device = -1
        # The compiled kernel's launcher takes every parameter in order, constexprs included (as
        # JITFunction.run passes them): the positional arguments, then the rest by name.
        self.direct = isinstance(kernel, JITFunction)
        self.tail: list[Any] = []
        if self.direct:
            for param in kernel.params[len(self.args) :]:
                if param.name in self.kwargs:
                    self.tail.append(self.kwargs[param.name])
                elif param.has_default:
                    self.tail.append(param.default)
                else:
                    raise TypeError(f"{self.name}: no value for parameter {param.name!r}")
        self.how = "not launched"

    def fill(self, data: Mapping[str, Any]) -> list[Any]:
        """The positional arguments with every slot filled from ``data``."""
        args = self.args.copy()
        for i, name in self.slots:
            args[i] = data[name]
        return args

    def launch(self, data: Mapping[str, Any]) -> Any:
        """Launch on the current CUDA device and stream with ``data`` in the slots."""
        args = self.fill(data)
        compiled = self.compiled
        if compiled is None or not self.direct:
            compiled = self.kernel[self.grid](*args, **self.kwargs)
            if self.direct:
                self.compiled, self.device = compiled, torch.cuda.current_device()
            self.how = "first launch: Triton's dispatch" if self.direct else "Triton's dispatch"
            return compiled
        device = torch.cuda.current_device()
        if device != self.device:
            raise RuntimeError(
                f"a launch prepared on cuda:{self.device} was called on cuda:{device}: prepared "
                "launches are kept per device"
            )
        full = args + self.tail
        if check_launches():
            self._check(args, device)
        # What JITFunction.run does once it has found the compiled kernel (Triton 3.6).
        knobs = triton.knobs.runtime
        stream = triton.runtime.driver.active.get_current_stream(device)
        g0, g1, g2 = self.grid
        metadata = compiled.launch_metadata(self.grid, stream, *full)
        compiled.run(
            g0, g1, g2, stream, compiled.function, compiled.packed_metadata, metadata,
            knobs.launch_enter_hook, knobs.launch_exit_hook, *full,
        )  # fmt: skip
        self.how = "direct"
        return compiled

    def _check(self, args: list[Any], device: int) -> None:
        """Raise unless Triton's own dispatch of ``args`` selects the prepared compiled kernel."""
        from triton.runtime.jit import compute_cache_key

        kernel_cache, key_cache, _, _, binder = self.kernel.device_caches[device]
        kwargs = dict(self.kwargs)
        kwargs["debug"] = kwargs.get("debug", self.kernel.debug) or triton.knobs.runtime.debug
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        _, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key(key_cache, specialization, options)
        if kernel_cache.get(key) is not self.compiled:
            raise RuntimeError(
                f"MLA_OPS_CHECK_LAUNCH: a prepared launch of {self.name} would run a "
                "kernel compiled for other arguments than these select; its key misses a "
                "specialisation"
            )
