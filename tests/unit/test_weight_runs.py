"""A wake maps each run of neighbouring weight allocations with one physical
allocation and one mapping (memory/mapping.py), so that a sleep gives it back
with one release (issue 38): on the faked VMM layer, which keeps a run's
memory until its last member is out of use, as the extension does."""

import logging

import pytest

from tests.unit.fake_vmm import FakeVmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator, SleepError, WakeUpError
from vllm_graph_sleep.patches.v1_worker_gpu_worker import orphan_leftovers

MIB = 1 << 20


def allocate(driver, manager, tag, mib):
    with manager.allocation_tag(tag):
        return driver.malloc(mib * MIB)


def weights_and_kv(capacity=1 << 30, rocm=False, sizes=(4, 8, 2)):
    driver = FakeVmmDriver(capacity=capacity, rocm=rocm)
    manager = GraphSleepAllocator(driver)
    weights = {
        allocate(driver, manager, "weights", size): value for value, size in enumerate(sizes, 1)
    }
    kv = allocate(driver, manager, "kv_cache", 8)
    for address, value in weights.items():
        driver.write(address, value)
    return driver, manager, weights, kv


def exact(driver, weights):
    return all(bool((driver.read(a) == v).all()) for a, v in weights.items())


def test_a_wake_maps_neighbouring_weights_as_one_run_and_a_sleep_gives_it_all_back():
    driver, manager, weights, kv = weights_and_kv()
    manager.sleep(offload_tags=("weights",))
    assert driver.run_calls == []  # allocated one by one, by torch
    for cycle in range(3):
        manager.wake_up()
        assert driver.run_calls[-1] == list(weights), cycle
        assert kv not in driver.run_of  # the KV cache maps on its own
        assert exact(driver, weights)
        assert manager.all_mapped_bytes() == driver.used_bytes() == 22 * MIB
        manager.sleep(offload_tags=("weights",))
        assert driver.used_bytes() == 0 and manager.all_mapped_bytes() == 0
        assert not driver.run_of
    assert len(driver.run_calls) == 3


def test_weights_apart_make_separate_runs():
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    first = [allocate(driver, manager, "weights", 2) for _ in range(2)]
    allocate(driver, manager, "kv_cache", 4)
    second = [allocate(driver, manager, "weights", 2) for _ in range(3)]
    alone = [allocate(driver, manager, "runtime", 2), allocate(driver, manager, "weights", 2)]
    manager.sleep(offload_tags=("weights", "runtime"))
    manager.wake_up()
    assert sorted(driver.run_calls) == sorted([first, second])
    assert alone[1] not in driver.run_of


def test_on_rocm_every_weight_maps_on_its_own():
    driver, manager, weights, _ = weights_and_kv(rocm=True)
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert driver.run_calls == [] and not driver.run_of
    assert exact(driver, weights)


def test_a_refused_run_maps_one_by_one_and_is_not_asked_for_again(caplog):
    driver, manager, weights, _ = weights_and_kv()
    manager.sleep(offload_tags=("weights",))
    driver.fail("create_and_map_run")
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        manager.wake_up()
    assert "one at a time from now on" in caplog.text
    assert exact(driver, weights) and not driver.run_of
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert driver.run_calls == [] and exact(driver, weights)


def test_a_run_refused_for_memory_fails_the_wake_cleanly_and_the_retry_maps_a_run():
    driver, manager, weights, _ = weights_and_kv(capacity=32 * MIB)
    manager.sleep(offload_tags=("weights",))
    driver.occupied_elsewhere = 20 * MIB  # no room for the weights' 14 MiB
    with pytest.raises(WakeUpError, match="out of memory"):
        manager.wake_up()
    assert driver.used_bytes() == 20 * MIB  # nothing of ours mapped
    driver.occupied_elsewhere = 0
    manager.wake_up()
    assert driver.run_calls == [list(weights)] and exact(driver, weights)


