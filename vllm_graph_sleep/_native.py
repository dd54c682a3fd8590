"""The device layer under the sleep-mode allocator: our VMM extension plus torch.

`VmmDriver` is everything `allocator.GraphSleepAllocator` needs from the GPU
(the contract: `vllm_graph_sleep.memory.driver.DeviceDriver`):
map/unmap through `vllm_graph_sleep._cumem`, byte views of device memory, pinned
host buffers (`HostBuffers`), synchronisation and a MemPool on the pluggable
allocator. CPU tests replace it with a faithful fake (tests/unit/fake_vmm.py).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import importlib
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vllm_graph_sleep.settings import HOST_BUFFERS, REGISTERED_HOST_BUFFERS, TORCH_HOST_BUFFERS

logger = logging.getLogger("vllm.graph_sleep")

_CUDA_DRIVER_LIBRARY = "libcuda.so.1"
# Fewer, larger pages for cudaHostRegister to lock, so pinning takes less time
# (benchmarks/pinning.py measures it; docs/design.md, "Sleep", has the figures). Linux only.
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


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

    def __init__(self, host_buffers: str | None = None) -> None:
        """`host_buffers`: how host buffers are pinned (settings.HOST_BUFFERS;
        default: read from the environment now)."""
        self._ext = _load_extension()
        self._pluggable: torch.cuda.memory.CUDAPluggableAllocator | None = None
        kind = host_buffer_kind() if host_buffers is None else host_buffers
        self._host_buffers = HostBuffers(kind, _TorchRuntime)

    def register_callbacks(
        self,
        on_malloc: Callable[[int, int, int, int], None],
        on_free: Callable[[int], tuple[int, int, bool]],
    ) -> None:
        self._ext.register_callbacks(on_malloc, on_free)

    def create_and_map(self, device: int, size: int, address: int, handle: int) -> None:
        self._ext.create_and_map(device, size, address, handle)

    def create_and_map_run(self, device: int, members: list[tuple[int, int, int]]) -> None:
        self._ext.create_and_map_run(device, members)

    def unmap_and_release(self, device: int, size: int, address: int, handle: int) -> None:
        self._ext.unmap_and_release(device, size, address, handle)

    def held_after_refused_frees(self) -> int:
        return self._ext.held_bytes()

    def retry_refused_frees(self) -> tuple[int, str]:
        freed = self._ext.retry_held()
        return freed, self._ext.last_error()

    def stack_limit(self, device: int) -> int:
        return self._ext.stack_limit(device)

    def set_stack_limit(self, device: int, size: int) -> None:
        self._ext.set_stack_limit(device, size)

    def probe_mapping(self, device: int) -> None:
        self._ext.probe_mapping(device)

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

    def collect_garbage(self) -> None:
        gc.collect()

    def release_cached_memory(self) -> None:
        """Has torch hand back the free segments of every pool nobody holds any
        more (a dropped MemPool, once no graph uses it) and of its default pool."""
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def current_stream_handle(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def on_stream(self, stream: torch.cuda.Stream):
        """Makes `stream` this thread's current stream inside."""
        return torch.cuda.stream(stream)

    def pool_active_blocks(self, pool: torch.cuda.MemPool) -> set[tuple[int, int]]:
        """(address, bytes) of the blocks torch has allocated in `pool`."""
        return {
            (block["address"], block["size"])
            for segment in pool.snapshot(include_traces=False)
            for block in segment["blocks"]
            if block["state"] != "inactive"
        }

    def block_offsets(self, addresses: set[int]) -> dict[int, list[int]]:
        """For each of our segments at `addresses`, the offsets of the blocks
        torch has allocated there."""
        return {
            segment["address"]: [
                block["address"] - segment["address"]
                for block in segment["blocks"]
                if block["state"] != "inactive"
            ]
            for segment in torch.cuda.memory_snapshot(include_traces=False)
            if segment["address"] in addresses
        }

    def torch_segments(self) -> list[tuple[int, int, int]]:
        """(address, stream, bytes in use) of every segment torch's allocator holds."""
        # Without the trace ring (up to 100,000 entries while torch records
        # memory history): every sleep asks this.
        segments = torch.cuda.memory_snapshot(include_traces=False)
        return [(s["address"], s["stream"], s["allocated_size"]) for s in segments]

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

    def hold_generator_graph_state(self) -> Any:
        """Has torch make the graph-safe state of the default CUDA generator
        on the current stream, if no live graph holds it yet, and returns what
        keeps it alive: a graph of one node, captured there and never
        instantiated. torch makes the state (two 8-byte tensors, outside the
        pool a capture routes to) when a capture begins while no graph is
        registered, and frees it when the last one goes
        (CUDAGeneratorState::register_graph, torch 2.11). The node spares
        torch's "The CUDA Graph is empty" warning; its tensor may go, as
        nothing ever launches the graph."""
        target = torch.zeros(1, device="cuda")
        holder = torch.cuda.CUDAGraph(keep_graph=True)
        holder.capture_begin(capture_error_mode="thread_local")
        try:
            target.zero_()
        finally:
            holder.capture_end()
        return holder

    def device_bytes(self, device: int, address: int, size: int) -> torch.Tensor:
        return torch.as_tensor(_DeviceRange(address, size), device=torch.device("cuda", device))

    def fingerprint(self, ranges: list[torch.Tensor], out: torch.Tensor) -> None:
        # Imported here: it brings Triton, which only a sleep that keeps backups needs.
        from vllm_graph_sleep.memory import fingerprint_kernel

        fingerprint_kernel.fingerprint(ranges, out)

    def host_buffer(self, size: int) -> torch.Tensor:
        return self._host_buffers.make(size)

    def release_dropped_host_buffers(self) -> None:
        release_dropped_host_buffers()
        self._host_buffers.empty_torch_cache_if_dropped()

    def synchronize(self, device: int) -> None:
        torch.cuda.synchronize(device)

    def is_rocm(self) -> bool:
        # The extension's build decides the ROCm behaviour (zero-on-wake), not
        # torch: a test build runs the ROCm path on CUDA (tests/rocm_shim/).
        return self._ext.platform == "rocm"

    def codes_backups_by_default(self) -> bool:
        # Measured on H200s (docs/results/archive/bench-h200-run14.md); the kernels
        # compile for MI300 but have not run on AMD hardware: opt-in there.
        return not self.is_rocm()


