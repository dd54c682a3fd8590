"""The backend lowers the interpreter's switch interval for the time of a
sleep and of a wake (vllm_graph_sleep/gil_handoffs.py), so that a thread busy
in Python beside them hands the GIL back quickly after each driver call, and
puts the interval back after; benchmarks/gil_handoffs.py's no-GPU exit."""

import sys

import pytest

from benchmarks import gil_handoffs as benchmark
from tests.unit.fake_vmm import PAGE, FakeVmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.gil_handoffs import SWITCH_INTERVAL_S, quick_gil_handoffs


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_interval_is_lowered_inside_and_put_back_after_even_on_an_error(interval):
    with quick_gil_handoffs():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == interval
    with pytest.raises(RuntimeError), quick_gil_handoffs():
        raise RuntimeError("a failed sleep")
    assert sys.getswitchinterval() == interval


def test_an_interval_already_lower_stays(interval):
    sys.setswitchinterval(SWITCH_INTERVAL_S / 5)
    with quick_gil_handoffs():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S / 5)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S / 5)


class IntervalSeen(FakeVmmDriver):
    """Records the switch interval at each map and unmap, as a driver call would see it."""

    def __init__(self):
        super().__init__()
        self.seen: list[float] = []

    def unmap_and_release(self, device, size, address, handle):
        self.seen.append(sys.getswitchinterval())
        super().unmap_and_release(device, size, address, handle)

    def create_and_map(self, device, size, address, handle):
        self.seen.append(sys.getswitchinterval())
        super().create_and_map(device, size, address, handle)


def test_the_backends_sleep_and_wake_make_their_driver_calls_at_the_lowered_interval(
    install_allocator, interval
):
    from vllm_graph_sleep.backend import GraphSleepBackend

    driver = IntervalSeen()
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    for tag in ("weights", "kv_cache", "cudagraph"):
        with manager.allocation_tag(tag):
            driver.malloc(PAGE)
    driver.seen.clear()  # torch's allocations, not the backend's
    backend = GraphSleepBackend()
    backend.suspend(level=1)
    assert len(driver.seen) == 3 and sys.getswitchinterval() == interval
    backend.resume()
    assert len(driver.seen) == 6 and sys.getswitchinterval() == interval
    assert driver.seen == pytest.approx([SWITCH_INTERVAL_S] * 6)


def test_the_benchmark_says_there_is_no_gpu_and_exits_2(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: False)
    assert benchmark.main(["--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
