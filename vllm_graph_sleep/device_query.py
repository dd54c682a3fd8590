"""Driver figures the memory ledger needs and torch does not offer: a context's
limits (stack per thread, printf FIFO, malloc heap), through libcuda.so.1's
cuCtxGetLimit or libamdhip64's hipDeviceGetLimit by ctypes, and this
process's GPU memory through NVML.

Both ask the driver directly rather than through our native extension, so the
ledger works in stock configurations too, where the extension is not loaded.
Every function answers None where the library, the device or the figure is
missing; none raises for that.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

# CUlimit and hipLimit_t number these the same.
LIMITS = {"stack": 0, "printf_fifo": 1, "malloc_heap": 2}
CUDA_LIBRARY = "libcuda.so.1"
HIP_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.7")


@functools.cache
def driver_library() -> tuple[str, Any] | None:
    """("cuda", libcuda) or ("hip", libamdhip64) for the platform torch was built
    for; None when it cannot be loaded."""
    names = HIP_LIBRARIES if torch.version.hip else (CUDA_LIBRARY,)
    for name in names:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        if torch.version.hip:
            library.hipDeviceGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
            library.hipDeviceGetLimit.restype = ctypes.c_int
            return "hip", library
        library.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        library.cuCtxGetLimit.restype = ctypes.c_int
        return "cuda", library
    return None


def context_limit(device: int, which: str) -> int | None:
    """The `which` limit (a key of LIMITS) of `device`'s context in bytes, or None."""
    found = driver_library()
    if found is None:
        return None
    kind, library = found
    value = ctypes.c_size_t(0)
    # Both calls read the context current on this thread: make it the device's.
    with torch.cuda.device(device):
        if kind == "cuda":
            status = library.cuCtxGetLimit(ctypes.byref(value), LIMITS[which])
        else:
            status = library.hipDeviceGetLimit(ctypes.byref(value), LIMITS[which])
    return int(value.value) if status == 0 else None


def resident_threads(device: int) -> int | None:
    """Threads the device can hold resident at once: multiprocessors x the most
    threads one multiprocessor holds (the count the stack reservation multiplies)."""
    properties = torch.cuda.get_device_properties(device)
    count = properties.multi_processor_count * properties.max_threads_per_multi_processor
    return count or None


def _nvml_handle(nvml: Any, device: int) -> Any:
    """NVML's handle of torch's `device`: by UUID, which survives CUDA_VISIBLE_DEVICES
    renumbering."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    if not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    return nvml.nvmlDeviceGetHandleByUUID(uuid)


def used_bytes(device: int) -> tuple[int | None, str | None]:
    """(bytes, source): this process's memory on `device` as NVML counts it per
    process; where NVML does not list this process (another PID namespace, no
    per-process accounting) the device's used memory; without NVML the driver's
    total minus free. Sources other than "nvml process" include other processes."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, device)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory), "nvml process"
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), "nvml device"
    except Exception:  # no NVML (ROCm, no bindings, no driver): the runtime's figure
        pass
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception:
        return None, None
    return int(total - free), "driver device"
