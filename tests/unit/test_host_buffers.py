"""The real driver's host buffers (vllm_graph_sleep._native) on CPU, with the
GPU runtime's calls recorded by a fake: exact size, registered once and
unregistered once, after the last view and before the memory is unmapped; the
fallback to torch's pinned allocator; the environment switch; the totals the
bench reads."""

from __future__ import annotations

import collections
import logging
import mmap
from pathlib import Path

import pytest
import torch

from tests.unit.fake_vmm import PAGE, FakeVmmDriver
from vllm_graph_sleep import _native
from vllm_graph_sleep._native import (
    REGISTERED_HOST_BUFFERS,
    TORCH_HOST_BUFFERS,
    HostBuffers,
    host_buffer_kind,
    registered_host_memory,
)
from vllm_graph_sleep.allocator import HOST_BUFFERS_ENV, GraphSleepAllocator

# A finalizer that raises must fail the test, not only print.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ERROR_MEMORY_ALLOCATION = 2
ERROR_CAPTURE_UNSUPPORTED = 900  # a call not permitted while a stream captures


def mapping_at(address: int) -> tuple[str, list[str]] | None:
    """(permissions, VmFlags) of this process's mapping at `address`, if any."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                found = (fields[1], []) if start <= address < end else None
            elif found is not None and fields[0] == "VmFlags:":
                found[1].extend(fields[1:])
                return found
    return found


def is_mapped(address: int) -> bool:
    return mapping_at(address) is not None


class FakeRuntime:
    """Records what `_TorchRuntime` would ask the GPU runtime; a refused call
    leaves its error pending, as the real runtime does, until read."""

    def __init__(self, register_error: int = 0, unregister_error: int = 0):
        self.register_error = register_error
        self.unregister_error = unregister_error
        self.registered: dict[int, int] = {}  # address -> bytes, registered now
        self.calls: list[tuple] = []
        self.pending_error = 0

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address, size, flags))
        if self.register_error:
            self.pending_error = self.register_error
            return self.register_error
        assert address not in self.registered, "registered twice"
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        # Whether the memory was still mapped when it was unregistered.
        self.calls.append(("unregister", address, is_mapped(address)))
        if self.unregister_error:
            self.pending_error = self.unregister_error
            return self.unregister_error
        del self.registered[address]
        return 0

    def cudaGetLastError(self) -> int:
        error, self.pending_error = self.pending_error, 0
        return error

    def cudaGetErrorName(self, error: int) -> str:
        return {
            ERROR_MEMORY_ALLOCATION: "cudaErrorMemoryAllocation",
            ERROR_CAPTURE_UNSUPPORTED: "cudaErrorStreamCaptureUnsupported",
        }[error]

    def unregistered(self) -> list[tuple]:
        return [call for call in self.calls if call[0] == "unregister"]


@pytest.fixture(autouse=True)
def totals(monkeypatch):
    """This test's own process-wide state: totals (registered bytes, seconds),
    the queue of dropped buffers and those that failed to unregister."""
    monkeypatch.setattr(_native, "_registered_totals", _native._RegisteredTotals())
    monkeypatch.setattr(_native, "_dropped", collections.deque())
    monkeypatch.setattr(_native, "_still_registered", [])


@pytest.fixture
def torch_pinned(monkeypatch):
    """Sizes asked of torch's pinned allocator (which needs a GPU; plain memory here)."""
    sizes: list[int] = []

    def pinned(size: int) -> torch.Tensor:
        sizes.append(size)
        return torch.empty(size, dtype=torch.uint8)

    monkeypatch.setattr(_native, "_torch_pinned_buffer", pinned)
    return sizes


def registered_buffers(runtime: FakeRuntime) -> HostBuffers:
    return HostBuffers(REGISTERED_HOST_BUFFERS, lambda: runtime)


