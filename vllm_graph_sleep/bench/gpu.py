"""GPU memory as another process sees it: NVML used bytes per GPU.

`NvmlMemory` reads the GPUs a server started from this process will use (the
first `count` of CUDA_VISIBLE_DEVICES, or 0..count-1). `settle` waits until the
numbers stop moving (frees land a moment after the call that made them), and
`MemorySampler` records them in the background for the plot.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Protocol


class NoGpuError(RuntimeError):
    """No usable NVIDIA GPU (or not enough of them) for the bench."""


class MemorySource(Protocol):
    gpus: list[str]

    def used(self) -> list[int]: ...


#: The environment of a child that must not reach a GPU: with CUDA hidden it
#: cannot create a context, so it may run while the floor is measured. vLLM
#: still finds its CUDA platform there (it asks NVML, which ignores the variable).
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def visible_gpu_ids(environ: dict[str, str] | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of ids (indices or UUIDs), None when unset."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


class NvmlMemory:
    """Used memory of the GPUs a `count`-GPU server will run on."""

    def __init__(self, count: int):
        try:
            import pynvml
        except ImportError as error:
            raise NoGpuError(
                f"NVML bindings not installed (pip install nvidia-ml-py): {error}"
            ) from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise NoGpuError(f"no NVIDIA GPU usable here (NVML could not start: {error})") from None
        total = pynvml.nvmlDeviceGetCount()
        ids = visible_gpu_ids()
        if ids is None:
            ids = [str(i) for i in range(total)]
        if not ids or total == 0:
            raise NoGpuError("no NVIDIA GPU visible (NVML found none)")
        if len(ids) < count:
            raise NoGpuError(f"--tp {count} needs {count} GPUs, {len(ids)} visible")
        self._handles = [self._handle(i) for i in ids[:count]]
        self.gpus = [self._describe(h) for h in self._handles]
        self._lock = threading.Lock()

    def _handle(self, ident: str):
        nvml = self._nvml
        try:
            if ident.isdigit():
                return nvml.nvmlDeviceGetHandleByIndex(int(ident))
            return nvml.nvmlDeviceGetHandleByUUID(ident)
        except nvml.NVMLError as error:
            raise NoGpuError(
                f"CUDA_VISIBLE_DEVICES entry {ident!r} is not a GPU NVML knows: {error}"
            ) from None

    def _describe(self, handle) -> str:
        name = self._nvml.nvmlDeviceGetName(handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def total(self) -> list[int]:
        with self._lock:
            return [int(self._nvml.nvmlDeviceGetMemoryInfo(h).total) for h in self._handles]

    def used(self) -> list[int]:
        with self._lock:
            return [int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles]

    def compute_processes(self) -> list[list[tuple[int, int | None]]]:
        """Per GPU, (pid, used bytes or None) of every process holding a compute
        context on it, as NVML lists them (pids of the driver's pid namespace,
        which in a container may not be this one's)."""
        nvml = self._nvml
        with self._lock:
            return [
                [
                    (int(p.pid), p.usedGpuMemory)
                    for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)
                ]
                for h in self._handles
            ]

    def persistence_modes(self) -> list[bool | None]:
        """Per GPU, whether the driver's persistence mode is on (None where NVML
        cannot say)."""
        nvml = self._nvml
        modes: list[bool | None] = []
        with self._lock:
            for handle in self._handles:
                try:
                    modes.append(
                        nvml.nvmlDeviceGetPersistenceMode(handle) == nvml.NVML_FEATURE_ENABLED
                    )
                except nvml.NVMLError:
                    modes.append(None)
        return modes

    def driver_version(self) -> str:
        version = self._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)


def settle(source: MemorySource, interval: float = 0.1, attempts: int = 30) -> list[int]:
    """Used bytes per GPU once two readings `interval` apart agree (or after `attempts`)."""
    last = source.used()
    for _ in range(attempts):
        time.sleep(interval)
        now = source.used()
        if now == last:
            return now
        last = now
    return last


def wait_released(
    source: MemorySource, baseline: list[int], slack: int, timeout: float
) -> list[int]:
    """Waits until every GPU is back within `slack` bytes of `baseline` (a stopped
    server's memory can take a few seconds to return); returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        now = source.used()
        if (
            all(n <= b + slack for n, b in zip(now, baseline, strict=True))
            or time.monotonic() > deadline
        ):
            return now
        time.sleep(0.25)


class MemorySampler:
    """Records (seconds since `origin`, used bytes per GPU) every `interval` seconds."""

    def __init__(self, source: MemorySource, origin: float, interval: float = 0.1):
        self._source = source
        self._origin = origin
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)
        self.times: list[float] = []
        self.used: list[list[int]] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                reading = self._source.used()
            except Exception:  # a sampler must never take the bench down
                reading = None
            if reading is not None:
                self.times.append(round(time.monotonic() - self._origin, 3))
                self.used.append(reading)
            self._stop.wait(self._interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def as_dict(self) -> dict:
        """Per GPU series, the layout the JSON and the plot use."""
        gpus = len(self.used[0]) if self.used else 0
        return {
            "t": list(self.times),
            "used_bytes": [[row[g] for row in self.used] for g in range(gpus)],
        }
