"""Allocations that torch frees while a sleep or a wake still holds their
records (a tensor that died while asleep, its segment cached until an
empty_cache), and the host buffers and KV cache of sleeps that stop early
(CPU: the faked VMM layer, whose release_cached_memory frees what torch would)."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time

import pytest

from tests.unit.fake_vmm import PAGE, FakeVmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator, SleepError

KV_THREAD = "graph-sleep-kv-release"


def _weights_with_one_to_die(driver, manager):
    """Two weights in a pool that is closed (its free segments go at the next
    empty_cache), as after load_model; the second is the one to die."""
    with manager.use_memory_pool("weights"):
        kept = driver.malloc(PAGE)
        doomed = driver.malloc(PAGE)
    driver.write(kept, 1)
    return kept, doomed


@pytest.mark.parametrize("offload", [("weights",), ()], ids=["backed_up", "dropped"])
def test_a_weight_that_died_asleep_is_freed_before_the_wake_maps_anything(offload):
    """The wake empties torch's cache first, which frees it: it must not be
    among what the wake maps (its record is gone, the extension released it)."""
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    kept, doomed = _weights_with_one_to_die(driver, manager)
    manager.sleep(offload_tags=offload)
    driver.tensor_dies(doomed)
    manager.wake_up()
    assert doomed not in manager.allocations and doomed not in driver.memory
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == PAGE
    if offload:
        assert bool((driver.read(kept) == 1).all())


class _KvThreadAfterTheCacheRelease(FakeVmmDriver):
    """The KV cache's thread started ahead gets to release only once the
    sleep's own thread has emptied torch's cache."""

    def __init__(self):
        super().__init__()
        self.cache_emptied = threading.Event()

    def unmap_and_release(self, device, size, address, handle):
        if threading.current_thread().name == KV_THREAD:
            self.cache_emptied.wait(timeout=10)
        super().unmap_and_release(device, size, address, handle)

    def release_cached_memory(self) -> None:
        super().release_cached_memory()
        self.cache_emptied.set()


def test_a_kv_segment_torch_frees_during_a_release_started_ahead_is_released_once(caplog):
    driver = _KvThreadAfterTheCacheRelease()
    manager = GraphSleepAllocator(driver)
    with manager.use_memory_pool("kv_cache"):
        kv = driver.malloc(4 * PAGE)
        dead = driver.malloc(PAGE)
    driver.tensor_dies(dead)  # cached in the closed pool until the sleep's empty_cache
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        with manager.kv_cache_released_ahead():
            manager.sleep(offload_tags=("cudagraph",), kv_cache_cleared=True)
    assert "could not release" not in caplog.text
    assert driver.unmap_calls.count(dead) == 1 and driver.unmap_calls.count(kv) == 1
    assert dead not in manager.allocations
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 0
    manager.wake_up()
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 4 * PAGE


@pytest.mark.parametrize(
    ("offload", "cleared", "what"),
    [(("kv_cache",), True, "back it up"), (("cudagraph",), False, "keep its contents")],
)
def test_a_sleep_that_would_keep_the_kv_cache_cannot_take_a_release_started_ahead(
    offload, cleared, what
):
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    with manager.use_memory_pool("kv_cache"):
        kv = driver.malloc(PAGE)
    with pytest.raises(ValueError, match=f"started ahead of this sleep, which would {what}"):
        with manager.kv_cache_released_ahead():
            manager.sleep(offload_tags=offload, kv_cache_cleared=cleared)
    # The block undid the release started ahead: the engine is awake.
    assert kv in driver.memory and manager.all_mapped_bytes() == PAGE


def _weights_and_kv_cache(values: list[int], kv_pages: list[int]):
    """An allocator on the fake driver with a weight of a page per value in
    `values`, written with it, and a KV cache allocation per entry of
    `kv_pages`, of that many pages: (driver, manager, weights, kv_cache)."""
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    with manager.use_memory_pool("weights"):
        weights = [driver.malloc(PAGE) for _ in values]
    for address, value in zip(weights, values, strict=True):
        driver.write(address, value)
    with manager.use_memory_pool("kv_cache"):
        kv_cache = [driver.malloc(pages * PAGE) for pages in kv_pages]
    return driver, manager, weights, kv_cache


def test_an_interrupt_while_backing_up_brings_the_kv_cache_back():
    driver, manager, (weights,), (kv,) = _weights_and_kv_cache([4], [4])
    synchronize, unmap = driver.synchronize, driver.unmap_and_release
    kv_released = threading.Event()

    def unmapping(*args):
        unmap(*args)
        if threading.current_thread().name == KV_THREAD:
            kv_released.set()

    def interrupted(device):  # Ctrl-C once the KV cache went, before the weights' release
        if threading.current_thread().name == "MainThread" and kv_released.wait(timeout=1):
            raise KeyboardInterrupt
        synchronize(device)

    driver.unmap_and_release, driver.synchronize = unmapping, interrupted
    with pytest.raises(KeyboardInterrupt):
        manager.sleep(offload_tags=("weights",), kv_cache_cleared=True)
    driver.unmap_and_release, driver.synchronize = unmap, synchronize
    assert kv_released.is_set()
    assert kv in driver.memory and weights in driver.memory
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 5 * PAGE
    assert bool((driver.read(weights) == 4).all())


class _Bug(BaseException):
    """What no driver raises: the KV cache's thread's own failure."""


def test_a_failed_backup_maps_the_kv_cache_back_before_raising_what_its_thread_raised():
    driver, manager, (weights,), (first_kv, second_kv) = _weights_and_kv_cache([3], [2, 2])
    synchronize, unmap = driver.synchronize, driver.unmap_and_release
    thread_failed = threading.Event()

    def unmapping(device, size, address, handle):
        if address == second_kv:
            thread_failed.set()
            raise _Bug("the KV cache's thread broke")
        unmap(device, size, address, handle)

    def failing(device):  # the backup fails once the thread has failed
        if threading.current_thread().name == "MainThread" and thread_failed.wait(timeout=1):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        synchronize(device)

    driver.unmap_and_release, driver.synchronize = unmapping, failing
    with pytest.raises(_Bug):
        manager.sleep(offload_tags=("weights",), kv_cache_cleared=True)
    driver.unmap_and_release, driver.synchronize = unmap, synchronize
    assert first_kv in driver.memory and manager.allocations[first_kv].mapped
    assert second_kv in driver.memory and weights in driver.memory
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 5 * PAGE
    assert bool((driver.read(weights) == 3).all())


def test_an_interrupt_while_releasing_the_weights_waits_for_the_kv_cache_thread():
    """Ctrl-C (or vLLM's SIGTERM handler) during the weights' release, while
    the KV cache's thread is still releasing: the sleep raises only once that
    thread is done, so that a wake after it finds the records true and maps
    everything back (it found the KV cache still mapped, and the thread then
    unmapped it under the woken engine)."""
    driver, manager, (first, second), (kv,) = _weights_and_kv_cache([5, 6], [2])
    unmap = driver.unmap_and_release
    kv_may_go = threading.Event()

    def unmapping(device, size, address, handle):
        if threading.current_thread().name == KV_THREAD:
            kv_may_go.wait(timeout=10)
        elif address == second:  # the KV cache's thread is still at work
            threading.Timer(0.2, kv_may_go.set).start()
            raise KeyboardInterrupt
        unmap(device, size, address, handle)

    driver.unmap_and_release = unmapping
    with pytest.raises(KeyboardInterrupt):
        manager.sleep(offload_tags=("weights",), kv_cache_cleared=True)
    driver.unmap_and_release = unmap
    assert not [t for t in threading.enumerate() if t.name == KV_THREAD]
    assert kv not in driver.memory and not manager.allocations[kv].mapped
    manager.wake_up()
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 4 * PAGE
    assert bool((driver.read(first) == 5).all()) and bool((driver.read(second) == 6).all())


def test_an_interrupt_while_waiting_for_the_kv_cache_thread_still_waits_for_it():
    """SIGINT while the sleep waits for the KV cache's thread: the wait goes
    on until the thread is done, then the interrupt is raised."""
    driver, manager, (weights,), (kv,) = _weights_and_kv_cache([7], [2])
    unmap, give_back = driver.unmap_and_release, driver.release_dropped_host_buffers
    main_released_all, interrupted_early = threading.Event(), threading.Event()

    def giving_back():  # the sleep's thread's last step before it waits
        give_back()
        main_released_all.set()

    def unmapping(device, size, address, handle):
        if threading.current_thread().name == KV_THREAD:
            main_released_all.wait(timeout=10)
            time.sleep(0.2)  # the sleep's thread is waiting for this one by now
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.3)
            interrupted_early.set()
        unmap(device, size, address, handle)

    driver.unmap_and_release, driver.release_dropped_host_buffers = unmapping, giving_back
    # SIGINT raises KeyboardInterrupt here even where this process was started
    # with it ignored (a shell's background job, as CI may run it).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            manager.sleep(offload_tags=("weights",), kv_cache_cleared=True)
    finally:
        signal.signal(signal.SIGINT, handler)
    driver.unmap_and_release, driver.release_dropped_host_buffers = unmap, give_back
    assert interrupted_early.is_set()  # raised only once the thread had gone on and finished
    assert not [t for t in threading.enumerate() if t.name == KV_THREAD]
    assert kv not in driver.memory and not manager.allocations[kv].mapped
    manager.wake_up()
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 3 * PAGE
    assert bool((driver.read(weights) == 7).all())


class _CollectsOnTheKvThread(FakeVmmDriver):
    """A garbage collection on the KV cache's thread while it holds torch's
    frees: the collection drops a pool of ours that only a cycle kept (`kept`
    lets go of it there), and torch frees its cached segment on that same
    thread (on_free)."""

    def __init__(self):
        super().__init__()
        self.kept: list = []
        self.collected_on_kv_thread = False
        self.automatic_collection_on_kv_thread: list[bool] = []

    def unmap_and_release(self, device, size, address, handle):
        if threading.current_thread().name == KV_THREAD:
            self.automatic_collection_on_kv_thread.append(gc.isenabled())
            if not self.collected_on_kv_thread:
                self.collected_on_kv_thread = True
                self.kept.clear()
                gc.collect()
        super().unmap_and_release(device, size, address, handle)


def test_a_collection_that_frees_a_pool_of_ours_on_the_kv_cache_thread_does_not_hang_the_sleep():
    assert gc.isenabled()
    driver = _CollectsOnTheKvThread()
    manager = GraphSleepAllocator(driver)
    with manager.use_memory_pool("kv_cache"):
        kv = driver.malloc(2 * PAGE)
    pool = driver.memory_pool()
    with manager.allocation_tag("weights"):  # not the KV cache's thread's to release
        driver.route(pool)
        cached = driver.malloc(PAGE)
        driver.unroute(pool)
    driver.tensor_dies(cached)  # cached in that pool until the pool goes
    cycle: list = [pool]
    cycle.append(cycle)
    driver.kept.append(cycle)
    del pool, cycle
    sleeping = threading.Thread(
        target=lambda: manager.sleep(offload_tags=("cudagraph",), kv_cache_cleared=True),
        daemon=True,
    )
    with manager.kv_cache_released_ahead():
        sleeping.start()
        sleeping.join(timeout=10)
        assert not sleeping.is_alive(), "the sleep hung: on_free waited for its own thread"
    assert driver.collected_on_kv_thread
    # The interpreter started no collection of its own while the thread held
    # the frees: neither at the KV cache's release nor at the freed segment's.
    assert driver.automatic_collection_on_kv_thread == [False, False]
    assert gc.isenabled()
    assert cached not in manager.allocations and cached not in driver.memory
    assert kv not in driver.memory
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 0


def test_a_shutdown_asleep_after_a_level_2_sleep_gives_the_kept_host_buffers_back():
    """The buffers a level-2 sleep kept (for the next sleep to compare) hold
    no backup a wake needs: the engine sleeps no more."""
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    with manager.allocation_tag("weights"):
        weights = [driver.malloc(4 * PAGE) for _ in range(2)]
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    manager.sleep(offload_tags=())
    assert manager.host_bytes() == 8 * PAGE  # kept for the next sleep's comparison
    manager.release_pools()
    assert manager.host_bytes() == 0
    assert all(address in manager.allocations for address in weights)


def test_a_shutdown_asleep_after_a_level_1_sleep_keeps_the_backups_for_a_wake():
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    with manager.allocation_tag("weights"):
        weights = driver.malloc(4 * PAGE)
    driver.write(weights, 6)
    manager.sleep(offload_tags=("weights",))
    manager.release_pools()
    assert manager.host_bytes() == 4 * PAGE
    manager.wake_up()
    assert bool((driver.read(weights) == 6).all())


def test_with_host_memory_released_a_failed_sleeps_buffers_go_at_the_next_wake():
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver, release_host_memory=True)
    with manager.allocation_tag("weights"):
        weights = [driver.malloc(8 * PAGE) for _ in range(3)]
    driver.fail("unmap_and_release", after=1)  # the second release fails
    with pytest.raises(SleepError, match="mapped back from their host copies"):
        manager.sleep(offload_tags=("weights",))
    assert all(address in driver.memory for address in weights)
    manager.wake_up()  # vLLM's resume after the failed sleep: nothing is asleep
    assert manager.host_bytes() == 0


def test_a_weight_torch_frees_during_the_backup_is_left_out_of_the_release():
    """Its last tensor dies while the sleep backs up (a garbage cycle or
    another thread), and the backup's own cache release frees it: the sleep
    must neither count it backed up nor release it again."""
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    kept, doomed = _weights_with_one_to_die(driver, manager)
    fingerprint = driver.fingerprint

    def fingerprint_then_a_tensor_dies(ranges, out):
        fingerprint(ranges, out)
        driver.tensor_dies(doomed)

    driver.fingerprint = fingerprint_then_a_tensor_dies
    manager.sleep(offload_tags=("weights",))
    driver.fingerprint = fingerprint
    assert doomed not in manager.allocations and driver.unmap_calls.count(doomed) == 1
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 0
    manager.wake_up()
    assert bool((driver.read(kept) == 1).all())
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == PAGE


@pytest.mark.parametrize("failing", ["block", "backup"])
def test_a_kv_segment_torch_frees_after_its_release_ahead_is_not_mapped_back_by_the_undo(
    failing, caplog
):
    """A sleep that fails maps the KV cache's released records back: not one
    torch freed meanwhile (my_free deleted its allocation; mapping it again
    would read freed memory and map bytes no record owns)."""
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    with manager.use_memory_pool("weights"):
        weights = driver.malloc(PAGE)
    with manager.use_memory_pool("kv_cache"):
        kv = driver.malloc(4 * PAGE)
        doomed = driver.malloc(PAGE)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        with pytest.raises((RuntimeError, SleepError)):
            with manager.kv_cache_released_ahead():
                deadline = time.monotonic() + 5
                while doomed not in driver.unmap_calls and time.monotonic() < deadline:
                    time.sleep(0.001)  # the KV cache's thread releases it
                driver.free(doomed)  # torch frees it meanwhile: its tensor died
                if failing == "block":
                    raise RuntimeError("suspend failed")
                driver.fail("synchronize")
                manager.sleep(offload_tags=("weights",), kv_cache_cleared=True)
    assert "could not map" not in caplog.text
    assert doomed not in manager.allocations and doomed not in driver.memory
    assert kv in driver.memory and weights in driver.memory
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 5 * PAGE