def test_a_buffer_is_exactly_the_size_asked_and_its_pages_are_registered_once(torch_pinned):
    runtime = FakeRuntime()
    size = 3 * mmap.PAGESIZE + 123
    host = registered_buffers(runtime).make(size)
    assert (host.dtype, host.device, host.numel()) == (torch.uint8, torch.device("cpu"), size)
    assert runtime.calls == [("register", host.data_ptr(), 4 * mmap.PAGESIZE, 0)]
    assert host.data_ptr() % mmap.PAGESIZE == 0
    permissions, flags = mapping_at(host.data_ptr())
    assert permissions == "rw-p"  # private: shared anonymous memory is shmem
    if THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text():
        assert "hg" in flags  # advised to use huge pages
    host.fill_(7)
    assert int(host.sum()) == 7 * size
    registered_bytes, seconds = registered_host_memory()
    assert registered_bytes == 4 * mmap.PAGESIZE
    assert seconds > 0
    assert torch_pinned == []


def test_unregister_runs_once_after_the_last_view_is_gone_and_before_the_unmap():
    runtime = FakeRuntime()
    host = registered_buffers(runtime).make(2 * PAGE)
    address = host.data_ptr()
    head, tail = host[:PAGE], host[PAGE:]
    as_words = host.view(torch.int32)
    as_array = host.numpy()
    del host
    head.fill_(1)
    del head
    del as_words
    del as_array
    _native.release_dropped_host_buffers()
    assert runtime.unregistered() == []  # a view is left
    assert int(tail[-1]) == 0
    del tail
    # Not where the last view died (that can be inside torch's allocator
    # callback), but at the next release point, and still mapped then.
    assert runtime.unregistered() == [] and is_mapped(address)
    assert registered_host_memory()[0] == 2 * PAGE
    _native.release_dropped_host_buffers()
    assert runtime.unregistered() == [("unregister", address, True)]
    assert runtime.registered == {}
    assert not is_mapped(address)
    assert registered_host_memory()[0] == 0
    _native.release_dropped_host_buffers()
    assert len(runtime.unregistered()) == 1


def test_a_refused_registration_falls_back_to_torch_with_one_warning(torch_pinned, caplog):
    runtime = FakeRuntime(register_error=ERROR_MEMORY_ALLOCATION)
    buffers = registered_buffers(runtime)
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        first = buffers.make(PAGE)
        second = buffers.make(3 * PAGE)
    assert first.numel() == PAGE and second.numel() == 3 * PAGE
    assert torch_pinned == [PAGE, 3 * PAGE]
    assert [call[0] for call in runtime.calls] == ["register"]  # no retry
    assert runtime.pending_error == 0, "the refusal's error was left for torch to raise"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "error 2 (cudaErrorMemoryAllocation)" in warnings[0]
    assert f"{HOST_BUFFERS_ENV}=torch" in warnings[0]
    registered_bytes, seconds = registered_host_memory()
    assert registered_bytes == 0 and seconds > 0  # the attempt counts as pinning time


def test_a_runtime_out_of_reach_falls_back_to_torch_with_one_warning(torch_pinned, caplog):
    def no_runtime():
        raise OSError("libcudart.so.13: cannot open shared object file")

    buffers = HostBuffers(REGISTERED_HOST_BUFFERS, no_runtime)
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        buffers.make(PAGE)
        buffers.make(PAGE)
    assert torch_pinned == [PAGE, PAGE]
    assert len(caplog.records) == 1
    assert "libcudart.so.13" in caplog.records[0].getMessage()


def test_a_failed_unregister_is_logged_and_its_pages_stay_counted_and_mapped(caplog):
    runtime = FakeRuntime(unregister_error=ERROR_CAPTURE_UNSUPPORTED)
    host = registered_buffers(runtime).make(PAGE)
    address = host.data_ptr()
    del host
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        _native.release_dropped_host_buffers()
    assert len(runtime.unregistered()) == 1
    assert runtime.pending_error == 0
    assert "cudaErrorStreamCaptureUnsupported" in caplog.records[0].getMessage()
    assert registered_host_memory()[0] == PAGE  # the driver may still hold them
    # Unmapped, the addresses could go to the next mapping while the driver
    # still translates them to the registered pages.
    assert is_mapped(address)
    assert runtime.registered == {address: PAGE}


def test_an_unregister_that_raises_keeps_the_pages_mapped_and_the_caller_going(caplog):
    runtime = FakeRuntime()

    def raises(address: int) -> int:
        raise RuntimeError("no current device")

    runtime.cudaHostUnregister = raises
    host = registered_buffers(runtime).make(PAGE)
    address = host.data_ptr()
    del host
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        _native.release_dropped_host_buffers()  # at the end of a sleep: must not raise
    assert "no current device" in caplog.records[0].getMessage()
    assert is_mapped(address) and runtime.registered == {address: PAGE}
    assert registered_host_memory()[0] == PAGE


