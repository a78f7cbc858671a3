"""Dynamo backends ``"mla"`` and ``"mla_eager"``, registered through the ``torch_dynamo_backends``
entry point (see pyproject.toml), so ``torch.compile(model, backend="mla")`` works right after
``pip install`` with no import.

* ``mla``: ``absorb_mla`` on the captured graph, then Inductor with the ``mode=`` and
  ``options=`` given to ``torch.compile`` (``"reduce-overhead"`` = CUDA graphs, as with Inductor).
* ``mla_eager``: ``absorb_mla`` only; the rewritten graph runs op by op (debugging, CPU tests,
  quick checks of what the rewrite did without Inductor's compile time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule

from .absorb import absorb_mla


def mla(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable:
    """Rewrite MLA sites, then compile with Inductor (``mode``/``options`` as Inductor's)."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    absorb_mla(gm)
    config: dict[str, Any] = {}
    if mode is not None and mode != "default":
        config.update(list_mode_options(mode))
    if options:
        config.update(options)
    return compile_fx(gm, list(example_inputs), config_patches=config)


def mla_eager(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable:
    """Rewrite MLA sites and run the graph as it is (no Inductor)."""
    if mode not in (None, "default") or options:
        raise ValueError("backend 'mla_eager' takes no mode or options (use backend='mla')")
    absorb_mla(gm)
    return gm.forward


def _register_without_entry_point() -> None:
    """A source checkout used through ``PYTHONPATH`` has no entry point; importing this module
    registers the backends by name then (an installed package's entry point already did)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    known = list_backends(exclude_tags=())
    for name, compiler in (("mla", mla), ("mla_eager", mla_eager)):
        if name not in known:
            register_backend(compiler, name=name)


_register_without_entry_point()
