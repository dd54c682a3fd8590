"""cuBLAS workspaces (CPU, faked VMM layer): the capture stream's are made in
the graph pool and never backed up, and a sleep has torch drop the others only
when no graph can be using one outside the graph pool."""

import logging
from contextlib import contextmanager

import pytest

from tests.unit.fake_vmm import BLAS_WORKSPACE, LT_WORKSPACE, PAGE, FakeVmmDriver
from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.patches.distributed_parallel_state import _wrap_graph_capture

CAPTURE_STREAM = 0x37F84240
AUX_STREAM = 0x37F85000  # vLLM's aux stream, which its graphs fork onto
PROFILING_STREAM = 0x37F86000  # the side stream of model runner V1's throwaway graphs
TORCH_CAPTURE_STREAM = 0x37F87000  # torch.cuda.graph's own, where no stream is given
# torch drops every workspace once before the first capture into the graph pool.
FIRST_CAPTURE = 1


def make(**kwargs):
    driver = FakeVmmDriver(capacity=1 << 30)
    return driver, GraphSleepAllocator(driver, **kwargs)


def capture_stream_workspaces(driver, manager):
    """What a graph_capture context does with offload on, then the warm-up."""
    driver.current_stream = CAPTURE_STREAM
    manager.create_blas_workspaces_in_graph_pool()
    driver.create_blas_workspaces()  # the warm-up's matmuls find them made
    driver.current_stream = 0
    driver.create_blas_workspaces()  # eager work on the default stream
    return driver.workspaces[CAPTURE_STREAM]


def full_graphs_on_torchs_capture_stream(driver, manager):
    """Model runner V2's FULL graphs: captured into the graph pool on torch's
    default capture stream, where the first matmul makes the workspaces, in
    the pool the capture routes to."""
    driver.current_stream = TORCH_CAPTURE_STREAM
    driver.begin_capture()
    with manager.cudagraph_pool() as pool:
        driver.route(pool)
        driver.create_blas_workspaces()
        driver.unroute(pool)
    driver.current_stream = 0


def graph_pool_segments(manager):
    with manager.cudagraph_pool() as pool:
        return list(pool.segments)


def test_the_capture_stream_workspaces_are_made_in_the_graph_pool():
    driver, manager = make()
    made = capture_stream_workspaces(driver, manager)
    for kind, size in (("blas", BLAS_WORKSPACE), ("lt", LT_WORKSPACE)):
        allocation = manager.allocations[made[kind]]
        assert allocation.tag == "cudagraph" and allocation.size >= size
        assert made[kind] in graph_pool_segments(manager)
    assert not driver.routing  # nothing stays routed afterwards
    # Outside: torch's graph-safe RNG state on the capture stream (held from
    # here) and the default stream's workspaces.
    assert [stream for _, stream, _ in driver.outside_segments] == [CAPTURE_STREAM, 0, 0]


def test_workspaces_in_the_graph_pool_are_never_backed_up():
    driver, manager = make(release_blas_workspaces=False)
    made = capture_stream_workspaces(driver, manager)
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.allocations[made["blas"]].backup_bytes() == 0
    assert manager.host_bytes() == 0
    manager.wake_up()
    assert manager.allocations[made["blas"]].mapped  # the graphs' address is back


def test_inside_another_pool_the_workspaces_still_go_to_the_graph_pool():
    driver, manager = make()
    with manager.use_memory_pool("weights") as weights:
        driver.current_stream = CAPTURE_STREAM
        manager.create_blas_workspaces_in_graph_pool()
        assert driver.routing == [weights]  # the enclosing pool is routed again
    assert manager.allocations[driver.workspaces[CAPTURE_STREAM]["blas"]].tag == "cudagraph"
    # torch's RNG state is outside every pool of ours: the weights pool is unrouted meanwhile.
    assert driver.generator_holds == [False]
    assert driver.generator_state[0] not in manager.allocations


def test_a_failure_leaves_the_capture_to_go_on(caplog):
    driver, manager = make()
    driver.current_stream = CAPTURE_STREAM

    def out_of_memory():
        raise RuntimeError("CUDA out of memory")

    driver.create_blas_workspace = out_of_memory
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        manager.create_blas_workspaces_in_graph_pool()
    assert "stay outside the graph pool: CUDA out of memory" in caplog.text
    assert not driver.routing


def test_sleep_drops_the_workspaces_and_keeps_the_pool_segment_for_the_graphs(caplog):
    driver, manager = make()
    made = capture_stream_workspaces(driver, manager)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE + 1 and not driver.workspaces
    # The default stream's are gone; the RNG state stays with the graphs.
    assert driver.outside_segments == [(*driver.generator_state, 1024)]
    # The graphs still hold the addresses: they sleep and wake with the pool.
    assert made["blas"] in manager.allocations
    manager.wake_up()
    assert manager.allocations[made["blas"]].mapped
    assert "cuBLAS workspaces released" in caplog.records[0].getMessage()