def host_buffer_kind(environ: Mapping[str, str] | None = None) -> str:
    """How host buffers are pinned, from VLLM_GRAPH_SLEEP_HOST_BUFFERS."""
    return HOST_BUFFERS.read(environ)


class _RegisteredTotals:
    """What registering host memory has cost this process: the bytes registered
    now and the seconds ever spent making registered buffers (mapping, advice,
    cudaHostRegister). Process-wide, like torch's host-allocator statistics,
    which registered buffers are not part of; buffers outlive any driver."""

    def __init__(self) -> None:
        # Read by the probe, which need not run on the thread that sleeps.
        # Nothing inside the lock can drop a buffer (plain arithmetic).
        self._lock = threading.Lock()
        self._bytes = 0
        self._seconds = 0.0

    def registering(self, size: int, seconds: float) -> None:
        """`seconds` spent on an attempt that registered `size` bytes (0: refused)."""
        with self._lock:
            self._bytes += size
            self._seconds += seconds

    def unregistered(self, size: int) -> None:
        with self._lock:
            self._bytes -= size

    def read(self) -> tuple[int, float]:
        with self._lock:
            return self._bytes, self._seconds


_registered_totals = _RegisteredTotals()


def registered_host_memory() -> tuple[int, float]:
    """(bytes of host memory registered now, seconds spent registering so far)."""
    return _registered_totals.read()


class _Registration:
    """One cudaHostRegister, undone once."""

    def __init__(self, runtime: Any, address: int, size: int) -> None:
        self.runtime = runtime
        self.address = address
        self.size = size

    def release(self) -> bool:
        """False (logged) when the pages may still be registered. Never raises:
        it runs at the end of a sleep or wake that has done its work."""
        try:
            error = self.runtime.cudaHostUnregister(self.address)
        except Exception as failure:
            logger.warning(
                "graph-sleep: cudaHostUnregister of a %d-byte host buffer raised %s; its "
                "pages stay mapped",
                self.size,
                failure,
            )
            return False
        if error != 0:
            self.runtime.cudaGetLastError()  # see _TorchRuntime
            logger.warning(
                "graph-sleep: cudaHostUnregister of a %d-byte host buffer failed with error "
                "%d (%s); the driver may keep its pages locked, so they stay mapped",
                self.size,
                error,
                self.runtime.cudaGetErrorName(error),
            )
            return False
        _registered_totals.unregistered(self.size)
        return True


