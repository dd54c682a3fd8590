"""What a sleep backs up of the graph pool (CPU, faked VMM layer): the blocks
torch still has allocated there, not the graph scratch around them."""

import logging

import pytest

from tests.unit.fake_vmm import PAGE, STALE_BYTE, FakeVmmDriver
from vllm_graph_sleep.allocator import POISON_BYTE, GraphSleepAllocator

KIB = 1 << 10
LIVE = 64 * KIB  # an output a runner keeps, at offset 256 KiB of the segment
AT = 256 * KIB


def graph_pool_segment(**kwargs):
    driver = FakeVmmDriver(capacity=1 << 30)
    manager = GraphSleepAllocator(driver, **kwargs)
    with manager.cudagraph_pool() as pool, manager.routed_to(pool):
        address = driver.malloc(PAGE)
    driver.blocks[address] = [
        (0, AT, "inactive"),
        (AT, LIVE, "active_allocated"),
        (AT + LIVE, PAGE - AT - LIVE, "inactive"),
    ]
    driver.write(address, 7)
    return driver, manager, address


def test_only_the_live_block_is_backed_up_and_restored_in_place(caplog):
    driver, manager, address = graph_pool_segment()
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert manager.host_bytes() == LIVE
    assert manager.usage_by_tag()["cudagraph"] == {
        "mapped": 0,
        "backed_up": LIVE,
        "dropped": PAGE - LIVE,
    }
    assert "backed up cudagraph 64.00 KiB" in caplog.records[0].getMessage()
    manager.wake_up(["kv_cache"])  # any wake brings the graph pool back
    memory = driver.read(address)
    assert bool((memory[AT : AT + LIVE] == 7).all())
    # Scratch holds whatever the fresh mapping held: replays write it first.
    assert bool((memory[:AT] == STALE_BYTE).all())


def test_the_poison_switch_fills_the_scratch_for_the_engine_tests(monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_POISON_GRAPH_SCRATCH", "1")
    driver, manager, address = graph_pool_segment()
    manager.sleep(offload_tags=("cudagraph",))
    manager.wake_up()
    memory = driver.read(address)
    assert bool((memory[AT : AT + LIVE] == 7).all())
    assert bool((memory[:AT] == POISON_BYTE).all())
    assert bool((memory[AT + LIVE :] == POISON_BYTE).all())


@pytest.mark.parametrize("poison", [True, False])
def test_the_remap_poison_switch_fills_dropped_weights_but_not_the_kv_cache(monkeypatch, poison):
    """Level 2 for the engine tests: a weight reload that misses a tensor must
    show in the tokens, not read back the old bytes the fresh pages held."""
    if poison:
        monkeypatch.setenv("VLLM_GRAPH_SLEEP_POISON_REMAPPED", "1")
    driver, manager, _ = graph_pool_segment()
    made = {}
    for tag in ("weights", "kv_cache"):
        with manager.allocation_tag(tag):
            made[tag] = driver.malloc(PAGE)
        driver.write(made[tag], 3)
    manager.sleep(offload_tags=("cudagraph",))  # level 2: weights and KV dropped
    manager.wake_up()
    assert bool((driver.read(made["weights"]) == (POISON_BYTE if poison else STALE_BYTE)).all())
    assert bool((driver.read(made["kv_cache"]) == STALE_BYTE).all())


def test_the_whole_pool_is_backed_up_when_asked(monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_BACK_UP_WHOLE_GRAPH_POOL", "1")
    driver, manager, address = graph_pool_segment()
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.host_bytes() == PAGE
    manager.wake_up()
    assert bool((driver.read(address) == 7).all())


@pytest.mark.parametrize("live_after", [2 * LIVE, LIVE // 2])
def test_a_backup_follows_the_live_blocks_of_each_sleep(live_after):
    driver, manager, address = graph_pool_segment()
    manager.sleep(offload_tags=("cudagraph",))
    manager.wake_up()
    driver.blocks[address][1] = (AT, live_after, "active_allocated")
    driver.write(address, 9)
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.usage_by_tag()["cudagraph"]["backed_up"] == live_after
    assert manager.host_bytes() >= live_after
    manager.wake_up()
    assert bool((driver.read(address)[AT : AT + live_after] == 9).all())


def test_segments_outside_the_graph_pool_are_backed_up_whole():
    driver, manager, address = graph_pool_segment()
    with manager.allocation_tag("weights"):
        weights = driver.malloc(PAGE)
    driver.write(weights, 3)
    manager.sleep(offload_tags=("cudagraph", "weights"))
    assert manager.usage_by_tag()["weights"]["backed_up"] == PAGE
    manager.wake_up()
    assert bool((driver.read(weights) == 3).all())


def test_a_segment_holding_only_scratch_has_no_host_buffer_and_comes_back_poisoned(monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_POISON_GRAPH_SCRATCH", "1")
    driver, manager, address = graph_pool_segment()
    driver.blocks[address] = [(0, PAGE, "inactive")]
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.allocations[address].host is None and manager.host_bytes() == 0
    assert manager.usage_by_tag()["cudagraph"] == {"mapped": 0, "backed_up": 0, "dropped": PAGE}
    manager.wake_up()
    assert bool((driver.read(address) == POISON_BYTE).all())


def test_zero_on_wake_zeroes_the_scratch_around_a_restored_block():
    driver, manager, address = graph_pool_segment(zero_on_wake=True)
    manager.sleep(offload_tags=("cudagraph",))
    manager.wake_up()
    memory = driver.read(address)
    assert bool((memory[AT : AT + LIVE] == 7).all())
    assert bool((memory[:AT] == 0).all()) and bool((memory[AT + LIVE :] == 0).all())


def test_a_failed_sleep_maps_the_live_block_back_intact():
    driver, manager, address = graph_pool_segment()
    with manager.allocation_tag("weights"):
        weights = driver.malloc(PAGE)
    driver.write(weights, 3)
    driver.fail("unmap_and_release", after=1)  # the second release fails
    with pytest.raises(RuntimeError, match="sleep failed after releasing"):
        manager.sleep(offload_tags=("cudagraph", "weights"))
    assert bool((driver.read(address)[AT : AT + LIVE] == 7).all())
    assert bool((driver.read(weights) == 3).all())
    assert not any(a.has_backup for a in manager.allocations.values())


def test_the_wake_line_counts_only_the_restored_bytes(caplog):
    driver, manager, address = graph_pool_segment()
    manager.sleep(offload_tags=("cudagraph",))
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.wake_up()
    line = caplog.records[-1].getMessage()
    assert "restored from host cudagraph 64.00 KiB" in line
    assert "remapped without backup cudagraph 1.94 MiB" in line


def test_a_host_buffer_far_larger_than_the_backup_is_replaced():
    driver, manager, address = graph_pool_segment()
    driver.blocks[address][1] = (AT, 4 * LIVE, "active_allocated")
    manager.sleep(offload_tags=("cudagraph",))
    manager.wake_up()
    assert manager.host_bytes() == 4 * LIVE
    driver.blocks[address][1] = (AT, LIVE, "active_allocated")
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.host_bytes() == LIVE
