"""A sleep copies again only the backup blocks that changed since the backup
its host buffers hold (issue 38), through the allocator on the fake driver:
kept blocks are not copied, a flipped bit is, every wake comes back exact,
a level-2 sleep keeps the buffers, so that the sleep after a reload copies
what the reload changed, and whatever leaves the host buffer unknown (a
discard, a failed sleep, other graph-pool ranges, the switch) makes the next
sleep copy all."""

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


def level_1_then_level_2(manager) -> None:
    """A level-1 cycle (host buffers made), then a level-2 sleep (the weights
    dropped, no backup) and the wake that maps them back without contents."""
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    manager.sleep(offload_tags=())
    manager.wake_up()


def reload(driver, addresses, seeds) -> None:
    """What `reload_weights` does: every layer written from its checkpoint."""
    for seed, address in zip(seeds, addresses, strict=True):
        driver.memory[address].copy_(random_bytes(LAYER, seed))


def test_a_level_2_sleep_keeps_the_host_buffers_and_a_reload_of_the_same_weights_copies_nothing(
    layers,
):
    """Issue 38: the level-1 sleep after a level-2 sleep and `reload_weights`
    pinned all buffers again and coded all weights again (3.75x stock's in
    run 19). The buffers and their fingerprints now outlive the drop."""
    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    host = {a: manager.allocations[a].host for a in addresses}
    manager.wake_up()
    manager.sleep(offload_tags=())  # level 2: the weights dropped, no backup
    assert {a: manager.allocations[a].host for a in addresses} == host
    manager.wake_up()
    # Mapped back without the backup the buffers still hold.
    for address, old in zip(addresses, expected, strict=True):
        assert not torch.equal(driver.memory[address], old)
    reload(driver, addresses, range(4))  # the same weights
    check_exact(driver, addresses, expected)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}
    assert manager.last_backup().kept == {"weights": 4 * LAYER}
    assert all(manager.allocations[a].host is host[a] for a in addresses)  # nothing pinned anew
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_after_a_level_2_sleep_what_the_reload_changed_is_copied(layers):
    driver, manager, addresses = layers
    level_1_then_level_2(manager)
    reload(driver, addresses, [50, 1, 2, 3])  # new weights for the first layer only
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_a_level_2_wake_that_loads_nothing_is_backed_up_as_it_is(layers):
    """Without a reload the weights come back as fresh memory: the next sleep
    finds every block changed from the kept backup and copies it."""
    driver, manager, addresses = layers
    level_1_then_level_2(manager)
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_a_discard_leaves_nothing_to_keep(layers):
    driver, manager, addresses = layers
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    manager.discard("weights")
    assert manager.host_bytes() == 0
    manager.wake_up()
    reload(driver, addresses, range(4))  # the same weights, but nothing kept to compare with
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_with_host_memory_released_a_level_2_sleep_holds_none(monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY", "1")
    driver, manager = make()
    address = allocate(driver, manager, "weights", LAYER)
    driver.memory[address].copy_(random_bytes(LAYER, 3))
    manager.sleep(offload_tags=("weights",))
    assert manager.host_bytes() == LAYER
    manager.wake_up()
    manager.sleep(offload_tags=())
    assert manager.host_bytes() == 0
    manager.wake_up()
    driver.memory[address].copy_(random_bytes(LAYER, 3))
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": LAYER}


@pytest.mark.parametrize("failing", ["fingerprint", "host_buffer", "synchronize"])
def test_a_failed_sleep_leaves_nothing_trusted_and_the_next_copies_all(layers, failing):
    driver, manager, addresses = layers
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().kept == {"weights": 4 * LAYER}
    manager.wake_up()
    driver.memory[addresses[0]][0] ^= 1
    if failing == "host_buffer":
        # A new buffer is asked for only when the size changes: make one grow.
        manager.allocations[addresses[3]].host = manager.allocations[addresses[3]].host[:MIB]
        manager.allocations[addresses[3]].fingerprints = None
    driver.fail(failing, after=1 if failing == "synchronize" else 0)
    with pytest.raises(SleepError):
        manager.sleep(offload_tags=("weights",))
    # The ledger's copied and kept bytes are the failed sleep's, not the one before's.
    assert manager.last_backup().kept in ({}, {"weights": 0})
    assert all(manager.allocations[a].fingerprints is None for a in addresses)
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_a_sleep_failing_before_its_backup_reports_nothing_copied_or_kept(layers):
    """A sticky CUDA error in the sleep's first steps (torch's cache release):
    the ledger must not go on reporting the sleep before's counts."""
    driver, manager, addresses = layers
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert manager.last_backup().kept == {"weights": 4 * LAYER}

    def sticky_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    driver.release_cached_memory = sticky_error
    with pytest.raises(RuntimeError, match="illegal memory access"):
        manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {} and manager.last_backup().kept == {}


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


def test_changed_spans_are_the_blocks_whose_fingerprints_differ():
    """The comparison a sleep makes per allocation: equal fingerprints give
    no span (the fast path most allocations take), differing blocks their
    byte spans with neighbours joined, per pair, and unknown ones None."""
    from vllm_graph_sleep.memory.backups import _changed_spans

    pairs = [(torch.empty(3 * BLOCK_BYTES, dtype=torch.uint8), None)]
    pairs.append((torch.empty(BLOCK_BYTES + 8, dtype=torch.uint8), None))
    then = torch.arange(10, dtype=torch.int64).view(5, 2)
    assert _changed_spans(then, then.clone(), pairs) == []
    now = then.clone()
    now[1, 0] ^= 1
    now[2, 1] ^= 1
    now[4, 0] ^= 1
    assert _changed_spans(then, now, pairs) == [
        (0, BLOCK_BYTES, 3 * BLOCK_BYTES),
        (1, BLOCK_BYTES, BLOCK_BYTES + 8),
    ]
    assert _changed_spans(None, now, pairs) is None
    assert _changed_spans(then[:4], now, pairs) is None


def test_a_backup_made_ahead_leaves_the_first_sleep_nothing_to_copy(layers, caplog):
    """The worker backs the weights up once warm-up is done, so that the
    first sleep neither pins its host buffers nor codes weights that did not
    change: 62.8 of that sleep's 130 ms pinned and 55.3 coded in lease 23."""
    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        count = manager.back_up_ahead(("weights",))
    assert count.copied == {"weights": 4 * LAYER}
    assert "graph-sleep: backed up weights 16.00 MiB ahead" in caplog.text
    assert all(manager.allocations[a].mapped for a in addresses)
    check_exact(driver, addresses, expected)
    kv_cache = [a for a in manager.allocations.values() if a.tag == "kv_cache"]
    assert [a.host for a in kv_cache] == [None]  # only the tags asked for
    host = manager.host_bytes()
    assert host == 4 * LAYER
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}
    assert manager.last_backup().kept == {"weights": 4 * LAYER}
    assert manager.host_bytes() == host
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_weights_changed_after_the_backup_ahead_are_copied_at_the_first_sleep(layers):
    driver, manager, addresses = layers
    manager.back_up_ahead(("weights",))
    driver.memory[addresses[1]][3 * BLOCK_BYTES + 7] ^= 0x01  # a load_weights, in one bit
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": BLOCK_BYTES}
    manager.wake_up()
    check_exact(driver, addresses, expected)


