"""mla-compile: Multi-head Latent Attention fast and deployable from plain PyTorch.

The installed distribution lives under this one namespace, so that none of its packages can
shadow a user's module or be shadowed by one:

* ``mla_compile.mla_ops``: the ``mla`` custom ops (decode, combine), their kernels, the planner,
  the paged latent cache and ``MLACache``.
* ``mla_compile.fx_passes``: ``torch.compile(backend="mla")`` and ``absorb_mla``.
* ``mla_compile.export``: ``torch.export``, AOTInductor and ONNX.

Subpackages load on first use (``mla_compile.mla_ops`` registers the ops; ``fx_passes`` and
``export`` import it).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.2.0"

# Run from a source checkout without installing (``PYTHONPATH=.``): the subpackages are the
# repository's top-level folders beside this one, as the installed layout maps them.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "mla_ops")) and os.path.isfile(
    os.path.join(_CHECKOUT, "mla_ops", "__init__.py")
):
    __path__.append(_CHECKOUT)

_SUBPACKAGES = ("mla_ops", "fx_passes", "export")
__all__ = ["__version__", *_SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
