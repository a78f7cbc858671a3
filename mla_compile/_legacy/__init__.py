"""The pre-namespace import names (``mla_ops``, ``fx_passes``, ``export``), kept for one release.

``import mla_ops`` (or any ``mla_ops.x``) gives the very modules of ``mla_compile.mla_ops`` (never
a second copy, which would register the ``mla`` ops twice) and warns once per name with a
``DeprecationWarning`` that names the new import. The bare names go in the next release: a top-level
module called ``export`` collides with any user's ``export.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

NAMESPACE = "mla_compile"
LEGACY_NAMES = ("mla_ops", "fx_passes", "export")


def _new_name(fullname: str) -> str | None:
    """``mla_compile.<fullname>`` where ``fullname`` is a legacy name or inside one."""
    head = fullname.partition(".")[0]
    return f"{NAMESPACE}.{fullname}" if head in LEGACY_NAMES else None


class _AliasLoader(importlib.abc.Loader):
    """Loads a legacy submodule name as the namespaced module itself."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__  # restored in exec_module (import overwrites it)
        return module

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__.loader_state
        module.__spec__ = spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``mla_ops.x`` -> ``mla_compile.mla_ops.x`` (the parent was handed over by ``hand_over``)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if "." not in fullname:
            return None  # top-level legacy names run their own __init__, which calls hand_over
        new = _new_name(fullname)
        if new is None or not isinstance(sys.modules.get(fullname.partition(".")[0]), ModuleType):
            return None
        if importlib.util.find_spec(new) is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader())
        spec.loader_state = new
        return spec


_FINDER = _AliasFinder()


def hand_over(name: str) -> None:
    """Called first by each package's ``__init__``: under a legacy name (``name`` is
    ``"mla_ops"``, not ``"mla_compile.mla_ops"``), warn and make the name the namespaced package.
    Under its namespaced name it does nothing."""
    if name not in LEGACY_NAMES:
        return
    new = f"{NAMESPACE}.{name}"
    warnings.warn(
        f"'import {name}' is deprecated and goes in the next release: import {new} instead "
        f"(a top-level '{name}' module can collide with a user's own)",
        DeprecationWarning,
        stacklevel=3,
    )
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    sys.modules[name] = importlib.import_module(new)
