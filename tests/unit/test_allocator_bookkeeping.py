"""Manager bookkeeping on a faked VMM layer (CPU): tags, offload vs drop, double
sleep/wake, rollback of a failing wake, ROCm zeroing."""

import logging
import re
import threading
import time

import pytest

from tests.unit.fake_vmm import PAGE, STALE_BYTE, FakeVmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator, SleepError, WakeUpError

MIB = 1 << 20


def make(capacity=1 << 30, rocm=False, **kwargs):
    driver = FakeVmmDriver(capacity=capacity, rocm=rocm)
    return driver, GraphSleepAllocator(driver, **kwargs)


def allocate(driver, manager, tag, size=PAGE, value=None):
    with manager.allocation_tag(tag):
        address = driver.malloc(size)
    if value is not None:
        driver.write(address, value)
    return address


def _three_tags(**kwargs):
    driver, manager = make(**kwargs)
    weights = allocate(driver, manager, "weights", 4 * MIB, value=1)
    kv = allocate(driver, manager, "kv_cache", 8 * MIB, value=2)
    graph = allocate(driver, manager, "cudagraph", 2 * MIB, value=3)
    return driver, manager, {"weights": weights, "kv_cache": kv, "cudagraph": graph}


@pytest.fixture
def setup():
    return _three_tags()


def test_allocations_carry_the_tag_current_at_malloc(setup):
    driver, manager, addresses = setup
    assert {a: manager.allocations[a].tag for a in addresses.values()} == {
        addresses["weights"]: "weights",
        addresses["kv_cache"]: "kv_cache",
        addresses["cudagraph"]: "cudagraph",
    }
    assert manager.current_tag == "default"
    assert manager.get_current_usage() == 14 * MIB
    assert manager.usage_by_tag()["kv_cache"] == {"mapped": 8 * MIB, "backed_up": 0, "dropped": 0}


def test_sleep_backs_up_offloaded_tags_and_drops_the_rest(setup):
    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights", "cudagraph"))
    assert driver.mapped_bytes() == 0
    assert manager.mapped_bytes() == 0
    usage = manager.usage_by_tag()
    assert usage["weights"]["backed_up"] == 4 * MIB
    assert usage["cudagraph"]["backed_up"] == 2 * MIB
    assert usage["kv_cache"]["dropped"] == 8 * MIB
    assert manager.allocations[addresses["kv_cache"]].host is None

    manager.wake_up()
    assert driver.mapped_bytes() == 14 * MIB
    assert bool((driver.read(addresses["weights"]) == 1).all())
    assert bool((driver.read(addresses["cudagraph"]) == 3).all())
    # Dropped memory comes back with whatever the driver gives (CUDA: no zeroing).
    assert bool((driver.read(addresses["kv_cache"]) == STALE_BYTE).all())


def test_default_offload_tag_is_default():
    driver, manager = make()
    address = allocate(driver, manager, "default", value=7)
    manager.sleep()
    manager.wake_up()
    assert bool((driver.read(address) == 7).all())


def test_second_sleep_is_a_no_op_and_keeps_the_first_backup(setup):
    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights",))
    unmaps = list(driver.unmap_calls)
    # A second sleep at another "level" must neither unmap again nor drop the
    # weights backup taken by the first one.
    manager.sleep(offload_tags=())
    assert driver.unmap_calls == unmaps
    assert manager.usage_by_tag()["weights"]["backed_up"] == 4 * MIB
    manager.wake_up()
    assert bool((driver.read(addresses["weights"]) == 1).all())


def test_second_wake_is_a_no_op(setup):
    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    driver.write(addresses["weights"], 9)
    maps = list(driver.map_calls)
    manager.wake_up()
    manager.wake_up(["weights"])
    assert driver.map_calls == maps
    assert bool((driver.read(addresses["weights"]) == 9).all())


def test_any_wake_restores_the_graph_pool_first(setup):
    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights", "cudagraph"))
    driver.map_calls.clear()
    manager.wake_up(["kv_cache"])
    assert driver.map_calls == [addresses["cudagraph"], addresses["kv_cache"]]
    assert bool((driver.read(addresses["cudagraph"]) == 3).all())
    assert manager.usage_by_tag()["weights"] == {"mapped": 0, "backed_up": 4 * MIB, "dropped": 0}

    manager.wake_up(["weights"])
    assert bool((driver.read(addresses["weights"]) == 1).all())


def test_other_internal_tags_are_not_deferrable():
    driver, manager = make()
    runtime = allocate(driver, manager, "runtime", value=4)
    allocate(driver, manager, "weights", value=1)
    manager.sleep(offload_tags=("runtime",))
    manager.wake_up(["weights"])
    assert bool((driver.read(runtime) == 4).all())