def test_a_wake_that_fails_after_its_run_gives_the_run_back_and_can_be_retried():
    driver, manager, weights, _ = weights_and_kv(capacity=32 * MIB)
    manager.sleep(offload_tags=("weights",))
    driver.occupied_elsewhere = 12 * MIB  # room for the weights (14 MiB), not the KV cache
    with pytest.raises(WakeUpError, match="out of memory"):
        manager.wake_up()
    assert driver.run_calls == [list(weights)]
    assert driver.used_bytes() == 12 * MIB and not driver.run_of
    assert manager.all_mapped_bytes() == 0
    driver.occupied_elsewhere = 0
    manager.wake_up()
    assert exact(driver, weights) and driver.used_bytes() == 22 * MIB


def test_a_weight_freed_while_its_run_is_mapped_stays_held_until_the_next_sleep():
    driver, manager, weights, _ = weights_and_kv(sizes=(4, 8, 2, 2))
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    freed = list(weights)[0]
    del weights[freed]
    driver.free(freed)
    assert freed not in manager.allocations
    assert manager.mapped_bytes() == 20 * MIB
    # One mapping: its 4 MiB go with the run.
    assert manager.all_mapped_bytes() == driver.used_bytes() == 24 * MIB
    manager.sleep(offload_tags=("weights",))
    assert manager.all_mapped_bytes() == driver.used_bytes() == 0
    manager.wake_up()
    assert exact(driver, weights) and driver.run_calls[-1] == list(weights)


def test_a_sleep_that_fails_midway_through_a_run_puts_back_what_left_it():
    driver, manager, weights, _ = weights_and_kv()
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    last = list(weights)[-1]
    driver.fail("unmap_and_release", address=last)  # the first two left the run already
    with pytest.raises(SleepError):
        manager.sleep(offload_tags=("weights",))
    assert exact(driver, weights)
    # Back in use in their run: no memory of their own.
    assert manager.all_mapped_bytes() == driver.used_bytes() == 22 * MIB
    assert all(driver.run_of.get(a) is driver.run_of[last] for a in weights)
    manager.sleep(offload_tags=("weights",))
    assert manager.all_mapped_bytes() == driver.used_bytes() == 0
    manager.wake_up()
    assert exact(driver, weights)


def test_a_chain_the_driver_finds_apart_maps_one_by_one_and_runs_stay_on():
    # Neighbours by address in two of the extension's reservations (arena chunks).
    driver, manager, weights, _ = weights_and_kv()
    manager.sleep(offload_tags=("weights",))
    driver.fail("create_and_map_run")
    driver.run_refusal = "map_run failed: the ranges are not free neighbours"
    manager.wake_up()
    assert exact(driver, weights) and not driver.run_of
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert driver.run_calls == [list(weights)] and exact(driver, weights)


def test_a_leftover_of_an_earlier_engine_is_taken_out_of_its_run_with_its_contents(caplog):
    # Engine 1 woke (runs formed) and shut down; something still references
    # one small weight. Its run would hold every freed weight with it.
    driver, manager, weights, kv = weights_and_kv(sizes=(4, 8, 200, 2))
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    leftover = list(weights)[-1]
    for address in [*list(weights)[:-1], kv]:
        driver.free(address)
    assert manager.all_mapped_bytes() == driver.used_bytes() == 214 * MIB
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        assert manager.orphan_leftovers() == 2 * MIB
    assert "gave back 212.00 MiB of freed weights" in caplog.text
    assert manager.all_mapped_bytes() == driver.used_bytes() == 2 * MIB
    assert leftover not in driver.run_of
    assert bool((driver.read(leftover) == weights[leftover]).all())
    # Never in a run again, nor in the next engine's sleeps.
    fresh = {allocate(driver, manager, "weights", 4): 9, allocate(driver, manager, "weights", 4): 7}
    for address, value in fresh.items():
        driver.write(address, value)
    calls_before = len(driver.run_calls)
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert driver.run_calls[calls_before:] == [list(fresh)]
    assert exact(driver, fresh) and bool((driver.read(leftover) == weights[leftover]).all())


