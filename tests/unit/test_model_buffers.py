"""A level-2 sleep saves the model's buffers at once, and vLLM's own wake puts
them back bit-exact (CPU: vLLM's real Worker.sleep and Worker.wake_up, with a
stand-in sleep-mode backend and torch's device queries stubbed)."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch

from tests.unit.force_cpu_platform import force_cpu_platform

force_cpu_platform()

from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from vllm_graph_sleep import config, model_buffers  # noqa: E402
from vllm_graph_sleep.patches import v1_worker_gpu_worker  # noqa: E402


class Model(torch.nn.Module):
    """Buffers of every kind a model registers, and one of each odd shape."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("k_scale", torch.tensor(0.37))  # 0-dim, as vLLM's scales
        self.register_buffer("cos_sin", torch.randn(7, 5, generator=generator).bfloat16())
        self.register_buffer("mask", torch.rand(3, 4, generator=generator) > 0.5)
        self.register_buffer("ids", torch.arange(12, dtype=torch.int64).reshape(3, 4).t())
        self.register_buffer("fp8", torch.randn(9, generator=generator).to(torch.float8_e4m3fn))
        self.register_buffer("freqs", torch.randn(6, generator=generator, dtype=torch.complex64))
        self.register_buffer("empty", torch.empty(0, 3))
        self.register_buffer("nan", torch.tensor([float("nan"), 1.0]).view(torch.int32).add(1))
        self.register_buffer("sparse", torch.eye(3).to_sparse())
        self.shared = torch.nn.Module()
        self.shared.register_buffer("again", self.k_scale)  # one tensor, two names
        self.calls = 0

    def named_buffers(self, *args, **kwargs):
        self.calls += 1
        return super().named_buffers(*args, **kwargs)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    dense = tensor.to_dense() if tensor.layout != torch.strided else tensor
    return dense.contiguous().reshape(-1).view(torch.uint8)


def _overwrite(model: torch.nn.Module, byte: int) -> None:
    """Every byte of every dense buffer becomes `byte` (bools: `byte` odd)."""
    for buffer in model.buffers():
        if buffer.layout != torch.strided or not buffer.numel():
            continue
        if buffer.dtype == torch.bool:
            buffer.fill_(bool(byte % 2))
            continue
        raw = torch.full((buffer.numel() * buffer.element_size(),), byte, dtype=torch.uint8)
        buffer.copy_(raw.view(buffer.dtype).reshape(buffer.shape))


