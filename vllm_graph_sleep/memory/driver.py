"""The device layer the allocator drives, written down as a Protocol.

Two implementations: `vllm_graph_sleep._native.VmmDriver` (our VMM extension
plus torch, on a GPU) and `tests/unit/fake_vmm.FakeVmmDriver` (host tensors, with
failure injection) for the CPU tests. Errors: a driver or runtime failure is a
`RuntimeError` whose message starts with the failing call (`"cuMemCreate failed:
out of memory"`); nothing else is raised for a device failure.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class MemoryPool(Protocol):
    """A torch MemPool on our pluggable allocator (or the fake's stand-in)."""

    id: Any

    def snapshot(self, include_traces: bool = True) -> list[dict]:
        """torch's segments of this pool: dicts with "address", "total_size",
        "allocated_size" and "blocks" ({"address", "size", "state"})."""
        ...


class DeviceDriver(Protocol):
    # -- the extension: allocation records and the VMM calls ----------------

    def register_callbacks(
        self,
        on_malloc: Callable[[int, int, int, int], None],
        on_free: Callable[[int], tuple[int, int, bool]],
    ) -> None:
        """Every allocation our pluggable allocator makes calls
        `on_malloc(device, size, address, handle)`; every free calls
        `on_free(address)`, which answers (size, handle, mapped) so that the
        extension unmaps only what is mapped. The extension keeps its own
        references to both. Raises nothing."""
        ...

    def create_and_map(self, device: int, size: int, address: int, handle: int) -> None:
        """Maps fresh physical memory at `address` (kept reserved while asleep)
        and rewrites the record `handle` points at. RuntimeError when the
        driver refuses (out of memory, a range already mapped); then nothing
        is mapped."""
        ...

    def create_and_map_run(self, device: int, members: list[tuple[int, int, int]]) -> None:
        """Maps fresh memory at the neighbouring ranges (size, address, handle)
        of `members`, in address order, none mapped nor in a run still mapped,
        with one physical allocation and one mapping: a run. A member's
        `unmap_and_release` then takes it out of use, and the last one out
        gives the whole run back; one torch frees leaves it too. A member out
        of use while the run lives keeps its memory and contents, and its
        `create_and_map` puts it back in use. All or nothing: RuntimeError
        when the driver refuses (out of memory; ranges that are not
        neighbours in one of the extension's reservations; always on ROCm);
        then nothing is mapped."""
        ...

    def unmap_and_release(self, device: int, size: int, address: int, handle: int) -> None:
        """Unmaps and releases the physical memory at `address`, keeping the
        address reserved. All or nothing: RuntimeError leaves it mapped with
        its contents."""
        ...

    def held_after_refused_frees(self) -> int:
        """Device bytes the extension holds because the driver refused to give
        them back when torch freed them (the allocations are gone from the
        table): a run no range uses, or a range whose unmap or release failed
        (on ROCm also one whose reservation's free failed: ROCm keeps the VRAM
        of a live reservation charged)."""
        ...

    def retry_refused_frees(self) -> tuple[int, str]:
        """Tries again to give back what `held_after_refused_frees` counts:
        the device bytes given back, and what the driver refused ("" when
        nothing: a run a member uses again ends when its last member leaves)."""
        ...

    def stack_limit(self, device: int) -> int:
        """The context's per-thread stack limit on `device`, in bytes. RuntimeError on failure."""
        ...

    def set_stack_limit(self, device: int, size: int) -> None:
        """Sets it; lowering gives the context's stack reservation back.
        RuntimeError when the driver refuses (the limit is unchanged)."""
        ...

    def probe_mapping(self, device: int) -> None:
        """Maps one granule at a range of its own and gives it back, so that the
        driver's deferred work after a large release is paid now.
        RuntimeError when it cannot (a full GPU)."""
        ...

    def synchronize(self, device: int) -> None:
        """Waits for all work queued on `device`. RuntimeError for a broken device."""
        ...

    def is_rocm(self) -> bool:
        """Whether the extension was built for ROCm (the build decides, not torch)."""
        ...

    def codes_backups_by_default(self) -> bool:
        """Whether weight backups are coded when the switch is unset."""
        ...

    # -- memory views and host buffers --------------------------------------

    def device_bytes(self, device: int, address: int, size: int) -> torch.Tensor:
        """A uint8 tensor viewing `size` mapped bytes at `address`."""
        ...

    def fingerprint(self, ranges: list[torch.Tensor], out: torch.Tensor) -> None:
        """Queues on `out`'s device the fingerprints of the 1 MiB blocks of
        `ranges` (uint8, on that device), range after range, into `out` (int64
        [blocks, 2]; vllm_graph_sleep.memory.fingerprints defines them);
        ValueError for a range that is not whole 8-byte words."""
        ...

    def host_buffer(self, size: int) -> torch.Tensor:
        """A pinned uint8 host tensor of at least `size` bytes. RuntimeError
        when host memory cannot be pinned."""
        ...

    def release_dropped_host_buffers(self) -> None:
        """Unregisters and unmaps the host buffers whose last view died since
        the last call (a registered buffer is never given back where it dies:
        that can be under torch's allocator lock or inside a capture)."""
        ...

    # -- torch's pools and routing ------------------------------------------

    def memory_pool(self) -> MemoryPool:
        """A new pool on our pluggable allocator."""
        ...

    def route(self, pool: MemoryPool) -> None:
        """Routes this thread's allocations to `pool` (torch.cuda.use_mem_pool's entry)."""
        ...

    def unroute(self, pool: MemoryPool) -> None:
        """Ends that routing (use_mem_pool's exit)."""
        ...

    def collect_garbage(self) -> None:
        """Collects Python's garbage cycles: tensors they hold go back to torch."""
        ...

    def release_cached_memory(self) -> None:
        """Has torch hand back the free segments of every pool nobody holds and
        of its default pool. torch asserts that no pool is routed meanwhile."""
        ...

    def pool_active_blocks(self, pool: MemoryPool) -> set[tuple[int, int]]:
        """(address, bytes) of the blocks torch has allocated in `pool`."""
        ...

    def block_offsets(self, addresses: set[int]) -> dict[int, list[int]]:
        """For each of our segments at `addresses`, the offsets of the blocks
        torch has allocated there (where its tensors start)."""
        ...

    def torch_segments(self) -> list[tuple[int, int, int]]:
        """(address, stream, bytes in use) of every segment torch's allocator holds."""
        ...

    # -- streams, cuBLAS workspaces, graph-safe RNG state ---------------------

    def current_stream_handle(self) -> int:
        """The handle of this thread's current stream."""
        ...

    def on_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Makes `stream` this thread's current stream inside."""
        ...

    def create_blas_workspace(self) -> None:
        """Has torch make the current stream's cuBLAS workspace, if it has none."""
        ...

    def create_blas_lt_workspace(self) -> None:
        """The same for cuBLASLt (nothing where torch has that path off)."""
        ...

    def release_blas_workspaces(self) -> None:
        """Has torch drop every cuBLAS/cuBLASLt workspace it keeps."""
        ...

    def hold_generator_graph_state(self) -> Any:
        """Has torch make the default generator's graph-safe state on the
        current stream, if no live graph holds it, and returns what keeps it
        alive. RuntimeError when the capture it needs is refused."""
        ...