def test_nested_pool_takes_over_routing_and_hands_it_back():
    driver, manager = make()
    with manager.use_memory_pool("runtime") as outer:
        before = driver.malloc(PAGE)
        with manager.use_memory_pool("kv_cache") as inner:
            kv = driver.malloc(PAGE)
        after = driver.malloc(PAGE)
    assert driver.routing == []
    assert (outer.segments, inner.segments) == ([before, after], [kv])
    assert [manager.allocations[a].tag for a in (before, kv, after)] == [
        "runtime",
        "kv_cache",
        "runtime",
    ]
    assert [(step, pool() is outer) for step, pool in driver.routing_log] == [
        ("route", True),
        ("unroute", True),
        ("route", False),
        ("unroute", False),
        ("route", True),
        ("unroute", True),
    ]


def test_failing_wake_rolls_back_and_can_be_retried():
    driver, manager = make(capacity=64 * MIB)
    graph = allocate(driver, manager, "cudagraph", 2 * MIB, value=3)
    weights = allocate(driver, manager, "weights", 8 * MIB, value=1)
    allocate(driver, manager, "kv_cache", 40 * MIB, value=2)
    manager.sleep(offload_tags=("weights", "cudagraph"))

    driver.occupied_elsewhere = 30 * MIB  # another process took memory meanwhile
    with pytest.raises(WakeUpError, match="cuMemCreate failed: out of memory") as raised:
        manager.wake_up()
    assert "retry" in str(raised.value)
    # The graph pool and weights were mapped before kv_cache failed: rolled back.
    assert driver.mapped_bytes() == 0
    assert manager.mapped_bytes() == 0
    usage = manager.usage_by_tag()
    assert usage["weights"]["backed_up"] == 8 * MIB
    assert usage["cudagraph"]["backed_up"] == 2 * MIB
    assert usage["kv_cache"]["dropped"] == 40 * MIB

    driver.occupied_elsewhere = 0
    manager.wake_up()
    assert driver.mapped_bytes() == 50 * MIB
    assert bool((driver.read(weights) == 1).all())
    assert bool((driver.read(graph) == 3).all())


def _fail_first_restore(monkeypatch, error):
    """The wake's first restore of a backup raises `error`, once the memory
    is mapped and before its copies are queued."""
    from vllm_graph_sleep.memory.backups import Backups

    pairs, calls = Backups.pairs, []

    def failing(self, allocation):
        calls.append(allocation.address)
        if len(calls) == 1:
            raise error
        return pairs(self, allocation)

    monkeypatch.setattr(Backups, "pairs", failing)


