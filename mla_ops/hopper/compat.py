"""Gluon names that moved between Triton releases, resolved once here so that the kernels read
the same on Triton 3.6 (the GPU machines) and later releases: the bulk tensor load, the
per-thread asynchronous copy, shared-memory reinterpretation and the thread barrier."""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gluon_builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    tma,
)

# Triton 3.6 names the bulk tensor load ``async_copy_global_to_shared``; later Gluon releases
# renamed it ``async_load`` and made the old name raise. Same arguments (descriptor, coordinates,
# barrier, destination).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


# Likewise for the per-thread asynchronous copy (``cp.async``): ``async_load`` in later releases.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@_gluon_builtin
def _reinterpret(desc, dtype, shape, layout, _semantic=None):
    """``desc`` (shared memory) seen as another dtype, shape and layout: ``_reinterpret`` in
    Triton 3.6, ``reinterpret`` in later Gluon releases."""
    view = getattr(desc, "reinterpret", None) or desc._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


# The barrier of all threads executing the region (a partition's own under warp specialisation):
# ``thread_barrier`` in Triton 3.6, ``barrier`` later.
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