def test_nothing_is_unregistered_at_interpreter_exit(monkeypatch):
    runtime = FakeRuntime()
    host = registered_buffers(runtime).make(PAGE)
    monkeypatch.setattr(_native._RegisteredMapping, "_finalizing", staticmethod(lambda: True))
    del host
    _native.release_dropped_host_buffers()
    assert runtime.unregistered() == []


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, REGISTERED_HOST_BUFFERS),
        ("", REGISTERED_HOST_BUFFERS),
        ("registered", REGISTERED_HOST_BUFFERS),
        ("torch", TORCH_HOST_BUFFERS),
        (" Torch ", TORCH_HOST_BUFFERS),
    ],
)
def test_the_environment_chooses_how_buffers_are_pinned(monkeypatch, value, kind):
    if value is None:
        monkeypatch.delenv(HOST_BUFFERS_ENV, raising=False)
    else:
        monkeypatch.setenv(HOST_BUFFERS_ENV, value)
    assert host_buffer_kind() == kind


def test_an_unknown_value_names_the_variable_and_what_it_takes(monkeypatch):
    monkeypatch.setenv(HOST_BUFFERS_ENV, "pinned")
    with pytest.raises(ValueError) as raised:
        host_buffer_kind()
    message = str(raised.value)
    assert HOST_BUFFERS_ENV in message and "'pinned'" in message
    assert "'registered'" in message and "'torch'" in message


class FakeExtension:
    platform = "cuda"


def test_the_driver_pins_as_the_environment_says(monkeypatch, torch_pinned):
    runtime = FakeRuntime()
    monkeypatch.setattr(_native, "_load_extension", FakeExtension)
    monkeypatch.setattr(_native, "_TorchRuntime", lambda: runtime)
    monkeypatch.delenv(HOST_BUFFERS_ENV, raising=False)
    registered = _native.VmmDriver().host_buffer(PAGE)
    assert runtime.registered == {registered.data_ptr(): PAGE}
    assert torch_pinned == []

    monkeypatch.setenv(HOST_BUFFERS_ENV, "torch")
    _native.VmmDriver().host_buffer(PAGE)
    assert torch_pinned == [PAGE]
    assert len(runtime.calls) == 1

    monkeypatch.setenv(HOST_BUFFERS_ENV, "pinned")
    with pytest.raises(ValueError, match=HOST_BUFFERS_ENV):
        _native.VmmDriver()


def test_a_dropped_torch_pinned_buffer_has_torch_unpin_its_cache(monkeypatch, torch_pinned):
    """Review, 2026-12-06: torch keeps a freed pinned block cached (pinned), so
    with torch's buffers VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY=1 freed nothing."""
    emptied: list[bool] = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(True))
    monkeypatch.setattr(_native, "_load_extension", FakeExtension)
    monkeypatch.setenv(HOST_BUFFERS_ENV, "torch")
    driver = _native.VmmDriver()
    kept = driver.host_buffer(PAGE)
    dropped = driver.host_buffer(PAGE)
    driver.release_dropped_host_buffers()
    assert emptied == []  # nothing of ours dropped: torch's cache is left alone
    del dropped
    driver.release_dropped_host_buffers()
    driver.release_dropped_host_buffers()
    assert emptied == [True] and kept.numel() == PAGE


KIB = 1 << 10