def test_an_interrupted_wake_is_rolled_back_and_a_retry_restores_the_weights(monkeypatch):
    """Ctrl-C in a wake (an in-process engine): what it mapped goes back to
    sleep with its backup, so that a retry restores it; it stayed mapped and
    recorded awake, and the retry had nothing to wake and left stale bytes."""
    driver, manager = make()
    first = allocate(driver, manager, "weights", value=1)
    second = allocate(driver, manager, "weights", value=2)
    manager.sleep(offload_tags=("weights",))
    _fail_first_restore(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        manager.wake_up()
    assert driver.mapped_bytes() == manager.mapped_bytes() == 0
    manager.wake_up()
    assert bool((driver.read(first) == 1).all()) and bool((driver.read(second) == 2).all())


def test_a_wake_rolled_back_around_memory_it_cannot_unmap_copies_its_backup_into_it(monkeypatch):
    """The restore fails (out of memory for the coded restore's staging),
    then the rollback cannot unmap the allocation it mapped first: that one
    stays awake, and must hold its backup (the retry passes it over, and the
    next sleep would copy what it held over the backup)."""
    import torch

    driver, manager = make()
    first = allocate(driver, manager, "weights", value=1)
    second = allocate(driver, manager, "weights", value=2)
    manager.sleep(offload_tags=("weights",))
    _fail_first_restore(monkeypatch, torch.OutOfMemoryError("CUDA out of memory"))
    stuck = manager.table.to_wake(None)[0].address
    driver.fail("unmap_and_release", address=stuck)
    with pytest.raises(WakeUpError):
        manager.wake_up()
    assert manager.allocations[stuck].mapped and not manager.allocations[stuck].has_backup
    manager.wake_up()
    assert bool((driver.read(first) == 1).all()) and bool((driver.read(second) == 2).all())
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert bool((driver.read(first) == 1).all()) and bool((driver.read(second) == 2).all())


def test_a_wake_that_fails_after_queuing_copies_waits_for_them_before_unmapping(monkeypatch):
    driver, manager = make()
    allocate(driver, manager, "cudagraph", 2 * MIB, value=3)
    weights = allocate(driver, manager, "weights", 8 * MIB, value=1)
    manager.sleep(offload_tags=("weights", "cudagraph"))
    order = []
    for call in ("synchronize", "unmap_and_release"):
        monkeypatch.setattr(driver, call, _recorded(order, call, getattr(driver, call)))
    driver.failures["synchronize"] = 0  # the wait at the end of the copies fails
    with pytest.raises(WakeUpError, match="illegal memory access"):
        manager.wake_up()
    # The copies were queued; the rollback waits for them, then unmaps.
    assert order[:3] == ["synchronize", "synchronize", "unmap_and_release"]
    assert driver.mapped_bytes() == 0
    manager.wake_up()
    assert bool((driver.read(weights) == 1).all())


def test_a_wake_queues_each_backups_copies_before_mapping_the_next(monkeypatch):
    # The copies of one allocation (or of the weights' run) run while the next
    # one maps: a wake of a large model does not pay for all of its mappings
    # before the first copy.
    driver, manager = make()
    kv = allocate(driver, manager, "kv_cache", 8 * MIB, value=2)
    first = allocate(driver, manager, "weights", 4 * MIB, value=1)
    second = allocate(driver, manager, "weights", 4 * MIB, value=5)
    graph = allocate(driver, manager, "cudagraph", 2 * MIB, value=3)
    manager.sleep(offload_tags=("weights", "cudagraph"))
    values = {graph: 3, first: 1, second: 5}
    seen = []
    map_one, map_run = driver.create_and_map, driver.create_and_map_run

    def restored():
        return [a for a, v in values.items() if a in driver.memory and (driver.read(a) == v).all()]

    def mapping(device, size, address, handle):
        seen.append((address, restored()))
        map_one(device, size, address, handle)

    def mapping_run(device, members):
        seen.append((tuple(address for _, address, _ in members), restored()))
        map_run(device, members)

    monkeypatch.setattr(driver, "create_and_map", mapping)
    monkeypatch.setattr(driver, "create_and_map_run", mapping_run)
    manager.wake_up()
    # Those with a backup first (the graph pool before the weights' run), each
    # restored by the time the next maps; the kv cache, without one, last.
    assert seen == [
        (graph, []),
        ((first, second), [graph]),
        (kv, [graph, first, second]),
    ]


def test_a_wake_that_fails_mapping_after_copies_were_queued_waits_before_unmapping(monkeypatch):
    driver, manager = make(capacity=32 * MIB)
    weights = allocate(driver, manager, "weights", 8 * MIB, value=1)
    allocate(driver, manager, "kv_cache", 16 * MIB, value=2)
    manager.sleep(offload_tags=("weights",))
    order = []
    for call in ("create_and_map", "synchronize", "unmap_and_release"):
        monkeypatch.setattr(driver, call, _recorded(order, call, getattr(driver, call)))
    driver.occupied_elsewhere = 16 * MIB
    with pytest.raises(WakeUpError, match="cuMemCreate failed: out of memory"):
        manager.wake_up()
    # The weights' copy was queued when the kv cache failed to map.
    assert order == ["create_and_map", "create_and_map", "synchronize", "unmap_and_release"]
    assert driver.mapped_bytes() == 0
    assert manager.usage_by_tag()["weights"]["backed_up"] == 8 * MIB
    driver.occupied_elsewhere = 0
    manager.wake_up()
    assert bool((driver.read(weights) == 1).all())


def test_a_sleep_that_fails_after_queuing_copies_waits_for_them(setup, monkeypatch):
    from vllm_graph_sleep.allocator import SleepError

    driver, manager, addresses = setup
    order = []
    for call in ("synchronize", "host_buffer"):
        monkeypatch.setattr(driver, call, _recorded(order, call, getattr(driver, call)))
    driver.fail("host_buffer", after=1)  # the weights' copy is queued, the graph's buffer refused
    with pytest.raises(SleepError, match="the engine is awake"):
        manager.sleep(offload_tags=("weights", "cudagraph"))
    # Nothing else waits for that copy: a later sleep that drops the weights
    # instead, or shutdown, unregisters its buffer without waiting.
    assert order == ["synchronize", "host_buffer", "host_buffer", "synchronize"]


def _recorded(order, name, call):
    def recording(*args):
        order.append(name)
        return call(*args)

    return recording


def test_failure_on_first_map_changes_nothing():
    driver, manager = make(capacity=16 * MIB)
    weights = allocate(driver, manager, "weights", 8 * MIB, value=1)
    manager.sleep(offload_tags=("weights",))
    driver.occupied_elsewhere = 12 * MIB
    with pytest.raises(WakeUpError):
        manager.wake_up(["weights"])
    assert weights not in driver.memory
    assert manager.usage_by_tag()["weights"] == {"mapped": 0, "backed_up": 8 * MIB, "dropped": 0}
    driver.occupied_elsewhere = 0
    manager.wake_up(["weights"])
    assert bool((driver.read(weights) == 1).all())


@pytest.mark.parametrize("rocm", [True, False])
def test_zeroing_only_of_allocations_without_a_backup(rocm):
    driver, manager = make(rocm=rocm)
    weights = allocate(driver, manager, "weights", value=1)
    kv = allocate(driver, manager, "kv_cache", value=2)
    manager.sleep(offload_tags=("weights",))
    syncs = driver.sync_calls
    manager.wake_up()
    assert bool((driver.read(weights) == 1).all())
    expected_kv = 0 if rocm else STALE_BYTE
    assert bool((driver.read(kv) == expected_kv).all())
    assert driver.sync_calls > syncs  # synchronized before wake returned


def test_zeroing_can_be_forced_on_cuda_and_turned_off_on_rocm(monkeypatch):
    driver, manager = make(rocm=False, zero_on_wake=True)
    kv = allocate(driver, manager, "kv_cache", value=2)
    manager.sleep(offload_tags=())
    manager.wake_up()
    assert bool((driver.read(kv) == 0).all())

    monkeypatch.setenv("VLLM_GRAPH_SLEEP_ZERO_ON_WAKE", "0")
    driver, manager = make(rocm=True)
    assert manager.zero_on_wake is False


def test_zero_on_wake_and_backup_coding_switched_on_a_running_allocator():
    """The GPU tests switch zeroing and coding on the process's allocator."""
    driver, manager = make(zero_on_wake=False, compress_backups=False)
    kv = allocate(driver, manager, "kv_cache", value=2)
    manager.sleep(offload_tags=())
    manager.wake_up()
    assert bool((driver.read(kv) == STALE_BYTE).all())
    manager.zero_on_wake = True
    manager.sleep(offload_tags=())
    manager.wake_up()
    assert manager.zero_on_wake is True and bool((driver.read(kv) == 0).all())
    manager.compress_backups = True
    assert manager.compress_backups is True


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.sleep(offload_tags=("weigths",)),
        lambda m: m.wake_up(["kv-cache"]),
        lambda m: m.wake_up([3]),
        lambda m: m.discard("bogus"),
    ],
    ids=["sleep-typo", "wake-typo", "wake-not-a-string", "discard-unknown"],
)
def test_unknown_tags_are_rejected_before_anything_changes(setup, call):
    driver, manager, _ = setup
    before = (list(driver.map_calls), list(driver.unmap_calls), manager.usage_by_tag())
    with pytest.raises(ValueError, match="unknown memory tag"):
        call(manager)
    assert (driver.map_calls, driver.unmap_calls, manager.usage_by_tag()) == before


