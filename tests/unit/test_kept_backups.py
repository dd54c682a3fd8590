"""A sleep copies again only the backup blocks that changed since the backup
its host buffers hold (issue 38), through the allocator on the fake driver:
kept blocks are not copied, a flipped bit is, every wake comes back exact,
and whatever leaves the host buffer unknown (a level-2 discard, a failed
sleep, other graph-pool ranges, the switch) makes the next sleep copy all."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.unit.fake_vmm import PAGE, FakeVmmDriver
from tests.unit.test_allocator_bookkeeping import allocate, make
from vllm_graph_sleep.allocator import GraphSleepAllocator, SleepError
from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES

MIB = 1 << 20
LAYER = 4 * MIB


def random_bytes(size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


@pytest.fixture
def layers():
    """Four weight allocations of random bytes and a KV cache, as an engine holds them."""
    driver, manager = make()
    addresses = []
    for seed in range(4):
        address = allocate(driver, manager, "weights", LAYER)
        driver.memory[address].copy_(random_bytes(LAYER, seed))
        addresses.append(address)
    allocate(driver, manager, "kv_cache", 8 * MIB, value=2)
    return driver, manager, addresses


def contents(driver, addresses):
    return [driver.memory[address].clone() for address in addresses]


def check_exact(driver, addresses, expected):
    for address, want in zip(addresses, expected, strict=True):
        assert torch.equal(driver.memory[address], want), hex(address)


def test_a_sleep_after_a_wake_copies_nothing_that_did_not_change(layers, caplog):
    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    assert manager.last_backup().kept == {"weights": 0}
    host = manager.host_bytes()
    for _ in range(3):
        manager.wake_up()
        check_exact(driver, addresses, expected)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
            manager.sleep(offload_tags=("weights",))
        assert manager.last_backup().copied == {"weights": 0}
        assert manager.last_backup().kept == {"weights": 4 * LAYER}
        assert manager.host_bytes() == host  # the host memory held is what it was
        (line,) = [r.getMessage() for r in caplog.records if "graph-sleep sleep" in r.getMessage()]
        assert "(copied 0 B, kept 16.00 MiB unchanged)" in line, line
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_one_flipped_bit_is_copied_again_and_comes_back(layers):
    driver, manager, addresses = layers
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    # Between the wake and the next sleep, one bit of the third block of layer 2.
    driver.memory[addresses[2]][2 * BLOCK_BYTES + 12345] ^= 0x10
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": BLOCK_BYTES}
    assert manager.last_backup().kept == {"weights": 4 * LAYER - BLOCK_BYTES}
    # Mapped back from what the host holds: the fresh mapping holds other bytes.
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_new_weights_for_a_quarter_of_the_layers_copy_a_quarter(layers):
    """The RL loop of issue 38: wake the weights, load new ones into some
    layers, wake the KV cache, sleep again."""
    driver, manager, addresses = layers
    manager.sleep(offload_tags=("weights",))
    for step in range(3):
        manager.wake_up(["weights"])
        driver.memory[addresses[step]].copy_(random_bytes(LAYER, 100 + step))
        manager.wake_up(["kv_cache"])
        expected = contents(driver, addresses)
        manager.sleep(offload_tags=("weights",))
        assert manager.last_backup().copied == {"weights": LAYER}, step
        manager.wake_up()
        check_exact(driver, addresses, expected)


def test_a_level_2_sleep_and_a_reload_copy_everything_again(layers):
    driver, manager, addresses = layers
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    manager.sleep(offload_tags=())  # level 2: nothing backed up
    manager.wake_up()
    for seed, address in enumerate(addresses):  # reload_weights
        driver.memory[address].copy_(random_bytes(LAYER, seed))
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.discard("weights")
    manager.wake_up()
    for address in addresses:
        driver.memory[address].copy_(random_bytes(LAYER, 9))
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


@pytest.mark.parametrize("failing", ["fingerprint", "host_buffer", "synchronize"])
def test_a_failed_sleep_leaves_nothing_trusted_and_the_next_copies_all(layers, failing):
    driver, manager, addresses = layers
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    driver.memory[addresses[0]][0] ^= 1
    if failing == "host_buffer":
        # A new buffer is asked for only when the size changes: make one grow.
        manager.allocations[addresses[3]].host = manager.allocations[addresses[3]].host[:MIB]
        manager.allocations[addresses[3]].fingerprints = None
    driver.fail(failing, after=1 if failing == "synchronize" else 0)
    with pytest.raises(SleepError):
        manager.sleep(offload_tags=("weights",))
    assert all(manager.allocations[a].fingerprints is None for a in addresses)
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_graph_pool_ranges_that_changed_are_copied_whole():
    driver = FakeVmmDriver(capacity=1 << 30)
    manager = GraphSleepAllocator(driver)
    with manager.cudagraph_pool() as pool, manager.routed_to(pool):
        address = driver.malloc(PAGE)
    driver.memory[address].copy_(random_bytes(PAGE, 1))
    driver.blocks[address] = [(0, MIB, "active_allocated"), (MIB, MIB, "inactive")]
    manager.sleep(offload_tags=("cudagraph",))
    manager.wake_up()
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.last_backup().kept == {"cudagraph": MIB}
    manager.wake_up()
    driver.blocks[address] = [(0, MIB, "inactive"), (MIB, MIB, "active_allocated")]
    expected = driver.memory[address][MIB:].clone()
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.last_backup().copied == {"cudagraph": MIB}
    manager.wake_up()
    assert torch.equal(driver.memory[address][MIB:], expected)


def test_the_switch_turns_keeping_off(monkeypatch, layers):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_KEEP_UNCHANGED_BACKUPS", "0")
    driver, manager = make()
    assert not manager.keeps_unchanged_backups
    address = allocate(driver, manager, "weights", LAYER, value=5)
    for _ in range(2):
        manager.sleep(offload_tags=("weights",))
        assert manager.last_backup().copied == {"weights": LAYER}
        manager.wake_up()
    assert driver.fingerprinted_bytes == 0
    assert bool((driver.memory[address] == 5).all())


def test_the_worker_warm_up_compiles_the_fingerprints_before_the_first_sleep(monkeypatch, caplog):
    """Compiled at the first sleep, the kernel cost 0.6 s there on an H200 and
    vLLM's JIT monitor warned of a compilation during inference."""
    from vllm_graph_sleep.patches import v1_worker_gpu_worker

    driver, manager = make()
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: True)
    monkeypatch.setattr(GraphSleepAllocator, "get_instance", staticmethod(lambda: manager))

    class Worker:
        device = torch.device("cpu")

    def warm_up(worker):
        assert driver.fingerprinted_bytes == BLOCK_BYTES  # before the original runs
        return "warmed"

    wrapped = v1_worker_gpu_worker._wrap_compile_or_warm_up_model(warm_up)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        assert wrapped(Worker()) == "warmed"
    assert "their fingerprints compiled on cpu" in caplog.text
    switched_off = make(keep_unchanged_backups=False)
    switched_off[1].prepare_backup_kernels(torch.device("cpu"))
    assert switched_off[0].fingerprinted_bytes == 0