def held_buffers(manager: GraphSleepAllocator) -> dict[int, int]:
    return {
        a.host.data_ptr(): -(-a.host.numel() // mmap.PAGESIZE) * mmap.PAGESIZE
        for a in manager.allocations.values()
        if a.host is not None
    }


def test_sleep_cycles_keep_exactly_the_buffers_the_allocator_holds_registered():
    """Replaced (too small, far too large), released after a wake, freed with
    their allocation, discarded: every buffer the allocator lets go of is
    unregistered, and what it holds stays registered."""
    runtime = FakeRuntime()
    driver = FakeVmmDriver()
    driver.host_buffer = registered_buffers(runtime).make
    driver.release_dropped_host_buffers = _native.release_dropped_host_buffers
    manager = GraphSleepAllocator(driver)
    with manager.cudagraph_pool() as pool, manager.routed_to(pool):
        graph_segment = driver.malloc(PAGE)
    weights = driver.malloc(PAGE)
    driver.write(weights, 9)

    def cycle(live: int, release_host_memory: bool = False) -> None:
        driver.write(graph_segment, 7)
        driver.blocks[graph_segment] = [(0, live, "active_allocated")]
        manager.sleep(offload_tags=("cudagraph", "default"))
        assert runtime.registered == held_buffers(manager)
        manager.release_host_memory = release_host_memory
        manager.wake_up()
        assert runtime.registered == held_buffers(manager)
        assert bool((driver.read(graph_segment)[:live] == 7).all())
        assert bool((driver.read(weights) == 9).all())

    cycle(live=256 * KIB)
    cycle(live=256 * KIB)  # reused
    cycle(live=64 * KIB)  # far too large: replaced
    cycle(live=512 * KIB)  # too small: replaced
    cycle(live=512 * KIB, release_host_memory=True)
    assert runtime.registered == {}
    cycle(live=512 * KIB)
    driver.free(weights)
    # Freed from torch's allocator callback: its backup is unregistered at the
    # next release point (the sleep), not inside the callback.
    assert len(runtime.registered) == len(held_buffers(manager)) + 1
    manager.sleep(offload_tags=("cudagraph",))
    assert runtime.registered == held_buffers(manager)
    manager.discard("cudagraph")
    assert runtime.registered == {}
    registered = [call for call in runtime.calls if call[0] == "register"]
    assert len(runtime.unregistered()) == len(registered) == 6
    assert all(mapped for _, _, mapped in runtime.unregistered())
    assert registered_host_memory()[0] == 0


def test_shutdown_lets_go_of_the_buffers_kept_for_a_next_sleep():
    """A buffer an awake allocation keeps for its next sleep is let go at
    shutdown: that engine sleeps no more, and the allocation may be freed
    (its tensor outliving the engine) after the last release point."""
    runtime = FakeRuntime()
    driver = FakeVmmDriver()
    driver.host_buffer = registered_buffers(runtime).make
    driver.release_dropped_host_buffers = _native.release_dropped_host_buffers
    manager = GraphSleepAllocator(driver)
    awake = driver.malloc(PAGE)
    with manager.allocation_tag("weights"):
        asleep = driver.malloc(PAGE)
    driver.write(asleep, 4)
    manager.sleep(offload_tags=("default", "weights"))
    manager.wake_up(tags=["kv_cache"])  # the weights stay asleep
    assert runtime.registered == held_buffers(manager) and len(runtime.registered) == 2
    manager.release_pools()  # engine shutdown
    assert manager.allocations[awake].host is None
    assert runtime.registered == held_buffers(manager) and len(runtime.registered) == 1
    driver.free(awake)
    assert len(runtime.registered) == 1
    manager.wake_up()  # a backup stays until its allocation is woken or freed
    assert bool((driver.read(asleep) == 4).all())


@pytest.mark.parametrize("failing", ["fingerprint", "host_buffer"])
def test_a_failed_backup_ahead_unpins_the_buffers_it_made_before_it_returns(failing):
    """The fingerprints fail once every buffer is made, or pinning the third
    one fails (host memory short): the buffers made are unregistered before
    back_up_ahead returns, not at the first sleep (a server that never sleeps
    would hold them pinned). The failure's traceback holds views of them."""
    runtime = FakeRuntime()
    driver = FakeVmmDriver()
    make, made = registered_buffers(runtime).make, []

    def host_buffer(size: int) -> torch.Tensor:
        if failing == "host_buffer" and len(made) == 2:
            raise RuntimeError("CUDA error: out of memory (pinned host allocation)")
        made.append(size)
        return make(size)

    driver.host_buffer = host_buffer
    driver.release_dropped_host_buffers = _native.release_dropped_host_buffers
    manager = GraphSleepAllocator(driver)
    for seed in range(4):
        with manager.allocation_tag("weights"):
            driver.write(driver.malloc(PAGE), seed + 1)
    if failing == "fingerprint":
        driver.fail("fingerprint")
    assert manager.back_up_ahead(("weights",)) is None
    assert made and manager.host_bytes() == 0
    assert runtime.registered == {}
    assert len(runtime.unregistered()) == len(made)