def test_discard_frees_only_the_named_tags(setup):
    driver, manager, addresses = setup
    assert manager.discard("kv_cache") == 8 * MIB
    assert addresses["kv_cache"] not in driver.memory
    assert bool((driver.read(addresses["weights"]) == 1).all())
    manager.wake_up(["kv_cache"])
    assert addresses["kv_cache"] in driver.memory


def test_discard_of_a_sleeping_tag_drops_its_backup(setup):
    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights",))
    manager.discard(["weights"])
    assert manager.usage_by_tag()["weights"]["dropped"] == 4 * MIB
    manager.wake_up()
    assert bool((driver.read(addresses["weights"]) == STALE_BYTE).all())


def test_free_while_asleep_does_not_unmap_twice(setup):
    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights",))
    unmaps = len(driver.unmap_calls)
    driver.free(addresses["weights"])
    assert len(driver.unmap_calls) == unmaps
    assert addresses["weights"] not in manager.allocations
    driver.free(addresses["kv_cache"])
    manager.wake_up()
    assert manager.get_current_usage() == 2 * MIB


def test_host_buffers_are_reused_unless_released(setup, monkeypatch):
    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights",))
    host = manager.allocations[addresses["weights"]].host
    manager.wake_up()
    manager.sleep(offload_tags=("weights",))
    assert manager.allocations[addresses["weights"]].host is host
    manager.wake_up()

    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY", "1")
    driver, manager = make()
    allocate(driver, manager, "weights", value=1)
    manager.sleep(offload_tags=("weights",))
    assert manager.host_bytes() == PAGE
    manager.wake_up()
    assert manager.host_bytes() == 0


