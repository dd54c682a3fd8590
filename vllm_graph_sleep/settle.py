"""Pays the driver's deferred work of a sleep while the engine sleeps.

After a large release the CUDA driver leaves work that the next mapping call on
the device pays, and the later that call comes the more it pays, up to about
0.1 s after the release: on an H200, 40 GiB released cost the first mapping
1.6 ms 5 ms later, 3-4 ms at 20 ms, 6-8 ms at 50 ms and 11-25 ms from 100 ms on
(80 GiB: 26 ms). Whoever calls first pays; one call made 150 ms after the
release left 0.3 ms for the next (docs/results/archive/bench-h200-run11.md). Without
this, that first call is the wake's. `Settler` makes it from a background
thread: a probe (map and unmap one granule at a range of its own, nothing the
allocator tracks) a little after the sleep and another once the work has
stopped growing. A wake stops the thread first and reports what it paid.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

logger = logging.getLogger("vllm.graph_sleep")

# Seconds after the sleep's end at which the thread probes each device: a probe
# at 50 ms paid 9-13 ms of the deferred work (40 GiB), one at 150 ms all of it.
PROBE_DELAYS_S = (0.05, 0.15)


class Settler:
    """One background thread per sleep that probes the driver (see module docstring)."""

    def __init__(
        self, probe: Callable[[int], None], delays: Sequence[float] = PROBE_DELAYS_S
    ) -> None:
        self._probe = probe
        self._delays = tuple(delays)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._paid: list[float] = []  # milliseconds per probe made
        self._failure: str | None = None

    def start(self, devices: Iterable[int]) -> None:
        """Probes `devices` from a new thread; stops one still running first."""
        self.stop()
        devices = sorted(set(devices))
        if not devices:
            return
        self._stop = threading.Event()
        self._paid = []
        self._failure = None
        self._thread = threading.Thread(
            target=self._run, args=(devices, self._stop), name="graph-sleep-settle", daemon=True
        )
        self._thread.start()
        # A daemon thread still in a probe when the interpreter exits would race
        # the driver's own teardown, which runs after Python's exit handlers.
        atexit.register(self.stop)

    def stop(self) -> str:
        """Stops the thread (a probe under way finishes first) and says what it
        paid, for the wake's log line."""
        thread, self._thread = self._thread, None
        if thread is None:
            return "driver not probed while asleep"
        atexit.unregister(self.stop)
        self._stop.set()
        thread.join()
        paid = f"{len(self._paid)} driver probe(s) while asleep, {sum(self._paid):.1f} ms"
        if self._failure is not None:
            return f"{paid}; a probe failed: {self._failure}"
        return paid

    def _run(self, devices: list[int], stop: threading.Event) -> None:
        start = time.monotonic()
        for delay in self._delays:
            if stop.wait(max(0.0, start + delay - time.monotonic())):
                return
            for device in devices:
                if stop.is_set():  # a wake waits for this thread: no further probe
                    return
                began = time.perf_counter()
                try:
                    self._probe(device)
                except Exception as error:
                    # A full GPU (another process took it while we sleep) refuses
                    # even one granule: the wake just pays the work itself.
                    self._failure = str(error)
                    logger.debug("graph-sleep: probing device %d failed: %s", device, error)
                    return
                self._paid.append(1000 * (time.perf_counter() - began))