def test_a_live_tensor_later_placed_where_a_released_workspace_was_is_backed_up():
    driver, manager = make()
    made = capture_stream_workspaces(driver, manager)
    manager.sleep(offload_tags=("cudagraph",))  # releases them: the block is free
    manager.wake_up()
    driver.cached.discard(made["blas"])  # a later capture keeps a tensor there
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.allocations[made["blas"]].backup_bytes() == BLAS_WORKSPACE


def test_other_memory_a_warm_up_left_on_a_prepared_capture_stream_is_no_workspace():
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    # The H200 run: 1 MiB of something else the warm-up made on that stream.
    driver.outside_segments.append((0x1234000, CAPTURE_STREAM, LT_WORKSPACE + 1024))
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE + 1


def test_without_the_cublaslt_workspace_in_the_pool_the_stream_is_not_trusted(caplog):
    driver, manager = make()
    driver.lt_path = False  # torch's addmm skips cuBLASLt: only cuBLAS's is made here
    driver.current_stream = CAPTURE_STREAM
    manager.create_blas_workspaces_in_graph_pool()
    driver.lt_path = True
    driver.create_blas_workspaces()  # the warm-up makes the cuBLASLt one outside
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE
    assert "cuBLAS workspaces kept (torch memory outside the graph pool on 1" in caplog.text


def test_a_workspace_outside_our_pools_on_another_stream_keeps_them_all(caplog):
    driver, manager = make()
    driver.current_stream = CAPTURE_STREAM
    driver.create_blas_workspaces()  # made by an eager warm-up, outside every pool
    with manager.cudagraph_pool() as pool, manager.routed_to(pool):
        driver.malloc(PAGE)  # a graph captured on that stream uses it
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 0
    assert driver.workspaces[CAPTURE_STREAM]["blas"] == driver.outside_segments[0][0]


def test_a_workspace_in_another_pool_of_ours_on_a_side_stream_keeps_them_all():
    """A drafter captured during load_model: its stream's workspace was made
    inside the weights pool, which frees its segments once they empty."""
    driver, manager = make()
    with manager.use_memory_pool("weights") as weights, manager.routed_to(weights):
        driver.current_stream = CAPTURE_STREAM
        driver.create_blas_workspaces()
    driver.current_stream = 0
    manager.sleep(offload_tags=("cudagraph", "weights"))
    assert driver.blas_releases == 0


def test_before_the_first_capture_workspaces_made_outside_are_made_again_in_the_pool():
    """A pooled stream used before, outside every pool: no graph exists yet, so
    its workspaces are dropped and made again in the graph pool."""
    driver, manager = make()
    driver.current_stream = CAPTURE_STREAM
    driver.create_blas_workspaces()
    outside = driver.workspaces[CAPTURE_STREAM]["blas"]
    manager.create_blas_workspaces_in_graph_pool()
    assert driver.workspaces[CAPTURE_STREAM]["blas"] in graph_pool_segments(manager)
    # The old one's segment stays cached, with nothing in use, until empty_cache.
    assert (outside, CAPTURE_STREAM, 0) in driver.outside_segments
    driver.current_stream = 0
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE + 1


def test_once_a_graph_exists_a_stream_with_its_workspace_outside_keeps_them_all():
    driver, manager = make()
    capture_stream_workspaces(driver, manager)  # the first capture: a graph now exists
    driver.current_stream = CAPTURE_STREAM + 1
    driver.create_blas_workspaces()  # another pooled stream, used eagerly, outside
    manager.create_blas_workspaces_in_graph_pool()  # finds them made: nothing moves
    driver.current_stream = 0
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE


def test_the_profiling_graphs_side_stream_workspace_is_gone_by_the_first_capture(caplog):
    """Model runner V1 captures throwaway graphs outside our pools on a side
    stream first (Qwen3-MoE, run 5: 32 MiB kept every workspace resident)."""
    driver, manager = make()
    driver.current_stream = PROFILING_STREAM
    driver.create_blas_workspaces()
    capture_stream_workspaces(driver, manager)
    assert PROFILING_STREAM not in driver.workspaces
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert "cuBLAS workspaces released" in caplog.text


def test_a_side_stream_the_graphs_fork_onto_gets_its_workspaces_in_the_pool(caplog):
    """DeepSeek-V2's shared experts run on vLLM's aux stream inside the graphs:
    its workspace, made by the eager profile run, is made again in the pool."""
    driver, manager = make()
    driver.current_stream = AUX_STREAM
    driver.create_blas_workspaces()
    driver.current_stream = CAPTURE_STREAM
    manager.create_blas_workspaces_in_graph_pool(side_streams=[AUX_STREAM])
    assert driver.current_stream == CAPTURE_STREAM
    for stream in (CAPTURE_STREAM, AUX_STREAM):
        assert driver.workspaces[stream]["blas"] in graph_pool_segments(manager)
    driver.current_stream = AUX_STREAM
    driver.create_blas_workspaces()  # the warm-up's shared experts find them made
    driver.current_stream = 0
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("cudagraph",))
    assert "cuBLAS workspaces released" in caplog.text