class _RegisteredMapping(mmap.mmap):
    """Anonymous memory that stays registered for as long as this object lives.

    torch.frombuffer keeps the object that exported the buffer alive until the
    storage over it is freed, that is until the last tensor or view of the
    buffer is gone, and nothing else holds this object. So the finalizer runs
    exactly then, once. It does not unregister there: the last view can die on
    any thread at any moment, e.g. inside torch's allocator callback (our free
    callback drops a freed allocation's backup) under torch's allocator lock,
    where the unregister binding releases the GIL and a thread holding the GIL
    that allocates would wait for that lock: a deadlock; or while a stream
    captures, where the driver refuses the call. The finalizer queues the
    mapping instead (which keeps it alive, mapped and registered), and
    release_dropped_host_buffers unregisters it at the allocator's next sleep,
    wake, discard or shutdown, then lets mmap unmap it (a finalizer runs once
    per object, PEP 442). The pages are never unmapped while registered, nor
    unregistered while a view can still reach them. One whose unregistration
    failed is kept (_still_registered) instead of unmapped."""

    registration: _Registration | None = None
    # Bound here: at interpreter exit module globals may be gone before this.
    _finalizing = staticmethod(sys.is_finalizing)

    def __del__(self) -> None:
        # At exit the runtime may be torn down already, and the driver drops
        # the process's registrations with it anyway.
        if self.registration is not None and not self._finalizing():
            _dropped.append(self)


# Mappings whose last view died, waiting to be unregistered (a deque: appends
# and pops are atomic, and the finalizer may run on any thread).
_dropped: collections.deque[_RegisteredMapping] = collections.deque()
# Mappings whose unregistration failed: unmapped, their addresses could go to
# the next mapping while the driver still translates them to these pages, so
# they are kept (their pages stay locked either way).
_still_registered: list[_RegisteredMapping] = []


def release_dropped_host_buffers() -> None:
    """Unregisters (then unmaps) every registered buffer whose last view died;
    to be called where no allocator lock is held and nothing captures."""
    while True:
        try:
            mapping = _dropped.popleft()
        except IndexError:
            return
        if not mapping.registration.release():
            _still_registered.append(mapping)


