"""cuBLAS workspaces (CPU, faked VMM layer): the capture stream's are made in
the graph pool, and a sleep has torch drop the others only when no graph can be
using one outside our pools."""

import logging
from contextlib import contextmanager

import pytest

from tests.unit.fake_vmm import BLAS_WORKSPACE, PAGE, FakeVmmDriver
from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.patches.distributed_parallel_state import _wrap_graph_capture

CAPTURE_STREAM = 0x37F84240


def make(**kwargs):
    driver = FakeVmmDriver(capacity=1 << 30)
    return driver, GraphSleepAllocator(driver, **kwargs)


def capture_stream_workspaces(driver, manager):
    """What a graph_capture context does with offload on, then the warm-up."""
    driver.current_stream = CAPTURE_STREAM
    manager.create_blas_workspaces_in_graph_pool()
    driver.create_blas_workspaces()  # the warm-up's first matmul finds it made
    driver.current_stream = 0
    driver.create_blas_workspaces()  # eager work on the default stream
    return driver.workspaces[CAPTURE_STREAM]


def test_the_capture_stream_workspace_is_made_in_the_graph_pool():
    driver, manager = make()
    workspace = capture_stream_workspaces(driver, manager)
    allocation = manager.allocations[workspace]
    assert allocation.tag == "cudagraph" and allocation.size == BLAS_WORKSPACE
    with manager.cudagraph_pool() as pool:
        assert workspace in pool.segments
    assert not driver.routing  # nothing stays routed afterwards
    assert [stream for _, stream in driver.outside_segments] == [0]


def test_inside_another_pool_the_workspace_still_goes_to_the_graph_pool():
    driver, manager = make()
    with manager.use_memory_pool("weights") as weights:
        driver.current_stream = CAPTURE_STREAM
        manager.create_blas_workspaces_in_graph_pool()
        assert driver.routing == [weights]  # the enclosing pool is routed again
    assert manager.allocations[driver.workspaces[CAPTURE_STREAM]].tag == "cudagraph"


def test_sleep_drops_the_workspaces_and_keeps_the_pool_segment_for_the_graphs(caplog):
    driver, manager = make()
    workspace = capture_stream_workspaces(driver, manager)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 1 and not driver.workspaces
    assert driver.outside_segments == []  # the default stream's is gone
    # The graphs still hold the address: it sleeps and wakes with the pool.
    assert workspace in manager.allocations
    manager.wake_up()
    assert manager.allocations[workspace].mapped
    assert "cuBLAS workspaces released" in caplog.records[0].getMessage()


def test_a_workspace_outside_our_pools_on_another_stream_keeps_them_all(caplog):
    driver, manager = make()
    driver.current_stream = CAPTURE_STREAM
    driver.create_blas_workspaces()  # made by an eager warm-up, outside every pool
    with manager.cudagraph_pool() as pool, manager._routed_to(pool):
        driver.malloc(PAGE)  # a graph captured on that stream uses it
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 0
    assert driver.workspaces[CAPTURE_STREAM] == driver.outside_segments[0][0]
    assert "cuBLAS workspaces kept (torch memory outside our pools on 1 non-default stream" in (
        caplog.records[0].getMessage()
    )


def test_other_memory_a_warm_up_left_on_a_prepared_capture_stream_is_no_workspace():
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    # The H200 run: 1 MiB of something else the warm-up made on that stream.
    driver.outside_segments.append((0x1234000, CAPTURE_STREAM))
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 1


def test_a_stream_that_had_its_workspace_outside_before_capture_keeps_them_all():
    driver, manager = make()
    driver.current_stream = CAPTURE_STREAM
    driver.create_blas_workspaces()  # a pooled stream used before, outside every pool
    manager.create_blas_workspaces_in_graph_pool()  # finds it made: nothing moves
    driver.current_stream = 0
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 0


def test_a_next_engine_capturing_on_the_same_stream_gets_workspaces_in_its_own_pool():
    driver, manager = make()
    first = capture_stream_workspaces(driver, manager)
    manager.release_pools()  # engine shutdown
    assert first not in manager.allocations  # freed with the dropped pool
    second = capture_stream_workspaces(driver, manager)  # a pooled stream comes back
    with manager.cudagraph_pool() as pool:
        assert second in pool.segments
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 2  # shutdown, then this sleep


def test_the_workspaces_are_kept_when_switched_off(monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_BLAS_WORKSPACES", "0")
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 0 and len(driver.workspaces) == 2


@pytest.mark.parametrize("routes", [True, False])
def test_graph_capture_makes_the_workspaces_only_where_captures_go_to_our_pools(
    monkeypatch, routes
):
    driver, manager = make()
    monkeypatch.setattr(GraphSleepAllocator, "get_instance", classmethod(lambda cls: manager))
    monkeypatch.setattr(config, "routes_to_pools", lambda: routes)
    entered = []

    @contextmanager
    def original(self, graph_capture_context=None):
        driver.current_stream = CAPTURE_STREAM  # vLLM makes the side stream current
        entered.append(graph_capture_context)
        yield graph_capture_context
        driver.current_stream = 0

    with _wrap_graph_capture(original)(object(), "context") as context:
        assert context == "context"
    assert entered == ["context"]
    assert (CAPTURE_STREAM in driver.workspaces) is routes