@pytest.mark.parametrize(
    "switches", [{"keep_unchanged_backups": False}, {"release_host_memory": True}]
)
def test_no_backup_ahead_where_it_would_not_be_kept(switches, caplog):
    driver, manager = make(**switches)
    address = allocate(driver, manager, "weights", LAYER, value=5)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        assert manager.back_up_ahead(("weights",)) is None
    said = "RELEASE_HOST_MEMORY is on" if "release_host_memory" in switches else "is off"
    assert "weights 4.00 MiB not backed up ahead: backups are not kept" in caplog.text
    assert said in caplog.text
    assert manager.host_bytes() == 0
    assert driver.fingerprinted_bytes == 0
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert bool((driver.memory[address] == 5).all())


@pytest.mark.parametrize(("call", "after"), [("host_buffer", 1), ("fingerprint", 0)])
def test_a_failed_backup_ahead_is_logged_holds_nothing_and_the_first_sleep_copies_all(
    layers, caplog, call, after
):
    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    driver.fail(call, after=after)  # the second buffer, or the one fingerprint pass
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        assert manager.back_up_ahead(("weights",)) is None
    assert "backing up weights 16.00 MiB ahead failed" in caplog.text
    assert manager.host_bytes() == 0
    assert all(manager.allocations[a].mapped for a in addresses)
    check_exact(driver, addresses, expected)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_an_unknown_tag_ahead_is_refused_before_anything_is_backed_up(layers):
    driver, manager, _ = layers
    with pytest.raises(ValueError, match="back_up_ahead: unknown memory tag"):
        manager.back_up_ahead(("weights", "wieghts"))
    assert manager.host_bytes() == 0