def _torch_pinned_buffer(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _anonymous_mapping(size: int) -> _RegisteredMapping:
    # Private: shared anonymous memory is shmem, whose huge pages follow
    # another setting (shmem_enabled) that is usually off.
    mapping = _RegisteredMapping(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _MADV_HUGEPAGE is not None:
        # A kernel without transparent huge pages refuses; small pages work.
        with contextlib.suppress(OSError):
            mapping.madvise(_MADV_HUGEPAGE)
    return mapping


class _TorchRuntime:
    """The calls host buffers make to the GPU runtime that torch is linked to.

    cudaHostRegister and cudaHostUnregister are torch's own bindings
    (torch.cuda.cudart()). ROCm builds of torch bind the same two names to
    hipHostRegister and hipHostUnregister, so registration works the same there.

    torch 2.11 binds no cudaGetLastError, yet a failed call leaves its error
    pending in the calling thread, and torch's check after the next kernel
    launch would raise it there, far from its cause. So the error is read (and
    cleared) through the runtime library itself, opened by the soname torch
    links: only one library of a soname is loaded, so it is torch's instance.

    With flags 0 a registration belongs to the context of the device current
    when it is made, and it is undone later, at a release point whose current
    device may differ, so every registration is made and undone on the device
    current when this object is made (vLLM runs one device per worker)."""

    def __init__(self) -> None:
        self._bindings = torch.cuda.cudart()
        self._device = torch.cuda.current_device()
        if torch.version.hip is not None:
            prefix, soname = "hip", f"libamdhip64.so.{torch.version.hip.split('.')[0]}"
        else:
            prefix, soname = "cuda", f"libcudart.so.{torch.version.cuda.split('.')[0]}"
        library = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        self._get_last_error = getattr(library, f"{prefix}GetLastError")
        self._error_name = getattr(library, f"{prefix}GetErrorName")
        self._error_name.restype = ctypes.c_char_p

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        with torch.cuda.device(self._device):
            return int(self._bindings.cudaHostRegister(address, size, flags))

    def cudaHostUnregister(self, address: int) -> int:
        with torch.cuda.device(self._device):
            return int(self._bindings.cudaHostUnregister(address))

    def cudaGetLastError(self) -> int:
        return self._get_last_error()

    def cudaGetErrorName(self, error: int) -> str:
        return self._error_name(error).decode()


class HostBuffers:
    """Page-locked host buffers of exactly the size asked for.

    "registered" (the default): anonymous memory, advised to use transparent
    huge pages, registered with cudaHostRegister. torch's pinned allocator
    rounds each buffer up to a power of two and pins small pages, so it pins
    more memory, more slowly (benchmarks/pinning.py; the figures are in
    docs/design.md, "Sleep"). "torch": torch's pinned allocator, which is
    also what the first refused registration falls back to, for that buffer
    and every later one (one warning, no retries).

    `make_runtime` gives the runtime calls (`_TorchRuntime` on a GPU)."""

    def __init__(self, kind: str, make_runtime: Callable[[], Any]) -> None:
        self._registering = kind == REGISTERED_HOST_BUFFERS
        self._make_runtime = make_runtime
        self._runtime: Any = None
        self._torch_buffer_dropped = threading.Event()

    def make(self, size: int) -> torch.Tensor:
        """A uint8 CPU tensor of `size` (> 0) page-locked bytes."""
        host = self._registered(size) if self._registering else None
        if host is None:
            host = _torch_pinned_buffer(size)
            weakref.finalize(host, self._torch_buffer_dropped.set)
        return host

    def empty_torch_cache_if_dropped(self) -> None:
        """Where a buffer from torch's pinned allocator was dropped since the
        last call, has torch unpin what it caches: torch keeps a freed pinned
        block for reuse, so a dropped backup (released host memory, a discard,
        a freed allocation) would otherwise stay pinned. Called where nothing
        captures (cudaFreeHost is no capture-safe call)."""
        if self._torch_buffer_dropped.is_set():
            self._torch_buffer_dropped.clear()
            torch._C._host_emptyCache()

    def _registered(self, size: int) -> torch.Tensor | None:
        """A registered buffer, or None once registration is given up."""
        runtime = self._registration_runtime()
        if runtime is None:
            return None
        start = time.perf_counter()
        mapping = _anonymous_mapping(size)
        host = torch.frombuffer(mapping, dtype=torch.uint8)
        # All the mapping's pages: no partial page for the driver to round.
        locked = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        error = runtime.cudaHostRegister(host.data_ptr(), locked, 0)
        if error != 0:
            runtime.cudaGetLastError()  # see _TorchRuntime
            _registered_totals.registering(0, time.perf_counter() - start)
            name = runtime.cudaGetErrorName(error)
            self._give_up(f"cudaHostRegister failed: error {error} ({name})")
            return None
        mapping.registration = _Registration(runtime, host.data_ptr(), locked)
        _registered_totals.registering(locked, time.perf_counter() - start)
        return host

    def _registration_runtime(self) -> Any:
        """The runtime calls, made at the first registered buffer (CUDA is up by
        then); None when they cannot be made."""
        if self._runtime is None:
            try:
                self._runtime = self._make_runtime()
            except (OSError, AttributeError) as error:
                self._give_up(f"the GPU runtime's error calls are out of reach ({error})")
        return self._runtime

    def _give_up(self, reason: str) -> None:
        self._registering = False
        logger.warning(
            "graph-sleep: %s; host backups use torch's pinned allocator from now on "
            "(%s=%s skips registering)",
            reason,
            HOST_BUFFERS.name,
            TORCH_HOST_BUFFERS,
        )
