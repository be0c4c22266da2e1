"""KvHint's KVCacheManager and BlockPool are built by vLLM as KvHint's classes
(engine_integration.hooks.hooked_construction), not re-classed afterwards, and the
window in which vLLM's constructors are rebound closes whatever happens in it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm.v1.core.kv_cache_coordinator as coordinator_module
import vllm.v1.core.sched.scheduler as scheduler_module
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager

from engine_integration import inproc
from engine_integration.hooks import KvHintBlockPool, KvHintKVCacheManager, install
from engine_integration.scheduler import KvHintScheduler

POOL = 64


def vllms_constructors_are_vllms() -> bool:
    return scheduler_module.KVCacheManager is KVCacheManager and coordinator_module.BlockPool is BlockPool


@pytest.mark.parametrize(("async_scheduling", "hybrid"), [(False, False), (True, False), (False, True)])
def test_kvhint_scheduler_builds_its_classes_and_restores_vllms(async_scheduling: bool, hybrid: bool) -> None:
    with inproc.running_scheduler(num_blocks=POOL, async_scheduling=async_scheduling, hybrid=hybrid) as scheduler:
        manager = scheduler.kv_cache_manager
        assert type(manager) is KvHintKVCacheManager and type(manager.block_pool) is KvHintBlockPool
        # One pool, shared by every group's manager (the coordinator's), and it is the adapter's.
        assert all(m.block_pool is manager.block_pool for m in manager.coordinator.single_type_managers)
        assert scheduler.kvhint_adapter.pool is manager.block_pool
        assert vllms_constructors_are_vllms()
        # A stock scheduler built next to it is stock through and through.
        stock = inproc.make_scheduler(num_blocks=POOL, kvhint=False, async_scheduling=async_scheduling, hybrid=hybrid)
        try:
            assert type(stock.kv_cache_manager) is KVCacheManager
            assert type(stock.kv_cache_manager.block_pool) is BlockPool
        finally:
            inproc.close(stock)


def test_the_window_closes_when_vllms_constructor_fails() -> None:
    scheduler = object.__new__(KvHintScheduler)
    with pytest.raises(Exception):
        KvHintScheduler.__init__(scheduler, vllm_config=None)  # vLLM's __init__ fails inside the window
    assert vllms_constructors_are_vllms()


def test_install_refuses_a_manager_vllm_built_as_its_own() -> None:
    stock = inproc.make_scheduler(num_blocks=POOL, kvhint=False)
    try:
        with pytest.raises(RuntimeError, match="KvHintKVCacheManager/KvHintBlockPool.*got KVCacheManager/BlockPool"):
            install(SimpleNamespace(kv_cache_manager=stock.kv_cache_manager), adapter=None)  # type: ignore[arg-type]
        assert type(stock.kv_cache_manager.block_pool) is BlockPool  # untouched
    finally:
        inproc.close(stock)
