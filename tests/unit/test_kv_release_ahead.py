"""A level-2 sleep's KV cache released ahead, on a thread of its own, while
the sleep's thread saves the model's buffers and prepares its own release
(CPU: the faked VMM layer). Through vLLM's real Worker.sleep:
test_model_buffers.py."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.unit.fake_vmm import FakeVmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator, SleepError

MIB = 1 << 20
KV_THREAD = "graph-sleep-kv-release"


class _KvReleaseHeldBack(FakeVmmDriver):
    """Gives back the KV cache only once `go` is set, and records the
    timeline as it was when that release began."""

    def __init__(self):
        super().__init__()
        self.kv_cache = None
        self.kv_release_began = threading.Event()
        self.go = threading.Event()
        self.go.set()

    def unmap_and_release(self, device, size, address, handle):
        if address == self.kv_cache:
            self.kv_release_began.set()
            if not self.go.wait(timeout=10):
                raise RuntimeError("cuMemUnmap failed: never let go (test timeout)")
        super().unmap_and_release(device, size, address, handle)


def _engine(driver=None):
    driver = driver or _KvReleaseHeldBack()
    manager = GraphSleepAllocator(driver)
    addresses = {}
    for tag, size, value in (
        ("weights", 4 * MIB, 1),
        ("kv_cache", 8 * MIB, 2),
        ("cudagraph", 2 * MIB, 3),
    ):
        with manager.allocation_tag(tag):
            addresses[tag] = driver.malloc(size)
        driver.write(addresses[tag], value)
    driver.kv_cache = addresses["kv_cache"]
    return driver, manager, addresses


def _level_2(manager):
    manager.sleep(offload_tags=("cudagraph",), kv_cache_cleared=True)


def test_the_sleep_takes_the_release_over_and_releases_its_own_only_after_it(caplog):
    driver, manager, addresses = _engine()
    driver.go.clear()
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        with manager.kv_cache_released_ahead():
            # Under way before the sleep starts, and held back until the
            # sleep's own work has run: nothing of the sleep's own went yet.
            assert driver.kv_release_began.wait(timeout=10)
            threading.Timer(0.1, driver.go.set).start()
            _level_2(manager)
    assert driver.unmap_threads == {
        addresses["kv_cache"]: KV_THREAD,
        addresses["weights"]: "MainThread",
        addresses["cudagraph"]: "MainThread",
    }
    # The driver serialises two threads' releases: the sleep's own wait.
    unmapped = [address for event, address in driver.timeline if event == "unmapped"]
    assert unmapped[0] == addresses["kv_cache"]
    assert "release on its thread, started ahead (1 allocations" in caplog.text
    assert "dropped cudagraph" not in caplog.text and "dropped kv_cache 8.00 MiB" in caplog.text
    assert manager.mapped_bytes() == 0
    manager.wake_up()
    assert bool((driver.read(addresses["cudagraph"]) == 3).all())
    assert manager.mapped_bytes() == 14 * MIB


def test_without_a_sleep_the_kv_cache_comes_back_empty_and_nothing_else_moves(caplog):
    driver, manager, addresses = _engine()
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        with pytest.raises(RuntimeError, match="the buffers' save failed"):
            with manager.kv_cache_released_ahead():
                assert driver.kv_release_began.wait(timeout=10)
                raise RuntimeError("the buffers' save failed")
    assert "no sleep took the KV cache's release over" in caplog.text
    assert "came back without its contents" in caplog.text
    assert KV_THREAD not in {thread.name for thread in threading.enumerate()}
    assert manager.mapped_bytes() == driver.mapped_bytes() == 14 * MIB
    for tag in ("weights", "cudagraph"):
        assert addresses[tag] not in driver.unmap_threads, tag
    assert bool((driver.read(addresses["weights"]) == 1).all())
    # The next sleep and wake work.
    _level_2(manager)
    manager.wake_up()
    assert bool((driver.read(addresses["cudagraph"]) == 3).all())


def test_a_sleep_that_fails_brings_the_kv_cache_back_and_the_engine_is_awake():
    driver, manager, addresses = _engine()
    driver.fail("synchronize", after=1)  # waiting for the graph pool's copies
    with manager.kv_cache_released_ahead():
        with pytest.raises(SleepError, match="came back without its contents") as raised:
            _level_2(manager)
    assert "the engine is awake" in str(raised.value)
    assert manager.mapped_bytes() == driver.mapped_bytes() == 14 * MIB
    for tag, value in (("weights", 1), ("cudagraph", 3)):
        assert bool((driver.read(addresses[tag]) == value).all()), tag


def test_a_kv_cache_the_driver_keeps_stays_mapped_and_the_sleep_finishes(caplog):
    driver, manager, addresses = _engine()
    driver.fail("unmap_and_release", address=addresses["kv_cache"])
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        with manager.kv_cache_released_ahead():
            _level_2(manager)
    assert "could not release kv_cache 8.00 MiB" in caplog.text
    assert manager.mapped_bytes() == 8 * MIB
    manager.wake_up()
    assert manager.mapped_bytes() == 14 * MIB


def test_the_backend_runs_the_first_step_beside_the_release_at_level_2(install_allocator):
    from vllm_graph_sleep.backend import GraphSleepBackend

    driver, manager, addresses = _engine()
    install_allocator(manager)
    backend = GraphSleepBackend()
    seen = []

    def step():
        # The release is under way (held back until the step is done).
        seen.append(driver.kv_release_began.wait(timeout=10))
        seen.append(list(driver.unmap_threads))
        driver.go.set()

    driver.go.clear()
    with backend.first_in_suspend(step):
        backend.suspend(level=2)
    assert seen == [True, []]
    assert driver.unmap_threads[addresses["kv_cache"]] == KV_THREAD
    assert manager.mapped_bytes() == 0
    backend.resume()
    # Level 1: the step runs first, and the KV cache goes once the backup's
    # copies are queued (EarlyDrop.split), not ahead.
    seen.clear()
    driver.kv_release_began.clear()
    with backend.first_in_suspend(lambda: seen.append(driver.kv_release_began.is_set())):
        backend.suspend(level=1)
    assert seen == [False]
    assert driver.unmap_threads[addresses["kv_cache"]] == KV_THREAD
    backend.resume()
    assert bool((driver.read(addresses["cudagraph"]) == 3).all())


def test_a_second_start_ahead_is_refused_and_the_first_goes_on():
    driver, manager, addresses = _engine()
    with manager.kv_cache_released_ahead():
        with pytest.raises(RuntimeError, match="already started ahead"):
            with manager.kv_cache_released_ahead():
                pass
        _level_2(manager)
    assert driver.unmap_threads[addresses["kv_cache"]] == KV_THREAD
    assert manager.mapped_bytes() == 0