def test_sleep_and_wake_each_log_one_info_line_with_bytes_per_tag(setup, caplog):
    driver, manager, _ = setup
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights", "cudagraph"))
        manager.wake_up(["kv_cache"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "backed up cudagraph 2.00 MiB, weights 4.00 MiB" in lines[0]
    assert "dropped kv_cache 8.00 MiB" in lines[0]
    assert "restored from host cudagraph 2.00 MiB" in lines[1]
    assert "remapped without backup kv_cache 8.00 MiB" in lines[1]
    assert "still asleep weights 4.00 MiB" in lines[1]
    # Each line ends with its time and where it went, phase by phase.
    ms = r"\d+\.\d ms"
    assert re.search(
        rf"\d\.\d{{3}} s \(freed allocations' host buffers {ms}, graph pool claimed {ms}, "
        rf"cuBLAS workspaces {ms}, garbage {ms}, torch's cache {ms}, backup of 2 allocations: "
        rf"waiting for the device {ms}, host buffers {ms}, fingerprints queued {ms}, "
        rf"fingerprints {ms}, plan and raw copies queued {ms}, copies {ms}, backup's scratch "
        rf"freed {ms}, release \(3 allocations\) {ms}, stack limit {ms}, "
        rf"host buffers given back {ms}\)$",
        lines[0],
    ), lines[0]
    assert re.search(
        rf"\d\.\d{{3}} s \(settle thread stopped {ms}, torch's cache {ms}, stack limit {ms}, "
        rf"mapping \(2 allocations\) with copies queued {ms}, copies {ms}, host buffers given back "
        rf"{ms}\)$",
        lines[1],
    ), lines[1]


def test_everything_in_the_graph_pool_is_claimed_as_graph_memory_at_sleep():
    driver, manager = make()
    with manager.cudagraph_pool() as pool:
        captured = driver.malloc(PAGE)
    lazily_captured = allocate(driver, manager, "default", value=6)  # tag was not cudagraph
    pool.segments += [captured, lazily_captured]
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.allocations[lazily_captured].tag == "cudagraph"
    assert manager.usage_by_tag()["cudagraph"]["backed_up"] == 2 * PAGE
    manager.wake_up(["kv_cache"])
    assert bool((driver.read(lazily_captured) == 6).all())


def test_a_pool_hands_back_free_segments_when_its_context_exits():
    driver, manager = make()
    with manager.use_memory_pool("weights"):
        kept = driver.malloc(PAGE)
        driver.write(kept, 7)
        scratch = driver.malloc(4 * PAGE)  # e.g. bf16 weights before online FP8 quantization
        driver.tensor_dies(scratch)
    assert scratch not in driver.memory and scratch not in manager.allocations
    assert manager.mapped_bytes() == PAGE
    assert manager.pool_ids() == set()

    manager.sleep(offload_tags=("weights",))
    assert manager.host_bytes() == PAGE  # only the live weights were copied
    manager.wake_up()
    assert bool((driver.read(kept) == 7).all())


def test_memory_freed_after_the_context_is_released_before_sleep_backs_it_up():
    driver, manager = make()
    with manager.use_memory_pool("weights"):
        repacked = driver.malloc(PAGE)
        original = driver.malloc(2 * PAGE)
    driver.tensor_dies(original)  # freed later, e.g. when MoE weights were repacked
    assert original in manager.allocations  # cached by torch until an empty_cache
    manager.sleep(offload_tags=("weights",))
    assert original not in manager.allocations
    assert manager.usage_by_tag()["weights"]["backed_up"] == PAGE
    assert repacked in manager.allocations


def test_a_pool_exit_empties_the_cache_without_a_garbage_collection_and_a_sleep_with_one():
    """At start-up a full collection costs an engine about 0.2 s per pool exit
    (issue 16); a sleep, where garbage cycles may hold what it would back up,
    still collects first."""
    driver, manager = make()
    with manager.use_memory_pool("weights"):
        driver.malloc(PAGE)
    assert driver.cache_calls == ["empty"]
    manager.sleep(offload_tags=("weights",))
    # Then, without one, for the device copy of the backup's fingerprints.
    assert driver.cache_calls == ["empty", "collect", "empty", "empty"]


def test_inner_pool_exit_leaves_the_outer_pool_and_its_memory_alone():
    driver, manager = make()
    with manager.use_memory_pool("runtime") as outer:
        state = driver.malloc(PAGE)
        with manager.use_memory_pool("kv_cache"):
            kv = driver.malloc(PAGE)
        after = driver.malloc(PAGE)
        assert manager.pool_ids() == {outer.id}
    assert {state, kv, after} <= manager.allocations.keys()
    assert driver.mapped_bytes() == 3 * PAGE


def _state(manager):
    return {a: (x.mapped, x.has_backup) for a, x in manager.allocations.items()}


@pytest.mark.parametrize(
    ("call", "after"),
    [
        ("synchronize", 0),  # before the copies
        ("synchronize", 1),  # waiting for the copies
        ("host_buffer", 0),
        ("host_buffer", 1),  # the second backup
        ("unmap_and_release", 0),  # first backed-up allocation
        ("unmap_and_release", 1),  # second: the first is mapped back from host
    ],
)
def test_a_sleep_that_fails_before_dropping_anything_leaves_the_engine_awake(setup, call, after):
    from vllm_graph_sleep.allocator import SleepError

    driver, manager, addresses = setup
    awake = _state(manager)
    driver.fail(call, after)
    with pytest.raises(SleepError, match="the engine is awake") as raised:
        manager.sleep(offload_tags=("weights", "cudagraph"))
    # vLLM paused scheduling before the sleep and resumes it only on a wake.
    assert "keeps scheduling paused until POST /wake_up" in str(raised.value)
    assert _state(manager) == awake
    assert driver.mapped_bytes() == 14 * MIB
    for tag, value in (("weights", 1), ("kv_cache", 2), ("cudagraph", 3)):
        assert bool((driver.read(addresses[tag]) == value).all()), tag
    # Nothing is left half done: the next sleep and wake work.
    manager.sleep(offload_tags=("weights", "cudagraph"))
    manager.wake_up()
    assert bool((driver.read(addresses["weights"]) == 1).all())


class _KvReleaseWaitsForTheWeights(FakeVmmDriver):
    """Gives back the KV cache only once the weights have gone: a sleep that
    released the KV cache before backing up and releasing the rest on the
    same thread would wait here until the timeout, and the release fail."""

    def __init__(self):
        super().__init__()
        self.kv_cache = self.weights = None
        self.weights_gone = threading.Event()
        self.before_kv_release = None  # the timeline when the KV cache's release began

    def unmap_and_release(self, device, size, address, handle):
        if address == self.kv_cache:
            self.before_kv_release = list(self.timeline)
        if address == self.kv_cache and not self.weights_gone.wait(timeout=10):
            raise RuntimeError("cuMemUnmap failed: the weights never went (test timeout)")
        super().unmap_and_release(device, size, address, handle)
        if address == self.weights:
            self.weights_gone.set()


@pytest.mark.parametrize("keep_unchanged", [True, False])
def test_a_cleared_kv_cache_is_released_on_a_thread_while_the_rest_is_backed_up(
    caplog, keep_unchanged
):
    driver = _KvReleaseWaitsForTheWeights()
    manager = GraphSleepAllocator(driver, keep_unchanged_backups=keep_unchanged)
    driver.weights = allocate(driver, manager, "weights", 4 * MIB, value=1)
    driver.kv_cache = allocate(driver, manager, "kv_cache", 8 * MIB, value=2)
    graph = allocate(driver, manager, "cudagraph", 2 * MIB, value=3)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights", "cudagraph"), kv_cache_cleared=True)
    assert "could not release" not in caplog.text
    assert driver.unmap_threads == {
        driver.weights: "MainThread",
        graph: "MainThread",
        driver.kv_cache: "graph-sleep-kv-release",
    }
    # The weights went first (the gate), and the sleep waited for the KV cache.
    kv_gone = driver.timeline.index(("unmapped", driver.kv_cache))
    assert kv_gone > driver.timeline.index(("unmapped", driver.weights))
    if keep_unchanged:
        # Started once the fingerprints were queued: the driver would make
        # the queueing's allocation and copy wait for the release.
        assert ("fingerprinted", 6 * MIB) in driver.before_kv_release
    assert manager.mapped_bytes() == 0
    assert "waiting for the kv_cache's release on its thread (1 allocations" in caplog.text
    assert "dropped kv_cache 8.00 MiB" in caplog.text
    manager.wake_up()
    for address, value in ((driver.weights, 1), (graph, 3)):
        assert bool((driver.read(address) == value).all())


@pytest.mark.parametrize("call", ["synchronize", "unmap_and_release"])
def test_a_failed_sleep_brings_a_cleared_kv_cache_back_empty_and_loses_nothing_else(setup, call):
    from vllm_graph_sleep.allocator import SleepError

    driver, manager, addresses = setup
    awake = _state(manager)
    # Waiting for the copies (the backup fails), or releasing the weights (the
    # release fails), while or after the KV cache goes on its thread.
    if call == "synchronize":
        driver.fail(call, after=1)
    else:
        driver.fail(call, address=addresses["weights"])
    with pytest.raises(SleepError, match="came back without its contents") as raised:
        manager.sleep(offload_tags=("weights", "cudagraph"), kv_cache_cleared=True)
    assert "the engine is awake" in str(raised.value)
    assert _state(manager) == awake
    assert driver.mapped_bytes() == 14 * MIB
    for tag, value in (("weights", 1), ("cudagraph", 3)):
        assert bool((driver.read(addresses[tag]) == value).all()), tag
    manager.sleep(offload_tags=("weights", "cudagraph"), kv_cache_cleared=True)
    manager.wake_up()
    assert bool((driver.read(addresses["weights"]) == 1).all())


def test_a_cleared_kv_cache_the_driver_keeps_stays_mapped_and_the_sleep_finishes(setup, caplog):
    driver, manager, addresses = setup
    driver.fail("unmap_and_release", address=addresses["kv_cache"])
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights", "cudagraph"), kv_cache_cleared=True)
    assert "could not release kv_cache 8.00 MiB" in caplog.text
    assert "waiting for the kv_cache's release on its thread (0 allocations" in caplog.text
    assert manager.mapped_bytes() == 8 * MIB
    manager.wake_up()
    assert driver.mapped_bytes() == 14 * MIB
    for tag, value in (("weights", 1), ("kv_cache", 2), ("cudagraph", 3)):
        assert bool((driver.read(addresses[tag]) == value).all()), tag


class _SlowKvReleaseAndFailingLastCall(FakeVmmDriver):
    """The KV cache takes 0.2 s to give back, and the sleep's last driver
    call (giving back the replaced host buffers) raises."""

    def __init__(self):
        super().__init__()
        self.kv_cache = None
        self.host_buffer_releases = 0

    def unmap_and_release(self, device, size, address, handle):
        if address == self.kv_cache:
            time.sleep(0.2)
        super().unmap_and_release(device, size, address, handle)

    def release_dropped_host_buffers(self):
        self.host_buffer_releases += 1
        if self.host_buffer_releases == 2:
            raise RuntimeError("cudaHostUnregister failed: invalid argument")


def test_a_sleep_that_raises_late_still_waits_for_the_kv_cache_thread():
    driver = _SlowKvReleaseAndFailingLastCall()
    manager = GraphSleepAllocator(driver)
    allocate(driver, manager, "weights", 4 * MIB, value=1)
    driver.kv_cache = allocate(driver, manager, "kv_cache", 8 * MIB, value=2)
    with pytest.raises(RuntimeError, match="cudaHostUnregister failed"):
        manager.sleep(offload_tags=("weights",), kv_cache_cleared=True)
    # The thread was joined before the error left: its records are settled.
    assert "graph-sleep-kv-release" not in {thread.name for thread in threading.enumerate()}
    assert not manager.allocations[driver.kv_cache].mapped
    assert driver.kv_cache not in driver.memory


class _StickyErrorAtARelease(FakeVmmDriver):
    """Releasing `broken_at` fails with a sticky error: every later wait for
    the device fails too, as after an illegal memory access. The KV cache
    takes 0.2 s to give back."""

    def __init__(self):
        super().__init__()
        self.kv_cache = self.broken_at = None
        self.broken = False

    def unmap_and_release(self, device, size, address, handle):
        if address == self.kv_cache:
            time.sleep(0.2)
        if address == self.broken_at:
            self.broken = True
            raise RuntimeError("cuMemUnmap failed: an illegal memory access was encountered")
        super().unmap_and_release(device, size, address, handle)

    def synchronize(self, device):
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().synchronize(device)


def test_a_release_that_fails_and_breaks_the_device_still_ends_in_a_sleep_error():
    driver = _StickyErrorAtARelease()
    manager = GraphSleepAllocator(driver)
    first = allocate(driver, manager, "weights", 4 * MIB, value=1)
    driver.broken_at = allocate(driver, manager, "weights", 4 * MIB, value=11)
    driver.kv_cache = allocate(driver, manager, "kv_cache", 8 * MIB, value=2)
    with pytest.raises(SleepError, match="the engine is awake") as raised:
        manager.sleep(offload_tags=("weights",), kv_cache_cleared=True)
    message = str(raised.value)
    assert "cuMemUnmap failed" in message and "is not certain" in message
    # The thread was joined before the error left, and every record says
    # what the driver holds: mapped, and awake (no backup a wake would trust).
    assert "graph-sleep-kv-release" not in {thread.name for thread in threading.enumerate()}
    for address in (first, driver.broken_at, driver.kv_cache):
        record = manager.allocations[address]
        assert record.mapped and not record.has_backup and address in driver.memory


def test_the_backend_releases_the_kv_cache_on_a_thread_of_its_own(install_allocator):
    from vllm_graph_sleep.backend import GraphSleepBackend

    driver, manager = make()
    install_allocator(manager)
    weights = allocate(driver, manager, "weights", value=1)
    kv = allocate(driver, manager, "kv_cache", value=2)
    GraphSleepBackend().suspend(level=1)
    assert driver.unmap_threads == {weights: "MainThread", kv: "graph-sleep-kv-release"}


def test_a_level_2_sleep_releases_the_kv_cache_ahead_and_the_rest_after_it(
    install_allocator, caplog
):
    from vllm_graph_sleep.backend import GraphSleepBackend

    driver, manager = make()
    install_allocator(manager)
    weights = allocate(driver, manager, "weights", value=1)
    kv = allocate(driver, manager, "kv_cache", value=2)
    graph = allocate(driver, manager, "cudagraph", value=3)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        GraphSleepBackend().suspend(level=2)
    # Started before the sleep's own work, which releases the rest on its
    # own thread once the KV cache has gone (the driver serialises the two).
    assert driver.unmap_threads == {
        weights: "MainThread",
        kv: "graph-sleep-kv-release",
        graph: "MainThread",
    }
    unmapped = [address for event, address in driver.timeline if event == "unmapped"]
    assert unmapped[0] == kv
    assert "release on its thread, started ahead (1 allocations" in caplog.text
    assert "dropped kv_cache" in caplog.text and manager.mapped_bytes() == 0
    GraphSleepBackend().resume()
    assert bool((driver.read(graph) == 3).all())
    # The next level-1 sleep backs the weights up and starts the thread itself.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        GraphSleepBackend().suspend(level=1)
    assert driver.unmap_threads[kv] == "graph-sleep-kv-release"
    assert "started ahead" not in caplog.text


def test_a_drop_that_fails_finishes_the_sleep_and_wake_restores_everything(setup, caplog):
    driver, manager, addresses = setup
    driver.fail("unmap_and_release", after=2)  # weights, cudagraph released; kv_cache fails
    with caplog.at_level(logging.ERROR, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights", "cudagraph"))
    assert "could not release kv_cache 8.00 MiB" in caplog.text
    assert manager.mapped_bytes() == 8 * MIB  # the KV cache stayed mapped
    manager.wake_up()
    assert driver.mapped_bytes() == 14 * MIB
    for tag, value in (("weights", 1), ("kv_cache", 2), ("cudagraph", 3)):
        assert bool((driver.read(addresses[tag]) == value).all()), tag


def test_graph_memory_made_under_a_dropped_tag_is_backed_up_by_the_backend(install_allocator):
    from vllm_graph_sleep.backend import GraphSleepBackend

    driver, manager = make()
    install_allocator(manager)
    weights = allocate(driver, manager, "weights", value=1)
    with manager.cudagraph_pool() as pool:
        pass
    lazily_captured = allocate(driver, manager, "kv_cache", value=6)  # only tag in its pool
    pool.segments.append(lazily_captured)
    backend = GraphSleepBackend()
    backend.suspend(level=2)
    assert manager.usage_by_tag()["cudagraph"]["backed_up"] == PAGE
    backend.resume(["kv_cache"])
    assert bool((driver.read(lazily_captured) == 6).all())
    assert weights not in driver.memory and backend.state() == "SUSPENDED"


def test_sleep_lowers_the_stack_limit_and_the_first_wake_restores_it(setup):
    from tests.unit.fake_vmm import DEFAULT_STACK

    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights", "cudagraph"))
    assert driver.stack_limits == {0: 0}
    manager.sleep(offload_tags=("weights", "cudagraph"))  # a repeat keeps what to restore
    manager.wake_up(["weights"])  # staged: the first stage already restores it
    assert driver.stack_limits == {0: DEFAULT_STACK}
    manager.wake_up(["kv_cache"])
    assert driver.stack_limits == {0: DEFAULT_STACK}


def test_a_wake_whose_stack_restore_fails_changes_nothing_and_can_be_retried(setup):
    from tests.unit.fake_vmm import DEFAULT_STACK

    driver, manager, addresses = setup
    manager.sleep(offload_tags=("weights", "cudagraph"))
    driver.fail("set_stack_limit")
    with pytest.raises(WakeUpError, match="stack limit: cuCtxSetLimit failed"):
        manager.wake_up()
    assert driver.mapped_bytes() == 0 and driver.stack_limits == {0: 0}
    manager.wake_up()
    assert driver.stack_limits == {0: DEFAULT_STACK}
    assert bool((driver.read(addresses["weights"]) == 1).all())


def test_a_wake_that_fails_to_map_lowers_the_stack_again():
    from tests.unit.fake_vmm import DEFAULT_STACK

    driver, manager = make(capacity=16 * MIB)
    allocate(driver, manager, "weights", 8 * MIB, value=1)
    manager.sleep(offload_tags=("weights",))
    driver.occupied_elsewhere = 12 * MIB
    with pytest.raises(WakeUpError):
        manager.wake_up()
    assert driver.stack_limits == {0: 0}  # asleep again, reservation released again
    driver.occupied_elsewhere = 0
    manager.wake_up()
    assert driver.stack_limits == {0: DEFAULT_STACK}


def test_a_device_that_refuses_to_lower_the_stack_still_sleeps(setup, caplog):
    driver, manager, addresses = setup
    driver.fail("set_stack_limit")
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights", "cudagraph"))
    assert "device 0 keeps its stack reservation" in caplog.text
    assert driver.mapped_bytes() == 0
    manager.wake_up()
    assert driver.mapped_bytes() == 14 * MIB and 0 not in driver.stack_limits


def test_the_stack_is_left_alone_when_switched_off(monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_STACK", "0")
    driver, manager = make()
    allocate(driver, manager, "weights", value=1)
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert driver.stack_limits == {}


@pytest.mark.parametrize("value", ["off", " No ", "FALSE", "0"])
def test_a_switch_reads_every_spelling_of_no(monkeypatch, value):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_STACK", value)
    assert make()[1].release_stack is False


@pytest.mark.parametrize("value", ["on", " Yes ", "TRUE", "1"])
def test_a_switch_reads_every_spelling_of_yes(monkeypatch, value):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY", value)
    assert make()[1].release_host_memory is True


@pytest.mark.parametrize("value", ["ture", "2", "keep"])
def test_a_switch_with_a_value_that_is_neither_yes_nor_no_is_refused(monkeypatch, value):
    # A typo must not silently pick a side (here: keep 264 MiB resident while asleep).
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_STACK", value)
    with pytest.raises(
        ValueError, match=f"VLLM_GRAPH_SLEEP_RELEASE_STACK='{value}' is not a yes/no"
    ):
        make()
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_STACK", "")
    assert make()[1].release_stack is True  # empty: the default


def test_memory_a_refused_free_left_is_counted_and_the_next_sleep_gives_it_back(caplog):
    # torch frees an allocation and the driver refuses to unmap it: the
    # extension keeps it (the record is gone). It counts as mapped, a sleep
    # whose retry is refused too says so, and the sleep after gives it back.
    driver, manager = make()
    weights = allocate(driver, manager, "weights", 4 * MIB, value=1)
    scratch = allocate(driver, manager, "kv_cache", 8 * MIB)
    driver.fail("unmap_and_release", address=scratch)
    driver.free(scratch)
    assert scratch not in manager.allocations
    assert manager.all_mapped_bytes() == driver.used_bytes() == 12 * MIB
    driver.fail("retry_refused_frees")
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights",))
    assert "8.00 MiB that frees the driver refused left on the device is still held" in caplog.text
    assert manager.all_mapped_bytes() == driver.used_bytes() == 8 * MIB
    manager.wake_up()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights",))
    assert "gave back 8.00 MiB that frees the driver had refused" in caplog.text
    assert "refused frees tried again" in caplog.text
    assert manager.all_mapped_bytes() == driver.used_bytes() == 0
    manager.wake_up()
    assert bool((driver.read(weights) == 1).all())