def _assert_same(saved: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    buffers = dict(model.named_buffers())
    assert list(saved) == list(buffers)
    for name, buffer in buffers.items():
        copy = saved[name]
        assert copy.device.type == "cpu", name
        assert (copy.dtype, copy.shape, copy.layout) == (buffer.dtype, buffer.shape, buffer.layout)
        assert torch.equal(_bits(copy), _bits(buffer)), name


def test_save_gives_what_vllms_per_buffer_copies_give(caplog):
    model = Model()
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        saved = model_buffers.save(model)
    # The worker's log says what the save took: it is outside the allocator's line.
    count = len(list(model.named_buffers()))
    assert re.search(
        rf"saved the model's {count} buffers \(.+\) in 1 chunk\(s\) in [0-9.]+ ms "
        r"\(layout made; listed [0-9.]+ ms, placed and staging buffer [0-9.]+ ms, copies queued "
        r"[0-9.]+ ms, waiting for the device [0-9.]+ ms, host views [0-9.]+ ms\)",
        caplog.text,
    )
    expected = {name: buffer.cpu().clone() for name, buffer in model.named_buffers()}
    _assert_same(saved, model)
    _assert_same(expected, model)
    # Copies, not views of the buffers: what a sleep loses stays saved.
    _overwrite(model, 0xAB)
    for name, copy in saved.items():
        assert torch.equal(_bits(copy), _bits(expected[name])), name


def test_the_next_save_keeps_the_layout_and_copies_the_buffers_as_they_are_now(caplog):
    model = Model()
    first = model_buffers.save(model)
    first_bits = {name: _bits(copy).clone() for name, copy in first.items()}
    _overwrite(model, 0x3C)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        second = model_buffers.save(model)
    assert "layout kept" in caplog.text
    _assert_same(second, model)
    # Into the same host memory: the first save's copies were read back by then.
    assert second["cos_sin"].data_ptr() == first["cos_sin"].data_ptr()
    assert any(not torch.equal(_bits(second[n]), first_bits[n]) for n in first_bits)


def test_a_buffer_replaced_or_reshaped_makes_a_new_layout(caplog):
    model = Model()
    model_buffers.save(model)
    model.cos_sin = torch.randn(4, 5).bfloat16()  # a new tensor, another shape
    model.ids = model.ids.t().contiguous()  # the same values, other strides
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        saved = model_buffers.save(model)
    assert "layout made" in caplog.text and "layout kept" not in caplog.text
    _assert_same(saved, model)


def test_a_non_contiguous_buffer_is_copied_as_it_is_at_each_save():
    model = Model()
    assert not model.ids.is_contiguous()
    model_buffers.save(model)
    model.ids.add_(100)  # in place: same tensor, same layout
    saved = model_buffers.save(model)
    assert torch.equal(saved["ids"], model.ids)


def test_hidden_shadows_named_buffers_only_inside():
    model = Model()
    names = [name for name, _ in model.named_buffers()]
    assert len(names) == 9  # the shared tensor once, as vLLM's save sees it
    with model_buffers.hidden(model):
        assert list(model.named_buffers()) == []
    assert [name for name, _ in model.named_buffers()] == names
    assert "named_buffers" not in model.__dict__


class _Backend:
    """Stands in for GraphSleepBackend: runs the steps given to
    `first_in_suspend` first in `suspend`, as ours does."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[str, object]] = []
        self.first_steps: list = []

    @contextlib.contextmanager
    def first_in_suspend(self, step):
        self.first_steps.append(step)
        try:
            yield
        finally:
            self.first_steps.remove(step)

    def suspend(self, level):
        self.calls.append(("suspend", level))
        for step in self.first_steps:
            step()
        if self.fail:
            raise RuntimeError("cuMemUnmap failed: an illegal memory access was encountered")

    def resume(self, tags):
        self.calls.append(("resume", tags))


class _Runner:
    def __init__(self) -> None:
        self.model = Model()

    def get_draft_model(self):
        return None

    def post_kv_cache_wake_up(self):
        pass


@pytest.fixture
def worker(monkeypatch):
    v1_worker_gpu_worker.apply()
    monkeypatch.setattr(config, "_active_in_this_process", True)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *args: (1 << 30, 2 << 30))
    worker = object.__new__(Worker)
    worker.model_runner = _Runner()
    worker._sleep_mode_backend = _Backend()
    worker._sleep_saved_buffers = {}
    worker._sleep_rebuild_draft_metadata_buffers = False
    return worker


@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_level_2_sleep_saves_once_and_vllms_wake_restores_bit_exact(worker, as_keyword):
    model = worker.model_runner.model
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.calls = 0
    assert (worker.sleep(level=2) if as_keyword else worker.sleep(2)) is None
    # Ours read the buffers once; vLLM's comprehension found none to copy.
    assert model.calls == 1
    assert worker._sleep_mode_backend.calls == [("suspend", 2)]
    _assert_same(worker._sleep_saved_buffers, model)
    _overwrite(model, 0x5A)  # what a level-2 sleep and a reload leave there
    worker.wake_up(None)
    for name, buffer in model.named_buffers():
        assert torch.equal(_bits(buffer), _bits(before[name])), name
    assert worker._sleep_saved_buffers == {}


def test_the_save_runs_in_our_backend_after_vllms_measure_and_beside_the_kv_release(
    worker, install_allocator, monkeypatch
):
    """vLLM measures the free memory its "Sleep mode freed" line starts
    from before it calls the backend: the KV cache's release, which our
    backend starts at a level-2 sleep's start, must come after that."""
    from tests.unit.fake_vmm import FakeVmmDriver
    from vllm_graph_sleep.allocator import GraphSleepAllocator
    from vllm_graph_sleep.backend import GraphSleepBackend

    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    with manager.allocation_tag("kv_cache"):
        kv_cache = driver.malloc(1 << 21)
    with manager.allocation_tag("weights"):
        weights = driver.malloc(1 << 21)
    measures: list[list[int]] = []

    def get_memory_info(*args):
        measures.append(list(driver.unmap_calls))
        return (1 << 30) + (1 << 20) * len(driver.unmap_calls), 2 << 30

    monkeypatch.setattr(torch.accelerator, "get_memory_info", get_memory_info)
    worker._sleep_mode_backend = GraphSleepBackend()
    model = worker.model_runner.model
    model.calls = 0
    assert worker.sleep(2) is None
    assert measures[0] == []  # nothing released before vLLM's first measure
    assert driver.unmap_threads == {kv_cache: "graph-sleep-kv-release", weights: "MainThread"}
    assert model.calls == 1  # read once, by ours, under vLLM's hidden comprehension
    _assert_same(worker._sleep_saved_buffers, model)
    assert "named_buffers" not in model.__dict__
    worker.wake_up(None)
    assert worker._sleep_saved_buffers == {}


class _ForwardingWrapper:
    """As vLLM's CUDAGraphWrapper around a drafter: not a Module; attribute
    reads it lacks go to the model it wraps (its __getattr__)."""

    def __init__(self, runnable) -> None:
        self.runnable = runnable

    def __getattr__(self, key):
        if hasattr(self.runnable, key):
            return getattr(self.runnable, key)
        raise AttributeError


def test_a_wrapped_model_has_its_buffers_saved_and_restored(worker):
    """Found on an H100 (lease 22): the save read the model's class method,
    which a wrapper's class does not have, and every level-2 sleep failed."""
    inner = worker.model_runner.model
    worker.model_runner.model = _ForwardingWrapper(inner)
    before = {name: buffer.clone() for name, buffer in inner.named_buffers()}
    assert worker.sleep(2) is None
    _assert_same(worker._sleep_saved_buffers, inner)
    _overwrite(inner, 0x5A)
    worker.wake_up(None)
    for name, buffer in inner.named_buffers():
        assert torch.equal(_bits(buffer), _bits(before[name])), name
    assert "named_buffers" not in worker.model_runner.model.__dict__


def test_a_level_1_sleep_saves_nothing(worker):
    worker.model_runner.model.calls = 0
    worker.sleep(1)
    assert worker._sleep_saved_buffers == {}
    assert worker.model_runner.model.calls == 0


def test_a_failed_level_2_sleep_keeps_the_saved_buffers_as_vllm_does(worker):
    worker._sleep_mode_backend = _Backend(fail=True)
    model = worker.model_runner.model
    with pytest.raises(RuntimeError, match="illegal memory access"):  # raised, as stock's
        worker.sleep(2)
    _assert_same(worker._sleep_saved_buffers, model)
    assert "named_buffers" not in model.__dict__


def test_without_pinned_memory_the_buffers_are_saved_all_the_same(monkeypatch):
    real_empty = torch.empty

    def pinning_fails(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", pinning_fails)
    model = Model()
    _assert_same(model_buffers.save(model), model)


def test_the_buffers_of_a_device_are_gathered_and_copied_at_once(monkeypatch):
    gathers: list[int] = []
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        gathers.append(len(tensors))
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting_cat)
    model = Model()
    _assert_same(model_buffers.save(model), model)
    # Every strided buffer (the sparse one aside) in one gather.
    assert gathers == [8]


def test_chunks_smaller_than_a_buffer_still_save_every_byte(monkeypatch):
    # cos_sin (70 bytes) and ids (96) are each larger than a chunk.
    monkeypatch.setattr(model_buffers, "_CHUNK_BYTES", 24)
    model = Model()
    _assert_same(model_buffers.save(model), model)


def test_without_device_memory_for_the_gather_each_buffer_is_copied_by_itself(monkeypatch):
    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB")

    monkeypatch.setattr(torch, "cat", no_room)
    model = Model()
    _assert_same(model_buffers.save(model), model)


class _DraftInner:
    """A DFlash/DSpark drafter's model: vLLM rebuilds its fused buffers from
    its weights at the wake after a level-2 sleep."""

    def __init__(self, events: list, weights_mapped) -> None:
        self._events, self._weights_mapped = events, weights_mapped

    def _build_fused_kv_buffers(self):
        self._events.append(("rebuild draft buffers", self._weights_mapped()))


class _RunnerTouchingWeights(_Runner):
    """post_kv_cache_wake_up as model runner V1's with an FP8 KV cache: it
    writes the attention layers' scale buffers, which live in the weights pool."""

    def __init__(self, events: list, weights_mapped) -> None:
        super().__init__()
        self._events, self._weights_mapped = events, weights_mapped
        self._draft = type("Draft", (), {"model": _DraftInner(events, weights_mapped)})()

    def get_draft_model(self):
        return self._draft

    def post_kv_cache_wake_up(self):
        self._events.append(("post_kv_cache_wake_up", self._weights_mapped()))


@pytest.fixture
def staged_worker(worker, install_allocator):
    """The worker on our real backend and allocator (over the fake driver),
    with a drafter and a model runner whose KV wake-up writes into the weights."""
    from tests.unit.fake_vmm import FakeVmmDriver
    from vllm_graph_sleep.allocator import GraphSleepAllocator
    from vllm_graph_sleep.backend import GraphSleepBackend

    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    with manager.allocation_tag("kv_cache"):
        driver.malloc(1 << 21)
    with manager.allocation_tag("weights"):
        weights = driver.malloc(1 << 21)
    events: list = []
    worker.model_runner = _RunnerTouchingWeights(events, lambda: weights in driver.memory)
    worker._sleep_mode_backend = GraphSleepBackend()
    return worker, events


@pytest.mark.parametrize("level", [1, 2])
def test_a_kv_cache_first_wake_leaves_the_weights_pool_to_the_weights_wake(staged_worker, level):
    """vLLM 0.26 restores the saved buffers, rebuilds the drafter's buffers and
    runs post_kv_cache_wake_up at a wake of the KV cache alone, all in the
    still-unmapped weights; each must run once, at the wake of the weights."""
    worker, events = staged_worker
    model = worker.model_runner.model
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    assert worker.sleep(level) is None
    assert worker.wake_up(["kv_cache"]) is None
    assert events == []
    if level == 2:
        _overwrite(model, 0x5A)  # the weights pool's pages as a level-2 wake maps them
    assert worker.wake_up(["weights"]) is None
    rebuilt = [("rebuild draft buffers", True)] if level == 2 else []
    assert events == rebuilt + [("post_kv_cache_wake_up", True)]
    for name, buffer in model.named_buffers():
        assert torch.equal(_bits(buffer), _bits(before[name])), name
    assert worker._sleep_saved_buffers == {}
    assert not worker._sleep_rebuild_draft_metadata_buffers


@pytest.mark.parametrize(
    "wakes", [[["weights"], ["kv_cache"]], [["kv_cache"], None], [None]], ids=str
)
def test_each_wake_order_runs_the_kv_wake_up_once_with_the_weights_mapped(staged_worker, wakes):
    worker, events = staged_worker
    worker.sleep(2)
    for tags in wakes:
        assert worker.wake_up(tags) is None
    assert events == [("rebuild draft buffers", True), ("post_kv_cache_wake_up", True)]
