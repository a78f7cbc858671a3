"""Plan caches: kept per key, bounded (least recently used out first), safe under threads, and
every planner choice comes from explicit options (no module global is read for one)."""

from __future__ import annotations

import threading

import pytest
import torch

from mla_compile.mla_ops import planner
from mla_compile.mla_ops.plan_cache import PlanCache, clear_plans


def test_lookup_put_and_lru_eviction() -> None:
    cache = PlanCache(capacity=2)
    assert cache.lookup("a") is None
    assert cache.put("a", 1) == 1 and cache.put("b", 2) == 2
    assert cache.lookup("a") == 1  # "a" is now the most recently used
    cache.put("c", 3)
    assert "b" not in cache and cache.lookup("a") == 1 and cache.lookup("c") == 3
    assert cache.put("a", 99) == 1, "the first entry kept under a key wins"
    clear_plans()
    assert len(cache) == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        PlanCache(capacity=0)


def _hammer(cache: PlanCache, keys: int, seen: dict[int, set[int]]) -> None:
    """Eight threads looking up and putting overlapping keys at once; raises what any raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(worker: int) -> None:
        try:
            start.wait()
            for i in range(4000):
                key = (i * 7 + worker) % keys
                kept = cache.lookup(key)
                if kept is None:
                    kept = cache.put(key, object())
                seen[key].add(id(kept))
                assert len(cache) <= cache.capacity
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_concurrent_callers_past_the_capacity() -> None:
    """Evictions under eight threads: no exception, and the bound holds throughout."""
    cache = PlanCache(capacity=16)
    _hammer(cache, 64, {k: set() for k in range(64)})
    assert len(cache) <= 16


def test_concurrent_callers_share_one_entry_per_key() -> None:
    """Without evictions, every caller of a key gets the one entry kept for it, however the
    threads interleave (a second put returns the first entry)."""
    cache = PlanCache(capacity=64)
    seen: dict[int, set[int]] = {k: set() for k in range(32)}
    _hammer(cache, 32, seen)
    assert all(len(ids) == 1 for ids in seen.values()), seen


def test_options_are_explicit_and_hashable() -> None:
    """``DecodeOptions`` is frozen and hashable (it keys the kept launches); the defaults are the
    planner's own choices."""
    options = planner.DecodeOptions(merge_max_splits=0, use_wgmma=False)
    assert hash(options) == hash(planner.DecodeOptions(merge_max_splits=0, use_wgmma=False))
    assert options != planner.DEFAULT_OPTIONS
    with pytest.raises(AttributeError):
        options.merge_max_splits = 4  # type: ignore[misc]


def test_plan_is_inspectable_before_a_launch() -> None:
    """``plan_decode`` answers from metadata alone (here a float64 call: the PyTorch path) and
    says why."""
    q = torch.randn(2, 1, 3, 48, dtype=torch.float64)
    kv = torch.randn(2, 40, 48, dtype=torch.float64)
    plan = planner.plan_decode(
        q, kv[..., :32], kv[..., 32:], None, None, causal=True, num_splits=1, total_splits=None
    )
    assert plan.kernel == "reference" and "float64" in plan.why("kernel")
    assert "reference kernel" in plan.describe()
    assert plan.record["kernel"] == "reference"
