"""The Gemma4 MTP drafter's centroid graphs are captured into our graph pool
when graph offload is active, and exactly as in stock vLLM otherwise (CPU: the
capture path up to torch.cuda.graph; the GPU test captures for real)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.fake_vmm import FakeVmmDriver
from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GRAPH_TAG, GraphSleepAllocator
from vllm_graph_sleep.patches import v1_spec_decode_gemma4 as patch

# torch.cuda.graph makes a CUDA stream unless given one; nothing runs on it here.
CPU_STREAM = object()


class RecordingProposer:
    """Records what the method would capture with: the graph context torch.cuda
    offers at call time, its pool, and the tag and routing in force."""

    def __init__(self, driver):
        self.driver = driver
        self.seen = []

    def _setup_centroids_cuda_graphs(self):
        graph = torch.cuda.graph(None, stream=CPU_STREAM)
        named = torch.cuda.graph(None, pool=(9, 9), stream=CPU_STREAM)
        manager = GraphSleepAllocator.current()
        self.seen.append((graph.pool, named.pool, manager.current_tag, list(self.driver.routing)))


@pytest.fixture
def manager(install_allocator):
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    return manager


def test_captures_go_to_the_graph_pool_and_this_thread_is_routed_there(monkeypatch, manager):
    monkeypatch.setattr(config, "_active_in_this_process", True)
    proposer = RecordingProposer(manager.driver)
    stock = torch.cuda.graph
    with manager.use_memory_pool("weights"):  # load_model's pool
        patch._wrap_setup(RecordingProposer._setup_centroids_cuda_graphs)(proposer)
    (default_pool, named_pool, tag, routing) = proposer.seen[0]
    graph_pool_id = next(iter(manager.pool_ids()))
    assert default_pool == (graph_pool_id,) and named_pool == ((9, 9),)
    assert tag == GRAPH_TAG and routing == []  # load_model's pool unrouted meanwhile
    assert torch.cuda.graph is stock


@pytest.mark.parametrize("profiling", [False, True])
def test_stock_capture_when_inactive_or_profiling(monkeypatch, manager, profiling):
    monkeypatch.setattr(config, "_active_in_this_process", profiling)
    proposer = RecordingProposer(manager.driver)
    wrapped = patch._wrap_setup(RecordingProposer._setup_centroids_cuda_graphs)
    with config.outside_pools():
        wrapped(proposer)
    if not profiling:
        wrapped(proposer)
    for default_pool, named_pool, tag, routing in proposer.seen:
        assert default_pool == () and named_pool == ((9, 9),)
        assert tag == "default" and routing == []


def test_the_patch_wraps_vllms_method():
    from vllm.v1.spec_decode.gemma4 import Gemma4Proposer

    from vllm_graph_sleep.patches._wrap import is_wrapped

    patch.apply()
    patch.apply()
    assert is_wrapped(Gemma4Proposer._setup_centroids_cuda_graphs)