@pytest.mark.parametrize("at_start", [True, False])
def test_the_worker_backs_the_weights_up_once_warm_up_is_done(monkeypatch, at_start):
    from vllm_graph_sleep.patches import v1_worker_gpu_worker

    driver, manager = make(back_up_at_start=at_start)
    address = allocate(driver, manager, "weights", LAYER, value=5)
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: True)
    monkeypatch.setattr(GraphSleepAllocator, "get_instance", staticmethod(lambda: manager))

    class Worker:
        device = torch.device("cpu")

    def warm_up(worker):
        assert manager.host_bytes() == 0  # after the warm-up, whose graphs read the weights
        return "warmed"

    wrapped = v1_worker_gpu_worker._wrap_compile_or_warm_up_model(warm_up)
    assert wrapped(Worker()) == "warmed"
    assert manager.host_bytes() == (LAYER if at_start else 0)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0 if at_start else LAYER}
    manager.wake_up()
    assert bool((driver.memory[address] == 5).all())


def test_the_backup_ahead_leaves_torchs_cache_as_vllms_warm_up_left_it(layers):
    """vLLM's warm-up ends by running the sampler at its largest shape so that
    those buffers stay in torch's cache; the first sleep empties it, as
    stock's does."""
    driver, manager, _ = layers
    driver.cache_calls.clear()
    manager.back_up_ahead(("weights",))
    assert "empty" not in driver.cache_calls
    manager.sleep(offload_tags=("weights",))
    assert "empty" in driver.cache_calls


def test_a_level_2_first_sleep_gives_back_the_buffers_filled_ahead(layers):
    """A loop of level-2 sleeps never reads them: they would be pinned for
    nothing. Once a sleep has backed the weights up, a level-2 sleep keeps
    them, as before (the next test file's reload case)."""
    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    manager.back_up_ahead(("weights",))
    manager.sleep(offload_tags=())  # level 2: the weights dropped
    assert manager.host_bytes() == 0
    manager.wake_up()
    reload(driver, addresses, range(4))
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)
    manager.sleep(offload_tags=())
    assert manager.host_bytes() == 4 * LAYER  # used by a sleep: kept through level 2


@pytest.mark.parametrize("warmed_up_again", [False, True])
def test_buffers_filled_ahead_and_used_by_a_level_1_sleep_stay_through_level_2(
    layers, warmed_up_again
):
    """warmed_up_again: elastic EP warms the engine up again, and with it the
    backup ahead; buffers a level-1 sleep has filled are not the start's
    unused ones, and a level-2 sleep keeps them all the same."""
    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    manager.back_up_ahead(("weights",))
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}
    manager.wake_up()
    if warmed_up_again:
        assert manager.back_up_ahead(("weights",)).copied == {"weights": 0}
    manager.sleep(offload_tags=())
    assert manager.host_bytes() == 4 * LAYER
    manager.wake_up()
    reload(driver, addresses, range(4))
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_a_backup_ahead_whose_live_ranges_fail_does_not_stop_the_engine(
    layers, monkeypatch, caplog
):
    from vllm_graph_sleep.memory.backups import Backups

    driver, manager, addresses = layers

    def refuse(*args):
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(Backups, "live_ranges", refuse)
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        assert manager.back_up_ahead(("weights",)) is None
    assert "ahead failed (snapshot failed)" in caplog.text
    assert manager.host_bytes() == 0


def test_a_backup_ahead_whose_buffers_cannot_be_given_back_still_lets_the_engine_start(
    layers, monkeypatch, caplog
):
    from vllm_graph_sleep.memory.backups import Backups

    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    driver.fail("fingerprint")

    def refuse(self, allocations):
        raise RuntimeError("cudaHostUnregister failed: invalid argument")

    monkeypatch.setattr(Backups, "give_back_host_buffers", refuse)
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        assert manager.back_up_ahead(("weights",)) is None
    assert "giving its host buffers back failed too: cudaHostUnregister failed" in caplog.text
    for address in addresses:
        allocation = manager.allocations[address]
        assert allocation.mapped and not allocation.has_backup
        assert allocation.fingerprints is None
    monkeypatch.undo()
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_a_failed_second_backup_ahead_keeps_the_buffers_a_sleep_filled(layers):
    """Its copies may have written them: nothing is kept, and the next sleep
    copies everything again, into the same pinned buffers."""
    driver, manager, addresses = layers
    expected = contents(driver, addresses)
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    driver.fail("fingerprint", after=0)
    assert manager.back_up_ahead(("weights",)) is None
    assert manager.host_bytes() == 4 * LAYER
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 4 * LAYER}
    manager.wake_up()
    check_exact(driver, addresses, expected)


def test_nothing_to_back_up_ahead_is_none():
    driver, manager = make()
    allocate(driver, manager, "kv_cache", LAYER, value=1)
    assert manager.back_up_ahead(("weights",)) is None
    assert manager.host_bytes() == 0
