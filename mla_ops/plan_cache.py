"""Caches of host-side choices per call signature, dropped whenever a module they follow changes.

An eager decode call makes the same choices for every call of the same shapes, strides and dtypes
(the split plan, the kernel, its tiling and its arguments), and making them took a large part of
its host time. ``PlanCache`` keeps them per signature. The choices read module-level functions
and knobs that tests and experiments replace (``monkeypatch.setattr(triton_kernels,
"has_wgmma", ...)``, ``triton_kernels.MERGE_MAX_SPLITS = 0``), so every lookup first checks that
no module the caches ``follow`` has had a global rebound, added or removed since the last
lookup (one comparison of each module's values: 1.4 us for this package's four, timed on a
development CPU, not on the GPU machines), and clears every cache if one has: a patched choice is
never read from a plan made before the patch.
"""

from __future__ import annotations

import sys
from typing import Any

_CACHES: list[PlanCache] = []
# Each followed module's globals and the values they held at the last lookup.
_FOLLOWED: list[tuple[dict[str, Any], list[Any]]] = []


def follow(module_name: str) -> None:
    """Clear every plan whenever a global of module ``module_name`` is rebound, added or removed."""
    namespace = sys.modules[module_name].__dict__
    _FOLLOWED.append((namespace, list(namespace.values())))


def _followed_unchanged() -> bool:
    """Whether no followed module changed since the last call (which takes the new values)."""
    unchanged = True
    for i, (namespace, seen) in enumerate(_FOLLOWED):
        values = list(namespace.values())
        try:
            same = values == seen  # identical objects compare equal without __eq__
        except Exception:  # an __eq__ that cannot answer (a tensor rebound to another)
            same = False
        if not same:
            _FOLLOWED[i] = (namespace, values)
            unchanged = False
    return unchanged


def clear_plans() -> None:
    """Drop every kept plan (the next call of each signature chooses again)."""
    for cache in _CACHES:
        cache.clear()


class PlanCache(dict):
    """A dict of plans by signature, at most ``capacity`` of them (the least recently used goes
    first), cleared with every other ``PlanCache`` by ``clear_plans`` and when a followed module
    changes."""

    def __init__(self, capacity: int = 256) -> None:
        super().__init__()
        self.capacity = capacity
        _CACHES.append(self)

    def lookup(self, key: Any) -> Any:
        """The plan kept under ``key``, or None (also after a followed module changed)."""
        if not _followed_unchanged():
            clear_plans()
            return None
        plan = self.pop(key, None)
        if plan is not None:
            self[key] = plan  # now the most recently used
        return plan

    def put(self, key: Any, plan: Any) -> Any:
        """Keep ``plan`` under ``key``; returns it."""
        if len(self) >= self.capacity:
            del self[next(iter(self))]
        self[key] = plan
        return plan
