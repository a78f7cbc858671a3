"""A bounded, thread-safe cache of plans and prepared launches per call signature.

An eager decode call makes the same decisions for every call of the same shapes, strides, dtypes
and options, and making them (and preparing the kernels' launches) took a large part of its host
time. ``PlanCache`` keeps them per key, least recently used out first. Every decision's inputs
are in the key (``runtime.call_signature`` and the ``DecodeOptions``), so a kept entry is never
stale; device facts that tests emulate are cleared with ``clear_plans``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

_CACHES: list[PlanCache] = []


def clear_plans() -> None:
    """Drop every kept plan (the next call of each signature plans again)."""
    for cache in _CACHES:
        cache.clear()


class PlanCache:
    """At most ``capacity`` entries by key; lookups and insertions are atomic under one lock, so
    concurrent callers (threads serving requests) never see a half-updated cache."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        _CACHES.append(self)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            return key in self._entries

    def lookup(self, key: Any) -> Any:
        """The entry kept under ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Any, entry: Any) -> Any:
        """Keep ``entry`` under ``key`` (evicting the least recently used past ``capacity``) and
        return the entry now kept: one another thread put first wins, so callers share it."""
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None:
                self._entries.move_to_end(key)
                return kept
            self._entries[key] = entry
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return entry

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
