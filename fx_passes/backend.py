"""Dynamo backends ``"mla"`` and ``"mla_eager"``, registered through the ``torch_dynamo_backends``
entry point (see pyproject.toml), so ``torch.compile(model, backend="mla")`` works right after
``pip install`` with no import.

* ``mla``: ``absorb_mla`` on the captured graph, then Inductor with the ``mode=`` and
  ``options=`` given to ``torch.compile`` (``"reduce-overhead"`` = CUDA graphs, as with Inductor).
* ``mla_eager``: ``absorb_mla`` only; the rewritten graph runs op by op (debugging, CPU tests,
  quick checks of what the rewrite did without Inductor's compile time).
* ``mla_backend(RewriteOptions(...))``: either of the two with rewrite options other than the
  defaults, e.g. ``torch.compile(model, backend=mla_backend(RewriteOptions(prefill="original")))``.

With CUDA graphs on, ``mla`` refuses a graph that allocates an ``MLACache``'s storage (its first
update traced inside the compiled call): the storage would be an output of a CUDA graph, which
the graph's next replay overwrites while the cache still holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .absorb import RewriteOptions, absorb_mla

_ALLOCATED_IN_GRAPH = (
    "backend='mla' with CUDA graphs: this graph allocates the MLACache(static=True) storage (its "
    "first update ran inside the compiled call), and a CUDA graph's next replay overwrites what "
    "it allocated while the cache still holds it. Allocate the storage up front, before the "
    "first call: MLACache(config, max_length=..., static=True, batch_size=B, dtype=model.dtype, "
    "device=model.device)"
)


def cache_allocated_in_graph(gm: GraphModule) -> bool:
    """Whether a latent-cache write (``mla::paged_append``) in ``gm`` stores into a tensor the
    graph itself created, rather than into one of its inputs (a cache allocated before the
    call)."""
    appends = (torch.ops.mla.paged_append, torch.ops.mla.paged_append.default)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in appends:
            continue
        root = node.args[0]  # the pool, or a view of it
        while isinstance(root, Node) and root.op == "call_function" and root.args:
            if not isinstance(root.args[0], Node):
                break
            root = root.args[0]
        if not (isinstance(root, Node) and root.op in ("placeholder", "get_attr")):
            return True
    return False


def _cuda_graphs(config: dict[str, Any], example_inputs: Sequence[Any]) -> bool:
    from torch._inductor import config as inductor_config

    on = config.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    return bool(on) and on_cuda


def mla(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    rewrite: RewriteOptions | None = None,
) -> Callable:
    """Rewrite MLA sites, then compile with Inductor (``mode``/``options`` as Inductor's)."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    absorb_mla(gm, options=rewrite)
    config: dict[str, Any] = {}
    if mode is not None and mode != "default":
        config.update(list_mode_options(mode))
    if options:
        config.update(options)
    if _cuda_graphs(config, example_inputs) and cache_allocated_in_graph(gm):
        raise RuntimeError(_ALLOCATED_IN_GRAPH)
    return compile_fx(gm, list(example_inputs), config_patches=config)


def mla_eager(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    rewrite: RewriteOptions | None = None,
) -> Callable:
    """Rewrite MLA sites and run the graph as it is (no Inductor)."""
    if mode not in (None, "default") or options:
        raise ValueError("backend 'mla_eager' takes no mode or options (use backend='mla')")
    absorb_mla(gm, options=rewrite)
    return gm.forward


def mla_backend(rewrite: RewriteOptions, *, inductor: bool = True) -> Callable:
    """The ``mla`` backend (``inductor=False``: ``mla_eager``) rewriting with ``rewrite``; pass
    it as ``torch.compile(..., backend=mla_backend(RewriteOptions(...)))``."""
    if not isinstance(rewrite, RewriteOptions):
        raise TypeError(f"rewrite must be a RewriteOptions, got {type(rewrite).__name__}")
    compiler = mla if inductor else mla_eager

    def backend(gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        return compiler(gm, example_inputs, rewrite=rewrite, **kwargs)

    backend.__name__ = compiler.__name__
    return backend


def _register_without_entry_point() -> None:
    """A source checkout used through ``PYTHONPATH`` has no entry point; importing this module
    registers the backends by name then (an installed package's entry point already did)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    known = list_backends(exclude_tags=())
    for name, compiler in (("mla", mla), ("mla_eager", mla_eager)):
        if name not in known:
            register_backend(compiler, name=name)


_register_without_entry_point()
