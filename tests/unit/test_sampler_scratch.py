"""vLLM's Triton top-k/top-p sampler scratch is dropped by our backend's sleep
(CPU, faked VMM layer), before the allocator empties torch's cache."""

import logging
import sys
import types

import pytest
import torch

from tests.unit.fake_vmm import FakeVmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.backend import GraphSleepBackend
from vllm_graph_sleep.sampler_scratch import SAMPLER_MODULE, drop_sampler_scratch


@pytest.fixture
def backend(install_allocator):
    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    return GraphSleepBackend()


def sampler_module(monkeypatch, calls: list[str]) -> types.ModuleType:
    module = types.ModuleType(SAMPLER_MODULE)
    module.reset_buffer_cache = lambda: calls.append("scratch dropped")
    monkeypatch.setitem(sys.modules, SAMPLER_MODULE, module)
    return module


def test_sleep_drops_the_sampler_scratch_before_the_allocator_empties_the_cache(
    monkeypatch, backend
):
    calls: list[str] = []
    sampler_module(monkeypatch, calls)
    manager = GraphSleepAllocator.get_instance()
    sleep = manager.sleep
    monkeypatch.setattr(manager, "sleep", lambda **kw: (calls.append("sleep"), sleep(**kw)))
    backend.suspend(level=1)
    backend.resume()
    backend.suspend(level=2)
    assert calls == ["scratch dropped", "sleep"] * 2


def test_an_invalid_level_drops_nothing(monkeypatch, backend):
    calls: list[str] = []
    sampler_module(monkeypatch, calls)
    with pytest.raises(ValueError, match="sleep level must be one of"):
        backend.suspend(level=3)
    assert calls == []


def test_a_sampler_vllm_never_imported_is_not_imported_for_it(monkeypatch, backend):
    monkeypatch.delitem(sys.modules, SAMPLER_MODULE, raising=False)
    backend.suspend(level=1)
    assert SAMPLER_MODULE not in sys.modules


def test_without_vllms_reset_the_sleep_goes_on_and_says_what_is_missing(
    monkeypatch, backend, caplog
):
    monkeypatch.setitem(sys.modules, SAMPLER_MODULE, types.ModuleType(SAMPLER_MODULE))
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        backend.suspend(level=1)
    assert f"{SAMPLER_MODULE}.reset_buffer_cache is missing in vLLM" in caplog.text
    assert backend.state() == "SUSPENDED"


def test_a_failed_drop_leaves_the_sleep_to_go_on(monkeypatch, backend, caplog):
    module = sampler_module(monkeypatch, [])

    def refuse():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    module.reset_buffer_cache = refuse
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        backend.suspend(level=1)
    assert "scratch stays resident while asleep: CUDA error" in caplog.text
    assert backend.state() == "SUSPENDED"


def test_a_vllm_that_captures_sampling_into_graphs_keeps_the_scratch(monkeypatch, backend):
    """Later vLLMs capture sampling into model runner V2's graphs, which would
    use the scratch by address; 0.26 has no such module."""
    import importlib.util

    import vllm_graph_sleep.sampler_scratch as sampler_scratch

    assert importlib.util.find_spec(sampler_scratch.SAMPLING_GRAPHS_MODULE) is None
    calls: list[str] = []
    sampler_module(monkeypatch, calls)
    graphs = types.ModuleType(sampler_scratch.SAMPLING_GRAPHS_MODULE)
    graphs.__spec__ = importlib.util.spec_from_loader(graphs.__name__, loader=None)
    monkeypatch.setitem(sys.modules, sampler_scratch.SAMPLING_GRAPHS_MODULE, graphs)
    backend.suspend(level=1)
    assert calls == [] and backend.state() == "SUSPENDED"


def test_vllms_own_reset_empties_the_installed_samplers_cache():
    """The seam, against the vLLM installed here (its module imports on a CPU
    machine: Triton is then disabled, not missing)."""
    sampler = pytest.importorskip(SAMPLER_MODULE)
    sampler._TRITON_BUFFER_CACHE[("cpu", torch.float32, 8)] = torch.empty(2, 8)
    sampler._TRITON_TABLE_CACHE["cpu"] = (torch.empty(1), torch.empty(1))
    drop_sampler_scratch()
    assert sampler._TRITON_BUFFER_CACHE == {} and sampler._TRITON_TABLE_CACHE == {}
