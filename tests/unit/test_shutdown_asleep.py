"""An engine shut down asleep, then a second engine in the same process (issue
34, item 3): the second starts with the stack limit restored and no settle
thread of the first, its first sleep lowers the stack again, and what the first
left referenced (vLLM's rotary caches) is mapped back, and logged as it is."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.unit.fake_vmm import DEFAULT_STACK, PAGE, FakeVmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.patches.v1_worker_gpu_worker import orphan_leftovers

ROPE, WEIGHTS, KV = 7, 1, 2


def allocate(driver, manager, tag, value):
    with manager.allocation_tag(tag):
        address = driver.malloc(PAGE)
    driver.write(address, value)
    return address


def settle_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "graph-sleep-settle" and t.is_alive()]


def first_engine_shut_down_asleep(offload_tags):
    """The first engine: weights (a rotary cache among them, which vLLM keeps
    in a module-level cache) and a KV cache; it sleeps and shuts down asleep,
    and everything but the rotary cache dies with it."""
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)  # settles after each sleep, as by default
    rope = allocate(driver, manager, "weights", ROPE)
    dead = [
        allocate(driver, manager, "weights", WEIGHTS),
        allocate(driver, manager, "kv_cache", KV),
    ]
    manager.sleep(offload_tags=offload_tags)
    assert driver.stack_limits == {0: 0}
    manager.release_pools()  # Worker.shutdown
    for address in dead:
        driver.free(address)
    return driver, manager, rope


def test_shutdown_asleep_restores_the_stack_and_stops_the_settle_thread():
    others = set(settle_threads())  # of allocators that earlier tests left asleep
    driver, manager, _ = first_engine_shut_down_asleep(("weights",))
    assert driver.stack_limits == {0: DEFAULT_STACK}
    assert set(settle_threads()) <= others
    orphan_leftovers(manager)  # the next engine's init_device
    weights = allocate(driver, manager, "weights", WEIGHTS)
    manager.sleep(offload_tags=("weights",))
    assert driver.stack_limits == {0: 0}, "the second engine's first sleep kept the stack"
    manager.wake_up()
    assert driver.stack_limits == {0: DEFAULT_STACK}
    assert bool((driver.read(weights) == WEIGHTS).all())


def test_a_leftover_asleep_with_a_backup_is_mapped_back_with_its_contents(caplog):
    driver, manager, rope = first_engine_shut_down_asleep(("weights",))
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        orphan_leftovers(manager)
    assert bool((driver.read(rope) == ROPE).all())  # the next engine's first forward reads it
    (line,) = [r.getMessage() for r in caplog.records if "still referenced" in r.getMessage()]
    assert "2.00 MiB" in line and "shut down asleep" in line
    assert "mapped back from their host copies" in line and "without" not in line
    # Set apart from the next engine: its sleeps leave it alone, so the pinned
    # buffer its wake came from is given back now, not at the next shutdown.
    assert manager.allocations[rope].host is None and manager.host_bytes() == 0
    manager.sleep(offload_tags=())
    assert bool((driver.read(rope) == ROPE).all())


def test_a_leftover_whose_sleep_dropped_it_is_mapped_back_and_said_to_be_lost(caplog):
    driver, manager, rope = first_engine_shut_down_asleep(())  # level 2: weights dropped
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        orphan_leftovers(manager)
    driver.read(rope)  # mapped: a reader does not fault
    (line,) = [r.getMessage() for r in caplog.records if "still referenced" in r.getMessage()]
    assert "mapped back without their contents" in line and "weights 2.00 MiB" in line
    assert "wake the engine before shutting it down" in line


def test_leftovers_that_cannot_be_mapped_back_stop_the_next_engine_with_a_clear_error():
    driver, manager, rope = first_engine_shut_down_asleep(("weights",))
    driver.fail("create_and_map")
    with pytest.raises(RuntimeError, match="could not be mapped back"):
        orphan_leftovers(manager)
    orphan_leftovers(manager)  # a retry, once the memory is there
    assert bool((driver.read(rope) == ROPE).all())
