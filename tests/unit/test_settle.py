"""The driver probes a sleep leaves to a background thread (vllm_graph_sleep.settle),
on the faked VMM layer (CPU): when they run, that a wake stops them first, that
a failing probe costs nothing, and the switch."""

import gc
import logging
import subprocess
import sys
import threading
import time
import weakref

import pytest

from tests.unit.fake_vmm import FakeVmmDriver
from tests.unit.test_allocator_bookkeeping import MIB, allocate
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.settle import PROBE_DELAYS_S, Settler


def asleep(delays=None, fail_probes=False, **kwargs):
    """An allocator asleep at level 1 on the fake; `delays` replaces the probe
    schedule, `fail_probes` makes every probe fail (both before the sleep, so
    no probe can run first on a slow machine)."""
    driver = FakeVmmDriver()
    if delays is not None:
        kwargs["settler"] = Settler(driver.probe_mapping, delays=delays)
    manager = GraphSleepAllocator(driver, **kwargs)
    if fail_probes:
        driver.fail("probe_mapping")
    allocate(driver, manager, "weights", 2 * MIB, value=7)
    allocate(driver, manager, "kv_cache", 4 * MIB)
    manager.sleep(offload_tags=("weights",))
    return driver, manager


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_sleep_probes_each_device_at_every_delay_and_the_wake_reports_it(caplog):
    driver, manager = asleep()
    assert wait_for(lambda: len(driver.probes) == len(PROBE_DELAYS_S))
    assert driver.probes == [0] * len(PROBE_DELAYS_S)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.wake_up()
    assert f"{len(PROBE_DELAYS_S)} driver probe(s) while asleep" in caplog.text
    assert bool((driver.read(next(iter(driver.memory))) == 7).all())


def test_a_wake_before_the_first_probe_stops_the_thread_and_none_runs(caplog):
    driver, manager = asleep(delays=(2.0,))
    assert driver.probes == []  # not during the sleep: the work it pays comes later
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.wake_up()
    time.sleep(2.2)
    assert driver.probes == []
    assert "0 driver probe(s) while asleep, 0.0 ms" in caplog.text
    assert not any(t.name == "graph-sleep-settle" for t in threading.enumerate())


def test_a_probe_that_fails_leaves_the_wake_to_pay_and_is_reported(caplog):
    driver, manager = asleep(fail_probes=True)
    time.sleep(max(PROBE_DELAYS_S) + 0.1)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.wake_up()
    assert driver.probes == []  # the thread gave up after its first refusal
    assert "a probe failed: cuMemCreate failed: out of memory" in caplog.text
    assert driver.mapped_bytes() == 6 * MIB


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_probes_are_switched_off(monkeypatch, caplog, how):
    if how == "environment":
        monkeypatch.setenv("VLLM_GRAPH_SLEEP_SETTLE_AFTER_SLEEP", "0")
        driver, manager = asleep()
    else:
        driver, manager = asleep(settle_after_sleep=False)
    time.sleep(max(PROBE_DELAYS_S) + 0.1)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.wake_up()
    assert driver.probes == []
    assert "switched off: VLLM_GRAPH_SLEEP_SETTLE_AFTER_SLEEP" in caplog.text


def test_a_second_sleep_restarts_the_probes_from_its_own_end():
    probes = []
    settler = Settler(probes.append, delays=(0.2,))
    settler.start([1, 0, 1])
    time.sleep(0.1)
    settler.start([0])  # the first thread is stopped before its probe
    assert wait_for(lambda: probes == [0])
    time.sleep(0.3)
    assert probes == [0]
    assert settler.stop().startswith("1 driver probe(s) while asleep, ")
    assert settler.stop() == "driver not probed while asleep"  # nothing left running


def test_devices_are_probed_in_order_once_per_delay_and_nothing_without_devices():
    probes = []
    settler = Settler(probes.append, delays=(0.0, 0.01))
    settler.start([])
    assert settler.stop() == "driver not probed while asleep"
    settler.start([1, 0, 1])
    assert wait_for(lambda: len(probes) == 4)
    assert probes == [0, 1, 0, 1]
    assert settler.stop().startswith("4 driver probe(s) while asleep, ")


def test_an_exit_while_a_probe_runs_waits_for_it_and_a_stopped_settler_leaves_no_exit_hook(
    tmp_path,
):
    # The thread is a daemon: without the exit hook the interpreter would end
    # with the probe half done (on a GPU, racing the driver's teardown).
    done = tmp_path / "probe-finished"
    script = f"""
import pathlib, time
from vllm_graph_sleep.settle import Settler

def slow_probe(device):
    time.sleep(0.5)
    pathlib.Path({str(done)!r}).write_text(str(device))

Settler(slow_probe, delays=(0.0,)).start([3])
time.sleep(0.1)  # the probe is under way when the script ends
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert done.read_text() == "3"

    # Stopped, it is not held by an exit hook: allocators come and go in tests.
    settler = Settler(lambda device: None, delays=(5.0,))
    settler.start([0])
    settler.stop()
    gone = weakref.ref(settler)
    del settler
    gc.collect()
    assert gone() is None


def test_a_stop_during_a_probe_runs_no_probe_of_the_other_devices():
    """Review, 2026-12-06: the wake waited for every remaining device's probe."""
    probed, probing = [], threading.Event()

    def probe(device):
        probing.set()
        time.sleep(0.2)
        probed.append(device)

    settler = Settler(probe, delays=(0.0, 5.0))
    settler.start([0, 1, 2])
    assert probing.wait(5)
    settler.stop()
    assert probed == [0]


def test_the_wake_times_the_probe_it_waited_for_as_its_own_lap(caplog):
    """Review, 2026-12-06: it was counted under "stack limit"."""
    import re

    probing = threading.Event()

    class SlowProbes(FakeVmmDriver):
        def probe_mapping(self, device):
            probing.set()
            time.sleep(0.3)

    driver = SlowProbes()
    manager = GraphSleepAllocator(driver, settler=Settler(driver.probe_mapping, delays=(0.0,)))
    allocate(driver, manager, "weights", 2 * MIB, value=7)
    manager.sleep(offload_tags=("weights",))
    assert probing.wait(5)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.wake_up()
    laps = dict(re.findall(r"(settle thread stopped|stack limit) ([\d.]+) ms", caplog.text))
    assert float(laps["settle thread stopped"]) >= 150 and float(laps["stack limit"]) < 100