def test_torchs_rng_state_is_put_on_the_capture_stream_before_full_graphs_elsewhere(caplog):
    """torch makes the graph-safe RNG state on the stream of the first graph;
    made there by the graph_capture context first, it sits on a trusted
    stream, and FULL graphs captured on torch's own stream leave nothing
    outside the pool there."""
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    assert driver.generator_state[1] == CAPTURE_STREAM
    assert driver.generator_holds == [False]  # made outside every pool of ours
    full_graphs_on_torchs_capture_stream(driver, manager)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        for _ in range(2):
            manager.sleep(offload_tags=("cudagraph",))
            manager.wake_up()
    sleeps = [r.getMessage() for r in caplog.records if "cuBLAS workspaces" in r.getMessage()]
    assert len(sleeps) == 2 and all("cuBLAS workspaces released" in line for line in sleeps)


def test_with_the_rng_state_left_to_full_graphs_on_torchs_stream_they_keep_them_all(caplog):
    driver, manager = make()
    driver.fail("hold_generator_graph_state")
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        capture_stream_workspaces(driver, manager)
    assert "RNG state was not put on the capture stream: CUDA error" in caplog.text
    assert CAPTURE_STREAM in manager.trusted_streams()  # the workspaces went on
    full_graphs_on_torchs_capture_stream(driver, manager)
    assert driver.generator_state[1] == TORCH_CAPTURE_STREAM
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE


def test_the_rng_state_is_held_once_per_engine_until_its_shutdown():
    driver, manager = make()
    for _ in range(2):  # vLLM enters graph_capture once per parallel group
        capture_stream_workspaces(driver, manager)
    assert len(driver.generator_holds) == 1
    manager.release_pools()
    assert driver.generator_state is None
    capture_stream_workspaces(driver, manager)  # a next engine in this process
    assert len(driver.generator_holds) == 2


def test_a_side_stream_left_outside_keeps_them_all():
    driver, manager = make()
    driver.current_stream = AUX_STREAM
    driver.create_blas_workspaces()
    driver.current_stream = CAPTURE_STREAM
    manager.create_blas_workspaces_in_graph_pool()  # vLLM's aux stream not passed
    driver.current_stream = AUX_STREAM
    driver.create_blas_workspaces()  # the warm-up: made again, outside every pool
    driver.current_stream = 0
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE


def test_a_cached_segment_with_nothing_in_use_on_another_stream_holds_no_workspace():
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    driver.outside_segments.append((0x1234000, PROFILING_STREAM, 0))
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE + 1


def test_a_next_engine_capturing_on_the_same_stream_gets_workspaces_in_its_own_pool():
    driver, manager = make()
    first = capture_stream_workspaces(driver, manager)
    manager.release_pools()  # engine shutdown
    assert first["blas"] not in manager.allocations  # freed with the dropped pool
    second = capture_stream_workspaces(driver, manager)  # a pooled stream comes back
    assert second["blas"] in graph_pool_segments(manager)
    manager.sleep(offload_tags=("cudagraph",))
    # Each engine's first capture, shutdown, then this sleep.
    assert driver.blas_releases == 2 * FIRST_CAPTURE + 2


@pytest.mark.parametrize("kept_by", ["the switch", "a stream it cannot trust"])
def test_shutdown_drops_graph_pool_workspaces_whatever_a_sleep_would_keep(kept_by):
    """Review, 2026-12-06: a workspace a sleep keeps would outlive the graph
    pool, and the next engine would capture with it."""
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver, release_blas_workspaces=kept_by != "the switch")
    first = capture_stream_workspaces(driver, manager)
    if kept_by != "the switch":
        driver.outside_segments.append((0x5555000, 0x999, PAGE))  # eager memory elsewhere
    manager.sleep(offload_tags=("cudagraph",))  # keeps them
    assert first["blas"] in manager.allocations
    manager.wake_up()
    manager.release_pools()  # engine shutdown
    assert first["blas"] not in manager.allocations  # freed with the dropped pool
    second = capture_stream_workspaces(driver, manager)
    assert second["blas"] != first["blas"] and second["blas"] in graph_pool_segments(manager)


