"""The warm-up leaves the worker's garbage-collector heap frozen with the
backup made ahead (after vLLM's own freeze), and a weight reload or
transfer leaves it frozen again, while graph offload is on; and the
allocator's records, frozen with it, form no reference cycle that would keep
a dropped backup alive (CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.unit.force_cpu_platform import force_cpu_platform

force_cpu_platform()

from vllm.v1.worker import gpu_worker  # noqa: E402

from vllm_graph_sleep.patches import v1_worker_gpu_worker  # noqa: E402
from vllm_graph_sleep.patches._wrap import is_wrapped  # noqa: E402

MIB = 1 << 20
SIZE = 2 * MIB  # the fake driver's granule


class Node:
    """An object the gc tracks, in a cycle as model objects often are."""

    def __init__(self) -> None:
        self.me = self


def _tracked(obj: object) -> bool:
    """Whether a collection would scan `obj` (frozen objects are not)."""
    return any(candidate is obj for candidate in gc.get_objects())


@pytest.fixture
def unfreeze_after():
    gc.unfreeze()  # whatever ran before starts nothing frozen here
    yield
    gc.unfreeze()  # what vLLM's Worker.shutdown does: the test process goes on


@pytest.mark.usefixtures("unfreeze_after")
@pytest.mark.parametrize("active", [True, False])
def test_weight_reloads_refreeze_the_gc_heap_when_graph_offload_is_on(monkeypatch, active):
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: active)
    made = []
    garbage = []

    def reload(worker):
        made.append(Node())
        garbage.append(Node())  # dropped before the call returns: a cycle to collect
        del garbage[:]
        return "reloaded"

    wrapped = v1_worker_gpu_worker._wrap_refreeze_gc_heap(reload)
    assert wrapped(object()) == "reloaded"
    # Frozen with graph offload on (the collection before the freeze took the
    # garbage, so nothing dead is frozen); stock behaviour with it off.
    assert _tracked(made[0]) is not active
    assert (gc.get_freeze_count() > 0) is active


@pytest.mark.usefixtures("unfreeze_after")
def test_a_failed_reload_freezes_nothing(monkeypatch):
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: True)

    def reload(worker):
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        v1_worker_gpu_worker._wrap_refreeze_gc_heap(reload)(object())
    assert gc.get_freeze_count() == 0


@pytest.mark.usefixtures("unfreeze_after")
@pytest.mark.parametrize("active", [True, False])
def test_the_warm_up_leaves_the_workers_heap_frozen_when_graph_offload_is_on(monkeypatch, active):
    """vLLM's warm-up freezes the heap before the backup ahead runs, and only
    the EngineCore process freezes again: a worker process of its own (TP >
    1) would leave the backup's records to every sleep's collection."""
    from tests.unit.test_allocator_bookkeeping import allocate, make
    from vllm_graph_sleep.allocator import GraphSleepAllocator

    driver, manager = make()
    allocate(driver, manager, "weights", SIZE, value=3)
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: active)
    monkeypatch.setattr(GraphSleepAllocator, "get_instance", staticmethod(lambda: manager))
    made = []

    class Worker:
        device = torch.device("cpu")

    def warm_up(worker):
        made.append(Node())
        return "warmed"

    wrapped = v1_worker_gpu_worker._wrap_compile_or_warm_up_model(warm_up)
    assert wrapped(Worker()) == "warmed"
    assert _tracked(made[0]) is not active
    assert (gc.get_freeze_count() > 0) is active
    if active:  # the backup ahead's records are frozen with the rest
        (record,) = manager.allocations.values()
        assert record.host is not None and not _tracked(record)


def test_both_are_wrapped_on_vllms_worker():
    v1_worker_gpu_worker.apply()
    for name in ("reload_weights", "finish_weight_update"):
        assert is_wrapped(getattr(gpu_worker.Worker, name)), name


@pytest.mark.parametrize("coded", [False, True])
def test_backup_records_form_no_reference_cycles(monkeypatch, coded):
    # A refrozen heap holds the allocator's records of the backups made so far;
    # one that a later sleep replaces is freed by its reference count alone, or
    # never (with the host memory it holds) if it sat in a cycle.
    from tests.unit.test_allocator_bookkeeping import allocate, make
    from tests.unit.test_exponent_codec import bf16_weights
    from tests.unit.triton_interpreter import interpret_codec
    from vllm_graph_sleep import coded_backup

    # The coder as test_coded_backups runs it: interpreted, small pieces, checked.
    interpret_codec(monkeypatch, symbols_per_lane=128, lanes_per_program=4096)
    monkeypatch.setattr(coded_backup, "PIECE_BYTES", MIB)
    monkeypatch.setattr(coded_backup, "_proven", {torch.device("cpu")})
    monkeypatch.setattr(coded_backup, "RECODE_MIN_BYTES", 0)  # changed pieces coded again
    driver, manager = make(compress_backups=coded)
    weights = [allocate(driver, manager, "weights", SIZE) for _ in range(3)]
    for seed, address in enumerate(weights):
        driver.memory[address].copy_(bf16_weights(SIZE // 2, seed=seed))
    allocate(driver, manager, "kv_cache", SIZE, value=2)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for cycle in range(2):
            manager.sleep(("weights",))
            manager.wake_up()
            # Changed: its pieces' records are replaced at the next sleep.
            driver.memory[weights[cycle]].copy_(bf16_weights(SIZE // 2, seed=10 + cycle))
            manager.sleep(("weights",))
            manager.wake_up()
            manager.sleep(())
            manager.wake_up()
        assert (manager.allocations[weights[2]].coded is not None) is coded
        # Freed: its record, backup and host buffer go.
        driver.free(weights[2])
        manager.sleep(("weights",))
        manager.wake_up()
        gc.collect()
        ours = [
            type(obj).__qualname__
            for obj in gc.garbage
            if type(obj).__module__.startswith("vllm_graph_sleep") or isinstance(obj, torch.Tensor)
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ours == []
