"""Plan caches: kept per signature, bounded, and dropped when a followed module changes."""

from __future__ import annotations

import sys
import types

import pytest

from mla_compile.mla_ops import plan_cache


@pytest.fixture
def followed_module():
    """A throwaway module that the caches follow, removed afterwards."""
    name = "tests_plan_cache_followed"
    module = types.ModuleType(name)
    module.KNOB = 1
    sys.modules[name] = module
    plan_cache.follow(name)
    yield module
    plan_cache._FOLLOWED[:] = [f for f in plan_cache._FOLLOWED if f[0] is not module.__dict__]
    del sys.modules[name]


def test_lookup_put_and_capacity() -> None:
    cache = plan_cache.PlanCache(capacity=2)
    assert cache.lookup("a") is None
    assert cache.put("a", 1) == 1 and cache.lookup("a") == 1
    cache.put("b", 2)
    assert cache.lookup("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert cache.lookup("b") is None and cache.lookup("a") == 1 and cache.lookup("c") == 3
    plan_cache.clear_plans()
    assert cache.lookup("b") is None and len(cache) == 0


@pytest.mark.parametrize("change", ["rebind", "add", "delete", "monkeypatch"])
def test_a_followed_module_change_drops_every_plan(followed_module, monkeypatch, change) -> None:
    first, second = plan_cache.PlanCache(), plan_cache.PlanCache()
    first.lookup("warm")  # takes the followed values as they are now
    first.put("k", "plan")
    second.put("k", "other plan")
    assert first.lookup("k") == "plan"
    if change == "rebind":
        followed_module.KNOB = 2
    elif change == "add":
        followed_module.NEW = object()
    elif change == "delete":
        del followed_module.KNOB
    else:
        monkeypatch.setattr(followed_module, "KNOB", 3)
    assert first.lookup("k") is None
    assert second.lookup("k") is None  # cleared with the first
    second.put("k", "new plan")
    assert second.lookup("k") == "new plan"  # the new values are now the ones seen


def test_an_equal_value_or_a_mutated_object_keeps_plans(followed_module) -> None:
    followed_module.TABLE = {}
    cache = plan_cache.PlanCache()
    cache.lookup("warm")
    cache.put("k", "plan")
    followed_module.KNOB = 1  # rebound to an equal value: the choices it feeds are the same
    followed_module.TABLE["entry"] = 1  # the same object, mutated (as LAST_LAUNCH is per call)
    assert cache.lookup("k") == "plan"


def test_the_package_modules_are_followed() -> None:
    """Patching a knob of the op's modules drops the kept plans (the op would otherwise keep the
    choices made before the patch)."""
    pytest.importorskip("triton")
    from mla_compile.mla_ops import ops, planner, triton_kernels

    modules = [ops, planner, triton_kernels]
    try:
        from mla_compile.mla_ops import wgmma_decode

        modules.append(wgmma_decode)
    except ImportError:  # a Triton without Gluon's Hopper module: no wgmma_decode to follow
        pass
    followed = [namespace for namespace, _ in plan_cache._FOLLOWED]
    for module in modules:
        assert any(namespace is module.__dict__ for namespace in followed), module.__name__