def test_a_next_engine_trusts_none_of_the_streams_an_earlier_one_trusted():
    """torch hands stream handles out again. Here the next engine's capture
    stream has the handle an earlier engine trusted, and a workspace made
    eagerly outside every pool, in a segment that held as much at the earlier
    engine's release: the growth check cannot tell."""
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    leftover = (0x1234000, CAPTURE_STREAM, BLAS_WORKSPACE + LT_WORKSPACE)
    driver.outside_segments.append(leftover)
    manager.sleep(offload_tags=("cudagraph",))  # trusted; notes the leftover
    manager.wake_up()
    manager.release_pools()  # engine shutdown
    releases = driver.blas_releases
    with manager.cudagraph_pool() as pool, manager.routed_to(pool):
        driver.malloc(PAGE)  # a drafter's graph from load_model: no first-capture drop
    driver.workspaces[CAPTURE_STREAM] = {"blas": 0x1234000, "lt": 0x1234000 + BLAS_WORKSPACE}
    driver.current_stream = CAPTURE_STREAM
    manager.create_blas_workspaces_in_graph_pool()  # finds them made: nothing moves
    driver.current_stream = 0
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == releases


def test_a_failed_drop_before_the_first_capture_leaves_the_capture_to_go_on(caplog):
    driver, manager = make()

    def failing():
        raise RuntimeError("CUDA error: unspecified launch failure")

    driver.release_blas_workspaces = failing
    driver.current_stream = CAPTURE_STREAM
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        manager.create_blas_workspaces_in_graph_pool(side_streams=[AUX_STREAM])
    assert "were not dropped before the first capture: CUDA error" in caplog.text
    for stream in (CAPTURE_STREAM, AUX_STREAM):
        assert driver.workspaces[stream]["blas"] in graph_pool_segments(manager)
    assert driver.current_stream == CAPTURE_STREAM and not driver.routing


def test_a_trusted_stream_where_torch_later_made_more_outside_is_no_longer_trusted():
    """After a release, eager cuBLAS work on the capture stream (torch hands
    stream handles out again) makes its workspaces outside the pool; a capture
    there would use them, so they must not be freed at the next sleep."""
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    driver.outside_segments.append((0x1234000, CAPTURE_STREAM, LT_WORKSPACE + 1024))
    manager.sleep(offload_tags=("cudagraph",))
    manager.wake_up()
    assert driver.blas_releases == FIRST_CAPTURE + 1
    manager.sleep(offload_tags=("cudagraph",))  # nothing new there: released again
    manager.wake_up()
    assert driver.blas_releases == FIRST_CAPTURE + 2
    driver.current_stream = CAPTURE_STREAM
    driver.create_blas_workspaces()  # eager work: new workspaces, outside the pool
    manager.create_blas_workspaces_in_graph_pool()  # a new capture finds them made
    driver.current_stream = 0
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == FIRST_CAPTURE + 2


def test_a_failure_after_the_cublas_step_still_keeps_its_block_out_of_the_backup():
    driver, manager = make(release_blas_workspaces=False)
    driver.current_stream = CAPTURE_STREAM

    def out_of_memory():
        raise RuntimeError("CUDA out of memory")

    driver.create_blas_lt_workspace = out_of_memory
    manager.create_blas_workspaces_in_graph_pool()
    made = driver.workspaces[CAPTURE_STREAM]["blas"]
    manager.sleep(offload_tags=("cudagraph",))
    assert manager.allocations[made].backup_bytes() == 0


def test_the_workspaces_are_kept_when_switched_off(monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_BLAS_WORKSPACES", "0")
    driver, manager = make()
    capture_stream_workspaces(driver, manager)
    manager.sleep(offload_tags=("cudagraph",))
    assert driver.blas_releases == 0 and len(driver.workspaces) == 2
    assert driver.generator_holds == []  # it only serves the release


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


class Platform:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def is_cuda(self) -> bool:
        return self.cuda


@pytest.mark.parametrize(
    "aux,cuda,passed",
    [
        (AUX_STREAM, True, True),
        (None, True, False),
        # ROCm: vLLM makes the stream but runs shared experts without it.
        (AUX_STREAM, False, False),
    ],
)
def test_graph_capture_passes_vllms_aux_stream_once_it_exists_on_cuda(
    monkeypatch, aux, cuda, passed
):
    import vllm.platforms as platforms
    from vllm.utils import torch_utils

    driver, manager = make()
    monkeypatch.setattr(GraphSleepAllocator, "get_instance", classmethod(lambda cls: manager))
    monkeypatch.setattr(config, "routes_to_pools", lambda: True)
    monkeypatch.setattr(torch_utils, "_aux_stream", aux)
    monkeypatch.setattr(platforms, "_current_platform", Platform(cuda))

    @contextmanager
    def original(self, graph_capture_context=None):
        driver.current_stream = CAPTURE_STREAM
        yield graph_capture_context

    with _wrap_graph_capture(original)(object()):
        pass
    assert set(driver.workspaces) == {CAPTURE_STREAM} | ({AUX_STREAM} if passed else set())
