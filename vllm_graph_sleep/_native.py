"""The device layer under the sleep-mode allocator: our VMM extension plus torch.

`VmmDriver` is everything `allocator.GraphSleepAllocator` needs from the GPU:
map/unmap through `vllm_graph_sleep._cumem`, byte views of device memory, pinned
host buffers, synchronisation and a MemPool on the pluggable allocator. CPU tests
replace it with a faithful fake (tests/unit/fake_vmm.py).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
from collections.abc import Callable
from typing import Any

import torch

_CUDA_DRIVER_LIBRARY = "libcuda.so.1"


def _load_extension() -> Any:
    if torch.version.hip is None:
        # The CUDA build leaves driver symbols to be resolved at load time (see
        # CMakeLists.txt), so the driver library must be globally visible first.
        try:
            ctypes.CDLL(_CUDA_DRIVER_LIBRARY, mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            raise RuntimeError(
                f"vllm_graph_sleep needs the NVIDIA driver library {_CUDA_DRIVER_LIBRARY}: {error}"
            ) from error
    return importlib.import_module("vllm_graph_sleep._cumem")


class _DeviceRange:
    """Exposes raw device memory through __cuda_array_interface__ (no sync)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


class VmmDriver:
    """GPU implementation of the device operations the manager relies on."""

    def __init__(self) -> None:
        self._ext = _load_extension()
        self._pluggable: torch.cuda.memory.CUDAPluggableAllocator | None = None

    def register_callbacks(
        self,
        on_malloc: Callable[[int, int, int, int], None],
        on_free: Callable[[int], tuple[int, int, bool]],
    ) -> None:
        self._ext.register_callbacks(on_malloc, on_free)

    def create_and_map(self, device: int, size: int, address: int, handle: int) -> None:
        self._ext.create_and_map(device, size, address, handle)

    def unmap_and_release(self, device: int, size: int, address: int, handle: int) -> None:
        self._ext.unmap_and_release(device, size, address, handle)

    def stack_limit(self, device: int) -> int:
        return self._ext.stack_limit(device)

    def set_stack_limit(self, device: int, size: int) -> None:
        self._ext.set_stack_limit(device, size)

    def last_error(self) -> str:
        return self._ext.last_error()

    def library_path(self) -> str:
        return self._ext.__file__

    def memory_pool(self) -> torch.cuda.MemPool:
        if self._pluggable is None:
            self._pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                self.library_path(), "my_malloc", "my_free"
            )
        return torch.cuda.MemPool(self._pluggable.allocator())

    # What torch.cuda.use_mem_pool does on entry and on exit (torch 2.11), split
    # so that a nested pool can take over from an enclosing one and hand back.
    def route(self, pool: torch.cuda.MemPool) -> None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(torch.cuda.current_device(), pool.id)

    def unroute(self, pool: torch.cuda.MemPool) -> None:
        device = torch.cuda.current_device()
        torch._C._cuda_endAllocateToPool(device, pool.id)
        torch._C._cuda_releasePool(device, pool.id)

    def release_cached_memory(self) -> None:
        """Has torch hand back the free segments of every pool nobody holds any
        more (a dropped MemPool, once no graph uses it) and of its default pool."""
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def current_stream_handle(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def pool_active_blocks(self, pool: torch.cuda.MemPool) -> set[tuple[int, int]]:
        """(address, bytes) of the blocks torch has allocated in `pool`."""
        return {
            (block["address"], block["size"])
            for segment in pool.snapshot(include_traces=False)
            for block in segment["blocks"]
            if block["state"] != "inactive"
        }

    def torch_segments(self) -> list[tuple[int, int, int]]:
        """(address, stream, bytes in use) of every segment torch's allocator holds."""
        return [
            (s["address"], s["stream"], s["allocated_size"]) for s in torch.cuda.memory_snapshot()
        ]

    def create_blas_workspace(self) -> None:
        # torch makes the cuBLAS workspace of (handle, current stream) when it
        # hands out the handle.
        torch.cuda.current_blas_handle()

    def create_blas_lt_workspace(self) -> None:
        # ... and the cuBLASLt one at the first cuBLASLt call: a matmul with a
        # bias vector takes that path unless torch has it turned off
        # (DISABLE_ADDMM_CUDA_LT=1), in which case nothing is made.
        ones = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        torch.addmm(ones[0], ones, ones)

    def release_blas_workspaces(self) -> None:
        torch._C._cuda_clearCublasWorkspaces()

    def device_bytes(self, device: int, address: int, size: int) -> torch.Tensor:
        return torch.as_tensor(_DeviceRange(address, size), device=torch.device("cuda", device))

    def host_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def synchronize(self, device: int) -> None:
        torch.cuda.synchronize(device)

    def is_rocm(self) -> bool:
        # The extension's build decides the ROCm behaviour (zero-on-wake), not
        # torch: a test build runs the ROCm path on CUDA (tests/rocm_shim/).
        return self._ext.platform == "rocm"