def test_a_run_of_leftovers_the_driver_keeps_stays_mapped_with_their_contents(caplog):
    driver, manager, weights, _ = weights_and_kv(sizes=(4, 8, 2, 2))
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    kept = list(weights)[2:]
    for address in list(weights)[:2]:
        driver.free(address)
    driver.fail("unmap_and_release", address=kept[-1])  # the run's last one out
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        manager.orphan_leftovers()
    assert "could not be given back" in caplog.text
    assert all(driver.run_of.get(a) is driver.run_of[kept[0]] for a in kept)
    assert manager.all_mapped_bytes() == driver.used_bytes()
    assert all(bool((driver.read(a) == weights[a]).all()) for a in kept)


def test_a_leftover_that_cannot_be_mapped_again_keeps_its_contents_until_the_next_start():
    # Two leftovers share a run with freed weights; once the run is given
    # back, the driver refuses to map the second one again on its own.
    driver, manager, weights, kv = weights_and_kv(sizes=(4, 8, 200, 2, 2))
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    first, second = list(weights)[-2:]
    for address in [*list(weights)[:-2], kv]:
        driver.free(address)
    driver.fail("create_and_map", after=1)
    with pytest.raises(RuntimeError, match=r"1 of an earlier engine's leftovers \(2.00 MiB\)"):
        orphan_leftovers(manager)  # the next engine's init_device
    # Nothing of the freed weights is held, nothing is set apart unmapped,
    # and the count says what is mapped.
    assert driver.used_bytes() == manager.all_mapped_bytes() == 2 * MIB
    assert bool((driver.read(first) == weights[first]).all())
    assert not manager.allocations[second].mapped
    assert not any(a.orphaned for a in manager.allocations.values())
    # The start after it maps the leftover back, with its contents.
    orphan_leftovers(manager)
    assert driver.used_bytes() == manager.all_mapped_bytes() == 4 * MIB
    assert all(bool((driver.read(a) == weights[a]).all()) for a in (first, second))
    assert all(manager.allocations[a].orphaned for a in (first, second))
    assert second not in driver.run_of


def test_a_run_its_last_free_could_not_end_is_counted_until_a_member_or_a_sleep_ends_it():
    driver, manager, weights, kv = weights_and_kv(sizes=(4, 8, 2))
    first, middle, last = weights
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()  # the weights in one run
    for address in (first, middle):  # out of use: the run holds their memory
        driver.unmap_and_release(*manager.allocations[address].vmm_args())
        manager.allocations[address].unmapped()
    driver.fail("unmap_and_release", address=last)
    driver.free(last)  # the run's last member in use: the driver refuses
    assert manager.all_mapped_bytes() == driver.used_bytes() == 22 * MIB
    # One mapped again rejoins it (the table counts it, the extension the rest).
    driver.create_and_map(*manager.allocations[first].vmm_args())
    manager.allocations[first].mapped_again()
    assert manager.all_mapped_bytes() == driver.used_bytes() == 22 * MIB
    manager.sleep(offload_tags=("weights",))  # its last member out ends it
    assert manager.all_mapped_bytes() == driver.used_bytes() == 0


def test_an_allocation_counts_as_mapped_as_soon_as_a_wake_maps_it():
    # torch may free a segment while the wake goes on (a cache release between
    # a coded wake's phases): the extension must then unmap it.
    driver, manager, weights, kv = weights_and_kv()
    manager.sleep(offload_tags=("weights",))
    seen: list[bool] = []
    original = driver.create_and_map

    def create_and_map(device, size, address, handle):
        original(device, size, address, handle)
        seen.append(all(manager.allocations[a].mapped for a in weights))

    driver.create_and_map = create_and_map
    manager.wake_up()
    assert seen and all(seen)  # the weights' run, before the KV cache maps
